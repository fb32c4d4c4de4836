//! The one HTTP server of kvferry, under the metrics endpoint and the
//! bootstrap service: worker threads over a bound listener ([`Listener`],
//! [`Server`]), a route table of (method, path) → handler ([`Routes`]), a
//! hook that checks the requests a route wants signed ([`Gate`],
//! [`verify_signed`]), a bounded request body, and one rule for the
//! requests no route takes: an unknown path is 404, a known path asked
//! with another method is 405 with an `Allow` header ([`Refusal`]).
//!
//! `tiny_http` was chosen because it is small, maintained, synchronous and
//! has no Tokio in its tree: a scrape now and then and a handful of
//! registrations per rank need plain threads, not a second async runtime
//! next to glommio. This crate is the only one that names it.

#![warn(missing_docs)]

mod method;
mod request;
mod routes;
mod server;
mod signed;

pub use method::Method;
pub use request::{Refusal, Reply, Request};
pub use routes::{Access, Gate, Routes};
pub use server::{Config, Listener, Server, ServerError};
pub use signed::{unix_ms, verify_signed};

#[cfg(test)]
mod tests;
