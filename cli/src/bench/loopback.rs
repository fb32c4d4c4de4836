//! One measurement of a transport on loopback (`kvferry bench transport`
//! and its sweep): tcp, local and mooncake in this process, shm through a
//! peer process ([`super::shm`]).
//!
//! For `tcp` the target and the initiator each run on their own glommio
//! executor, pinned to different cores when the machine has two. The
//! initiator submits one batch at a time (`--batch` descriptors of
//! `--block-bytes` each) for `--seconds`, and times each batch from submit to
//! completion.

use std::net::SocketAddr;

use glommio::LocalExecutorBuilder;
use kvferry::transport::LocalTransport;
use kvferry::transport::{EndpointAddr, MooncakeConfig, MooncakeTransport};
use kvferry::transport::{Session, ShmMode, TcpConfig, TcpTransport, Transport};

use super::measure::{buffer_bytes, buffers, descs, drive, measure_memcpy, placement};
use super::measure::{Measured, Params};
use super::shm;

/// Runs one measurement of `p` over freshly filled buffers.
pub(crate) fn measure(p: &Params) -> Result<Measured, String> {
    let total = buffer_bytes(p);
    // Both buffers live here and outlive the executor threads, which only
    // see their addresses; they are touched again only after the threads
    // are joined. The side the data comes from holds a pattern, the other
    // zeros, so the check after the run means something in both directions.
    let (mut src, mut dst) = buffers(p.op, total);
    let src_addr = src.as_mut_ptr() as u64;
    let dst_addr = dst.as_mut_ptr() as u64;

    let measured = match p.transport.as_str() {
        "tcp" => run_tcp(p, src_addr, dst_addr),
        "shm" => shm::run(p, ShmMode::Require),
        "auto" => shm::run(p, ShmMode::Auto),
        "mooncake" => run_mooncake(p, src_addr, dst_addr),
        _ => run_local(p, src_addr, dst_addr),
    };
    drop((src, dst));
    measured
}

fn run_tcp(p: &Params, src_addr: u64, dst_addr: u64) -> Result<Measured, String> {
    let total = buffer_bytes(p) as usize;
    let config = TcpConfig {
        streams: p.streams,
        poll: p.poll,
        ..TcpConfig::default()
    };
    let (addr_tx, addr_rx) = flume::bounded::<Result<SocketAddr, String>>(1);
    let (stop_tx, stop_rx) = flume::bounded::<()>(1);
    let target_config = config.clone();
    let target = LocalExecutorBuilder::new(placement(p.pin, 1))
        .name("bench-target")
        .spawn(move || async move {
            let setup = || -> Result<TcpTransport, String> {
                let t = TcpTransport::bind("127.0.0.1:0".parse().unwrap(), target_config)
                    .map_err(|e| e.to_string())?;
                // SAFETY: `dst` outlives this thread (joined before it is
                // touched again) and only the transport uses it meanwhile.
                unsafe { t.register(dst_addr as usize as *mut u8, total) }
                    .map_err(|e| e.to_string())?;
                Ok(t)
            };
            match setup() {
                Ok(t) => {
                    let _ = addr_tx.send(Ok(t.local_addr()));
                    let _ = stop_rx.recv_async().await;
                    drop(t);
                }
                Err(e) => {
                    let _ = addr_tx.send(Err(e));
                }
            }
        })
        .map_err(|e| format!("starting the target executor: {e}"))?;
    let peer = addr_rx.recv().map_err(|e| e.to_string()).and_then(|r| r)?;
    let p2 = p.clone();
    let initiator = LocalExecutorBuilder::new(placement(p.pin, 0))
        .name("bench-initiator")
        .spawn(move || async move {
            let t = TcpTransport::bind("127.0.0.1:0".parse().unwrap(), config)
                .map_err(|e| e.to_string())?;
            // SAFETY: as for the target's buffer.
            unsafe { t.register(src_addr as usize as *mut u8, total) }
                .map_err(|e| e.to_string())?;
            let session = t
                .open(&EndpointAddr::Tcp(peer))
                .await
                .map_err(|e| e.to_string())?;
            let batch = descs(&p2, src_addr, dst_addr);
            let m = drive(&p2, &session, &batch).await;
            session.close().await;
            // The target is idle now (it waits for the stop signal), so the
            // buffers can be compared and copied on this thread.
            m.map(|m| verify_and_memcpy(&p2, m, src_addr, dst_addr))
        })
        .map_err(|e| format!("starting the initiator executor: {e}"))?;
    let result = initiator
        .join()
        .map_err(|e| format!("initiator executor: {e}"));
    let _ = stop_tx.send(());
    target.join().map_err(|e| format!("target executor: {e}"))?;
    result?
}

