//! The one way kvferry renders `/metrics`: families of plain values and
//! whatever else a caller encodes, through prometheus-client's OpenMetrics
//! encoder ([`render`]), and one macro that declares a set of counters,
//! its snapshot and its families in one place ([`crate::counter_set!`]).

use std::fmt;

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::registry::Registry;

/// What a family's value is.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    /// Only grows; exposed with a `_total` suffix.
    Counter,
    /// Goes up and down.
    Gauge,
}

/// One metric family holding one value.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Family {
    /// Its name; a counter's without the `_total` the encoder appends.
    pub name: &'static str,
    /// Its help text.
    pub help: &'static str,
    /// Counter or gauge.
    pub kind: Kind,
    /// Its value now.
    pub value: u64,
}

/// Encodes each of `families` as one metric.
pub fn encode_families(
    encoder: &mut DescriptorEncoder,
    families: &[Family],
) -> Result<(), fmt::Error> {
    for f in families {
        match f.kind {
            Kind::Counter => {
                let c = ConstCounter::new(f.value);
                c.encode(encoder.encode_descriptor(f.name, f.help, None, c.metric_type())?)?;
            }
            Kind::Gauge => {
                let g = ConstGauge::new(i64::try_from(f.value).unwrap_or(i64::MAX));
                g.encode(encoder.encode_descriptor(f.name, f.help, None, g.metric_type())?)?;
            }
        }
    }
    Ok(())
}

/// `kvferry_auth_rejected_total{surface}` and
/// `kvferry_rate_limited_total{surface}`: the refusals and the limited
/// requests `rejects` counted, every surface listed (zeros included, so a
/// dashboard sees the families before the first one).
pub fn encode_auth_rejects(
    encoder: &mut DescriptorEncoder,
    rejects: &kvferry_auth::Rejects,
) -> Result<(), fmt::Error> {
    use kvferry_auth::{Rejects, Surface};
    /// A family's name, help and count per surface.
    type AuthFamily = (&'static str, &'static str, fn(&Rejects, Surface) -> u64);
    let families: [AuthFamily; 2] = [
        (
            "kvferry_auth_rejected",
            "Peers and requests refused for failing authentication, by surface.",
            Rejects::get,
        ),
        (
            "kvferry_rate_limited",
            "Requests and connections turned away for exceeding their address's budget, by surface.",
            Rejects::limited,
        ),
    ];
    for (name, help, count) in families {
        let mut family = encoder.encode_descriptor(
            name,
            help,
            None,
            prometheus_client::metrics::MetricType::Counter,
        )?;
        for surface in Surface::ALL {
            let labels = [("surface", surface.label())];
            ConstCounter::new(count(rejects, surface)).encode(family.encode_family(&labels)?)?;
        }
    }
    Ok(())
}

/// What a scrape encodes.
type Encode = dyn Fn(&mut DescriptorEncoder) -> Result<(), fmt::Error> + Send + Sync;

/// OpenMetrics text (what Prometheus scrapes) of what `encode` writes.
pub fn render(
    encode: impl Fn(&mut DescriptorEncoder) -> Result<(), fmt::Error> + Send + Sync + 'static,
) -> String {
    let mut registry = Registry::default();
    registry.register_collector(Box::new(Scrape(Box::new(encode))));
    let mut out = String::with_capacity(4096);
    // Writing to a String cannot fail, and the collector only fails when
    // the writer does.
    let _ = prometheus_client::encoding::text::encode(&mut out, &registry);
    out
}

/// Runs a caller's encoding at scrape time.
struct Scrape(Box<Encode>);

impl fmt::Debug for Scrape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("Scrape")
    }
}

impl Collector for Scrape {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), fmt::Error> {
        (self.0)(&mut encoder)
    }
}

/// Declares a set of counters in one place: a struct of relaxed atomics,
/// its snapshot struct with `load()`, and each field's metric family.
///
/// ```
/// kvferry_metrics::counter_set! {
///     /// What a server counts.
///     #[derive(Debug, Default)]
///     pub struct Counters;
///     /// A snapshot of [`Counters`].
///     #[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
///     pub struct Stats;
///     /// Requests answered.
///     requests: Counter "x_requests", "requests answered";
///     /// Connections open now.
///     connections: Gauge "x_connections", "connections open";
/// }
/// let c = Counters::default();
/// c.requests.fetch_add(2, std::sync::atomic::Ordering::Relaxed);
/// assert_eq!(c.load().requests, 2);
/// assert_eq!(c.load().families()[1].name, "x_connections");
/// assert_eq!(c.load().fields()[0], ("requests", 2));
/// ```
#[macro_export]
macro_rules! counter_set {
    (
        $(#[$cmeta:meta])* $cvis:vis struct $counters:ident;
        $(#[$smeta:meta])* $svis:vis struct $stats:ident;
        $( $(#[$doc:meta])* $field:ident: $kind:ident $family:literal, $help:literal; )*
    ) => {
        $(#[$cmeta])*
        $cvis struct $counters {
            $( $(#[$doc])* pub(crate) $field: ::std::sync::atomic::AtomicU64, )*
        }

        $(#[$smeta])*
        $svis struct $stats {
            $( $(#[$doc])* pub $field: u64, )*
        }

        impl $counters {
            /// Reads every counter (each on its own: no decision depends
            /// on two of them agreeing).
            pub fn load(&self) -> $stats {
                $stats {
                    $( $field: self.$field.load(::std::sync::atomic::Ordering::Relaxed), )*
                }
            }
        }

        impl $stats {
            /// `(field name, value)` of every field, in declaration order:
            /// for reports by name (JSON, the Python package).
            pub fn fields(&self) -> ::std::vec::Vec<(&'static str, u64)> {
                ::std::vec![ $( (::std::stringify!($field), self.$field), )* ]
            }

            /// Every field as a metric family, in declaration order.
            pub fn families(&self) -> ::std::vec::Vec<$crate::Family> {
                ::std::vec![
                    $( $crate::Family {
                        name: $family,
                        help: $help,
                        kind: $crate::Kind::$kind,
                        value: self.$field,
                    }, )*
                ]
            }
        }

        /// Several sets (the ranks of a run, the servers of a cluster),
        /// added up field by field.
        impl ::std::iter::Sum for $stats {
            fn sum<I: ::std::iter::Iterator<Item = $stats>>(sets: I) -> $stats {
                sets.fold($stats::default(), |a, s| $stats {
                    $( $field: a.$field + s.$field, )*
                })
            }
        }
    };
}
