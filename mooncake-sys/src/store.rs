//! The Mooncake Store client (`store_c.h`), wrapped.
//!
//! A [`Store`] has one owner and owns the buffers registered with it
//! (unregistered when it drops, before the client is destroyed). It is
//! `Send`, not `Sync`: kvferry creates it and then calls it from one
//! backend thread. Moving it between threads is sound because the client
//! keeps no thread-local state: `store_c.cpp` forwards each call to a
//! `mooncake::Client`, which Mooncake's own Python binding calls from any
//! thread (its methods release the GIL).

use std::ffi::{c_char, c_int, c_void, CString};
use std::sync::Arc;

use crate::error::Error;
use crate::ffi::{ReplicateConfig, StoreHandle};
use crate::lib_te::StoreLib;

/// What `mooncake_store_setup` takes.
#[derive(Clone, Debug)]
pub struct StoreConfig {
    /// This client's `host:port` (its transfer engine's segment name).
    pub local_hostname: String,
    /// The metadata service (`P2PHANDSHAKE`, `http://…`, `etcd://…`).
    pub metadata_server: String,
    /// Bytes this client contributes to the store's global segment (0: a
    /// client only).
    pub global_segment_size: u64,
    /// Bytes of the client's local staging buffer.
    pub local_buffer_size: u64,
    /// The transfer engine's protocol (`tcp`, `rdma`).
    pub protocol: String,
    /// The RDMA device names (empty for tcp).
    pub device_name: String,
    /// `host:port` of `mooncake_master`.
    pub master_server_addr: String,
}

/// A store client, set up, and the buffers registered with it.
pub struct Store {
    lib: Arc<StoreLib>,
    handle: StoreHandle,
    buffers: Vec<*mut u8>,
}

// SAFETY: see the module docs: the client is not tied to a thread, and a
// `Store` has one owner (no `Clone`, no `Sync`).
unsafe impl Send for Store {}

impl Drop for Store {
    fn drop(&mut self) {
        for b in std::mem::take(&mut self.buffers) {
            // SAFETY: registered with this live store.
            unsafe { (self.lib.unregister_buffer)(self.handle, b.cast()) };
        }
        // SAFETY: a live store used by nothing else any more.
        unsafe { (self.lib.destroy)(self.handle) };
    }
}

fn c_string(what: &'static str, s: &str) -> Result<CString, Error> {
    CString::new(s).map_err(|_| Error::Nul { what })
}

/// Keys as C strings and the pointer array `store_c.h` takes.
struct Keys {
    _owned: Vec<CString>,
    ptrs: Vec<*const c_char>,
}

impl Keys {
    fn new<'a>(keys: impl IntoIterator<Item = &'a str>) -> Result<Keys, Error> {
        let owned = (keys.into_iter())
            .map(|k| c_string("key", k))
            .collect::<Result<Vec<_>, _>>()?;
        let ptrs = owned.iter().map(|k| k.as_ptr()).collect();
        Ok(Keys {
            _owned: owned,
            ptrs,
        })
    }
}

impl Store {
    /// Creates a client and connects it to the master.
    pub fn new(lib: Arc<StoreLib>, cfg: &StoreConfig) -> Result<Store, Error> {
        // SAFETY: no arguments.
        let handle = unsafe { (lib.create)() };
        if handle.is_null() {
            return Err(Error::Call {
                call: "mooncake_store_create",
                code: -1,
            });
        }
        let store = Store {
            lib,
            handle,
            buffers: Vec::new(),
        };
        let host = c_string("local_hostname", &cfg.local_hostname)?;
        let meta = c_string("metadata_server", &cfg.metadata_server)?;
        let proto = c_string("protocol", &cfg.protocol)?;
        let dev = c_string("device_name", &cfg.device_name)?;
        let master = c_string("master_server_addr", &cfg.master_server_addr)?;
        // SAFETY: a live store; strings outlive the call.
        let rc = unsafe {
            (store.lib.setup)(
                handle,
                host.as_ptr(),
                meta.as_ptr(),
                cfg.global_segment_size,
                cfg.local_buffer_size,
                proto.as_ptr(),
                dev.as_ptr(),
                master.as_ptr(),
            )
        };
        Error::check("mooncake_store_setup", rc)?;
        Ok(store)
    }

