//! Registered memory regions and the range checks every descriptor passes.
//!
//! A [`Registry`] is shared by reference counting between an endpoint and the
//! transfers that use it. Validating a batch also *pins* the regions it
//! touches, so a region cannot be unregistered (and its memory freed) while a
//! copy into or out of it is still running.

use kvferry_reactor::lock;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard};

use super::MisuseError;

/// Identifies one registration of an endpoint.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct RegionId(pub u64);

/// A registered region as advertised to peers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
pub struct RegionInfo {
    /// First byte.
    pub addr: u64,
    /// Length in bytes (never zero).
    pub len_bytes: u64,
}

/// What is wrong with a range `(addr, len_bytes)`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum RangeFault {
    /// `len_bytes` is zero.
    Empty,
    /// `addr + len_bytes` does not fit in 64 bits.
    Overflow,
    /// The range is not entirely inside one registered region.
    OutOfRegion,
}

impl fmt::Display for RangeFault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            RangeFault::Empty => "is empty",
            RangeFault::Overflow => "overflows the address space",
            RangeFault::OutOfRegion => "is outside every registered region",
        })
    }
}

/// Default bound on registrations per endpoint (a KV cache registers a few
/// regions per layer; this leaves ample room while bounding the map).
pub const DEFAULT_MAX_REGIONS: usize = 4096;

#[derive(Debug)]
struct Entry {
    len_bytes: u64,
    pins: u64,
    /// Device memory: sockets never touch it, copy engines do.
    device: bool,
}

#[derive(Debug)]
struct Inner {
    /// Keyed by start address, so the region holding an address is the last
    /// one starting at or before it.
    by_addr: BTreeMap<u64, Entry>,
    /// id -> start address, for `unregister`.
    by_id: BTreeMap<u64, u64>,
    next_id: u64,
}

/// The regions of one endpoint.
#[derive(Debug)]
pub struct Registry {
    inner: Mutex<Inner>,
    max_regions: usize,
}

