//! The server's side of a control connection's framing: the handshake
//! that opens it (with a cluster key) and the reading of each request.

use std::time::Duration;

use glommio::net::TcpStream;
use kvferry_auth::Surface;
use kvferry_store::internal::proto::{self, Channel, Request};

use crate::server::Server;

/// Why a connection stops reading.
pub(crate) enum ReadEnd {
    Closed,
    Malformed(proto::ProtoError),
    Unauthenticated,
}

/// The connection's framing: with a key, after the handshake that must
/// open it (within the connect timeout); `None` when it failed (counted).
pub(crate) async fn open_channel(server: &Server, stream: &mut TcpStream) -> Option<Channel> {
    let Some(key) = server.key() else {
        return Some(Channel::plain());
    };
    let handshake = async { Some(Channel::respond(stream, key).await) };
    let timeout = async {
        glommio::timer::Timer::new(HANDSHAKE_TIMEOUT).await;
        None
    };
    match futures_lite::future::or(handshake, timeout).await {
        Some(Ok(channel)) => Some(channel),
        Some(Err(proto::ReadError::Closed)) => None,
        _ => {
            server.rejects().count(Surface::Store);
            tracing::warn!("store server: an engine did not authenticate; connection closed");
            None
        }
    }
}

/// Bound on a connection's handshake: a peer that connects and says
/// nothing holds its slot no longer.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// The next request of a connection.
pub(crate) async fn read_request(
    channel: &mut Channel,
    stream: &mut TcpStream,
) -> Result<(u64, Request), ReadEnd> {
    match channel.read_body(stream).await {
        Ok(body) => proto::decode_request(&body).map_err(ReadEnd::Malformed),
        Err(proto::ReadError::Closed) => Err(ReadEnd::Closed),
        Err(proto::ReadError::Malformed(e)) => Err(ReadEnd::Malformed(e)),
        Err(proto::ReadError::Unauthenticated) => Err(ReadEnd::Unauthenticated),
    }
}
