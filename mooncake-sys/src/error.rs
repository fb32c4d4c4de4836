//! Why a Mooncake call failed.

/// Why loading a library or a call into it failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// None of the candidates could be opened (each with the loader's
    /// reason).
    #[error("no Mooncake library could be loaded; tried: {}", tried.join("; "))]
    LibraryNotFound {
        /// `path: reason` for every candidate tried, in order.
        tried: Vec<String>,
    },
    /// The library was opened but lacks a function this crate needs (a
    /// Mooncake build older or newer than the one the binding is written
    /// for, or not a Mooncake library at all).
    #[error("{library} has no symbol {symbol}")]
    MissingSymbol {
        /// The library's path.
        library: String,
        /// The function looked up.
        symbol: &'static str,
    },
    /// A C function returned a failure code.
    #[error("{call} failed with code {code}")]
    Call {
        /// The C function.
        call: &'static str,
        /// What it returned.
        code: i64,
    },
    /// A string argument holds a NUL byte and cannot cross into C.
    #[error("{what} contains a NUL byte")]
    Nul {
        /// Which argument.
        what: &'static str,
    },
    /// The library returned text that is not UTF-8 or not NUL-terminated
    /// within its buffer.
    #[error("{call} returned malformed text")]
    BadText {
        /// The C function.
        call: &'static str,
    },
    /// A batch was given more requests than it was allocated for, or a
    /// task index past its end.
    #[error("batch of {capacity} tasks given {asked}")]
    BatchOverflow {
        /// Tasks the batch was allocated for.
        capacity: usize,
        /// What was asked.
        asked: usize,
    },
    /// `freeBatchID` refused: a task of the batch is not finished.
    #[error("batch has unfinished tasks")]
    BatchBusy,
}

impl Error {
    /// `Ok(())` for code 0, else [`Error::Call`].
    pub(crate) fn check(call: &'static str, code: std::ffi::c_int) -> Result<(), Error> {
        if code == 0 {
            Ok(())
        } else {
            Err(Error::Call {
                call,
                code: i64::from(code),
            })
        }
    }
}
