//! End-to-end with the KV cache in device memory: prefill and decode nodes
//! whose KV lives in a stand-in device's memory (`HostDevice`), moved
//! staged through pinned buffers (`tcp`) or device to device through the
//! peer's allocation opened by IPC handle (`auto` on one host); every byte
//! verified.
//! The node finds which ranges are device memory by asking the device,
//! as it asks the CUDA driver on a GPU.

use std::sync::Arc;
use std::time::Duration;

use kvferry::machines::internal::common::Mode;
use kvferry::machines::Phase;
use kvferry::node::{DataPlaneError, NodeError, TransportKind};
use kvferry::transport::HostDevice;
use kvferry::TransferId;
use kvferry_testkit::model::{self, ModelSpecExt};
use kvferry_testkit::synth::{Cluster, ClusterSpec};

fn spec(tp: (u32, u32), mode: Mode, transport: TransportKind) -> ClusterSpec {
    ClusterSpec {
        prefill_tp: tp.0,
        decode_tp: tp.1,
        transport,
        ..ClusterSpec::new(model::large().with_heads(4), mode)
    }
}

fn device() -> Arc<HostDevice> {
    // Copies take time, as a device's do.
    HostDevice::new(0, Duration::from_micros(200))
}

fn run(c: &Cluster, requests: u64) {
    for t in 0..requests {
        let tid = TransferId(500 + t);
        let n = 1 + (t as u32 % 6);
        let src: Vec<u32> = (0..n).map(|i| 3 * i + t as u32 % 3).collect();
        let dst: Vec<u32> = (0..n).map(|i| 60 - 2 * i - t as u32 % 2).collect();
        c.fill(tid, &src);
        for r in &c.decode {
            r.kv.clear(&dst);
        }
        c.start_request(tid, &src, &dst, 0).expect("request starts");
        let phases = c.wait_decode(tid, Duration::from_secs(10));
        assert!(
            phases.iter().all(|p| *p == Phase::Success),
            "{tid:?}: {phases:?}"
        );
        assert_eq!(c.verify(tid, &dst, 0), 0, "{tid:?}: bytes differ on decode");
        let phases = c.wait_prefill(tid, Duration::from_secs(10));
        assert!(
            phases.iter().all(|p| *p == Phase::Success),
            "{tid:?}: {phases:?}"
        );
    }
}

/// Runs `requests` with these devices under prefill and decode, then
/// checks how the bytes went: staged through pinned buffers (tcp), or
/// device to device through the peer's allocation opened by IPC handle
/// (`auto`, both on devices of this host: no buffer staged at all).
fn run_on(s: &ClusterSpec, devices: [Option<Arc<HostDevice>>; 2], requests: u64) {
    let c = Cluster::start_on(s, devices.clone()).expect("cluster");
    run(&c, requests);
    let by_ipc = s.transport == TransportKind::Auto && devices.iter().all(Option::is_some);
    for d in devices.iter().flatten() {
        let staged = d.pinned_live() > 0;
        assert_eq!(
            staged, !by_ipc,
            "staged {staged}, expected through IPC {by_ipc}"
        );
    }
}

#[test]
fn push_from_host_kv_into_device_kv() {
    let s = spec((1, 1), Mode::Push, TransportKind::Tcp);
    run_on(&s, [None, Some(device())], 12);
}

#[test]
fn pull_between_device_kv_caches_through_ipc_with_tp_2_to_1() {
    let s = spec((2, 1), Mode::Pull, TransportKind::Auto);
    run_on(&s, [Some(device()), Some(device())], 12);
}

#[test]
fn push_between_device_kv_caches_staged_over_tcp_tp_1_to_2() {
    let s = spec((1, 2), Mode::Push, TransportKind::Tcp);
    run_on(&s, [Some(device()), Some(device())], 12);
}

#[test]
fn device_kv_with_the_local_transport_is_refused_clearly() {
    let s = spec((1, 1), Mode::Push, TransportKind::Local);
    let err = Cluster::start_on(&s, [None, Some(device())]).err();
    assert!(
        matches!(
            err,
            Some(NodeError::DataPlane(
                DataPlaneError::DeviceUnsupported { .. }
            ))
        ),
        "{err:?}"
    );
}
