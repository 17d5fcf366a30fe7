// SPDX-License-Identifier: Apache-2.0
//! `KvError`: one variant per `kvport_status` error code, with the message
//! `kvport_last_error()` gave for the failing call.

use std::ffi::CStr;
use std::fmt;

use crate::ffi;

/// An error from kvport. Each variant is one status code of the C ABI
/// (`KVPORT_ERR_*`, which map kvport's C++ exception types one to one) and
/// carries the library's message.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum KvError {
    /// `KVPORT_ERR_ERROR`: a kvport error of no more specific kind.
    Error(String),
    /// `KVPORT_ERR_INVALID_ARGUMENT`: a value outside the contract (a bad
    /// config field, a wrong buffer length, an unknown backend or dtype name,
    /// `inc_ref` of a free block, a stream of another backend, ...).
    InvalidArgument(String),
    /// `KVPORT_ERR_CACHE_EXHAUSTED`: no free (or evictable) block.
    /// Recoverable: preempt a sequence, evict, retry.
    CacheExhausted(String),
    /// `KVPORT_ERR_OUT_OF_MEMORY`: an allocation failed.
    OutOfMemory(String),
    /// `KVPORT_ERR_BACKEND`: a vendor runtime call failed, or a synchronize
    /// reported an asynchronous error.
    Backend(String),
    /// `KVPORT_ERR_DEVICE_LOST`: the device context is gone; restart the
    /// process.
    DeviceLost(String),
    /// `KVPORT_ERR_OUT_OF_RANGE` (C++'s `kvport::OutOfRange`): a block id >=
    /// the block count, a layer >= the layer count or a group >= the group
    /// count (checked before any change or device work).
    OutOfRange(String),
    /// `KVPORT_ERR_INVALID_HANDLE`: a null, destroyed or foreign handle
    /// (e.g. a `stream: u64` that is no live stream).
    InvalidHandle(String),
    /// `KVPORT_ERR_HANDLE_IN_USE`: destroying a handle with live children.
    HandleInUse(String),
    /// `KVPORT_ERR_UNKNOWN` (a non-kvport C++ exception), or a status this
    /// crate does not know (the message then starts with its number).
    Unknown(String),
}

impl KvError {
    /// The error for a non-OK `status` and its message; `None` for
    /// `KVPORT_OK`.
    pub fn from_status(status: ffi::kvport_status, message: String) -> Option<KvError> {
        Some(match status {
            ffi::KVPORT_OK => return None,
            ffi::KVPORT_ERR_ERROR => KvError::Error(message),
            ffi::KVPORT_ERR_INVALID_ARGUMENT => KvError::InvalidArgument(message),
            ffi::KVPORT_ERR_CACHE_EXHAUSTED => KvError::CacheExhausted(message),
            ffi::KVPORT_ERR_OUT_OF_MEMORY => KvError::OutOfMemory(message),
            ffi::KVPORT_ERR_BACKEND => KvError::Backend(message),
            ffi::KVPORT_ERR_DEVICE_LOST => KvError::DeviceLost(message),
            ffi::KVPORT_ERR_OUT_OF_RANGE => KvError::OutOfRange(message),
            ffi::KVPORT_ERR_INVALID_HANDLE => KvError::InvalidHandle(message),
            ffi::KVPORT_ERR_HANDLE_IN_USE => KvError::HandleInUse(message),
            ffi::KVPORT_ERR_UNKNOWN => KvError::Unknown(message),
            other => KvError::Unknown(format!("status {}: {}", other, message)),
        })
    }

    /// The `kvport_status` value of this error.
    pub fn status(&self) -> ffi::kvport_status {
        match self {
            KvError::Error(_) => ffi::KVPORT_ERR_ERROR,
            KvError::InvalidArgument(_) => ffi::KVPORT_ERR_INVALID_ARGUMENT,
            KvError::CacheExhausted(_) => ffi::KVPORT_ERR_CACHE_EXHAUSTED,
            KvError::OutOfMemory(_) => ffi::KVPORT_ERR_OUT_OF_MEMORY,
            KvError::Backend(_) => ffi::KVPORT_ERR_BACKEND,
            KvError::DeviceLost(_) => ffi::KVPORT_ERR_DEVICE_LOST,
            KvError::OutOfRange(_) => ffi::KVPORT_ERR_OUT_OF_RANGE,
            KvError::InvalidHandle(_) => ffi::KVPORT_ERR_INVALID_HANDLE,
            KvError::HandleInUse(_) => ffi::KVPORT_ERR_HANDLE_IN_USE,
            KvError::Unknown(_) => ffi::KVPORT_ERR_UNKNOWN,
        }
    }

    /// "KVPORT_ERR_INVALID_ARGUMENT", ... (from `kvport_status_name`).
    pub fn status_name(&self) -> &'static str {
        // SAFETY: kvport_status_name never returns null; static storage.
        unsafe { CStr::from_ptr(ffi::kvport_status_name(self.status())) }
            .to_str()
            .unwrap_or("KVPORT_ERR_<non-utf8 name>")
    }

    /// The library's message for the failing call.
    pub fn message(&self) -> &str {
        match self {
            KvError::Error(m)
            | KvError::InvalidArgument(m)
            | KvError::CacheExhausted(m)
            | KvError::OutOfMemory(m)
            | KvError::Backend(m)
            | KvError::DeviceLost(m)
            | KvError::OutOfRange(m)
            | KvError::InvalidHandle(m)
            | KvError::HandleInUse(m)
            | KvError::Unknown(m) => m,
        }
    }

    /// True for `CacheExhausted`, the one error an engine handles by
    /// preempting or evicting and retrying.
    pub fn is_cache_exhausted(&self) -> bool {
        matches!(self, KvError::CacheExhausted(_))
    }
}

impl fmt::Display for KvError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.status_name(), self.message())
    }
}

impl std::error::Error for KvError {}

/// This thread's last error message (`kvport_last_error`).
pub(crate) fn last_error_message() -> String {
    // SAFETY: never null; valid until the next failing call of this thread,
    // and we copy it right away.
    unsafe { CStr::from_ptr(ffi::kvport_last_error()) }
        .to_string_lossy()
        .into_owned()
}

/// `Ok(())` for `KVPORT_OK`, else the error with this thread's last message
/// (read at once, on the thread that made the call).
pub(crate) fn check(status: ffi::kvport_status) -> Result<(), KvError> {
    match KvError::from_status(status, String::new()) {
        None => Ok(()),
        Some(_) => Err(KvError::from_status(status, last_error_message()).unwrap()),
    }
}

/// For calls that cannot fail on a live handle (counts of a cache this
/// crate owns): a failure is a bug in kvport or this crate.
pub(crate) fn expect_ok(status: ffi::kvport_status, what: &str) {
    if let Err(e) = check(status) {
        panic!("kvport: {} failed on a live handle: {}", what, e);
    }
}
