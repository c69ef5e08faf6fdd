//! Reading id sequences from Python: numpy integer arrays (read in place) or
//! any sequence of ints, range-checked into `u32`.

use numpy::{PyArray1, PyArrayMethods, PyUntypedArrayMethods};
use pyo3::prelude::*;

use crate::errors::invalid_argument;

fn check_u32<T: Copy + TryInto<u32> + std::fmt::Display>(
    values: &[T],
    what: &str,
) -> PyResult<Vec<u32>> {
    values
        .iter()
        .map(|&v| {
            v.try_into().map_err(|_| {
                invalid_argument(format!(
                    "{what} must be integers in [0, {}], got {v}",
                    u32::MAX
                ))
            })
        })
        .collect()
}

macro_rules! try_numpy {
    ($obj:expr, $what:expr, $($t:ty),+) => {
        $(
            if let Ok(array) = $obj.cast::<PyArray1<$t>>() {
                let readonly = array.readonly();
                return match readonly.as_slice() {
                    Ok(slice) => check_u32(slice, $what),
                    Err(_) => check_u32(&readonly.to_vec().unwrap_or_default(), $what),
                };
            }
        )+
    };
}

/// Ids from a 1-D numpy integer array or a sequence of Python ints.
pub fn extract_ids(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u32>> {
    try_numpy!(obj, what, i64, i32, u32, u64, i16, u16, i8, u8);
    if let Ok(array) = obj.cast::<numpy::PyUntypedArray>() {
        return Err(invalid_argument(format!(
            "{what} must be a 1-D integer array, got dtype {} with {} dimension(s)",
            array.dtype(),
            array.ndim()
        )));
    }
    if obj.is_instance_of::<pyo3::types::PyString>() || obj.is_instance_of::<pyo3::types::PyBytes>()
    {
        return Err(invalid_argument(format!(
            "{what} must be a sequence of ints, not a string"
        )));
    }
    let values: Vec<i128> = obj
        .extract()
        .map_err(|_| invalid_argument(format!("{what} must be a sequence of ints")))?;
    check_u32(&values, what)
}

/// Like `extract_ids`, for 64-bit request ids.
pub fn extract_u64s(obj: &Bound<'_, PyAny>, what: &str) -> PyResult<Vec<u64>> {
    if let Ok(array) = obj.cast::<PyArray1<i64>>() {
        let values = array.readonly().to_vec().unwrap_or_default();
        return values
            .into_iter()
            .map(|v| {
                u64::try_from(v)
                    .map_err(|_| invalid_argument(format!("{what} must be non-negative, got {v}")))
            })
            .collect();
    }
    let values: Vec<i128> = obj
        .extract()
        .map_err(|_| invalid_argument(format!("{what} must be a sequence of ints")))?;
    values
        .into_iter()
        .map(|v| {
            u64::try_from(v)
                .map_err(|_| invalid_argument(format!("{what} must be in [0, 2**64), got {v}")))
        })
        .collect()
}
