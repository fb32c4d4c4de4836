//! How a setting's value maps onto its [`NodeConfig`](crate::node::NodeConfig)
//! field, one module per mapping: `get` reads the field as the setting
//! (`None`: unset), `put` writes a set value into it. A key's declaration
//! names its mapping and its field, and the schema's `build` and `of` are
//! generated from those two, so the two directions cannot drift apart.

use super::error::ConfigError;

/// The field has the setting's type.
pub(super) mod plain {
    use super::ConfigError;

    pub(in super::super) fn get<T: Clone>(field: &T) -> Option<T> {
        Some(field.clone())
    }

    pub(in super::super) fn put<T: Clone>(field: &mut T, v: &T) -> Result<(), ConfigError> {
        *field = v.clone();
        Ok(())
    }
}

/// An optional field: unset stays `None`.
pub(super) mod opt {
    use super::ConfigError;

    pub(in super::super) fn get<T: Clone>(field: &Option<T>) -> Option<T> {
        field.clone()
    }

    pub(in super::super) fn put<T: Clone>(field: &mut Option<T>, v: &T) -> Result<(), ConfigError> {
        *field = Some(v.clone());
        Ok(())
    }
}

/// A field of another type that converts both ways (an enum and its
/// setting).
pub(super) mod convert {
    use super::ConfigError;

    pub(in super::super) fn get<F: Copy, S: From<F>>(field: &F) -> Option<S> {
        Some(S::from(*field))
    }

    pub(in super::super) fn put<F: From<S>, S: Copy>(
        field: &mut F,
        v: &S,
    ) -> Result<(), ConfigError> {
        *field = F::from(*v);
        Ok(())
    }
}

/// A [`Duration`](std::time::Duration) in whole milliseconds.
pub(super) mod ms {
    use super::ConfigError;
    use std::time::Duration;

    pub(in super::super) fn get(field: &Duration) -> Option<u64> {
        Some(u64::try_from(field.as_millis()).unwrap_or(u64::MAX))
    }

    pub(in super::super) fn put(field: &mut Duration, v: &u64) -> Result<(), ConfigError> {
        *field = Duration::from_millis(*v);
        Ok(())
    }
}

/// An optional [`Duration`](std::time::Duration) in whole milliseconds.
pub(super) mod opt_ms {
    use super::ConfigError;
    use std::time::Duration;

    pub(in super::super) fn get(field: &Option<Duration>) -> Option<u64> {
        field.as_ref().and_then(super::ms::get)
    }

    pub(in super::super) fn put(field: &mut Option<Duration>, v: &u64) -> Result<(), ConfigError> {
        *field = Some(Duration::from_millis(*v));
        Ok(())
    }
}

/// An optional file path, given as text.
pub(super) mod path {
    use super::ConfigError;
    use std::path::PathBuf;

    pub(in super::super) fn get(field: &Option<PathBuf>) -> Option<String> {
        field.as_ref().map(|p| p.display().to_string())
    }

    pub(in super::super) fn put(
        field: &mut Option<PathBuf>,
        v: &String,
    ) -> Result<(), ConfigError> {
        *field = Some(v.into());
        Ok(())
    }
}

/// A [`PollPolicy`](crate::transport::PollPolicy) as microseconds of spin:
/// 0 parks.
pub(super) mod spin_us {
    use super::ConfigError;
    use crate::transport::PollPolicy;
    use std::time::Duration;

    pub(in super::super) fn get(field: &PollPolicy) -> Option<u64> {
        Some(match field {
            PollPolicy::Park => 0,
            PollPolicy::Spin { spin } => u64::try_from(spin.as_micros()).unwrap_or(u64::MAX),
        })
    }

    pub(in super::super) fn put(field: &mut PollPolicy, v: &u64) -> Result<(), ConfigError> {
        *field = match *v {
            0 => PollPolicy::Park,
            us => PollPolicy::Spin {
                spin: Duration::from_micros(us),
            },
        };
        Ok(())
    }
}

/// The KV cache's device: `cpu` (none) or `cuda:N`, opened when the
/// config is built (a missing driver fails it).
pub(super) mod device {
    use super::ConfigError;
    use crate::transport::Device;
    use std::sync::Arc;

    pub(in super::super) fn get(field: &Option<Arc<dyn Device>>) -> Option<String> {
        Some(field.as_ref().map_or_else(|| "cpu".into(), |d| d.name()))
    }

    pub(in super::super) fn put(
        field: &mut Option<Arc<dyn Device>>,
        v: &str,
    ) -> Result<(), ConfigError> {
        *field = match parse(v)? {
            Some(ordinal) => Some(crate::transport::open_cuda(ordinal)?),
            None => None,
        };
        Ok(())
    }

    /// `cpu` is `None`, `cuda:N` is `Some(N)`.
    fn parse(text: &str) -> Result<Option<u32>, ConfigError> {
        let bad = || ConfigError::BadDevice(text.to_string());
        match text.trim() {
            "cpu" => Ok(None),
            t => match t.strip_prefix("cuda:") {
                Some(n) => n.parse().map(Some).map_err(|_| bad()),
                None => Err(bad()),
            },
        }
    }
}
