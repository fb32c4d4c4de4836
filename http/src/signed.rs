//! What every authenticated HTTP endpoint of kvferry asks of a request: a
//! signature with the cluster key ([`kvferry_auth::request`]).

use kvferry_auth::request::{Verifier, HEADER};
use kvferry_auth::{AuthError, ClusterKey};

use crate::Request;

/// Milliseconds since the Unix epoch: the clock signed requests carry
/// (hosts of one cluster keep theirs in step, as for any TLS deployment).
pub fn unix_ms() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// Checks the signature of `request` (its method, target and body) against
/// `key` at the wall clock.
pub fn verify_signed(
    verifier: &mut Verifier,
    key: &ClusterKey,
    request: &Request<'_>,
) -> Result<(), AuthError> {
    verifier.verify(
        key,
        unix_ms(),
        request.method(),
        request.url(),
        request.body(),
        request.header(HEADER),
    )
}
