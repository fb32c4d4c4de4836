//! CUDA devices through the driver API (cudarc, loaded at run time).
//!
//! The engine (PyTorch) allocates the KV cache in the device's primary
//! context, so this module retains that context and makes it current on
//! every thread before a call: device pointers are only meaningful there.

use std::ffi::{c_void, CStr};
use std::fmt;
use std::sync::Arc;

use cudarc::driver::sys::{self, CUresult};

use super::{
    CopyStream, Device, DeviceAlloc, DeviceError, Dir, EngineEvent, IpcExport, IpcOpened, Mark,
    MarkState, Pinned, IPC_HANDLE_LEN,
};

/// One CUDA device, in its primary context.
pub struct CudaDevice {
    ordinal: u32,
    ctx: Ctx,
}

/// A `CUcontext`: a handle the driver lets any thread make current.
#[derive(Clone, Copy)]
struct Ctx(sys::CUcontext);
// SAFETY: a CUDA context handle may be used from any thread once made
// current there, which every call below does first.
unsafe impl Send for Ctx {}
// SAFETY: as above.
unsafe impl Sync for Ctx {}

impl fmt::Debug for CudaDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "CudaDevice(cuda:{})", self.ordinal)
    }
}

fn check(call: &'static str, r: CUresult) -> Result<(), DeviceError> {
    if r == CUresult::CUDA_SUCCESS {
        return Ok(());
    }
    let mut name: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: the driver is loaded (every caller got past `open`);
    // cuGetErrorName writes a pointer to a static string or fails.
    let known = unsafe { sys::cuGetErrorName(r, &mut name) } == CUresult::CUDA_SUCCESS;
    let detail = if known && !name.is_null() {
        // SAFETY: a NUL-terminated static string from the driver.
        unsafe { CStr::from_ptr(name) }
            .to_string_lossy()
            .into_owned()
    } else {
        format!("{r:?}")
    };
    Err(DeviceError::Driver { call, detail })
}

/// What a drop calls, on any thread: `release(addr)` in context `ctx`,
/// for an address allocated or opened there (freed or closed once).
fn release_in(
    ctx: Ctx,
    release: unsafe fn(sys::CUdeviceptr) -> CUresult,
) -> Box<dyn FnOnce(u64) + Send + Sync> {
    Box::new(move |addr| {
        // The whole `Ctx` (Send), not its raw pointer field.
        let ctx: Ctx = ctx;
        // SAFETY: `addr` came from `ctx` and is released once (the owner's
        // drop); the driver is loaded (the owner exists).
        unsafe {
            sys::cuCtxSetCurrent(ctx.0);
            release(addr);
        }
    })
}

impl CudaDevice {
    /// Loads the driver and retains device `ordinal`'s primary context.
    pub fn open(ordinal: u32) -> Result<CudaDevice, DeviceError> {
        // SAFETY: only tries to load the library; cudarc would panic on
        // the first call without it, so nothing is called before this.
        if !unsafe { sys::is_culib_present() } {
            return Err(DeviceError::NoDriver {
                detail: format!(
                    "cuda:{ordinal} asked for, but the CUDA driver library (libcuda.so) is not \
                     installed or not on the library path"
                ),
            });
        }
        // SAFETY: plain driver calls with valid out-pointers.
        unsafe {
            check("cuInit", sys::cuInit(0)).map_err(|e| DeviceError::NoDriver {
                detail: format!("cuda:{ordinal}: the driver did not initialise ({e})"),
            })?;
            let mut count = 0;
            check("cuDeviceGetCount", sys::cuDeviceGetCount(&mut count))?;
            if ordinal as i64 >= i64::from(count) {
                return Err(DeviceError::NoDriver {
                    detail: format!(
                        "cuda:{ordinal} asked for, but the driver sees {count} devices"
                    ),
                });
            }
            let mut dev = 0;
            check("cuDeviceGet", sys::cuDeviceGet(&mut dev, ordinal as i32))?;
            let mut ctx = std::ptr::null_mut();
            check(
                "cuDevicePrimaryCtxRetain",
                sys::cuDevicePrimaryCtxRetain(&mut ctx, dev),
            )?;
            Ok(CudaDevice {
                ordinal,
                ctx: Ctx(ctx),
            })
        }
    }

    fn current(&self) -> Result<(), DeviceError> {
        // SAFETY: a context retained in `open`, released never.
        check("cuCtxSetCurrent", unsafe {
            sys::cuCtxSetCurrent(self.ctx.0)
        })
    }

    fn record_on_engine_stream(&self, stream: u64) -> Result<EngineEvent, DeviceError> {
        self.current()?;
        let mut ev = std::ptr::null_mut();
        let flags = sys::CUevent_flags_enum::CU_EVENT_DISABLE_TIMING as u32;
        // SAFETY: valid out-pointer; `stream` is the caller's live stream.
        unsafe {
            check("cuEventCreate", sys::cuEventCreate(&mut ev, flags))?;
            let recorded = check(
                "cuEventRecord",
                sys::cuEventRecord(ev, stream as sys::CUstream),
            );
            if let Err(e) = recorded {
                sys::cuEventDestroy_v2(ev);
                return Err(e);
            }
        }
        Ok(EngineEvent {
            raw: ev as u64,
            drop_fn: Some(|raw| {
                // SAFETY: created above; destroying a recorded event is
                // allowed, the driver releases it once it completes.
                unsafe { sys::cuEventDestroy_v2(raw as sys::CUevent) };
            }),
        })
    }
}

