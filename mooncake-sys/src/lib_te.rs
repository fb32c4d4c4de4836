//! Opening the two libraries and looking up their functions.

use std::ffi::OsString;

use crate::error::Error;
use crate::ffi::{store as s, te};

/// Names the transfer engine library's path; unset, the system search path
/// is tried for [`TE_LIB_NAME`].
pub const TE_LIB_ENV: &str = "MOONCAKE_TE_LIB";
/// Names the store library's path; unset, the system search path is tried
/// for [`STORE_LIB_NAME`].
pub const STORE_LIB_ENV: &str = "MOONCAKE_STORE_LIB";
/// The transfer engine's file name on the search path.
pub const TE_LIB_NAME: &str = "libtransfer_engine.so";
/// The store's file name on the search path.
pub const STORE_LIB_NAME: &str = "libmooncake_store.so";

/// The path in `env` if set, else `name` on the system search path.
fn candidates(env: &str, name: &str) -> Vec<OsString> {
    match std::env::var_os(env) {
        Some(path) if !path.is_empty() => vec![path],
        _ => vec![name.into()],
    }
}

/// Opens the first of `candidates` that loads.
fn open(candidates: Vec<OsString>) -> Result<(libloading::Library, String), Error> {
    let mut tried = Vec::new();
    for c in candidates {
        // SAFETY: loading runs the library's initialisers; a Mooncake
        // library's are its C++ static constructors, which the engine
        // expects to run in any process that loads it.
        match unsafe { libloading::Library::new(&c) } {
            Ok(lib) => return Ok((lib, c.to_string_lossy().into_owned())),
            Err(e) => tried.push(format!("{}: {e}", c.to_string_lossy())),
        }
    }
    Err(Error::LibraryNotFound { tried })
}

/// Looks up `name` (NUL-terminated) as a function of type `T`.
///
/// # Safety
///
/// `T` must be the function's true C signature.
unsafe fn sym<T: Copy>(
    lib: &libloading::Library,
    path: &str,
    name: &'static str,
) -> Result<T, Error> {
    let bare = name.trim_end_matches('\0');
    // SAFETY: forwarded: the caller names the right signature.
    match unsafe { lib.get::<T>(name.as_bytes()) } {
        Ok(f) => Ok(*f),
        Err(_) => Err(Error::MissingSymbol {
            library: path.to_string(),
            symbol: bare,
        }),
    }
}

/// The transfer engine library, opened, with every function it needs.
/// The function pointers stay valid while `_lib` is alive, which it is for
/// as long as this value is (it is shared by [`std::sync::Arc`] with every
/// engine made from it).
pub struct TeLib {
    pub(crate) create: te::CreateTransferEngine,
    pub(crate) local_ip_and_port: te::GetLocalIpAndPort,
    pub(crate) install_transport: te::InstallTransport,
    pub(crate) open_segment: te::OpenSegment,
    pub(crate) close_segment: te::CloseSegment,
    pub(crate) destroy: te::DestroyTransferEngine,
    pub(crate) register: te::RegisterLocalMemory,
    pub(crate) unregister: te::UnregisterLocalMemory,
    pub(crate) register_batch: te::RegisterLocalMemoryBatch,
    pub(crate) unregister_batch: te::UnregisterLocalMemoryBatch,
    pub(crate) allocate_batch: te::AllocateBatchId,
    pub(crate) submit: te::SubmitTransfer,
    pub(crate) status: te::GetTransferStatus,
    pub(crate) free_batch: te::FreeBatchId,
    path: String,
    _lib: libloading::Library,
}

impl TeLib {
    /// Opens the library named by [`TE_LIB_ENV`], else [`TE_LIB_NAME`] on
    /// the search path.
    pub fn load() -> Result<TeLib, Error> {
        Self::from_library(open(candidates(TE_LIB_ENV, TE_LIB_NAME))?)
    }

