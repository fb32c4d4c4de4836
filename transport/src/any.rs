//! A transport chosen at run time (`async fn` in traits is not object safe,
//! so configuration-driven code uses this enum instead of `dyn Transport`).

use std::time::Instant;

use super::local::{LocalSession, LocalTransport};
use super::mooncake::{MooncakeSession, MooncakeTransport};
use super::tcp::{TcpSession, TcpTransport};
use super::{Desc, EndpointAddr, Op, RegionId, RegionInfo, Session, Transport, TransportError};

/// Any of the transports.
pub enum AnyTransport {
    /// In-process memcpy.
    Local(LocalTransport),
    /// TCP sockets.
    Tcp(TcpTransport),
    /// Mooncake's transfer engine.
    Mooncake(MooncakeTransport),
}

/// A session of an [`AnyTransport`].
pub enum AnySession {
    /// In-process memcpy.
    Local(LocalSession),
    /// TCP sockets.
    Tcp(TcpSession),
    /// Mooncake's transfer engine.
    Mooncake(MooncakeSession),
}

impl Transport for AnyTransport {
    type Session = AnySession;

    unsafe fn register(&self, addr: *mut u8, len_bytes: usize) -> Result<RegionId, TransportError> {
        // SAFETY: the caller's promise is forwarded unchanged.
        unsafe {
            match self {
                AnyTransport::Local(t) => t.register(addr, len_bytes),
                AnyTransport::Tcp(t) => t.register(addr, len_bytes),
                AnyTransport::Mooncake(t) => t.register(addr, len_bytes),
            }
        }
    }

    fn unregister(&self, id: RegionId) -> Result<(), TransportError> {
        match self {
            AnyTransport::Local(t) => t.unregister(id),
            AnyTransport::Tcp(t) => t.unregister(id),
            AnyTransport::Mooncake(t) => t.unregister(id),
        }
    }

    fn regions(&self) -> Vec<RegionInfo> {
        match self {
            AnyTransport::Local(t) => t.regions(),
            AnyTransport::Tcp(t) => t.regions(),
            AnyTransport::Mooncake(t) => t.regions(),
        }
    }

    fn endpoint_addr(&self) -> EndpointAddr {
        match self {
            AnyTransport::Local(t) => t.endpoint_addr(),
            AnyTransport::Tcp(t) => t.endpoint_addr(),
            AnyTransport::Mooncake(t) => t.endpoint_addr(),
        }
    }

    async fn open(&self, peer: &EndpointAddr) -> Result<AnySession, TransportError> {
        Ok(match self {
            AnyTransport::Local(t) => AnySession::Local(t.open(peer).await?),
            AnyTransport::Tcp(t) => AnySession::Tcp(t.open(peer).await?),
            AnyTransport::Mooncake(t) => AnySession::Mooncake(t.open(peer).await?),
        })
    }

    fn stops_on_drop(&self) -> bool {
        match self {
            AnyTransport::Local(t) => t.stops_on_drop(),
            AnyTransport::Tcp(t) => t.stops_on_drop(),
            AnyTransport::Mooncake(t) => t.stops_on_drop(),
        }
    }

    fn coalesce_small_batches(&self) -> bool {
        match self {
            AnyTransport::Local(t) => t.coalesce_small_batches(),
            AnyTransport::Tcp(t) => t.coalesce_small_batches(),
            AnyTransport::Mooncake(t) => t.coalesce_small_batches(),
        }
    }

    fn carries_notifications(&self) -> bool {
        match self {
            AnyTransport::Local(t) => t.carries_notifications(),
            AnyTransport::Tcp(t) => t.carries_notifications(),
            AnyTransport::Mooncake(t) => t.carries_notifications(),
        }
    }
}

impl Session for AnySession {
    async fn transfer(&self, op: Op, descs: &[Desc]) -> Result<(), TransportError> {
        match self {
            AnySession::Local(s) => s.transfer(op, descs).await,
            AnySession::Tcp(s) => s.transfer(op, descs).await,
            AnySession::Mooncake(s) => s.transfer(op, descs).await,
        }
    }

    async fn transfer_until(
        &self,
        op: Op,
        descs: &[Desc],
        trailer: Option<&[u8]>,
        deadline: Instant,
    ) -> Result<bool, TransportError> {
        match self {
            AnySession::Local(s) => s.transfer_until(op, descs, trailer, deadline).await,
            AnySession::Tcp(s) => s.transfer_until(op, descs, trailer, deadline).await,
            AnySession::Mooncake(s) => s.transfer_until(op, descs, trailer, deadline).await,
        }
    }

    async fn notify_peer(&self, payload: &[u8]) -> Result<bool, TransportError> {
        match self {
            AnySession::Local(s) => s.notify_peer(payload).await,
            AnySession::Tcp(s) => s.notify_peer(payload).await,
            AnySession::Mooncake(s) => s.notify_peer(payload).await,
        }
    }

    async fn close(self) {
        match self {
            AnySession::Local(s) => s.close().await,
            AnySession::Tcp(s) => s.close().await,
            AnySession::Mooncake(s) => s.close().await,
        }
    }
}
