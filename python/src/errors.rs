//! The Python exceptions of `kvferry._native`, each a kind of blame, and
//! the mapping of the node's errors onto them.

use kvferry::NodeError;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyTimeoutError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::{PyDict, PyType};

create_exception!(_native, Error, PyException, "Base of every kvferry error.");
create_exception!(
    _native,
    MisuseError,
    Error,
    "The caller used kvferry wrongly: a bad argument, configuration or call order."
);
create_exception!(
    _native,
    PeerError,
    Error,
    "A peer misbehaved or refused (another protocol version, a colliding request id)."
);
create_exception!(
    _native,
    TransportError,
    Error,
    "The data plane, the side channel or the bootstrap service failed."
);
/// `kvferry.TimeoutError`: a kvferry [`Error`] and the builtin
/// `TimeoutError` both, so `except TimeoutError` catches a kvferry wait
/// that ran out as it catches any other. Made at import (`create_exception!`
/// takes one base).
static TIMEOUT_ERROR: PyOnceLock<Py<PyType>> = PyOnceLock::new();

pub(crate) fn timeout_type(py: Python<'_>) -> PyResult<&Py<PyType>> {
    TIMEOUT_ERROR.get_or_try_init(py, || {
        let bases = (py.get_type::<Error>(), py.get_type::<PyTimeoutError>());
        let attrs = PyDict::new(py);
        attrs.set_item("__module__", "kvferry._native")?;
        attrs.set_item("__doc__", "A bounded wait ran out.")?;
        let made = py
            .get_type::<PyType>()
            .call1(("TimeoutError", bases, attrs))?;
        Ok(made.cast_into::<PyType>()?.unbind())
    })
}

/// A `kvferry.TimeoutError` saying `text`.
pub(crate) fn timeout_err(text: String) -> PyErr {
    Python::attach(|py| match timeout_type(py) {
        Ok(ty) => PyErr::from_type(ty.bind(py).clone(), text),
        Err(e) => e,
    })
}
create_exception!(
    _native,
    ParamsError,
    Error,
    "A request's kv_transfer_params (from the router) are malformed."
);
create_exception!(
    _native,
    BusyError,
    Error,
    "Back-pressure: the node holds its maximum of requests; collect finished ones and retry."
);

/// The exception of a node error, with the blame kept apart.
pub(crate) fn node_err(e: NodeError) -> PyErr {
    let text = e.to_string();
    match e {
        NodeError::Misuse(_) => MisuseError::new_err(text),
        NodeError::IdCollision(_) => PeerError::new_err(text),
        NodeError::Busy(_) => BusyError::new_err(text),
        NodeError::Timeout(_) => timeout_err(text),
        NodeError::DataPlane(_)
        | NodeError::SideChannel { .. }
        | NodeError::Http(_)
        | NodeError::Bootstrap(_) => TransportError::new_err(text),
        _ => Error::new_err(text),
    }
}

pub(crate) fn misuse(text: impl Into<String>) -> PyErr {
    MisuseError::new_err(text.into())
}
