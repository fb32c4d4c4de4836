//! The safe wrapper: an engine and the handles made from it, each freed
//! when dropped.
//!
//! Threads: an [`Engine`] and its handles share one reference count
//! ([`Rc`]) and so are neither `Send` nor `Sync`: each is made and used
//! on one thread (a kvferry endpoint's executor). The C library would
//! allow more (its Python binding calls one engine from many threads, and
//! `transfer_engine_c.cpp` locks inside the engine), but kvferry needs no
//! more, and one thread per engine keeps the polling of a batch and its
//! free in one order without locks here.

use std::cell::RefCell;
use std::ffi::{c_void, CString};
use std::rc::Rc;
use std::sync::Arc;

use crate::error::Error;
use crate::ffi::{self, BatchId, EngineHandle, SegmentId, TransferRequest, TransferStatus};
use crate::lib_te::TeLib;

/// Longest `ip:port` text `getLocalIpAndPort` may return.
pub const LOCAL_ADDR_BYTES_MAX: usize = 256;
/// Most unfinished batches an engine keeps for a later free; past it a
/// dropped unfinished batch is leaked (counted by
/// [`Engine::leaked_batches`]) rather than kept without bound.
pub const LINGERING_MAX: usize = 4096;

/// What [`Engine::new`] passes to `createTransferEngine` and
/// `installTransport`.
#[derive(Clone, Debug)]
pub struct EngineConfig {
    /// The metadata service: `P2PHANDSHAKE` (peers named `host:rpc_port`,
    /// no service), or an etcd/http/redis connection string.
    pub metadata: String,
    /// This engine's server name; under `P2PHANDSHAKE` the engine names
    /// itself by its address instead.
    pub local_server_name: String,
    /// The IP or host name peers reach this engine at.
    pub ip_or_host: String,
    /// The handshake port (0: the engine picks one under `P2PHANDSHAKE`).
    pub rpc_port: u64,
    /// The transport to install: `tcp`, `rdma`, `nvlink`, `nvlink_intra`,
    /// `efa`, ...
    pub protocol: String,
}

impl EngineConfig {
    /// An engine under `P2PHANDSHAKE` (no metadata service) reachable at
    /// `host`, the engine picking its handshake port, with `protocol`.
    pub fn p2p(host: &str, protocol: &str) -> EngineConfig {
        EngineConfig {
            metadata: "P2PHANDSHAKE".into(),
            local_server_name: host.into(),
            ip_or_host: host.into(),
            rpc_port: 0,
            protocol: protocol.into(),
        }
    }
}

struct Inner {
    lib: Arc<TeLib>,
    handle: EngineHandle,
    /// Batches dropped before every task finished: `(id, tasks)`, freed by
    /// [`Engine::reap`].
    lingering: RefCell<Vec<(BatchId, usize)>>,
    leaked: std::cell::Cell<u64>,
}

/// One transfer engine with its transport installed.
#[derive(Clone)]
pub struct Engine(Rc<Inner>);

/// The state of one task of a batch, as `getTransferStatus` reports it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TaskState {
    /// Not started.
    Waiting,
    /// Moving.
    Pending,
    /// Done; the bytes the library says it moved.
    Completed {
        /// `transferred_bytes`.
        bytes: u64,
    },
    /// Failed, timed out, cancelled or invalid: finished, bytes not moved.
    Failed(i32),
    /// A status code this binding does not know: treated as unfinished.
    Unknown(i32),
}

impl TaskState {
    fn from_status(s: TransferStatus) -> TaskState {
        match s.status {
            ffi::STATUS_WAITING => TaskState::Waiting,
            ffi::STATUS_PENDING => TaskState::Pending,
            ffi::STATUS_COMPLETED => TaskState::Completed {
                bytes: s.transferred_bytes,
            },
            ffi::STATUS_INVALID
            | ffi::STATUS_CANCELED
            | ffi::STATUS_TIMEOUT
            | ffi::STATUS_FAILED => TaskState::Failed(s.status),
            other => TaskState::Unknown(other),
        }
    }

