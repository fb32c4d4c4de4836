//! Fake `libtransfer_engine.so` and `libmooncake_store.so` for tests
//! (`csrc/fake_te.c`, `csrc/fake_store.c`): the C surfaces with memcpy
//! inside one process, every range checked against registered memory,
//! injectable faults, and counters. [`build`] and [`build_store`] compile
//! them with the system C compiler into real shared objects, loaded by path
//! through [`crate::TE_LIB_ENV`] / [`crate::STORE_LIB_ENV`] exactly as the
//! real libraries are.

use std::ffi::c_int;
use std::path::{Path, PathBuf};
use std::process::Command;

const FAKE_TE_C: &str = include_str!("../csrc/fake_te.c");
const TE_HEADER: &str = include_str!("../include/transfer_engine_c.h");
const FAKE_STORE_C: &str = include_str!("../csrc/fake_store.c");
const STORE_HEADER: &str = include_str!("../include/store_c.h");

/// A fault the fake library applies to the next `count` submits or tasks.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// `submitTransfer` fails; nothing moves.
    SubmitFail,
    /// The task ends `STATUS_FAILED`; nothing moves.
    TaskFailed,
    /// The task ends `STATUS_TIMEOUT`; nothing moves.
    TaskTimeout,
    /// The task stays pending until this many milliseconds after its
    /// submit, then moves its bytes (at the next status poll) and
    /// completes.
    Late(i64),
    /// The task stays pending until [`Control::finish_never`].
    Never,
    /// The bytes move; `transferred_bytes` says one less.
    WrongBytes,
}

impl Fault {
    fn code(self) -> (c_int, i64) {
        match self {
            Fault::SubmitFail => (1, 0),
            Fault::TaskFailed => (2, 0),
            Fault::TaskTimeout => (3, 0),
            Fault::Late(ms) => (4, ms),
            Fault::Never => (5, 0),
            Fault::WrongBytes => (6, 0),
        }
    }
}

/// The fake library's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// `allocateBatchID` calls that returned a batch.
    pub allocated: i64,
    /// `freeBatchID` calls that freed one.
    pub freed: i64,
    /// Submits refused because a local range was not registered.
    pub submits_refused: i64,
    /// Tasks refused because the remote range was not registered.
    pub tasks_refused: i64,
    /// Tasks started.
    pub tasks: i64,
    /// Registrations at a device location (any but `cpu:N` and `*`).
    pub device_regions: i64,
}

/// Compiles the fake transfer engine into `dir` (created if missing) and
/// returns its path. `CC` names the compiler (default `cc`).
pub fn build(dir: &Path) -> std::io::Result<PathBuf> {
    compile(
        dir,
        ("fake_te.c", FAKE_TE_C),
        ("transfer_engine_c.h", TE_HEADER),
        "libfake_transfer_engine.so",
    )
}

/// Compiles the fake store into `dir` and returns its path.
pub fn build_store(dir: &Path) -> std::io::Result<PathBuf> {
    compile(
        dir,
        ("fake_store.c", FAKE_STORE_C),
        ("store_c.h", STORE_HEADER),
        "libfake_mooncake_store.so",
    )
}

fn compile(
    dir: &Path,
    (c_name, c_text): (&str, &str),
    (h_name, h_text): (&str, &str),
    so: &str,
) -> std::io::Result<PathBuf> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join(c_name), c_text)?;
    std::fs::write(dir.join(h_name), h_text)?;
    let out = dir.join(so);
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(&cc)
        .args(["-O1", "-shared", "-fPIC", "-Wall", "-Werror", "-o"])
        .arg(&out)
        .arg(dir.join(c_name))
        .arg(format!("-I{}", dir.display()))
        .arg("-lpthread")
        .status()?;
    if !status.success() {
        return Err(std::io::Error::other(format!("{cc} failed: {status}")));
    }
    Ok(out)
}

type FaultFn = unsafe extern "C" fn(c_int, c_int, i64);
type StatsFn = unsafe extern "C" fn(*mut i64);
type FinishFn = unsafe extern "C" fn();

/// The fake library's test controls (the same library the engines use:
/// opening a path twice gives the same loaded object).
pub struct Control {
    fault: FaultFn,
    stats: StatsFn,
    finish_never: FinishFn,
    _lib: libloading::Library,
}

impl Control {
    /// Opens the controls of the fake library at `path`.
    pub fn open(path: &Path) -> Result<Control, libloading::Error> {
        // SAFETY: the fake library's initialisers are none; the symbols'
        // types are those `csrc/fake_te.c` defines.
        unsafe {
            let lib = libloading::Library::new(path)?;
            Ok(Control {
                fault: *lib.get::<FaultFn>(b"fake_te_fault\0")?,
                stats: *lib.get::<StatsFn>(b"fake_te_stats\0")?,
                finish_never: *lib.get::<FinishFn>(b"fake_te_finish_never\0")?,
                _lib: lib,
            })
        }
    }