impl Device for CudaDevice {
    fn name(&self) -> String {
        format!("cuda:{}", self.ordinal)
    }

    fn check_range(&self, addr: u64, len_bytes: u64) -> Result<(), DeviceError> {
        self.current()?;
        let not_device = || DeviceError::NotDeviceMemory {
            addr,
            len_bytes,
            device: self.name(),
        };
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: valid out-pointers; the driver checks `addr` itself.
        let r = unsafe { sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr) };
        if r != CUresult::CUDA_SUCCESS {
            return Err(not_device());
        }
        let mut ordinal: i32 = -1;
        let attr = sys::CUpointer_attribute::CU_POINTER_ATTRIBUTE_DEVICE_ORDINAL;
        // SAFETY: `ordinal` is an int, the attribute's type.
        let r = unsafe {
            sys::cuPointerGetAttribute(&mut ordinal as *mut i32 as *mut c_void, attr, addr)
        };
        let end = addr.checked_add(len_bytes);
        let inside = end.is_some_and(|e| e <= base + size as u64) && len_bytes > 0;
        if r != CUresult::CUDA_SUCCESS || ordinal != self.ordinal as i32 || !inside {
            return Err(not_device());
        }
        Ok(())
    }

    fn alloc_pinned(&self, len_bytes: usize) -> Result<Pinned, DeviceError> {
        self.current()?;
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: valid out-pointer; freed by `Pinned`'s drop.
        check("cuMemHostAlloc", unsafe {
            sys::cuMemHostAlloc(&mut p, len_bytes, sys::CU_MEMHOSTALLOC_PORTABLE)
        })?;
        Ok(Pinned {
            addr: p as *mut u8,
            len_bytes,
            free: Box::new(|p, _| {
                // SAFETY: allocated by cuMemHostAlloc above (PORTABLE: any
                // context may free it).
                unsafe { sys::cuMemFreeHost(p as *mut c_void) };
            }),
        })
    }

    fn record_engine_event(&self, stream: u64) -> Result<EngineEvent, DeviceError> {
        self.record_on_engine_stream(stream)
    }

    fn export_ipc(&self, addr: u64, len_bytes: u64) -> Result<IpcExport, DeviceError> {
        self.check_range(addr, len_bytes)?;
        let (mut base, mut size) = (0u64, 0usize);
        // SAFETY: valid out-pointers; `addr` was checked above.
        check("cuMemGetAddressRange", unsafe {
            sys::cuMemGetAddressRange_v2(&mut base, &mut size, addr)
        })?;
        // SAFETY: a zeroed handle is a valid out-value.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        // SAFETY: `base` starts an allocation of this context. Memory from
        // the VMM API (cuMemCreate) has no legacy IPC handle: the call
        // fails and the region stays on the staged tcp path.
        check("cuIpcGetMemHandle", unsafe {
            sys::cuIpcGetMemHandle(&mut h, base)
        })?;
        let mut handle = [0u8; IPC_HANDLE_LEN];
        for (d, s) in handle.iter_mut().zip(h.reserved.iter()) {
            *d = *s as u8;
        }
        Ok(IpcExport {
            handle,
            offset: addr - base,
        })
    }

    fn open_ipc(&self, handle: &[u8; IPC_HANDLE_LEN]) -> Result<IpcOpened, DeviceError> {
        self.current()?;
        // SAFETY: a zeroed handle is a valid value, filled below.
        let mut h: sys::CUipcMemHandle = unsafe { std::mem::zeroed() };
        for (d, s) in h.reserved.iter_mut().zip(handle.iter()) {
            *d = *s as _;
        }
        let mut base = 0u64;
        let flags = sys::CUipcMem_flags_enum::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32;
        // SAFETY: valid out-pointer; the driver checks the handle.
        check("cuIpcOpenMemHandle", unsafe {
            sys::cuIpcOpenMemHandle_v2(&mut base, h, flags)
        })?;
        Ok(IpcOpened {
            base,
            close: Some(release_in(self.ctx, sys::cuIpcCloseMemHandle)),
        })
    }

    fn alloc_device(&self, len_bytes: usize) -> Result<DeviceAlloc, DeviceError> {
        self.current()?;
        let mut addr = 0u64;
        // SAFETY: valid out-pointer; freed on drop, in this context.
        unsafe {
            check(
                "cuMemAlloc",
                sys::cuMemAlloc_v2(&mut addr, len_bytes.max(1)),
            )?;
            check("cuMemsetD8", sys::cuMemsetD8_v2(addr, 0, len_bytes))?;
        }
        Ok(DeviceAlloc {
            addr,
            len_bytes,
            free: Some(release_in(self.ctx, sys::cuMemFree_v2)),
        })
    }

    /// On the legacy default stream, then synchronized: `cudaMemcpy`.
    unsafe fn memcpy_sync(
        &self,
        dir: Dir,
        dst: u64,
        src: u64,
        len_bytes: usize,
    ) -> Result<(), DeviceError> {
        self.current()?;
        let legacy = std::ptr::null_mut();
        // SAFETY: the caller's promise; the copy ends before this returns.
        unsafe {
            copy_async(dir, dst, src, len_bytes, legacy)?;
            check("cuStreamSynchronize", sys::cuStreamSynchronize(legacy))
        }
    }

    fn copy_stream(&self) -> Result<Arc<dyn CopyStream>, DeviceError> {
        self.current()?;
        let mut s = std::ptr::null_mut();
        let flags = sys::CUstream_flags_enum::CU_STREAM_NON_BLOCKING as u32;
        // SAFETY: valid out-pointer; destroyed on drop.
        check("cuStreamCreate", unsafe {
            sys::cuStreamCreate(&mut s, flags)
        })?;
        Ok(Arc::new(CudaStream {
            ctx: self.ctx,
            stream: Stream(s),
        }))
    }
}