    /// True once the library touches the task's memory no more.
    pub fn is_finished(self) -> bool {
        match self {
            TaskState::Completed { .. } | TaskState::Failed(_) => true,
            TaskState::Waiting | TaskState::Pending | TaskState::Unknown(_) => false,
        }
    }
}

fn c_string(what: &'static str, s: &str) -> Result<CString, Error> {
    CString::new(s).map_err(|_| Error::Nul { what })
}

impl Engine {
    /// Creates an engine and installs `cfg.protocol`.
    pub fn new(lib: Arc<TeLib>, cfg: &EngineConfig) -> Result<Engine, Error> {
        let metadata = c_string("metadata", &cfg.metadata)?;
        let name = c_string("local_server_name", &cfg.local_server_name)?;
        let ip = c_string("ip_or_host", &cfg.ip_or_host)?;
        let proto = c_string("protocol", &cfg.protocol)?;
        // SAFETY: the strings are NUL-terminated and outlive the call (the
        // header: no `char *` argument is used after a call returns).
        let handle = unsafe {
            (lib.create)(
                metadata.as_ptr(),
                name.as_ptr(),
                ip.as_ptr(),
                cfg.rpc_port,
                0,
            )
        };
        if handle.is_null() {
            return Err(Error::Call {
                call: "createTransferEngine",
                code: -1,
            });
        }
        let engine = Engine(Rc::new(Inner {
            lib,
            handle,
            lingering: RefCell::new(Vec::new()),
            leaked: std::cell::Cell::new(0),
        }));
        // SAFETY: a live engine; `args` may be null (no transport options).
        let t = unsafe {
            (engine.0.lib.install_transport)(handle, proto.as_ptr(), std::ptr::null_mut())
        };
        if t.is_null() {
            return Err(Error::Call {
                call: "installTransport",
                code: -1,
            });
        }
        Ok(engine)
    }

    fn lib(&self) -> &TeLib {
        &self.0.lib
    }

    fn handle(&self) -> EngineHandle {
        self.0.handle
    }

    /// `ip:port` that peers open this engine's segment by.
    pub fn local_addr(&self) -> Result<String, Error> {
        let mut buf = [0u8; LOCAL_ADDR_BYTES_MAX];
        // SAFETY: a live engine and a buffer of the length passed.
        let rc = unsafe {
            (self.lib().local_ip_and_port)(self.handle(), buf.as_mut_ptr().cast(), buf.len())
        };
        Error::check("getLocalIpAndPort", rc)?;
        let bad = Error::BadText {
            call: "getLocalIpAndPort",
        };
        let text = std::ffi::CStr::from_bytes_until_nul(&buf).map_err(|_| bad.clone())?;
        Ok(text.to_str().map_err(|_| bad)?.to_string())
    }

    /// Registers `len` bytes at `addr` with the engine, `location` naming
    /// where they live (`cpu:0`, `cuda:1`, or `*` to let the engine find
    /// out), remotely accessible.
    ///
    /// # Safety
    ///
    /// The memory must stay allocated until the returned [`Registration`]
    /// drops, and peers may read or write it at any time until then.
    pub unsafe fn register(
        &self,
        addr: *mut u8,
        len: usize,
        location: &str,
    ) -> Result<Registration, Error> {
        let loc = c_string("location", location)?;
        // SAFETY: a live engine; the caller vouches for the memory.
        let rc = unsafe { (self.lib().register)(self.handle(), addr.cast(), len, loc.as_ptr(), 1) };
        Error::check("registerLocalMemory", rc)?;
        Ok(Registration {
            engine: self.clone(),
            addrs: vec![addr],
        })
    }

