// SPDX-License-Identifier: Apache-2.0
//! `Backend` (a kvport backend by registry name), `GpuBackend` (the trait the
//! reference's `gpu: &dyn GpuBackend` parameters take), `Stream`, `DevicePtr`.

use std::ffi::{c_void, CStr, CString};
use std::os::raw::c_int;
use std::ptr;
use std::sync::Arc;

use crate::error::{check, expect_ok, KvError};
use crate::ffi;

struct BackendHandle {
    raw: *mut ffi::kvport_backend,
}

// SAFETY: the handle is a token looked up in a thread-safe table, and a
// kvport backend may be used from any thread (docs/backends.md: every call
// sets the device it needs). Caches and streams keep the handle alive.
unsafe impl Send for BackendHandle {}
unsafe impl Sync for BackendHandle {}

impl Drop for BackendHandle {
    fn drop(&mut self) {
        // Every cache and stream holds an Arc to this handle, so none is
        // alive here and destroy cannot report HANDLE_IN_USE.
        unsafe { ffi::kvport_backend_destroy(self.raw) };
    }
}

/// A kvport backend from the compiled registry: `"host"`, `"cuda"`, `"hip"`,
/// or `"default"` (`$KVPORT_BACKEND` when set, else the first GPU backend with
/// a device, else host).
///
/// Cloning is cheap and shares the backend; it is destroyed when the last
/// clone, cache and stream on it are dropped. `Send + Sync`.
#[derive(Clone)]
pub struct Backend {
    handle: Arc<BackendHandle>,
}

impl Backend {
    /// The backend called `name`. `InvalidArgument` for an unknown name (the
    /// message lists the compiled ones), `Backend` when it has no device.
    pub fn new(name: &str) -> Result<Backend, KvError> {
        let c = CString::new(name)
            .map_err(|_| KvError::InvalidArgument(format!("backend name {:?} has a NUL", name)))?;
        let mut raw = ptr::null_mut();
        check(unsafe { ffi::kvport_backend_create(c.as_ptr(), &mut raw) })?;
        Ok(Backend { handle: Arc::new(BackendHandle { raw }) })
    }

    /// The backend `name` on device ordinal `device` (not for "default").
    pub fn on_device(name: &str, device: i32) -> Result<Backend, KvError> {
        let c = CString::new(name)
            .map_err(|_| KvError::InvalidArgument(format!("backend name {:?} has a NUL", name)))?;
        let mut raw = ptr::null_mut();
        check(unsafe { ffi::kvport_backend_create_on(c.as_ptr(), device as c_int, &mut raw) })?;
        Ok(Backend { handle: Arc::new(BackendHandle { raw }) })
    }

    /// The host backend (always compiled in).
    pub fn host() -> Result<Backend, KvError> {
        Backend::new("host")
    }

    /// "host", "cuda", ...
    pub fn name(&self) -> String {
        let mut p = ptr::null();
        expect_ok(unsafe { ffi::kvport_backend_name(self.raw(), &mut p) }, "kvport_backend_name");
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    /// Devices the backend sees (host: 1).
    pub fn device_count(&self) -> Result<i32, KvError> {
        let mut n: c_int = 0;
        check(unsafe { ffi::kvport_backend_device_count(self.raw(), &mut n) })?;
        Ok(n as i32)
    }

    /// (free, total) bytes of the backend's device.
    pub fn mem_info(&self) -> Result<(usize, usize), KvError> {
        let (mut free, mut total) = (0usize, 0usize);
        check(unsafe { ffi::kvport_backend_mem_info(self.raw(), &mut free, &mut total) })?;
        Ok((free, total))
    }

    /// Waits for the backend's default stream (`stream` 0).
    pub fn synchronize(&self) -> Result<(), KvError> {
        check(unsafe { ffi::kvport_backend_synchronize(self.raw()) })
    }

    /// The C handle (valid while this backend lives).
    pub fn raw(&self) -> *mut ffi::kvport_backend {
        self.handle.raw
    }

    /// Whether two values are the same kvport backend.
    pub fn same_as(&self, other: &Backend) -> bool {
        Arc::ptr_eq(&self.handle, &other.handle)
    }
}

impl std::fmt::Debug for Backend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Backend").field("name", &self.name()).finish()
    }
}

/// What the reference's `gpu: &dyn GpuBackend` parameters take. kvport's
/// caches do their device work through the backend they were created on, so
/// the methods only check that `gpu` is that backend (`InvalidArgument`
/// otherwise); an engine's own backend type can implement this trait by
/// returning the kvport backend it wraps.
pub trait GpuBackend {
    fn kvport_backend(&self) -> &Backend;
}

impl GpuBackend for Backend {
    fn kvport_backend(&self) -> &Backend {
        self
    }
}