fn run_local(p: &Params, src_addr: u64, dst_addr: u64) -> Result<Measured, String> {
    let total = buffer_bytes(p) as usize;
    let p2 = p.clone();
    LocalExecutorBuilder::new(placement(p.pin, 0))
        .name("bench-local")
        .spawn(move || async move {
            let (a, b) = (LocalTransport::default(), LocalTransport::default());
            // SAFETY: both buffers outlive this thread and only the
            // transport touches them meanwhile.
            unsafe { register_pair(&a, &b, (src_addr, dst_addr), total) }?;
            drive_pair(&p2, &a, &b, (src_addr, dst_addr)).await
        })
        .map_err(|e| format!("starting the executor: {e}"))?
        .join()
        .map_err(|e| format!("local executor: {e}"))?
}

/// Two Mooncake engines on one executor (the library from
/// `MOONCAKE_TE_LIB`, protocol `--mooncake-protocol`): the bytes cross the
/// engine's transport (loopback for `tcp`) between them.
fn run_mooncake(p: &Params, src_addr: u64, dst_addr: u64) -> Result<Measured, String> {
    let total = buffer_bytes(p) as usize;
    let p2 = p.clone();
    let cfg = MooncakeConfig {
        protocol: p.mooncake_protocol.clone(),
        max_descs: p.batch as usize,
        cadence: p.mooncake_cadence,
        ..MooncakeConfig::default()
    };
    LocalExecutorBuilder::new(placement(p.pin, 0))
        .name("bench-mooncake")
        .spawn(move || async move {
            let ip = std::net::IpAddr::from([127, 0, 0, 1]);
            let a = MooncakeTransport::new(ip, cfg.clone()).map_err(|e| e.to_string())?;
            let b = MooncakeTransport::new(ip, cfg).map_err(|e| e.to_string())?;
            // SAFETY: both buffers outlive this thread and only the
            // transport touches them meanwhile.
            unsafe { register_pair(&a, &b, (src_addr, dst_addr), total) }?;
            // What `b`'s hello would tell a node.
            a.learn_peer(&b.endpoint_addr(), b.regions());
            drive_pair(&p2, &a, &b, (src_addr, dst_addr)).await
        })
        .map_err(|e| format!("starting the executor: {e}"))?
        .join()
        .map_err(|e| format!("mooncake executor: {e}"))?
}

/// Registers `src` with `a` and `dst` with `b`, `total` bytes each.
///
/// # Safety
///
/// Both buffers must outlive the endpoints, and only they touch them.
unsafe fn register_pair(
    a: &impl Transport,
    b: &impl Transport,
    (src, dst): (u64, u64),
    total: usize,
) -> Result<(), String> {
    // SAFETY: forwarded from the caller.
    unsafe {
        a.register(src as usize as *mut u8, total)
            .map_err(|e| e.to_string())?;
        b.register(dst as usize as *mut u8, total)
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Opens a session from `a` to `b`, drives the batches over it and
/// checks and measures the buffers ([`verify_and_memcpy`]).
async fn drive_pair<T: Transport>(
    p: &Params,
    a: &T,
    b: &T,
    (src, dst): (u64, u64),
) -> Result<Measured, String> {
    let session = a
        .open(&b.endpoint_addr())
        .await
        .map_err(|e| e.to_string())?;
    let batch = descs(p, src, dst);
    let m = drive(p, &session, &batch).await;
    m.map(|m| verify_and_memcpy(p, m, src, dst))
}

/// Checks that the transfers left both buffers equal, then measures memcpy
/// of the same buffers on the calling (executor) thread, so both figures
/// come from the same core in the same run.
fn verify_and_memcpy(p: &Params, mut m: Measured, src_addr: u64, dst_addr: u64) -> Measured {
    let total = buffer_bytes(p) as usize;
    // SAFETY: the buffers are owned by `measure`, which does not touch
    // them until this thread is joined, and no transfer is running now.
    let (src, dst) = unsafe {
        (
            std::slice::from_raw_parts(src_addr as usize as *const u8, total),
            std::slice::from_raw_parts_mut(dst_addr as usize as *mut u8, total),
        )
    };
    m.verified = src == &*dst;
    m.memcpy_gbps = measure_memcpy(src, dst, p.block_bytes as usize, p.seconds.min(1.0));
    m
}
