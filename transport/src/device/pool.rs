//! The staging pool: a bounded set of pinned host buffers that device bytes
//! pass through on their way to and from sockets, and the tracker the
//! block fence drains before a close returns.

use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::fmt;
use std::rc::Rc;
use std::sync::Arc;
use std::time::Duration;

use glommio::sync::{Semaphore, StaticPermit};

use super::{CopyStream, Device, DeviceError, Dir, EngineEvent, Mark, Pinned};

/// Counters of a [`StagingPool`].
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PoolStats {
    /// Buffers allocated (never more than the pool's bound).
    pub allocated: usize,
    /// Most buffers leased at once.
    pub high_water: usize,
    /// Buffers leased now, including those whose last copy is running.
    pub leased: usize,
    /// Leases dropped while a copy on their buffer was still running: the
    /// buffer went back only once the copy finished.
    pub held_for_copies: u64,
    /// Buffers retired because a copy on them outlived the drain bound.
    pub lost: u64,
}

/// At most `buffers` pinned host buffers of `buffer_bytes` each, allocated
/// on first use and leased in arrival order. A lease dropped while a copy
/// still runs on its buffer (a batch cancelled, a peer gone) returns the
/// buffer only once that copy finished, so no copy ever lands in a buffer
/// that was leased again.
pub struct StagingPool {
    device: Arc<dyn Device>,
    buffer_bytes: usize,
    buffers: usize,
    permits: Rc<Semaphore>,
    free: RefCell<Vec<Pinned>>,
    allocated: Cell<usize>,
    leased: Cell<usize>,
    high_water: Cell<usize>,
    held_for_copies: Cell<u64>,
    lost: Cell<u64>,
    drain_max: Duration,
}

impl fmt::Debug for StagingPool {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("StagingPool")
            .field("buffers", &self.buffers)
            .field("buffer_bytes", &self.buffer_bytes)
            .field("stats", &self.stats())
            .finish()
    }
}

impl StagingPool {
    /// A pool of at most `buffers` buffers of `buffer_bytes` on `device`;
    /// a lease dropped while its copy runs waits at most `drain_max`.
    pub fn new(
        device: Arc<dyn Device>,
        buffers: usize,
        buffer_bytes: usize,
        drain_max: Duration,
    ) -> Rc<StagingPool> {
        Rc::new(StagingPool {
            device,
            buffer_bytes,
            buffers,
            permits: Rc::new(Semaphore::new(buffers as u64)),
            free: RefCell::new(Vec::new()),
            allocated: Cell::new(0),
            leased: Cell::new(0),
            high_water: Cell::new(0),
            held_for_copies: Cell::new(0),
            lost: Cell::new(0),
            drain_max,
        })
    }

    /// Bytes of one buffer: the most one staged copy moves.
    pub fn buffer_bytes(&self) -> usize {
        self.buffer_bytes
    }

    /// The pool's counters.
    pub fn stats(&self) -> PoolStats {
        PoolStats {
            allocated: self.allocated.get(),
            high_water: self.high_water.get(),
            leased: self.leased.get(),
            held_for_copies: self.held_for_copies.get(),
            lost: self.lost.get(),
        }
    }

    /// Leases a buffer, waiting (in arrival order) while all are leased.
    /// A caller must hold no other lease while it waits here (then every
    /// lease it waits for is released by a copy or a send that ends on its
    /// own, and no two waiters wait for each other); [`Self::try_lease`]
    /// takes more.
    pub async fn lease(self: &Rc<Self>) -> Result<Lease, DeviceError> {
        let permit =
            self.permits
                .acquire_static_permit(1)
                .await
                .map_err(|_| DeviceError::Driver {
                    call: "leasing a staging buffer",
                    detail: "the pool was closed".into(),
                })?;
        self.hand_out(permit)
    }

    /// Leases a buffer if one is free now, behind no waiter.
    pub fn try_lease(self: &Rc<Self>) -> Option<Result<Lease, DeviceError>> {
        let permit = self.permits.try_acquire_static_permit(1).ok()?;
        Some(self.hand_out(permit))
    }

    /// Whether a lease now would wait.
    pub fn exhausted(&self) -> bool {
        self.permits.available() == 0
    }

    fn hand_out(self: &Rc<Self>, permit: StaticPermit) -> Result<Lease, DeviceError> {
        let buf = match self.free.borrow_mut().pop() {
            Some(b) => b,
            None => {
                let b = self.device.alloc_pinned(self.buffer_bytes)?;
                self.allocated.set(self.allocated.get() + 1);
                b
            }
        };
        self.leased.set(self.leased.get() + 1);
        self.high_water
            .set(self.high_water.get().max(self.leased.get()));
        Ok(Lease {
            pool: Rc::clone(self),
            buf: Some(buf),
            permit: Some(permit),
            copy: None,
        })
    }

    fn give_back(&self, buf: Pinned) {
        self.free.borrow_mut().push(buf);
        self.leased.set(self.leased.get() - 1);
    }
}