    /// Opens the library at `path`.
    pub fn open(path: &std::path::Path) -> Result<TeLib, Error> {
        Self::from_library(open(vec![path.into()])?)
    }

    fn from_library((lib, path): (libloading::Library, String)) -> Result<TeLib, Error> {
        let p = path.as_str();
        // SAFETY: each type is the signature `transfer_engine_c.h`
        // declares for the name (the `layout` test checks the structs).
        unsafe {
            Ok(TeLib {
                create: sym(&lib, p, "createTransferEngine\0")?,
                local_ip_and_port: sym(&lib, p, "getLocalIpAndPort\0")?,
                install_transport: sym(&lib, p, "installTransport\0")?,
                open_segment: sym(&lib, p, "openSegment\0")?,
                close_segment: sym(&lib, p, "closeSegment\0")?,
                destroy: sym(&lib, p, "destroyTransferEngine\0")?,
                register: sym(&lib, p, "registerLocalMemory\0")?,
                unregister: sym(&lib, p, "unregisterLocalMemory\0")?,
                register_batch: sym(&lib, p, "registerLocalMemoryBatch\0")?,
                unregister_batch: sym(&lib, p, "unregisterLocalMemoryBatch\0")?,
                allocate_batch: sym(&lib, p, "allocateBatchID\0")?,
                submit: sym(&lib, p, "submitTransfer\0")?,
                status: sym(&lib, p, "getTransferStatus\0")?,
                free_batch: sym(&lib, p, "freeBatchID\0")?,
                path,
                _lib: lib,
            })
        }
    }

    /// The path the library was opened from.
    pub fn path(&self) -> &str {
        &self.path
    }
}

/// The store library, opened, with every function it needs.
pub struct StoreLib {
    pub(crate) create: s::Create,
    pub(crate) destroy: s::Destroy,
    pub(crate) setup: s::Setup,
    pub(crate) register_buffer: s::RegisterBuffer,
    pub(crate) unregister_buffer: s::UnregisterBuffer,
    pub(crate) batch_put_from: s::BatchPutFrom,
    pub(crate) batch_get_into: s::BatchGetInto,
    pub(crate) batch_is_exist: s::BatchIsExist,
    pub(crate) remove: s::Remove,
    path: String,
    _lib: libloading::Library,
}

impl StoreLib {
    /// Opens the library named by [`STORE_LIB_ENV`], else
    /// [`STORE_LIB_NAME`] on the search path.
    pub fn load() -> Result<StoreLib, Error> {
        Self::from_library(open(candidates(STORE_LIB_ENV, STORE_LIB_NAME))?)
    }

    /// Opens the library at `path`.
    pub fn open(path: &std::path::Path) -> Result<StoreLib, Error> {
        Self::from_library(open(vec![path.into()])?)
    }

    fn from_library((lib, path): (libloading::Library, String)) -> Result<StoreLib, Error> {
        let p = path.as_str();
        // SAFETY: each type is the signature `store_c.h` declares.
        unsafe {
            Ok(StoreLib {
                create: sym(&lib, p, "mooncake_store_create\0")?,
                destroy: sym(&lib, p, "mooncake_store_destroy\0")?,
                setup: sym(&lib, p, "mooncake_store_setup\0")?,
                register_buffer: sym(&lib, p, "mooncake_store_register_buffer\0")?,
                unregister_buffer: sym(&lib, p, "mooncake_store_unregister_buffer\0")?,
                batch_put_from: sym(&lib, p, "mooncake_store_batch_put_from\0")?,
                batch_get_into: sym(&lib, p, "mooncake_store_batch_get_into\0")?,
                batch_is_exist: sym(&lib, p, "mooncake_store_batch_is_exist\0")?,
                remove: sym(&lib, p, "mooncake_store_remove\0")?,
                path,
                _lib: lib,
            })
        }
    }

    /// The path the library was opened from.
    pub fn path(&self) -> &str {
        &self.path
    }
}