    /// Registers `len` bytes at `addr` for zero-copy puts and gets, until
    /// the store drops.
    ///
    /// # Safety
    ///
    /// The memory must stay allocated until the store drops.
    pub unsafe fn register_buffer(&mut self, addr: *mut u8, len: usize) -> Result<(), Error> {
        // SAFETY: a live store; the caller vouches for the memory.
        let rc = unsafe { (self.lib.register_buffer)(self.handle, addr.cast(), len) };
        Error::check("mooncake_store_register_buffer", rc)?;
        self.buffers.push(addr);
        Ok(())
    }

    /// Which of `keys` exist: per key 1 (yes), 0 (no) or a negative error.
    pub fn batch_exists(&mut self, keys: &[&str]) -> Result<Vec<c_int>, Error> {
        let k = Keys::new(keys.iter().copied())?;
        let mut out = vec![0 as c_int; keys.len()];
        // SAFETY: a live store; arrays of the length passed.
        let rc = unsafe {
            (self.lib.batch_is_exist)(self.handle, k.ptrs.as_ptr(), keys.len(), out.as_mut_ptr())
        };
        Error::check("mooncake_store_batch_is_exist", rc)?;
        Ok(out)
    }

    /// Puts `items` (`key`, registered buffer, length): per key 0 or a
    /// negative error code.
    ///
    /// # Safety
    ///
    /// Every buffer must lie in memory registered with
    /// [`Store::register_buffer`] and stay valid during the call.
    pub unsafe fn batch_put_from(
        &mut self,
        items: &[(&str, *mut u8, usize)],
        config: &ReplicateConfig,
    ) -> Result<Vec<c_int>, Error> {
        let k = Keys::new(items.iter().map(|i| i.0))?;
        let bufs: Vec<*mut c_void> = items.iter().map(|i| i.1.cast()).collect();
        let sizes: Vec<usize> = items.iter().map(|i| i.2).collect();
        let mut out = vec![0 as c_int; items.len()];
        // SAFETY: a live store, arrays of the length passed; the caller
        // vouches for the buffers.
        let rc = unsafe {
            (self.lib.batch_put_from)(
                self.handle,
                k.ptrs.as_ptr(),
                bufs.as_ptr(),
                sizes.as_ptr(),
                items.len(),
                config,
                out.as_mut_ptr(),
            )
        };
        Error::check("mooncake_store_batch_put_from", rc)?;
        Ok(out)
    }

    /// Gets `items` into registered buffers: per key the bytes read or a
    /// negative error code.
    ///
    /// # Safety
    ///
    /// As [`Store::batch_put_from`]; the library writes at most each
    /// item's length into its buffer.
    pub unsafe fn batch_get_into(
        &self,
        items: &[(&str, *mut u8, usize)],
    ) -> Result<Vec<i64>, Error> {
        let k = Keys::new(items.iter().map(|i| i.0))?;
        let bufs: Vec<*mut c_void> = items.iter().map(|i| i.1.cast()).collect();
        let sizes: Vec<usize> = items.iter().map(|i| i.2).collect();
        let mut out = vec![0i64; items.len()];
        // SAFETY: as in `batch_put_from`.
        let rc = unsafe {
            (self.lib.batch_get_into)(
                self.handle,
                k.ptrs.as_ptr(),
                bufs.as_ptr(),
                sizes.as_ptr(),
                items.len(),
                out.as_mut_ptr(),
            )
        };
        Error::check("mooncake_store_batch_get_into", rc)?;
        Ok(out)
    }

    /// Removes `key`.
    pub fn remove(&mut self, key: &str) -> Result<(), Error> {
        let k = c_string("key", key)?;
        // SAFETY: a live store and a NUL-terminated key.
        let rc = unsafe { (self.lib.remove)(self.handle, k.as_ptr(), 0) };
        Error::check("mooncake_store_remove", rc)
    }
}