/// One leased staging buffer. Record the copies that use it with
/// [`Lease::copying`]; dropping the lease then waits for them before the
/// buffer can be leased again.
pub struct Lease {
    pool: Rc<StagingPool>,
    buf: Option<Pinned>,
    permit: Option<StaticPermit>,
    /// The mark behind the last copy into or out of the buffer, and what
    /// must stay alive until it is done (the pins of the device region).
    copy: Option<(Mark, Box<dyn std::any::Any>)>,
}

impl fmt::Debug for Lease {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Lease({:?})", self.buf)
    }
}

impl Lease {
    /// The buffer's first byte.
    pub fn addr(&self) -> u64 {
        self.buf.as_ref().map_or(0, Pinned::addr)
    }

    /// Its length.
    pub fn len_bytes(&self) -> usize {
        self.pool.buffer_bytes
    }

    /// Records that copies up to `mark` use the buffer, keeping `keep`
    /// (what the copies' other side needs alive) until they are done.
    pub fn copying(&mut self, mark: Mark, keep: Box<dyn std::any::Any>) {
        self.copy = Some((mark, keep));
    }
}

impl Drop for Lease {
    /// A buffer goes back only once no copy uses it. A lease dropped while
    /// its copy runs (a batch cancelled, a peer gone) waits for the copy
    /// here, at most the pool's `drain_max` (copies are microseconds long;
    /// leases of a running batch are dropped after their marks, so only a
    /// cancellation waits). Past that the buffer and what the copy needs
    /// are leaked, never reused: the pool is one buffer smaller.
    fn drop(&mut self) {
        let (Some(buf), Some(permit)) = (self.buf.take(), self.permit.take()) else {
            return;
        };
        let pool = &self.pool;
        if let Some((mark, keep)) = self.copy.take() {
            if !mark.is_done() {
                pool.held_for_copies.set(pool.held_for_copies.get() + 1);
                if !mark.wait_blocking(pool.drain_max) {
                    pool.lost.set(pool.lost.get() + 1);
                    tracing::error!(
                        device = %pool.device.name(),
                        "a device copy outlived its batch past the drain bound; its staging \
                         buffer is retired"
                    );
                    std::mem::forget((buf, keep, permit));
                    return;
                }
            }
            drop(keep);
        }
        pool.give_back(buf);
        drop(permit);
    }
}

/// A mark, and the device ranges `(addr, len)` of the copies before it.
type InFlight = (Mark, Vec<(u64, u64)>);

/// The copy streams of one endpoint's device, and the copies in flight on
/// them with the device ranges they touch: what a fence close waits for.
#[derive(Debug)]
pub(crate) struct CopyTracker {
    pub(crate) device: Arc<dyn Device>,
    /// Device to host (sends), host to device (receives): the two
    /// directions use different copy engines, so they overlap.
    to_host: Arc<dyn CopyStream>,
    to_device: Arc<dyn CopyStream>,
    /// Marks not yet seen done, oldest first, with the device ranges of
    /// the copies before them. Pruned at each enqueue; bounded by the
    /// staging pool (every staged copy holds a lease until its mark).
    inflight: RefCell<VecDeque<InFlight>>,
    /// Longest a close waits for copies in flight.
    drain_max: Duration,
    drain_waits: Cell<u64>,
    drain_overruns: Cell<u64>,
}

impl CopyTracker {
    pub(crate) fn new(device: Arc<dyn Device>, drain_max: Duration) -> Result<Self, DeviceError> {
        Ok(CopyTracker {
            to_host: device.copy_stream()?,
            to_device: device.copy_stream()?,
            device,
            inflight: RefCell::new(VecDeque::new()),
            drain_max,
            drain_waits: Cell::new(0),
            drain_overruns: Cell::new(0),
        })
    }

    /// Makes the copies enqueued from now on (those that read the
    /// engine's blocks: to the host and device to device) wait for the
    /// engine's `event`.
    pub(crate) fn wait_engine(&self, event: &EngineEvent) -> Result<(), DeviceError> {
        self.to_host.wait_engine(event)?;
        self.to_device.wait_engine(event)
    }

    /// Copies `len` bytes now: enqueues the copy and waits for it on this
    /// thread (at most `drain_max`). For copies whose end a peer's close
    /// waits for through the shared fence's lane.
    ///
    /// # Safety
    ///
    /// As for [`CopyStream::enqueue`].
    pub(crate) unsafe fn copy_now(
        &self,
        dir: Dir,
        dst: u64,
        src: u64,
        len: u64,
    ) -> Result<(), DeviceError> {
        // SAFETY: the caller's promise.
        let mark = unsafe { self.copy(dir, &[(dst, src, len)])? };
        if !mark.wait_blocking(self.drain_max) {
            return Err(DeviceError::Driver {
                call: "a device copy to a peer",
                detail: format!("it did not end within {:?}", self.drain_max),
            });
        }
        mark.result()
    }

