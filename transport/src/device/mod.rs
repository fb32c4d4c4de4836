//! Device memory: KV caches that live on an accelerator.
//!
//! Sockets and `memcpy` reach host memory only, so every byte of a device
//! region moves through a copy engine: the transport enqueues asynchronous
//! copies on a [`CopyStream`] of the region's [`Device`] and learns that
//! they finished from a [`Mark`] placed behind them. Two implementations
//! sit behind these traits:
//!
//! * `CudaDevice` (cargo feature `cuda`): the CUDA driver API through
//!   cudarc, loaded when a node first asks for device memory, so a binary
//!   built with the feature starts where there is no driver and fails
//!   that request with [`DeviceError::NoDriver`];
//! * [`HostDevice`]: host memory standing in for a device, its copies run
//!   in order by one worker thread per stream, so the staging pipeline,
//!   the pool's bound, the ordering and a peer dying mid-pipeline are
//!   tested on machines without an accelerator, through the same code.
//!
//! What uses them: the tcp transport stages device bytes through a bounded
//! pool of pinned host buffers ([`StagingPool`], `crate::tcp`), and the
//! block fence waits for device copies in flight before a close returns
//! ([`CopyTracker`]).

#[cfg(feature = "cuda")]
mod cuda;
mod host;
mod pool;

use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use futures::task::AtomicWaker;

#[cfg(feature = "cuda")]
pub use cuda::CudaDevice;
pub use host::HostDevice;
pub(crate) use pool::CopyTracker;
pub use pool::{Lease, PoolStats, StagingPool};

/// Why a device call failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum DeviceError {
    /// Device memory was asked for where it cannot be had: no driver
    /// library, no device, or a binary built without the `cuda` feature.
    #[error("device memory unavailable: {detail}")]
    NoDriver {
        /// What is missing.
        detail: String,
    },
    /// A driver call failed.
    #[error("{call} failed: {detail}")]
    Driver {
        /// The call.
        call: &'static str,
        /// The driver's error name or message.
        detail: String,
    },
    /// A range said to be device memory is not one allocation of this
    /// device (the caller's mistake; nothing registered).
    #[error("{addr:#x}+{len_bytes} is not inside one allocation of device {device}")]
    NotDeviceMemory {
        /// Start of the range.
        addr: u64,
        /// Its length.
        len_bytes: u64,
        /// The device asked for.
        device: String,
    },
}

/// Which side of a copy is device memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Dir {
    /// Device to (pinned) host.
    ToHost,
    /// Host to device.
    ToDevice,
    /// Device to device, on this device or a peer device.
    DeviceToDevice,
}

/// One accelerator as the transports use it.
pub trait Device: Send + Sync + fmt::Debug {
    /// Its name in logs and in Mooncake's location naming: `cuda:0`.
    fn name(&self) -> String;

    /// Checks that `[addr, addr + len_bytes)` lies inside one allocation
    /// of this device (CUDA: `cuMemGetAddressRange`).
    fn check_range(&self, addr: u64, len_bytes: u64) -> Result<(), DeviceError>;

    /// Allocates `len_bytes` of page-locked host memory, which copy
    /// engines reach at full speed.
    fn alloc_pinned(&self, len_bytes: usize) -> Result<Pinned, DeviceError>;

    /// A new stream of copies, run in order.
    fn copy_stream(&self) -> Result<Arc<dyn CopyStream>, DeviceError>;

    /// Records an event on the engine's stream `stream` (a `CUstream`, 0
    /// for the legacy default stream): copies that wait for it
    /// ([`CopyStream::wait_engine`]) read only what the engine's work
    /// before it wrote.
    fn record_engine_event(&self, stream: u64) -> Result<EngineEvent, DeviceError>;

    /// A handle another process on this host opens to reach the
    /// allocation holding `[addr, addr + len_bytes)` (CUDA:
    /// `cuIpcGetMemHandle` of the allocation's base), and the range's
    /// offset in it.
    fn export_ipc(&self, addr: u64, len_bytes: u64) -> Result<IpcExport, DeviceError>;