    /// Registers several buffers in one call (`registerLocalMemoryBatch`:
    /// the engine registers them in parallel, which matters for large KV).
    ///
    /// # Safety
    ///
    /// As [`Engine::register`], for every buffer.
    pub unsafe fn register_batch(
        &self,
        buffers: &[(*mut u8, usize)],
        location: &str,
    ) -> Result<Registration, Error> {
        let loc = c_string("location", location)?;
        let mut entries: Vec<ffi::BufferEntry> = (buffers.iter())
            .map(|&(addr, length)| ffi::BufferEntry {
                addr: addr.cast(),
                length,
            })
            .collect();
        // SAFETY: a live engine, `entries` of the length passed; the
        // caller vouches for the memory.
        let rc = unsafe {
            (self.lib().register_batch)(
                self.handle(),
                entries.as_mut_ptr(),
                entries.len(),
                loc.as_ptr(),
            )
        };
        Error::check("registerLocalMemoryBatch", rc)?;
        Ok(Registration {
            engine: self.clone(),
            addrs: buffers.iter().map(|&(a, _)| a).collect(),
        })
    }

    /// Opens the segment `name` (`host:rpc_port` under `P2PHANDSHAKE`).
    pub fn open_segment(&self, name: &str) -> Result<Segment, Error> {
        let n = c_string("segment name", name)?;
        // SAFETY: a live engine and a NUL-terminated name.
        let id = unsafe { (self.lib().open_segment)(self.handle(), n.as_ptr()) };
        if id < 0 {
            return Err(Error::Call {
                call: "openSegment",
                code: i64::from(id),
            });
        }
        Ok(Segment {
            engine: self.clone(),
            id,
        })
    }

    /// Allocates a batch of at most `tasks` requests.
    pub fn batch(&self, tasks: usize) -> Result<Batch, Error> {
        // SAFETY: a live engine.
        let id = unsafe { (self.lib().allocate_batch)(self.handle(), tasks) };
        if id == ffi::INVALID_BATCH {
            return Err(Error::Call {
                call: "allocateBatchID",
                code: -1,
            });
        }
        Ok(Batch {
            engine: self.clone(),
            id,
            capacity: tasks,
            submitted: 0,
        })
    }

    fn status(&self, id: BatchId, task: usize) -> Result<TaskState, Error> {
        let mut s = TransferStatus::default();
        // SAFETY: a live engine and batch, and a status to write.
        let rc = unsafe { (self.lib().status)(self.handle(), id, task, &mut s) };
        Error::check("getTransferStatus", rc)?;
        Ok(TaskState::from_status(s))
    }

    fn free(&self, id: BatchId) -> Result<(), Error> {
        // SAFETY: a live engine; `id` is a batch of it not freed yet.
        let rc = unsafe { (self.lib().free_batch)(self.handle(), id) };
        match rc {
            0 => Ok(()),
            ffi::CODE_BATCH_BUSY => Err(Error::BatchBusy),
            code => Err(Error::Call {
                call: "freeBatchID",
                code: i64::from(code),
            }),
        }
    }

    /// Frees the batches dropped unfinished whose every task has finished
    /// since; returns how many are still unfinished.
    pub fn reap(&self) -> usize {
        let mut lingering = self.0.lingering.borrow_mut();
        lingering.retain(|&(id, tasks)| {
            let done = (0..tasks).all(|t| self.status(id, t).is_ok_and(TaskState::is_finished));
            !(done && self.free(id).is_ok())
        });
        lingering.len()
    }

    /// Unfinished batches this engine could not keep for a later free
    /// ([`LINGERING_MAX`]).
    pub fn leaked_batches(&self) -> u64 {
        self.0.leaked.get()
    }

