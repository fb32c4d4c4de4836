//! How a Redis backend reaches its server or cluster: [`RedisConfig`] (the
//! server, the credentials, the connect timeout), the `redis://` and
//! `redis+cluster://` URLs it is read from, the password file, and
//! [`RedisError`] for a URL or file that will not do. A leaf: the
//! connection (`conn.rs`) opens with it and both stores (`mod.rs`,
//! `cluster.rs`) parse their URLs through it, and it needs none of them.

use std::time::Duration;

/// Environment variable naming a file whose first line is the password
/// (so it never has to be on a command line).
pub const PASSWORD_FILE_ENV: &str = "KVFERRY_REDIS_PASSWORD_FILE";
/// `HOST:PORT` seeds a URL may name at most.
pub const SEEDS_MAX: usize = 64;

/// How a [`RedisStore`](super::RedisStore) reaches its server.
#[derive(Clone)]
pub struct RedisConfig {
    /// `HOST:PORT`.
    pub server: String,
    /// ACL user for `AUTH` (with `password`).
    pub user: Option<String>,
    /// Password for `AUTH`.
    pub password: Option<String>,
    /// Most time a connect waits (also bounded by the call's deadline).
    pub connect_timeout: Duration,
}

impl std::fmt::Debug for RedisConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The password stays out of logs.
        f.debug_struct("RedisConfig")
            .field("server", &self.server)
            .field("user", &self.user)
            .field("password", &self.password.as_ref().map(|_| "***"))
            .finish()
    }
}

/// Why a `redis://` URL or its password file is not usable.
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum RedisError {
    /// Not `redis://[user:password@]HOST:PORT`.
    #[error("{url:?}: {reason}")]
    Url {
        /// The URL, its password hidden.
        url: String,
        /// Why.
        reason: &'static str,
    },
    /// The password file could not be read.
    #[error("{PASSWORD_FILE_ENV} {path:?}: {reason}")]
    PasswordFile {
        /// The file.
        path: String,
        /// Why.
        reason: String,
    },
}

impl RedisConfig {
    /// The settings for `redis://[user:password@]HOST:PORT`; a password
    /// in [`PASSWORD_FILE_ENV`] wins over one in the URL.
    pub fn from_url(url: &str) -> Result<RedisConfig, RedisError> {
        let (mut cfg, servers) = parse_url(url, "redis://")?;
        match <[String; 1]>::try_from(servers) {
            Ok([server]) => {
                cfg.server = server;
                Ok(cfg)
            }
            Err(_) => Err(url_error(
                url,
                "one HOST:PORT (redis+cluster:// takes several)",
            )),
        }
    }

    /// The same credentials and timeout for another server.
    pub(crate) fn for_server(&self, server: &str) -> RedisConfig {
        RedisConfig {
            server: server.to_string(),
            ..self.clone()
        }
    }
}

pub(super) fn url_error(url: &str, reason: &'static str) -> RedisError {
    RedisError::Url {
        url: url.split('@').next_back().unwrap_or("").to_string(),
        reason,
    }
}

/// `SCHEME[user:password@]HOST:PORT[,HOST:PORT...]`: the credentials (a
/// server left empty) and the servers, at most [`SEEDS_MAX`].
pub(super) fn parse_url(url: &str, scheme: &str) -> Result<(RedisConfig, Vec<String>), RedisError> {
    let bad = |reason| url_error(url, reason);
    let rest = url
        .strip_prefix(scheme)
        .ok_or_else(|| bad("not the URL's scheme"))?;
    let rest = rest.strip_suffix('/').unwrap_or(rest);
    let (auth, list) = match rest.rsplit_once('@') {
        Some((a, s)) => (Some(a), s),
        None => (None, rest),
    };
    let servers: Vec<String> = list.split(',').map(str::to_string).collect();
    if servers.len() > SEEDS_MAX {
        return Err(bad("too many HOST:PORT"));
    }
    for server in &servers {
        let (host, port) = server.rsplit_once(':').ok_or_else(|| bad("no :PORT"))?;
        if host.is_empty() || port.parse::<u16>().is_err() || server.contains('/') {
            return Err(bad("not HOST:PORT"));
        }
    }
    let (user, password) = match auth {
        None => (None, None),
        Some(a) => match a.split_once(':') {
            Some((u, p)) => ((!u.is_empty()).then(|| u.to_string()), Some(p.to_string())),
            None => return Err(bad("credentials are user:password@")),
        },
    };
    let password = match std::env::var_os(PASSWORD_FILE_ENV) {
        Some(path) => Some(read_password(&path.to_string_lossy())?),
        None => password,
    };
    let cfg = RedisConfig {
        server: String::new(),
        user,
        password,
        connect_timeout: Duration::from_secs(2),
    };
    Ok((cfg, servers))
}

fn read_password(path: &str) -> Result<String, RedisError> {
    let text = std::fs::read_to_string(path).map_err(|e| RedisError::PasswordFile {
        path: path.to_string(),
        reason: e.to_string(),
    })?;
    Ok(text.lines().next().unwrap_or("").to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_parse_with_and_without_credentials() {
        let c = RedisConfig::from_url("redis://127.0.0.1:6379").unwrap();
        assert_eq!(
            (c.server.as_str(), c.user, c.password),
            ("127.0.0.1:6379", None, None)
        );
        let c = RedisConfig::from_url("redis://u:p@h:1/").unwrap();
        assert_eq!(
            (c.server.as_str(), c.user.as_deref(), c.password.as_deref()),
            ("h:1", Some("u"), Some("p"))
        );
        assert!(RedisConfig::from_url("redis://h").is_err());
        assert!(RedisConfig::from_url("kvferry://h:1").is_err());
        assert!(RedisConfig::from_url("redis://h:99999").is_err());
    }
}
