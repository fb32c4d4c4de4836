//! The cluster key: loaded from a file, never printed.

use std::fmt;
use std::path::{Path, PathBuf};

use crate::mac::Keyed;

/// The environment variable naming the cluster key's file.
pub const KEY_FILE_ENV: &str = "KVFERRY_CLUSTER_KEY_FILE";
/// The environment variable naming the previous key's file, accepted
/// beside the current one during a rotation.
pub const PREVIOUS_KEY_FILE_ENV: &str = "KVFERRY_CLUSTER_KEY_PREVIOUS_FILE";
/// Fewest bytes a key file may hold.
pub const MIN_KEY_BYTES: usize = 32;
/// Most bytes read from a key file (a key is a secret, not a document).
const MAX_KEY_BYTES: usize = 4096;

/// A key's public name: 8 bytes of a MAC under the key, so two nodes can
/// tell (and an operator can log) which key they hold without showing it.
#[derive(Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct KeyId(pub [u8; 8]);

impl fmt::Display for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

impl fmt::Debug for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "KeyId({self})")
    }
}

/// Why a key could not be loaded (the operator's to fix).
#[non_exhaustive]
#[derive(Debug, thiserror::Error)]
pub enum KeyError {
    /// The file could not be read.
    #[error("cluster key file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// What the OS said.
        #[source]
        source: std::io::Error,
    },
    /// The file holds fewer than [`MIN_KEY_BYTES`] or more than 4096 bytes.
    #[error("cluster key file {path} holds {len} bytes; a key is 32 to 4096 bytes")]
    BadLength {
        /// The file.
        path: PathBuf,
        /// Its length.
        len: usize,
    },
    /// The previous key is the current one (a rotation not started, or
    /// the same file named twice).
    #[error("the previous cluster key {0} is the current one")]
    SameKey(PathBuf),
}

/// The cluster's secret: the current key, and the previous one while a
/// rotation is under way. Signing uses the current key; verifying accepts
/// either, and a handshake settles on a key both sides hold.
#[derive(Clone)]
pub struct ClusterKey {
    /// The current key first.
    keys: Vec<(KeyId, Keyed)>,
}

impl fmt::Debug for ClusterKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let ids: Vec<KeyId> = self.ids().collect();
        f.debug_struct("ClusterKey").field("ids", &ids).finish()
    }
}

impl ClusterKey {
    /// A key from its bytes (32 to 4096) and, during a rotation, the
    /// previous key's. For tests and embedders; engines load files.
    pub fn from_bytes(current: &[u8], previous: Option<&[u8]>) -> Result<ClusterKey, KeyError> {
        let mut keys = vec![keyed(current, Path::new("<bytes>"))?];
        if let Some(p) = previous {
            let prev = keyed(p, Path::new("<previous bytes>"))?;
            if prev.0 == keys[0].0 {
                return Err(KeyError::SameKey(PathBuf::from("<previous bytes>")));
            }
            keys.push(prev);
        }
        Ok(ClusterKey { keys })
    }

    /// Reads the key from `current` (its raw bytes, as they are: a
    /// trailing newline is part of the key) and the previous key from
    /// `previous`. Warns when a file is readable by others.
    pub fn load(current: &Path, previous: Option<&Path>) -> Result<ClusterKey, KeyError> {
        let mut keys = vec![keyed(&read(current)?, current)?];
        if let Some(p) = previous {
            let prev = keyed(&read(p)?, p)?;
            if prev.0 == keys[0].0 {
                return Err(KeyError::SameKey(p.to_path_buf()));
            }
            keys.push(prev);
        }
        Ok(ClusterKey { keys })
    }

    /// The key named by [`KEY_FILE_ENV`] (and [`PREVIOUS_KEY_FILE_ENV`]),
    /// `None` when the variable is unset or empty.
    pub fn from_env() -> Result<Option<ClusterKey>, KeyError> {
        let var = |name| std::env::var_os(name).filter(|v| !v.is_empty());
        let Some(current) = var(KEY_FILE_ENV) else {
            return Ok(None);
        };
        let previous = var(PREVIOUS_KEY_FILE_ENV);
        Self::load(Path::new(&current), previous.as_deref().map(Path::new)).map(Some)
    }