#[derive(Clone, Copy)]
struct Stream(sys::CUstream);
// SAFETY: a stream handle is usable from any thread in its context.
unsafe impl Send for Stream {}
// SAFETY: as above; the driver serialises calls on one stream.
unsafe impl Sync for Stream {}

struct CudaStream {
    ctx: Ctx,
    stream: Stream,
}

impl fmt::Debug for CudaStream {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CudaStream")
    }
}

impl CudaStream {
    fn current(&self) -> Result<(), DeviceError> {
        // SAFETY: the device's retained primary context.
        check("cuCtxSetCurrent", unsafe {
            sys::cuCtxSetCurrent(self.ctx.0)
        })
    }
}

/// Enqueues one copy on `stream` (null: the legacy default stream).
///
/// # Safety
///
/// Both ranges valid until the copy ended; the context current.
unsafe fn copy_async(
    dir: Dir,
    dst: u64,
    src: u64,
    len_bytes: usize,
    stream: sys::CUstream,
) -> Result<(), DeviceError> {
    // SAFETY: the caller's promise.
    unsafe {
        match dir {
            Dir::ToHost => check(
                "cuMemcpyDtoHAsync",
                sys::cuMemcpyDtoHAsync_v2(dst as *mut c_void, src, len_bytes, stream),
            ),
            Dir::ToDevice => check(
                "cuMemcpyHtoDAsync",
                sys::cuMemcpyHtoDAsync_v2(dst, src as *const c_void, len_bytes, stream),
            ),
            Dir::DeviceToDevice => check(
                "cuMemcpyDtoDAsync",
                sys::cuMemcpyDtoDAsync_v2(dst, src, len_bytes, stream),
            ),
        }
    }
}

/// Runs on a driver thread once the copies before it finished: no CUDA
/// call is allowed here, only the mark's flag and waker.
unsafe extern "C" fn mark_done(user: *mut c_void) {
    // SAFETY: `Arc::into_raw` in `mark`, consumed exactly once here.
    let state = unsafe { Arc::from_raw(user as *const MarkState) };
    state.finish(true);
}

impl CopyStream for CudaStream {
    unsafe fn enqueue(
        &self,
        dir: Dir,
        dst: u64,
        src: u64,
        len_bytes: usize,
    ) -> Result<(), DeviceError> {
        self.current()?;
        // SAFETY: the caller keeps both ranges valid until a later mark.
        unsafe { copy_async(dir, dst, src, len_bytes, self.stream.0) }
    }

    fn mark(&self) -> Result<Mark, DeviceError> {
        self.current()?;
        let (mark, state) = Mark::new();
        let user = Arc::into_raw(state) as *mut c_void;
        // SAFETY: `mark_done` takes the reference back exactly once.
        let r = unsafe { sys::cuLaunchHostFunc(self.stream.0, Some(mark_done), user) };
        if let Err(e) = check("cuLaunchHostFunc", r) {
            // SAFETY: the driver did not take `user`.
            drop(unsafe { Arc::from_raw(user as *const MarkState) });
            return Err(e);
        }
        Ok(mark)
    }

    fn wait_engine(&self, event: &EngineEvent) -> Result<(), DeviceError> {
        self.current()?;
        // SAFETY: a live event recorded on the engine's stream.
        check("cuStreamWaitEvent", unsafe {
            sys::cuStreamWaitEvent(self.stream.0, event.raw as sys::CUevent, 0)
        })
    }
}

impl Drop for CudaStream {
    fn drop(&mut self) {
        // SAFETY: created in `copy_stream`; the driver finishes the work
        // already enqueued before it releases the stream.
        unsafe {
            sys::cuCtxSetCurrent(self.ctx.0);
            sys::cuStreamDestroy_v2(self.stream.0);
        }
    }
}
