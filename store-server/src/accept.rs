//! The listener: admits connections within the server's bounds, gives
//! each a task, and shuts everything down when the server stops.

use std::rc::Rc;
use std::sync::atomic::Ordering;

use glommio::net::TcpListener;

use crate::conn::Conn;
use crate::metrics::ServerCounters;
use crate::server::Server;

/// Serves until `stop` says so, then shuts the listener and every
/// connection down, so the port is free again at once and engines see the
/// server gone now rather than at their calls' deadlines.
pub(crate) async fn serve(
    server: Rc<Server>,
    std_listener: std::net::TcpListener,
    stop: flume::Receiver<()>,
) {
    use std::os::fd::{FromRawFd, IntoRawFd};
    let listener_fd = std_listener.into_raw_fd();
    // SAFETY: a bound, listening socket we own, handed over to glommio.
    let listener = unsafe { TcpListener::from_raw_fd(listener_fd) };
    let acceptor = glommio::spawn_local(accept_loop(Rc::clone(&server), listener));
    let _ = stop.recv_async().await;
    server.stopping.set(true);
    // Shut down while the accept is pending, so it fails and the loop
    // ends; the fd stays open until the loop drops the listener.
    // SAFETY: shutting down a socket we own, not closing it.
    unsafe { libc::shutdown(listener_fd, libc::SHUT_RDWR) };
    server.hang_up_all();
    acceptor.await;
}

async fn accept_loop(server: Rc<Server>, listener: TcpListener) {
    loop {
        let stream = match listener.accept().await {
            Ok(s) => s,
            Err(_) if server.stopping.get() => return,
            Err(e) => {
                tracing::warn!("store server: accept failed: {e}");
                continue;
            }
        };
        let open = server.counters.connections.load(Ordering::Relaxed);
        if open >= server.max_connections as u64 {
            tracing::warn!("store server: {open} connections open; one more refused");
            continue;
        }
        let Some(addr) = server.admit(&stream) else {
            continue;
        };
        let _ = stream.set_nodelay(true);
        ServerCounters::add(&server.counters.connections, 1);
        let fd = std::os::fd::AsRawFd::as_raw_fd(&stream);
        let slot = server.conns.borrow_mut().insert(fd);
        let s = Rc::clone(&server);
        glommio::spawn_local(async move {
            Conn::new(&s, &stream).serve(&s, stream).await;
            s.conns.borrow_mut().remove(slot);
            s.release(addr);
            s.counters.connections.fetch_sub(1, Ordering::Relaxed);
        })
        .detach();
    }
}