    /// Opens a peer's handle in this process: the allocation's base here,
    /// mapped until the returned value is dropped.
    fn open_ipc(&self, handle: &[u8; IPC_HANDLE_LEN]) -> Result<IpcOpened, DeviceError>;

    /// Allocates `len_bytes` of device memory, zeroed, freed on drop (an
    /// engine's KV cache in tests and benchmarks; engines allocate their own).
    fn alloc_device(&self, len_bytes: usize) -> Result<DeviceAlloc, DeviceError>;

    /// Copies `len_bytes` now, outside any stream, and returns once done
    /// (`cudaMemcpy`): the baseline of the benchmarks, and how tests fill
    /// and read device memory.
    ///
    /// # Safety
    ///
    /// Both ranges valid, `dst` written by nothing else meanwhile.
    unsafe fn memcpy_sync(
        &self,
        dir: Dir,
        dst: u64,
        src: u64,
        len_bytes: usize,
    ) -> Result<(), DeviceError>;
}

/// Device memory from [`Device::alloc_device`], freed on drop.
pub struct DeviceAlloc {
    addr: u64,
    len_bytes: usize,
    free: Option<Box<dyn FnOnce(u64) + Send + Sync>>,
}

impl DeviceAlloc {
    /// The first byte, in the device's address space.
    pub fn addr(&self) -> u64 {
        self.addr
    }

    /// Its length.
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }
}

impl fmt::Debug for DeviceAlloc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "DeviceAlloc({:#x}+{})", self.addr, self.len_bytes)
    }
}

impl Drop for DeviceAlloc {
    fn drop(&mut self) {
        if let Some(free) = self.free.take() {
            free(self.addr);
        }
    }
}

/// Bytes of an IPC handle (`CUipcMemHandle`).
pub const IPC_HANDLE_LEN: usize = 64;

/// A device range as another process opens it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct IpcExport {
    /// The allocation's handle.
    pub handle: [u8; IPC_HANDLE_LEN],
    /// Where the range starts in the allocation.
    pub offset: u64,
}

/// A peer's allocation opened here; closed on drop.
pub struct IpcOpened {
    base: u64,
    close: Option<Box<dyn FnOnce(u64) + Send + Sync>>,
}

impl IpcOpened {
    /// The allocation's first byte in this process.
    pub fn base(&self) -> u64 {
        self.base
    }
}

impl fmt::Debug for IpcOpened {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "IpcOpened({:#x})", self.base)
    }
}

impl Drop for IpcOpened {
    fn drop(&mut self) {
        if let Some(close) = self.close.take() {
            close(self.base);
        }
    }
}

/// Copies run in the order they were enqueued, asynchronously.
pub trait CopyStream: Send + Sync + fmt::Debug {
    /// Enqueues a copy of `len_bytes` from `src` to `dst`; `dir` says which
    /// is device memory.
    ///
    /// # Safety
    ///
    /// Both ranges must stay valid, and `dst` written by nothing else,
    /// until a [`Mark`] placed after this copy is done.
    unsafe fn enqueue(
        &self,
        dir: Dir,
        dst: u64,
        src: u64,
        len_bytes: usize,
    ) -> Result<(), DeviceError>;

    /// A mark behind every copy enqueued so far.
    fn mark(&self) -> Result<Mark, DeviceError>;

    /// Makes the copies enqueued from now on wait for an event the engine
    /// recorded on its own stream ([`EngineEvent`]).
    fn wait_engine(&self, event: &EngineEvent) -> Result<(), DeviceError>;
}

/// An event recorded on an engine's stream when it handed blocks over: the
/// copies that read those blocks wait for it on the device, never on a
/// host thread. The host stand-in has no engine stream (`raw` 0).
#[derive(Debug)]
pub struct EngineEvent {
    raw: u64,
    drop_fn: Option<fn(u64)>,
}

impl EngineEvent {
    /// An event that is already complete (no engine stream to wait for).
    pub fn complete() -> EngineEvent {
        EngineEvent {
            raw: 0,
            drop_fn: None,
        }
    }

    /// The driver's handle (a `CUevent`), 0 for none.
    pub fn raw(&self) -> u64 {
        self.raw
    }
}

