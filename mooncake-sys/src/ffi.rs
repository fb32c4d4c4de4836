//! The C surface of `transfer_engine_c.h` and `store_c.h` (vendored under
//! `include/`, see `include/UPSTREAM.md`): types, constants and the
//! signatures of the functions [`crate::TeLib`] and [`crate::StoreLib`]
//! load. The `layout` test checks every struct here against the headers.

use std::ffi::{c_char, c_int, c_void};

/// `segment_id_t` (a `#define` for `int32_t`).
pub type SegmentId = i32;
/// `batch_id_t` (a `#define` for `uint64_t`).
pub type BatchId = u64;
/// `transfer_engine_t`.
pub type EngineHandle = *mut c_void;
/// `transport_t`.
pub type TransportHandle = *mut c_void;
/// `mooncake_store_t`.
pub type StoreHandle = *mut c_void;

/// `LOCAL_SEGMENT`.
pub const LOCAL_SEGMENT: SegmentId = 0;
/// `INVALID_BATCH`: what `allocateBatchID` returns when it fails.
pub const INVALID_BATCH: BatchId = u64::MAX;
/// `OPCODE_READ`: copy the segment's bytes into `source`.
pub const OPCODE_READ: c_int = 0;
/// `OPCODE_WRITE`: copy `source` into the segment.
pub const OPCODE_WRITE: c_int = 1;

/// `STATUS_WAITING`.
pub const STATUS_WAITING: c_int = 0;
/// `STATUS_PENDING`.
pub const STATUS_PENDING: c_int = 1;
/// `STATUS_INVALID`.
pub const STATUS_INVALID: c_int = 2;
/// `STATUS_CANCELED`.
pub const STATUS_CANCELED: c_int = 3;
/// `STATUS_COMPLETED`.
pub const STATUS_COMPLETED: c_int = 4;
/// `STATUS_TIMEOUT`.
pub const STATUS_TIMEOUT: c_int = 5;
/// `STATUS_FAILED`.
pub const STATUS_FAILED: c_int = 6;

/// The code `freeBatchID` returns while a task of the batch is not
/// finished (`Status::Code::kBatchBusy`; the C functions return the code
/// of the engine's `Status`, 0 for success).
pub const CODE_BATCH_BUSY: c_int = 4;

/// The store's per-key error codes (`mooncake::ErrorCode` in the store's
/// `types.h`) that kvferry tells apart; any other negative value is a
/// failure of the key's transfer.
pub mod store_code {
    /// `NO_AVAILABLE_HANDLE`: no space left (the pressure path).
    pub const NO_AVAILABLE_HANDLE: i64 = -200;
    /// `INVALID_PARAMS`.
    pub const INVALID_PARAMS: i64 = -600;
    /// `OBJECT_NOT_FOUND`.
    pub const OBJECT_NOT_FOUND: i64 = -704;
    /// `OBJECT_ALREADY_EXISTS`.
    pub const OBJECT_ALREADY_EXISTS: i64 = -705;
    /// `CHECKSUM_MISMATCH`: the stored bytes are not those put.
    pub const CHECKSUM_MISMATCH: i64 = -801;
}

/// `struct transfer_request`.
#[repr(C)]
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TransferRequest {
    /// [`OPCODE_READ`] or [`OPCODE_WRITE`].
    pub opcode: c_int,
    /// Local registered memory.
    pub source: *mut c_void,
    /// The segment `openSegment` returned.
    pub target_id: SegmentId,
    /// Address in the segment's registered memory (the peer's virtual
    /// address for host memory: Mooncake's "offset" is the address).
    pub target_offset: u64,
    /// Bytes.
    pub length: u64,
}

/// `struct transfer_status`.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TransferStatus {
    /// One of the `STATUS_*` values.
    pub status: c_int,
    /// Bytes moved so far.
    pub transferred_bytes: u64,
}

/// `struct notify_msg`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct NotifyMsg {
    /// The sender's name.
    pub name: *mut c_char,
    /// The message.
    pub msg: *mut c_char,
}

/// `struct buffer_entry`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct BufferEntry {
    /// Start of the buffer.
    pub addr: *mut c_void,
    /// Its length.
    pub length: usize,
}

/// `struct mooncake_replicate_config`.
#[repr(C)]
#[derive(Clone, Copy, Debug)]
pub struct ReplicateConfig {
    /// Replicas per value.
    pub replica_num: usize,
    /// Soft pin: kept longer under eviction.
    pub with_soft_pin: c_int,
    /// Hard pin: never evicted.
    pub with_hard_pin: c_int,
    /// Segments preferred for the replicas (may be null).
    pub preferred_segments: *const *const c_char,
    /// Entries of `preferred_segments`.
    pub preferred_segments_count: usize,
}

/// The transfer engine's functions, as `transfer_engine_c.h` declares them.
pub mod te {
    use super::*;

