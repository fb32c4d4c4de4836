//! `kvferry bench ...`: the benchmarks, one subcommand each; this module
//! only dispatches. The measurement helpers they share are in [`measure`].

use std::process::ExitCode;

use clap::Subcommand;

mod baseline;
mod device;
mod loopback;
mod measure;
mod pingpong;
mod shm;
mod store;
mod sweep;
mod transport;

/// `kvferry bench ...`.
#[derive(Clone, Debug, Subcommand)]
pub(crate) enum BenchCommand {
    /// Transport throughput and latency on loopback, next to memcpy.
    #[command(allow_negative_numbers = true)]
    Transport(transport::TransportArgs),
    /// Store put and get throughput of fresh keys, every byte verified.
    Store(store::StoreBenchArgs),
    /// The target process of `bench transport --transport shm`.
    #[command(hide = true)]
    TransportPeer(shm::PeerArgs),
    /// Device memory through kvferry (a copy stream, IPC to another
    /// process, staged tcp) against cudaMemcpy and host tcp, verified.
    Device(device::DeviceArgs),
    /// The peer process of `bench device`.
    #[command(hide = true)]
    DevicePeer(device::PeerArgs),
}

/// Runs `kvferry bench ...`.
pub(crate) fn main(c: &BenchCommand) -> ExitCode {
    match c {
        BenchCommand::Transport(a) => transport::main(a),
        BenchCommand::Store(a) => store::main(a),
        BenchCommand::TransportPeer(a) => shm::peer_main(a),
        BenchCommand::Device(a) => device::main(a),
        BenchCommand::DevicePeer(a) => device::peer_main(a),
    }
}