    fn linger(&self, id: BatchId, tasks: usize) {
        let mut lingering = self.0.lingering.borrow_mut();
        if lingering.len() < LINGERING_MAX {
            lingering.push((id, tasks));
        } else {
            self.0.leaked.set(self.0.leaked.get() + 1);
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Every handle holds the engine, so none is left; the engine's
        // destruction stops the transfers of batches still unfinished.
        // SAFETY: the engine is live and used by nothing else.
        unsafe { (self.lib.destroy)(self.handle) };
    }
}

/// Memory registered with an engine; unregistered when dropped.
pub struct Registration {
    engine: Engine,
    addrs: Vec<*mut u8>,
}

impl Drop for Registration {
    fn drop(&mut self) {
        let lib = self.engine.lib();
        if let [addr] = self.addrs[..] {
            // SAFETY: `addr` was registered with this live engine.
            unsafe { (lib.unregister)(self.engine.handle(), addr.cast()) };
        } else {
            let mut addrs: Vec<*mut c_void> = self.addrs.iter().map(|a| a.cast()).collect();
            // SAFETY: as above, for every address.
            unsafe {
                (lib.unregister_batch)(self.engine.handle(), addrs.as_mut_ptr(), addrs.len())
            };
        }
    }
}

/// A peer's segment, open; closed when dropped.
pub struct Segment {
    engine: Engine,
    id: SegmentId,
}

impl Segment {
    /// The id requests name as their target.
    pub fn id(&self) -> SegmentId {
        self.id
    }
}

impl Drop for Segment {
    fn drop(&mut self) {
        // SAFETY: a segment of this live engine, closed once.
        unsafe { (self.engine.lib().close_segment)(self.engine.handle(), self.id) };
    }
}

/// A batch id; freed when dropped, or kept by its engine until every task
/// finished if it is dropped before ([`Engine::reap`]).
pub struct Batch {
    engine: Engine,
    id: BatchId,
    capacity: usize,
    submitted: usize,
}

impl Batch {
    /// Submits `requests` as the batch's next tasks (indices from the
    /// number submitted before).
    ///
    /// # Safety
    ///
    /// Every request's `source..source+length` must be memory registered
    /// with this engine, and `target_offset..+length` inside memory the
    /// target segment registered; both must stay valid until the tasks
    /// finish (or the engine is destroyed).
    pub unsafe fn submit(&mut self, requests: &[TransferRequest]) -> Result<(), Error> {
        let asked = self.submitted + requests.len();
        if asked > self.capacity {
            return Err(Error::BatchOverflow {
                capacity: self.capacity,
                asked,
            });
        }
        // SAFETY: a live engine and batch; `submitTransfer` copies the
        // entries and never writes through the pointer (it is `*mut` in
        // the header only); the caller vouches for the memory.
        let rc = unsafe {
            (self.engine.lib().submit)(
                self.engine.handle(),
                self.id,
                requests.as_ptr().cast_mut(),
                requests.len(),
            )
        };
        Error::check("submitTransfer", rc)?;
        self.submitted = asked;
        Ok(())
    }

    /// Tasks submitted so far.
    pub fn submitted(&self) -> usize {
        self.submitted
    }

    /// The state of task `task`.
    pub fn status(&self, task: usize) -> Result<TaskState, Error> {
        if task >= self.submitted {
            return Err(Error::BatchOverflow {
                capacity: self.submitted,
                asked: task + 1,
            });
        }
        self.engine.status(self.id, task)
    }

    /// Frees the batch now; gives it back with [`Error::BatchBusy`] while a
    /// task is unfinished.
    pub fn try_free(self) -> Result<(), (Batch, Error)> {
        let me = std::mem::ManuallyDrop::new(self);
        match me.engine.free(me.id) {
            Ok(()) => {
                // SAFETY: `me` is never used or dropped again; its engine
                // reference is moved out exactly once.
                drop(unsafe { std::ptr::read(&me.engine) });
                Ok(())
            }
            Err(e) => Err((std::mem::ManuallyDrop::into_inner(me), e)),
        }
    }
}

impl Drop for Batch {
    fn drop(&mut self) {
        if self.engine.free(self.id).is_err() {
            self.engine.linger(self.id, self.submitted);
        }
    }
}

/// A request's source as the C type wants it.
pub fn source_ptr(addr: u64) -> *mut c_void {
    addr as usize as *mut c_void
}