    /// `createTransferEngine`.
    pub type CreateTransferEngine = unsafe extern "C" fn(
        metadata_conn_string: *const c_char,
        local_server_name: *const c_char,
        ip_or_host_name: *const c_char,
        rpc_port: u64,
        auto_discover: c_int,
    ) -> EngineHandle;
    /// `getLocalIpAndPort`.
    pub type GetLocalIpAndPort =
        unsafe extern "C" fn(engine: EngineHandle, buf_out: *mut c_char, buf_len: usize) -> c_int;
    /// `installTransport`.
    pub type InstallTransport = unsafe extern "C" fn(
        engine: EngineHandle,
        proto: *const c_char,
        args: *mut *mut c_void,
    ) -> TransportHandle;
    /// `openSegment`.
    pub type OpenSegment =
        unsafe extern "C" fn(engine: EngineHandle, segment_name: *const c_char) -> SegmentId;
    /// `closeSegment`.
    pub type CloseSegment = unsafe extern "C" fn(engine: EngineHandle, id: SegmentId) -> c_int;
    /// `destroyTransferEngine`.
    pub type DestroyTransferEngine = unsafe extern "C" fn(engine: EngineHandle);
    /// `registerLocalMemory`.
    pub type RegisterLocalMemory = unsafe extern "C" fn(
        engine: EngineHandle,
        addr: *mut c_void,
        length: usize,
        location: *const c_char,
        remote_accessible: c_int,
    ) -> c_int;
    /// `unregisterLocalMemory`.
    pub type UnregisterLocalMemory =
        unsafe extern "C" fn(engine: EngineHandle, addr: *mut c_void) -> c_int;
    /// `registerLocalMemoryBatch`.
    pub type RegisterLocalMemoryBatch = unsafe extern "C" fn(
        engine: EngineHandle,
        buffers: *mut BufferEntry,
        count: usize,
        location: *const c_char,
    ) -> c_int;
    /// `unregisterLocalMemoryBatch`.
    pub type UnregisterLocalMemoryBatch =
        unsafe extern "C" fn(engine: EngineHandle, addrs: *mut *mut c_void, count: usize) -> c_int;
    /// `allocateBatchID`.
    pub type AllocateBatchId = unsafe extern "C" fn(engine: EngineHandle, size: usize) -> BatchId;
    /// `submitTransfer`.
    pub type SubmitTransfer = unsafe extern "C" fn(
        engine: EngineHandle,
        batch: BatchId,
        entries: *mut TransferRequest,
        count: usize,
    ) -> c_int;
    /// `getTransferStatus`.
    pub type GetTransferStatus = unsafe extern "C" fn(
        engine: EngineHandle,
        batch: BatchId,
        task: usize,
        status: *mut TransferStatus,
    ) -> c_int;
    /// `freeBatchID`.
    pub type FreeBatchId = unsafe extern "C" fn(engine: EngineHandle, batch: BatchId) -> c_int;
}

/// The store's functions, as `store_c.h` declares them.
pub mod store {
    use super::*;

    /// `mooncake_store_create`.
    pub type Create = unsafe extern "C" fn() -> StoreHandle;
    /// `mooncake_store_destroy`.
    pub type Destroy = unsafe extern "C" fn(store: StoreHandle);
    /// `mooncake_store_setup`.
    pub type Setup = unsafe extern "C" fn(
        store: StoreHandle,
        local_hostname: *const c_char,
        metadata_server: *const c_char,
        global_segment_size: u64,
        local_buffer_size: u64,
        protocol: *const c_char,
        device_name: *const c_char,
        master_server_addr: *const c_char,
    ) -> c_int;
    /// `mooncake_store_register_buffer`.
    pub type RegisterBuffer =
        unsafe extern "C" fn(store: StoreHandle, buffer: *mut c_void, size: usize) -> c_int;
    /// `mooncake_store_unregister_buffer`.
    pub type UnregisterBuffer =
        unsafe extern "C" fn(store: StoreHandle, buffer: *mut c_void) -> c_int;
    /// `mooncake_store_batch_put_from`.
    pub type BatchPutFrom = unsafe extern "C" fn(
        store: StoreHandle,
        keys: *const *const c_char,
        buffers: *const *mut c_void,
        sizes: *const usize,
        count: usize,
        config: *const ReplicateConfig,
        results_out: *mut c_int,
    ) -> c_int;
    /// `mooncake_store_batch_get_into`.
    pub type BatchGetInto = unsafe extern "C" fn(
        store: StoreHandle,
        keys: *const *const c_char,
        buffers: *const *mut c_void,
        sizes: *const usize,
        count: usize,
        results_out: *mut i64,
    ) -> c_int;
    /// `mooncake_store_batch_is_exist`.
    pub type BatchIsExist = unsafe extern "C" fn(
        store: StoreHandle,
        keys: *const *const c_char,
        count: usize,
        results_out: *mut c_int,
    ) -> c_int;
    /// `mooncake_store_remove`.
    pub type Remove =
        unsafe extern "C" fn(store: StoreHandle, key: *const c_char, force: c_int) -> c_int;
}
