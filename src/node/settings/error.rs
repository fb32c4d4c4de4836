//! Why settings could not be read or built.

/// Why settings could not be read or built.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The file could not be read.
    #[error("cannot read {path}: {source}")]
    Io {
        /// The file.
        path: String,
        /// The OS error.
        #[source]
        source: std::io::Error,
    },
    /// The file's name ends neither in `.json` nor in `.toml`.
    #[error("{path}: settings files end in .json or .toml")]
    UnknownFormat {
        /// The file.
        path: String,
    },
    /// JSON that does not fit the schema.
    #[error("JSON settings: {0}")]
    Json(#[from] serde_json::Error),
    /// TOML that does not fit the schema.
    #[error("TOML settings: {0}")]
    Toml(#[from] toml::de::Error),
    /// An environment variable whose value does not fit its key.
    #[error("{var}: {why}")]
    Env {
        /// The variable.
        var: String,
        /// What is wrong with its value.
        why: String,
    },
    /// A key a config cannot be built without.
    #[error("setting {0} is required")]
    Missing(&'static str),
    /// A `device` that is not `cpu` or `cuda:N`.
    #[error("device {0:?}: expected \"cpu\" or \"cuda:N\"")]
    BadDevice(String),
    /// The device asked for cannot be opened here.
    #[error(transparent)]
    Device(#[from] crate::transport::DeviceError),
}
