//! What kvferry measures and how it shows it: the one latency histogram
//! ([`Latency`]: the demo, the soak, the benches and `/metrics` record into
//! it and read quantiles by one rule), counter sets declared once
//! ([`counter_set!`]), the one OpenMetrics rendering ([`render`]) and the
//! `/metrics` HTTP endpoint ([`http::MetricsServer`]) of nodes and the
//! store server.

#![warn(missing_docs)]

mod families;
pub mod http;
mod latency;

pub use families::{encode_auth_rejects, encode_families, render, Family, Kind};

pub use latency::{Latency, LATENCY_BUCKETS_S};