    /// Enqueues the copies `(dst, src, len)` in direction `dir` and returns
    /// the mark behind them.
    ///
    /// # Safety
    ///
    /// As for [`CopyStream::enqueue`], for every copy.
    pub(crate) unsafe fn copy(
        &self,
        dir: Dir,
        copies: &[(u64, u64, u64)],
    ) -> Result<Mark, DeviceError> {
        let stream = match dir {
            Dir::ToHost => &self.to_host,
            Dir::ToDevice | Dir::DeviceToDevice => &self.to_device,
        };
        for &(dst, src, len) in copies {
            // SAFETY: the caller's promise.
            unsafe { stream.enqueue(dir, dst, src, len as usize)? };
        }
        let mark = stream.mark()?;
        let device_side = |&(dst, src, len): &(u64, u64, u64)| match dir {
            Dir::ToHost => (src, len),
            Dir::ToDevice | Dir::DeviceToDevice => (dst, len),
        };
        let mut inflight = self.inflight.borrow_mut();
        while inflight.front().is_some_and(|(m, _)| m.is_done()) {
            inflight.pop_front();
        }
        // The two streams finish out of order: a long copy at the front
        // must not keep the finished ones behind it.
        if inflight.len() >= 64 {
            inflight.retain(|(m, _)| !m.is_done());
        }
        inflight.push_back((mark.clone(), copies.iter().map(device_side).collect()));
        Ok(mark)
    }

    /// Waits, at most `drain_max` each, for the copies in flight on a range
    /// `closed` says was closed: a close of the fence calls it, so no copy
    /// into or out of a closed block outlives the close. A batch that
    /// succeeded waited for its own copies, so only failed or cancelled
    /// ones wait here (copies are microseconds long); an overrun is counted
    /// and logged.
    pub(crate) fn drain(&self, closed: impl Fn(u64, u64) -> bool) {
        let inflight = self.inflight.borrow();
        for (mark, ranges) in inflight.iter() {
            if mark.is_done() || !ranges.iter().any(|&(a, l)| closed(a, l)) {
                continue;
            }
            self.drain_waits.set(self.drain_waits.get() + 1);
            if !mark.wait_blocking(self.drain_max) {
                self.drain_overruns.set(self.drain_overruns.get() + 1);
                tracing::warn!(
                    device = %self.device.name(),
                    "a device copy ran past the fence's drain bound"
                );
            }
        }
    }

    /// Marks enqueued and not yet done.
    pub(crate) fn in_flight(&self) -> usize {
        self.inflight
            .borrow()
            .iter()
            .filter(|(m, _)| !m.is_done())
            .count()
    }

    /// Closes that waited for a copy in flight, and those that gave up.
    pub(crate) fn drain_counts(&self) -> (u64, u64) {
        (self.drain_waits.get(), self.drain_overruns.get())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::HostDevice;

    fn block_on<T>(f: impl std::future::Future<Output = T>) -> T {
        glommio::LocalExecutorBuilder::new(glommio::Placement::Unbound)
            .make()
            .expect("executor")
            .run(f)
    }

    #[test]
    fn a_lease_dropped_under_a_running_copy_waits_for_it() {
        block_on(async {
            let dev = HostDevice::new(0, Duration::from_millis(50));
            let pool = StagingPool::new(dev.clone(), 1, 4096, Duration::from_secs(5));
            let copies = CopyTracker::new(dev.clone(), Duration::from_secs(5)).unwrap();
            let src = dev.alloc(4096);
            let mut lease = pool.lease().await.unwrap();
            // SAFETY: the buffer is leased and `src` lives as long as `dev`.
            let mark = unsafe { copies.copy(Dir::ToHost, &[(lease.addr(), src, 4096)]) }.unwrap();
            lease.copying(mark.clone(), Box::new(()));
            assert!(!mark.is_done(), "the copy takes 50 ms");
            drop(lease);
            assert!(mark.is_done(), "the buffer went back under a running copy");
            let stats = pool.stats();
            assert_eq!((stats.leased, stats.held_for_copies, stats.lost), (0, 1, 0));
            // The one buffer is leased again, not a second one allocated.
            let again = pool.try_lease().expect("free").unwrap();
            assert_eq!(pool.stats().allocated, 1);
            assert!(pool.try_lease().is_none(), "the pool holds one buffer");
            drop(again);
        });
    }

    #[test]
    fn a_copy_past_the_bound_retires_its_buffer() {
        block_on(async {
            let dev = HostDevice::new(0, Duration::from_millis(300));
            let pool = StagingPool::new(dev.clone(), 2, 4096, Duration::from_millis(10));
            let copies = CopyTracker::new(dev.clone(), Duration::from_secs(5)).unwrap();
            let src = dev.alloc(4096);
            let mut lease = pool.lease().await.unwrap();
            // SAFETY: as above; the buffer is retired, never freed.
            let mark = unsafe { copies.copy(Dir::ToHost, &[(lease.addr(), src, 4096)]) }.unwrap();
            lease.copying(mark, Box::new(()));
            drop(lease);
            let stats = pool.stats();
            assert_eq!((stats.leased, stats.lost), (1, 1), "{stats:?}");
            // One buffer is left to lease.
            let one = pool.try_lease().expect("one left").unwrap();
            assert!(pool.try_lease().is_none());
            drop(one);
        });
    }
}
