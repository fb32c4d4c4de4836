//! Host memory standing in for a device: the staging and fence code runs
//! unchanged against it where no accelerator exists.

use std::alloc::Layout;
use std::fmt;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use super::{
    CopyStream, Device, DeviceAlloc, DeviceError, Dir, EngineEvent, IpcExport, IpcOpened, Mark,
    MarkState, Pinned, IPC_HANDLE_LEN,
};

/// A stand-in device: "device memory" is host memory it allocated itself
/// (so [`Device::check_range`] is exact, as the driver's is), and each
/// copy stream is a worker thread that runs its copies in order, each
/// taking at least `copy_delay` (a device copy is never instantaneous;
/// tests widen the window in which a pipeline must not reuse a buffer).
pub struct HostDevice {
    ordinal: u32,
    copy_delay: Duration,
    arenas: Mutex<Vec<(u64, u64)>>,
    pinned_live: Arc<AtomicU64>,
}

impl fmt::Debug for HostDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "HostDevice(host:{})", self.ordinal)
    }
}

const ALIGN: usize = 4096;

impl HostDevice {
    /// A stand-in device whose copies each take at least `copy_delay`.
    pub fn new(ordinal: u32, copy_delay: Duration) -> Arc<HostDevice> {
        Arc::new(HostDevice {
            ordinal,
            copy_delay,
            arenas: Mutex::new(Vec::new()),
            pinned_live: Arc::new(AtomicU64::new(0)),
        })
    }

    /// Allocates `len_bytes` of this stand-in's "device memory", zeroed;
    /// it lives as long as the device (a test's KV cache).
    pub fn alloc(&self, len_bytes: usize) -> u64 {
        let layout = Layout::from_size_align(len_bytes.max(1), ALIGN).expect("layout");
        // SAFETY: the layout has a non-zero size; the memory is leaked on
        // purpose (it stands for device memory the test keeps).
        let p = unsafe { std::alloc::alloc_zeroed(layout) };
        assert!(!p.is_null(), "stand-in device allocation failed");
        let addr = p as u64;
        kvferry_reactor::lock(&self.arenas).push((addr, len_bytes as u64));
        addr
    }

    /// Pinned buffers allocated and not yet freed.
    pub fn pinned_live(&self) -> u64 {
        self.pinned_live.load(Ordering::Relaxed)
    }
}

impl Device for HostDevice {
    fn name(&self) -> String {
        format!("host:{}", self.ordinal)
    }

    fn check_range(&self, addr: u64, len_bytes: u64) -> Result<(), DeviceError> {
        let end = addr.checked_add(len_bytes);
        let inside = kvferry_reactor::lock(&self.arenas)
            .iter()
            .any(|&(a, l)| end.is_some_and(|e| addr >= a && e <= a + l));
        if inside && len_bytes > 0 {
            Ok(())
        } else {
            Err(DeviceError::NotDeviceMemory {
                addr,
                len_bytes,
                device: self.name(),
            })
        }
    }

    fn alloc_pinned(&self, len_bytes: usize) -> Result<Pinned, DeviceError> {
        let layout =
            Layout::from_size_align(len_bytes.max(1), ALIGN).map_err(|e| DeviceError::Driver {
                call: "alloc_pinned",
                detail: e.to_string(),
            })?;
        // SAFETY: non-zero size; freed by `Pinned`'s drop with this layout.
        let addr = unsafe { std::alloc::alloc_zeroed(layout) };
        if addr.is_null() {
            return Err(DeviceError::Driver {
                call: "alloc_pinned",
                detail: "out of memory".into(),
            });
        }
        let live = Arc::clone(&self.pinned_live);
        live.fetch_add(1, Ordering::Relaxed);
        Ok(Pinned {
            addr,
            len_bytes,
            free: Box::new(move |p, _| {
                live.fetch_sub(1, Ordering::Relaxed);
                // SAFETY: allocated above with `layout`.
                unsafe { std::alloc::dealloc(p, layout) }
            }),
        })
    }

    fn record_engine_event(&self, _stream: u64) -> Result<EngineEvent, DeviceError> {
        // The stand-in's "engine" writes with plain stores, done before it
        // hands blocks over.
        Ok(EngineEvent::complete())
    }