/// The default stream of a backend, as a `stream: u64` argument.
pub const DEFAULT_STREAM: u64 = 0;

impl Backend {
    /// The vendor handle of the backend's default stream (`cudaStream_t`; the
    /// host backend's queue).
    pub fn default_stream_vendor_handle(&self) -> Result<*mut c_void, KvError> {
        let mut out = ptr::null_mut();
        check(unsafe {
            ffi::kvport_stream_vendor_handle(self.raw(), ptr::null_mut(), &mut out)
        })?;
        Ok(out)
    }
}

/// An independent in-order work queue on a backend. Methods that take the
/// reference's `stream: u64` take [`Stream::as_raw`] (or [`DEFAULT_STREAM`],
/// 0); a value that is no live stream is `KvError::InvalidHandle`, a stream
/// of another backend `KvError::InvalidArgument` (kvport checks the token;
/// it never dereferences it). `Send`, not `Sync`.
pub struct Stream {
    raw: *mut ffi::kvport_stream,
    _backend: Backend,
    /// A registration of an engine's stream (Stream::wrap): dropping it
    /// never destroys the stream.
    wrapped: bool,
}

// SAFETY: a stream is a token in a thread-safe table; its worker (host) or
// vendor stream (GPU) does not belong to the creating thread.
unsafe impl Send for Stream {}

impl Stream {
    pub fn new(backend: &Backend) -> Result<Stream, KvError> {
        let mut raw = ptr::null_mut();
        check(unsafe { ffi::kvport_stream_create(backend.raw(), &mut raw) })?;
        Ok(Stream { raw, _backend: backend.clone(), wrapped: false })
    }

    /// The engine's own stream as a kvport stream: `vendor_stream` is a
    /// `cudaStream_t` / `hipStream_t` of the backend's device (null: the
    /// runtime's legacy default stream); on the host backend, the handle
    /// [`Stream::vendor_handle`] gave for one of its streams. Work queued
    /// through it is ordered with the engine's own on that stream. Dropping
    /// the value ends the registration; it never destroys the stream, which
    /// must outlive it. `InvalidArgument` for a handle the backend cannot wrap.
    pub fn wrap(backend: &Backend, vendor_stream: *mut c_void) -> Result<Stream, KvError> {
        let mut raw = ptr::null_mut();
        check(unsafe { ffi::kvport_stream_wrap(backend.raw(), vendor_stream, &mut raw) })?;
        Ok(Stream { raw, _backend: backend.clone(), wrapped: true })
    }

    /// The vendor handle of this stream (`cudaStream_t`; the host backend's
    /// queue), to launch the engine's kernels on it.
    pub fn vendor_handle(&self) -> Result<*mut c_void, KvError> {
        let mut out = ptr::null_mut();
        check(unsafe { ffi::kvport_stream_vendor_handle(self._backend.raw(), self.raw, &mut out) })?;
        Ok(out)
    }

    /// Whether this is a wrap of an engine's stream ([`Stream::wrap`]).
    pub fn is_wrapped(&self) -> bool {
        self.wrapped
    }

    /// Waits for the work queued on this stream; `KvError::Backend` for an
    /// asynchronous error since the last synchronize.
    pub fn synchronize(&self) -> Result<(), KvError> {
        check(unsafe { ffi::kvport_stream_synchronize(self.raw) })
    }

    /// The stream as the reference's `stream: u64` (never 0).
    pub fn as_raw(&self) -> u64 {
        self.raw as usize as u64
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.wrapped {
            // Forgets the registration: the engine's stream is its own.
            unsafe { ffi::kvport_stream_release(self.raw) };
        } else {
            // Waits for the queued work, then destroys.
            unsafe { ffi::kvport_stream_destroy(self.raw) };
        }
    }
}

/// A `stream: u64` argument as the C handle (0: null, the default stream).
pub(crate) fn stream_ptr(stream: u64) -> *mut ffi::kvport_stream {
    stream as usize as *mut ffi::kvport_stream
}

/// A device address of a cache's backend (host memory on the host backend),
/// as the reference's `DevicePtr`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct DevicePtr(pub u64);

impl DevicePtr {
    /// The address `bytes` further on.
    pub fn offset(self, bytes: usize) -> DevicePtr {
        DevicePtr(self.0 + bytes as u64)
    }
    pub fn as_raw(self) -> u64 {
        self.0
    }
    /// The address as a pointer (dereferenceable on the host only for the
    /// host backend).
    pub fn as_ptr(self) -> *mut c_void {
        self.0 as usize as *mut c_void
    }
    pub fn is_null(self) -> bool {
        self.0 == 0
    }
}

impl From<*mut c_void> for DevicePtr {
    fn from(p: *mut c_void) -> Self {
        DevicePtr(p as usize as u64)
    }
}