impl Registry {
    /// An empty registry holding at most `max_regions` regions.
    pub fn new(max_regions: usize) -> Arc<Registry> {
        Arc::new(Registry {
            inner: Mutex::new(Inner {
                by_addr: BTreeMap::new(),
                by_id: BTreeMap::new(),
                next_id: 1,
            }),
            max_regions,
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        // A panic while holding this lock cannot leave the maps inconsistent
        // (every mutation is a single insert/remove), so poisoning is ignored.
        lock(&self.inner)
    }

    /// Adds a region. The caller's safety promise lives on
    /// [`super::Transport::register`]; this only records the range.
    pub fn insert(&self, addr: u64, len_bytes: u64) -> Result<RegionId, MisuseError> {
        self.insert_kind(addr, len_bytes, false)
    }

    /// Adds a region of device memory (already checked with its driver).
    pub fn insert_device(&self, addr: u64, len_bytes: u64) -> Result<RegionId, MisuseError> {
        self.insert_kind(addr, len_bytes, true)
    }

    fn insert_kind(
        &self,
        addr: u64,
        len_bytes: u64,
        device: bool,
    ) -> Result<RegionId, MisuseError> {
        let end = addr.checked_add(len_bytes);
        if len_bytes == 0 || end.is_none() {
            return Err(MisuseError::BadRegion { addr, len_bytes });
        }
        let end = end.unwrap_or(u64::MAX);
        let mut inner = self.lock();
        if inner.by_addr.len() >= self.max_regions {
            return Err(MisuseError::TooManyRegions {
                max_regions: self.max_regions,
            });
        }
        let overlaps_before = inner
            .by_addr
            .range(..=addr)
            .next_back()
            .is_some_and(|(start, e)| start + e.len_bytes > addr);
        let overlaps_after = inner.by_addr.range(addr..end).next().is_some();
        if overlaps_before || overlaps_after {
            return Err(MisuseError::RegionOverlap { addr, len_bytes });
        }
        let id = RegionId(inner.next_id);
        inner.next_id += 1;
        inner.by_addr.insert(
            addr,
            Entry {
                len_bytes,
                pins: 0,
                device,
            },
        );
        inner.by_id.insert(id.0, addr);
        Ok(id)
    }

    /// Removes a region unless a transfer has it pinned.
    pub fn remove(&self, id: RegionId) -> Result<(), MisuseError> {
        let mut inner = self.lock();
        let Some(&addr) = inner.by_id.get(&id.0) else {
            return Err(MisuseError::UnknownRegion(id));
        };
        let pins = inner.by_addr.get(&addr).map_or(0, |e| e.pins);
        if pins > 0 {
            return Err(MisuseError::RegionBusy { id, pins });
        }
        inner.by_id.remove(&id.0);
        inner.by_addr.remove(&addr);
        Ok(())
    }

    /// The registered regions, sorted by address.
    pub fn regions(&self) -> Vec<RegionInfo> {
        self.lock()
            .by_addr
            .iter()
            .map(|(&addr, e)| RegionInfo {
                addr,
                len_bytes: e.len_bytes,
            })
            .collect()
    }

    /// Checks every range and, only if all are valid, pins the regions they
    /// fall in until the returned [`Pins`] is dropped. On error nothing is
    /// pinned and the error names the first bad range by its index.
    pub fn pin(
        self: &Arc<Self>,
        ranges: impl Iterator<Item = (u64, u64)>,
    ) -> Result<Pins, (usize, RangeFault)> {
        let mut inner = self.lock();
        // First pass: validate everything, remembering the region of each
        // run of consecutive ranges (batches mostly stay in one region).
        let mut starts: Vec<u64> = Vec::new();
        for (index, (addr, len)) in ranges.enumerate() {
            let start = find(&inner.by_addr, addr, len, starts.last().copied())
                .map_err(|fault| (index, fault))?;
            if starts.last() != Some(&start) {
                starts.push(start);
            }
        }
        let mut device = false;
        for start in &starts {
            if let Some(e) = inner.by_addr.get_mut(start) {
                e.pins += 1;
                device |= e.device;
            }
        }
        drop(inner);
        Ok(Pins {
            registry: Arc::clone(self),
            starts,
            device,
        })
    }

    /// For each address, whether it lies in a region of device memory
    /// (one lock for all of them).
    pub fn device_flags(&self, addrs: impl Iterator<Item = u64>) -> Vec<bool> {
        let inner = self.lock();
        addrs
            .map(|addr| {
                let found = find(&inner.by_addr, addr, 1, None).ok();
                found.is_some_and(|start| inner.by_addr.get(&start).is_some_and(|e| e.device))
            })
            .collect()
    }

    fn unpin(&self, starts: &[u64]) {
        let mut inner = self.lock();
        for start in starts {
            match inner.by_addr.get_mut(start) {
                Some(e) if e.pins > 0 => e.pins -= 1,
                // A pinned region cannot be removed, so this is a bug here.
                _ => panic!("registry: unpinning a region at {start:#x} that is not pinned"),
            }
        }
    }
}

/// Finds the start of the region holding `[addr, addr + len)`, trying the
/// region of the previous range first.
fn find(
    by_addr: &BTreeMap<u64, Entry>,
    addr: u64,
    len: u64,
    hint: Option<u64>,
) -> Result<u64, RangeFault> {
    if len == 0 {
        return Err(RangeFault::Empty);
    }
    let end = addr.checked_add(len).ok_or(RangeFault::Overflow)?;
    let inside = |start: u64, e: &Entry| addr >= start && end <= start + e.len_bytes;
    if let Some(start) = hint {
        if let Some(e) = by_addr.get(&start) {
            if inside(start, e) {
                return Ok(start);
            }
        }
    }
    match by_addr.range(..=addr).next_back() {
        Some((&start, e)) if inside(start, e) => Ok(start),
        _ => Err(RangeFault::OutOfRegion),
    }
}

/// Checks ranges against a peer's advertised regions (sorted by address).
/// Returns the first bad range.
pub fn check_remote(
    regions: &[RegionInfo],
    ranges: impl Iterator<Item = (u64, u64)>,
) -> Result<(), (usize, RangeFault)> {
    let mut hint: Option<RegionInfo> = None;
    for (index, (addr, len)) in ranges.enumerate() {
        if len == 0 {
            return Err((index, RangeFault::Empty));
        }
        let end = addr.checked_add(len).ok_or((index, RangeFault::Overflow))?;
        let inside = |r: &RegionInfo| addr >= r.addr && end <= r.addr.saturating_add(r.len_bytes);
        if hint.as_ref().is_some_and(inside) {
            continue;
        }
        let pos = regions.partition_point(|r| r.addr <= addr);
        match pos.checked_sub(1).map(|i| regions[i]) {
            Some(r) if inside(&r) => hint = Some(r),
            _ => return Err((index, RangeFault::OutOfRegion)),
        }
    }
    Ok(())
}

/// Keeps regions registered while a transfer uses them.
#[derive(Debug)]
pub struct Pins {
    registry: Arc<Registry>,
    starts: Vec<u64>,
    device: bool,
}

impl Pins {
    /// Whether any pinned range is device memory (then each range's kind
    /// is asked with [`Registry::device_flags`]; host batches never are).
    pub fn touches_device(&self) -> bool {
        self.device
    }
}

impl Drop for Pins {
    fn drop(&mut self) {
        self.registry.unpin(&self.starts);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overlap_and_bounds() {
        let r = Registry::new(4);
        let a = r.insert(1000, 100).unwrap();
        assert!(matches!(
            r.insert(1050, 10),
            Err(MisuseError::RegionOverlap { .. })
        ));
        assert!(matches!(
            r.insert(990, 11),
            Err(MisuseError::RegionOverlap { .. })
        ));
        assert!(matches!(
            r.insert(900, 0),
            Err(MisuseError::BadRegion { .. })
        ));
        assert!(matches!(
            r.insert(u64::MAX, 2),
            Err(MisuseError::BadRegion { .. })
        ));
        r.insert(1100, 10).unwrap();
        r.insert(990, 10).unwrap();
        assert_eq!(r.pin([(1000, 100)].into_iter()).map(|_| ()), Ok(()));
        assert_eq!(
            r.pin([(1000, 101)].into_iter()).err(),
            Some((0, RangeFault::OutOfRegion))
        );
        assert_eq!(
            r.pin([(1000, 1), (u64::MAX, 1)].into_iter()).err(),
            Some((1, RangeFault::Overflow))
        );
        assert_eq!(
            r.pin([(1000, 0)].into_iter()).err(),
            Some((0, RangeFault::Empty))
        );
        let pins = r
            .pin([(1000, 5), (1005, 5), (1100, 1)].into_iter())
            .unwrap();
        assert!(matches!(
            r.remove(a),
            Err(MisuseError::RegionBusy { pins: 1, .. })
        ));
        drop(pins);
        r.remove(a).unwrap();
        assert!(matches!(r.remove(a), Err(MisuseError::UnknownRegion(_))));
        assert_eq!(
            r.pin([(1000, 1)].into_iter()).err(),
            Some((0, RangeFault::OutOfRegion))
        );
    }

    #[test]
    fn remote_check() {
        let regions = [
            RegionInfo {
                addr: 100,
                len_bytes: 10,
            },
            RegionInfo {
                addr: 200,
                len_bytes: 10,
            },
        ];
        assert_eq!(
            check_remote(&regions, [(100, 10), (205, 5)].into_iter()),
            Ok(())
        );
        assert_eq!(
            check_remote(&regions, [(100, 10), (105, 6)].into_iter()),
            Err((1, RangeFault::OutOfRegion))
        );
        assert_eq!(
            check_remote(&regions, [(50, 1)].into_iter()),
            Err((0, RangeFault::OutOfRegion))
        );
        assert_eq!(
            check_remote(&regions, [(u64::MAX, 1)].into_iter()),
            Err((0, RangeFault::Overflow))
        );
    }
}