impl Drop for EngineEvent {
    fn drop(&mut self) {
        if let Some(f) = self.drop_fn {
            f(self.raw);
        }
    }
}

/// Page-locked host memory of a device, freed on drop.
pub struct Pinned {
    addr: *mut u8,
    len_bytes: usize,
    free: Box<dyn Fn(*mut u8, usize) + Send + Sync>,
}

// SAFETY: the buffer is plain memory owned by this value; the transport
// hands out its address only under a `Lease`.
unsafe impl Send for Pinned {}
// SAFETY: as above; `&Pinned` exposes only the address.
unsafe impl Sync for Pinned {}

impl Pinned {
    /// The first byte.
    pub fn addr(&self) -> u64 {
        self.addr as u64
    }

    /// Its length.
    pub fn len_bytes(&self) -> usize {
        self.len_bytes
    }
}

impl fmt::Debug for Pinned {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Pinned({:#x}+{})", self.addr as u64, self.len_bytes)
    }
}

impl Drop for Pinned {
    fn drop(&mut self) {
        (self.free)(self.addr, self.len_bytes);
    }
}

/// Done once every copy enqueued on its stream before it finished. Set by
/// the driver's (or the stand-in's) thread, awaited on an executor.
#[derive(Clone, Debug)]
pub struct Mark {
    state: Arc<MarkState>,
}

#[derive(Debug, Default)]
pub(crate) struct MarkState {
    done: AtomicBool,
    failed: AtomicBool,
    waker: AtomicWaker,
}

impl MarkState {
    /// Called once, from the thread that ran the copies.
    pub(crate) fn finish(&self, ok: bool) {
        if !ok {
            self.failed.store(true, Ordering::Relaxed);
        }
        self.done.store(true, Ordering::Release);
        self.waker.wake();
    }
}

impl Mark {
    pub(crate) fn new() -> (Mark, Arc<MarkState>) {
        let state = Arc::new(MarkState::default());
        (
            Mark {
                state: Arc::clone(&state),
            },
            state,
        )
    }

    /// Whether the copies before it finished.
    pub fn is_done(&self) -> bool {
        self.state.done.load(Ordering::Acquire)
    }

    /// Waits for the copies before it; an error if one of them failed.
    pub async fn wait(&self) -> Result<(), DeviceError> {
        futures::future::poll_fn(|cx| {
            if self.is_done() {
                return std::task::Poll::Ready(());
            }
            self.state.waker.register(cx.waker());
            if self.is_done() {
                std::task::Poll::Ready(())
            } else {
                std::task::Poll::Pending
            }
        })
        .await;
        self.result()
    }

    /// Blocks this thread until done or `bound` passed; true when done.
    /// Only for the fence's close, which must not return while a copy into
    /// a closed block may still land (copies are microseconds long).
    pub fn wait_blocking(&self, bound: Duration) -> bool {
        let end = Instant::now() + bound;
        let mut spins = 0u32;
        while !self.is_done() {
            if Instant::now() >= end {
                return false;
            }
            spins += 1;
            if spins < 64 {
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        true
    }

    pub(crate) fn result(&self) -> Result<(), DeviceError> {
        if self.state.failed.load(Ordering::Relaxed) {
            return Err(DeviceError::Driver {
                call: "a copy on the stream",
                detail: "the stream reported a failed copy".into(),
            });
        }
        Ok(())
    }
}

/// Opens device `ordinal` of the CUDA driver: [`DeviceError::NoDriver`]
/// where the driver library or the device is missing, or where this
/// binary was built without the `cuda` feature.
pub fn open_cuda(ordinal: u32) -> Result<Arc<dyn Device>, DeviceError> {
    #[cfg(feature = "cuda")]
    {
        Ok(Arc::new(CudaDevice::open(ordinal)?))
    }
    #[cfg(not(feature = "cuda"))]
    {
        Err(DeviceError::NoDriver {
            detail: format!(
                "cuda:{ordinal} asked for, but this kvferry was built without the `cuda` feature"
            ),
        })
    }
}
