//! How the tcp transport's failures read as [`TransportError`]s: a failed
//! socket call's ([`IoFail`]) and a peer's broken protocol. A leaf: the
//! connections an endpoint serves (`target`), its sessions and the
//! handshake (`auth`) all word their failures alike through it.

use crate::fdio::IoFail;
use crate::{PeerError, TransportError};

pub(super) fn conv(during: &'static str) -> impl Fn(IoFail) -> TransportError {
    move |f| match f {
        IoFail::Closed => TransportError::Disconnected { during },
        IoFail::Fenced => TransportError::Fenced { during },
        IoFail::Os(source) => TransportError::Io { during, source },
    }
}

pub(super) fn protocol(msg: impl Into<String>) -> TransportError {
    TransportError::Peer(PeerError::Protocol(msg.into()))
}