    /// Arms `fault` for the next `count` submits or tasks (replacing any
    /// armed before).
    pub fn arm(&self, fault: Fault, count: u32) {
        let (kind, arg) = fault.code();
        let count = c_int::try_from(count).unwrap_or(c_int::MAX);
        // SAFETY: plain values.
        unsafe { (self.fault)(kind, count, arg) }
    }

    /// Disarms any fault.
    pub fn disarm(&self) {
        // SAFETY: plain values.
        unsafe { (self.fault)(0, 0, 0) }
    }

    /// The counters now.
    pub fn stats(&self) -> Stats {
        let mut v = [0i64; 6];
        // SAFETY: the function writes six values.
        unsafe { (self.stats)(v.as_mut_ptr()) };
        Stats {
            allocated: v[0],
            freed: v[1],
            submits_refused: v[2],
            tasks_refused: v[3],
            tasks: v[4],
            device_regions: v[5],
        }
    }

    /// Ends every [`Fault::Never`] task started so far as failed.
    pub fn finish_never(&self) {
        // SAFETY: no arguments.
        unsafe { (self.finish_never)() }
    }
}

type CapacityFn = unsafe extern "C" fn(u64);
type CorruptFn = unsafe extern "C" fn(*const std::ffi::c_char) -> c_int;
type ClearFn = unsafe extern "C" fn();
type CorruptStartingFn = unsafe extern "C" fn(c_int) -> c_int;

/// The fake store's counters.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct StoreStats {
    /// Values stored.
    pub puts: i64,
    /// Values read.
    pub gets: i64,
    /// Puts and gets that named memory not registered with the client.
    pub unregistered: i64,
}

/// The fake store's test controls.
pub struct StoreControl {
    capacity: CapacityFn,
    corrupt: CorruptFn,
    corrupt_starting: CorruptStartingFn,
    clear: ClearFn,
    stats: StatsFn,
    _lib: libloading::Library,
}

impl StoreControl {
    /// Opens the controls of the fake store at `path`.
    pub fn open(path: &Path) -> Result<StoreControl, libloading::Error> {
        // SAFETY: the symbols' types are those `csrc/fake_store.c` defines.
        unsafe {
            let lib = libloading::Library::new(path)?;
            Ok(StoreControl {
                capacity: *lib.get::<CapacityFn>(b"fake_store_capacity\0")?,
                corrupt: *lib.get::<CorruptFn>(b"fake_store_corrupt\0")?,
                corrupt_starting: *lib
                    .get::<CorruptStartingFn>(b"fake_store_corrupt_starting_with\0")?,
                clear: *lib.get::<ClearFn>(b"fake_store_clear\0")?,
                stats: *lib.get::<StatsFn>(b"fake_store_stats\0")?,
                _lib: lib,
            })
        }
    }

    /// Bytes the store may hold; a put past them is `NO_AVAILABLE_HANDLE`.
    pub fn set_capacity(&self, bytes: u64) {
        // SAFETY: a plain value.
        unsafe { (self.capacity)(bytes) }
    }

    /// Flips a byte of `key`'s stored value; false if it is not stored.
    pub fn corrupt(&self, key: &str) -> bool {
        let k = std::ffi::CString::new(key).expect("a key without NUL");
        // SAFETY: a NUL-terminated key.
        unsafe { (self.corrupt)(k.as_ptr()) == 0 }
    }

    /// Flips the first byte of every stored value whose first byte is
    /// `first`; how many.
    pub fn corrupt_starting_with(&self, first: u8) -> usize {
        // SAFETY: a plain value.
        let n = unsafe { (self.corrupt_starting)(c_int::from(first)) };
        usize::try_from(n).unwrap_or(0)
    }

    /// Drops every value.
    pub fn clear(&self) {
        // SAFETY: no arguments.
        unsafe { (self.clear)() }
    }

    /// The counters now.
    pub fn stats(&self) -> StoreStats {
        let mut v = [0i64; 5];
        // SAFETY: the function writes three values.
        unsafe { (self.stats)(v.as_mut_ptr()) };
        StoreStats {
            puts: v[0],
            gets: v[1],
            unregistered: v[2],
        }
    }
}

/// The fake transfer engine of a test process: built once, its path and
/// its controls.
pub struct Shared {
    /// Where the library is.
    pub path: PathBuf,
    /// Its controls.
    pub control: Control,
}

/// The fake transfer engine, built into `dir` once per process, and a lock
/// held for a test's whole run: its faults and counters are process-wide,
/// so tests that arm faults or compare counters run one at a time. Any
/// armed fault is cleared before it returns.
pub fn shared(dir: &Path) -> (&'static Shared, std::sync::MutexGuard<'static, ()>) {
    static BUILT: std::sync::OnceLock<Shared> = std::sync::OnceLock::new();
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let s = BUILT.get_or_init(|| {
        let path = build(dir).expect("the fake engine library builds");
        let control = Control::open(&path).expect("the fake library's controls");
        Shared { path, control }
    });
    let guard = ONE_AT_A_TIME.lock().unwrap_or_else(|e| e.into_inner());
    s.control.disarm();
    (s, guard)
}
