//! Who an endpoint is on its host: what two endpoints compare before they
//! share memory.

use std::io;
use std::os::unix::fs::MetadataExt;

/// An endpoint's host identity, as sent in the shm hello.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct HostId {
    /// The kernel's boot id: the same only on one host, in one boot.
    pub(crate) boot_id: [u8; 36],
    /// The network namespace (device and inode of `/proc/self/ns/net`):
    /// its abstract Unix sockets are the ones the peer can reach.
    pub(crate) netns: (u64, u64),
    pub(crate) uid: u32,
    pub(crate) pid: u32,
}

/// Bytes of an encoded [`HostId`].
pub(crate) const HOST_ID_LEN: usize = 64;

impl HostId {
    /// This process's identity.
    pub(crate) fn current() -> io::Result<HostId> {
        let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")?;
        let text = text.trim().as_bytes();
        let mut boot_id = [0u8; 36];
        if text.len() != boot_id.len() {
            return Err(io::Error::new(io::ErrorKind::InvalidData, "boot id"));
        }
        boot_id.copy_from_slice(text);
        let ns = std::fs::metadata("/proc/self/ns/net")?;
        Ok(HostId {
            boot_id,
            netns: (ns.dev(), ns.ino()),
            // SAFETY: neither call has preconditions.
            uid: unsafe { libc::geteuid() },
            pid: std::process::id(),
        })
    }

    /// Same host, same network namespace, same user.
    pub(crate) fn shares_with(&self, other: &HostId) -> bool {
        self.boot_id == other.boot_id && self.netns == other.netns && self.uid == other.uid
    }

    pub(crate) fn encode(&self) -> [u8; HOST_ID_LEN] {
        let mut b = [0u8; HOST_ID_LEN];
        b[..36].copy_from_slice(&self.boot_id);
        b[40..48].copy_from_slice(&self.netns.0.to_le_bytes());
        b[48..56].copy_from_slice(&self.netns.1.to_le_bytes());
        b[56..60].copy_from_slice(&self.uid.to_le_bytes());
        b[60..64].copy_from_slice(&self.pid.to_le_bytes());
        b
    }

    pub(crate) fn decode(b: &[u8]) -> Option<HostId> {
        let b: &[u8; HOST_ID_LEN] = b.get(..HOST_ID_LEN)?.try_into().ok()?;
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().unwrap_or_default());
        let mut boot_id = [0u8; 36];
        boot_id.copy_from_slice(&b[..36]);
        Some(HostId {
            boot_id,
            netns: (u64_at(40), u64_at(48)),
            uid: u32_at(56),
            pid: u32_at(60),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identity_round_trips_and_differs_by_host_or_user() {
        let me = HostId::current().unwrap();
        assert_eq!(HostId::decode(&me.encode()), Some(me));
        assert!(me.shares_with(&me));
        let mut other = me;
        other.boot_id[0] ^= 1;
        assert!(!me.shares_with(&other), "another boot id: another host");
        let mut other = me;
        other.netns.1 += 1;
        assert!(!me.shares_with(&other), "another network namespace");
        let mut other = me;
        other.uid += 1;
        assert!(!me.shares_with(&other), "another user");
        assert_eq!(HostId::decode(&[0; 10]), None);
    }
}