    /// The stand-in's handle names its arena by address and this process:
    /// it opens in this process only (tests run both ends in one), as a
    /// CUDA handle opens only on its host.
    fn export_ipc(&self, addr: u64, len_bytes: u64) -> Result<IpcExport, DeviceError> {
        self.check_range(addr, len_bytes)?;
        let arenas = kvferry_reactor::lock(&self.arenas);
        let Some(&(base, _)) = arenas.iter().find(|&&(a, l)| addr >= a && addr < a + l) else {
            unreachable!("check_range found the arena");
        };
        let mut handle = [0u8; IPC_HANDLE_LEN];
        handle[..8].copy_from_slice(&base.to_le_bytes());
        handle[8..12].copy_from_slice(&std::process::id().to_le_bytes());
        handle[12..16].copy_from_slice(&self.ordinal.to_le_bytes());
        Ok(IpcExport {
            handle,
            offset: addr - base,
        })
    }

    fn open_ipc(&self, handle: &[u8; IPC_HANDLE_LEN]) -> Result<IpcOpened, DeviceError> {
        let word = |r: std::ops::Range<usize>| {
            let mut b = [0u8; 8];
            b[..r.len()].copy_from_slice(&handle[r]);
            u64::from_le_bytes(b)
        };
        if word(8..12) != u64::from(std::process::id()) {
            return Err(DeviceError::Driver {
                call: "opening a stand-in IPC handle",
                detail: "stand-in device memory is not shared between processes".into(),
            });
        }
        Ok(IpcOpened {
            base: word(0..8),
            close: None,
        })
    }

    /// Stand-in memory lives as long as the process ([`HostDevice::alloc`]).
    fn alloc_device(&self, len_bytes: usize) -> Result<DeviceAlloc, DeviceError> {
        Ok(DeviceAlloc {
            addr: self.alloc(len_bytes),
            len_bytes,
            free: None,
        })
    }

    unsafe fn memcpy_sync(
        &self,
        _dir: Dir,
        dst: u64,
        src: u64,
        len_bytes: usize,
    ) -> Result<(), DeviceError> {
        // SAFETY: the caller's promise.
        unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len_bytes) };
        Ok(())
    }

    fn copy_stream(&self) -> Result<Arc<dyn CopyStream>, DeviceError> {
        let (tx, rx) = mpsc::channel::<Work>();
        let delay = self.copy_delay;
        std::thread::Builder::new()
            .name(format!("kvferry-{}-copy", self.name()))
            .spawn(move || run_stream(rx, delay))
            .map_err(|e| DeviceError::Driver {
                call: "spawning a stand-in copy stream",
                detail: e.to_string(),
            })?;
        Ok(Arc::new(HostStream { tx: Mutex::new(tx) }))
    }
}

enum Work {
    Copy { dst: u64, src: u64, len: usize },
    Mark(Arc<MarkState>),
}

fn run_stream(rx: mpsc::Receiver<Work>, delay: Duration) {
    // Ends when the stream's last handle is dropped.
    while let Ok(w) = rx.recv() {
        match w {
            Work::Copy { dst, src, len } => {
                if !delay.is_zero() {
                    std::thread::sleep(delay);
                }
                // SAFETY: `CopyStream::enqueue`'s contract keeps both
                // ranges valid until a later mark is done.
                unsafe { std::ptr::copy(src as *const u8, dst as *mut u8, len) };
            }
            Work::Mark(m) => m.finish(true),
        }
    }
}

struct HostStream {
    tx: Mutex<mpsc::Sender<Work>>,
}

impl fmt::Debug for HostStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("HostStream")
    }
}

impl HostStream {
    fn send(&self, w: Work) -> Result<(), DeviceError> {
        kvferry_reactor::lock(&self.tx)
            .send(w)
            .map_err(|_| DeviceError::Driver {
                call: "stand-in copy stream",
                detail: "its thread ended".into(),
            })
    }
}

impl CopyStream for HostStream {
    unsafe fn enqueue(
        &self,
        _dir: Dir,
        dst: u64,
        src: u64,
        len_bytes: usize,
    ) -> Result<(), DeviceError> {
        self.send(Work::Copy {
            dst,
            src,
            len: len_bytes,
        })
    }

    fn mark(&self) -> Result<Mark, DeviceError> {
        let (mark, state) = Mark::new();
        self.send(Work::Mark(state))?;
        Ok(mark)
    }

    fn wait_engine(&self, _event: &EngineEvent) -> Result<(), DeviceError> {
        // The stand-in's "engine" writes with plain stores before it hands
        // blocks over; there is nothing to wait for on a stream.
        Ok(())
    }
}