    /// The ids of the keys held, the current one first.
    pub fn ids(&self) -> impl Iterator<Item = KeyId> + '_ {
        self.keys.iter().map(|(id, _)| *id)
    }

    /// The current key.
    #[cfg(test)]
    pub(crate) fn current(&self) -> &Keyed {
        &self.keys[0].1
    }

    /// Every key held, the current one first.
    pub(crate) fn all(&self) -> impl Iterator<Item = &Keyed> {
        self.keys.iter().map(|(_, k)| k)
    }

    /// The key with id `id`, if held.
    pub(crate) fn by_id(&self, id: KeyId) -> Option<&Keyed> {
        self.keys.iter().find(|(i, _)| *i == id).map(|(_, k)| k)
    }
}

fn read(path: &Path) -> Result<Vec<u8>, KeyError> {
    use std::io::Read;
    use std::os::unix::fs::PermissionsExt;
    let err = |source| KeyError::Read {
        path: path.to_path_buf(),
        source,
    };
    let file = std::fs::File::open(path).map_err(err)?;
    let mode = file.metadata().map_err(err)?.permissions().mode();
    if mode & 0o077 != 0 {
        tracing::warn!(
            path = %path.display(),
            mode = format_args!("{:o}", mode & 0o777),
            "cluster key file is readable by other users; chmod 600 it"
        );
    }
    let mut bytes = Vec::new();
    file.take(MAX_KEY_BYTES as u64 + 1)
        .read_to_end(&mut bytes)
        .map_err(err)?;
    Ok(bytes)
}

fn keyed(bytes: &[u8], path: &Path) -> Result<(KeyId, Keyed), KeyError> {
    if !(MIN_KEY_BYTES..=MAX_KEY_BYTES).contains(&bytes.len()) {
        return Err(KeyError::BadLength {
            path: path.to_path_buf(),
            len: bytes.len(),
        });
    }
    let k = Keyed::new(bytes);
    let t = k.tag(b"kvferry/1 key id", &[]);
    let mut id = [0u8; 8];
    id.copy_from_slice(&t[..8]);
    Ok((KeyId(id), k))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    #[test]
    fn lengths_are_checked_and_debug_hides_the_key() {
        assert!(matches!(
            ClusterKey::from_bytes(&[7; 31], None),
            Err(KeyError::BadLength { len: 31, .. })
        ));
        let secret = [0x5a_u8; 40];
        let k = ClusterKey::from_bytes(&secret, None).unwrap();
        let shown = format!("{k:?}");
        assert!(shown.contains("ClusterKey"), "{shown}");
        assert!(!shown.contains("5a5a"), "the key leaked: {shown}");
        assert!(matches!(
            ClusterKey::from_bytes(&secret, Some(&secret)),
            Err(KeyError::SameKey(_))
        ));
    }

    #[test]
    fn files_are_read_as_raw_bytes() {
        let dir = std::env::temp_dir().join(format!("kvferry-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let (a, b) = (dir.join("a"), dir.join("b"));
        std::fs::File::create(&a)
            .unwrap()
            .write_all(&[1; 32])
            .unwrap();
        std::fs::write(&b, [1; 33]).unwrap();
        let ka = ClusterKey::load(&a, None).unwrap();
        let kab = ClusterKey::load(&a, Some(&b)).unwrap();
        let from_bytes = ClusterKey::from_bytes(&[1; 32], None).unwrap();
        assert_eq!(
            ka.ids().collect::<Vec<_>>(),
            from_bytes.ids().collect::<Vec<_>>()
        );
        assert_eq!(kab.ids().count(), 2);
        assert_ne!(
            kab.ids().nth(1),
            ka.ids().next(),
            "one more byte, another key"
        );
        let missing = ClusterKey::load(&dir.join("none"), None);
        assert!(matches!(missing, Err(KeyError::Read { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
