//! The `kvferry` command-line tool. See `kvferry help`.

#![warn(missing_docs)]

mod baseline;
mod bench;
mod bench_device;
mod bench_shm;
mod bootstrap;
mod cli;
mod decode;
mod demo;
mod pingpong;
mod plan;
mod prefill;
mod shape;
mod soak;
mod store_bench;
mod store_demo;
mod store_serve;
mod sweep;

use std::process::ExitCode;

fn main() -> ExitCode {
    kvferry_testkit::init_tracing();
    cli::run(std::env::args_os())
}
