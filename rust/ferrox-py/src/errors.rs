//! Maps core errors onto the exception classes of `ferrox.common.errors`.

use ferrox_core::CoreError;
use pyo3::exceptions::PyRuntimeError;
use pyo3::prelude::*;
use pyo3::types::PyType;

fn class_name(err: &CoreError) -> &'static str {
    match err {
        CoreError::InvalidArgument(_) => "InvalidArgumentError",
        CoreError::OutOfBlocks { .. } => "OutOfBlocksError",
        CoreError::BlockOutOfRange { .. } => "InvalidBlockError",
        CoreError::BlockNotAllocated { .. } => "BlockNotAllocatedError",
        CoreError::InvalidHandle { .. } => "InvalidHandleError",
        CoreError::NotLocked { .. } => "NotLockedError",
        CoreError::DuplicateRequest { .. } => "DuplicateRequestError",
        CoreError::RequestRejected { .. } => "RequestRejectedError",
        CoreError::PlanMismatch(_) => "SchedulerStateError",
        CoreError::Integrity(_) => "IntegrityError",
    }
}

/// Builds the Python exception for a core error.
pub fn to_py_err(err: CoreError) -> PyErr {
    let message = err.to_string();
    Python::attach(|py| {
        let class = py
            .import("ferrox.common.errors")
            .and_then(|m| m.getattr(class_name(&err)))
            .and_then(|c| c.cast_into::<PyType>().map_err(PyErr::from));
        match class {
            Ok(class) => PyErr::from_type(class, message),
            Err(_) => PyRuntimeError::new_err(message),
        }
    })
}

/// `result.or_raise()?` turns a core `Result` into a `PyResult`.
pub trait OrRaise<T> {
    fn or_raise(self) -> PyResult<T>;
}

impl<T> OrRaise<T> for Result<T, CoreError> {
    fn or_raise(self) -> PyResult<T> {
        self.map_err(to_py_err)
    }
}

pub fn invalid_argument(message: String) -> PyErr {
    to_py_err(CoreError::InvalidArgument(message))
}
