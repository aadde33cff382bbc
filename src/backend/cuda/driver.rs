//! The CUDA driver API (`libcuda.so.1`), loaded at run time: contexts, modules, launches and the
//! few copies the launchers need. Declarations are hand-written from the driver API reference
//! (`cuda.h`; the `_v2` names are the ones the header's macros select). The caller (torch, or a
//! C++ trainer) owns devices, memory and streams; this file only borrows them.

use std::collections::HashMap;
use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};

use once_cell::sync::OnceCell;
use parking_lot::Mutex;

use crate::backend::Stream;
use crate::backend::{LibrarySpec, Loaded, load};
use crate::error::{Error, ErrorKind, Result};

pub type CUresult = c_int;
pub type CUdevice = c_int;
pub type CUcontext = *mut c_void;
pub type CUmodule = *mut c_void;
pub type CUfunction = *mut c_void;
pub type CUstream = *mut c_void;
pub type CUdeviceptr = u64;

const CUDA_SUCCESS: CUresult = 0;
const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR: c_int = 75;
const CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR: c_int = 76;

pub static SPEC: LibrarySpec = LibrarySpec {
    what: "The CUDA driver (libcuda)",
    env_var: "FSDPTURBO_CUDA_PATH",
    file_names: &["libcuda.so.1", "libcuda.so"],
    extra_dirs: LibrarySpec::no_extra_dirs,
};

/// The driver functions libfsdpturbo calls.
pub struct Driver {
    lib: Loaded,
    get_error_string: unsafe extern "C" fn(CUresult, *mut *const c_char) -> CUresult,
    pub driver_get_version: unsafe extern "C" fn(*mut c_int) -> CUresult,
    device_get: unsafe extern "C" fn(*mut CUdevice, c_int) -> CUresult,
    device_get_attribute: unsafe extern "C" fn(*mut c_int, c_int, CUdevice) -> CUresult,
    primary_ctx_retain: unsafe extern "C" fn(*mut CUcontext, CUdevice) -> CUresult,
    ctx_get_current: unsafe extern "C" fn(*mut CUcontext) -> CUresult,
    ctx_set_current: unsafe extern "C" fn(CUcontext) -> CUresult,
    ctx_get_device: unsafe extern "C" fn(*mut CUdevice) -> CUresult,
    module_load_data: unsafe extern "C" fn(*mut CUmodule, *const c_void) -> CUresult,
    module_get_function: unsafe extern "C" fn(*mut CUfunction, CUmodule, *const c_char) -> CUresult,
    #[allow(clippy::type_complexity)]
    launch_kernel: unsafe extern "C" fn(
        CUfunction,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        c_uint,
        CUstream,
        *mut *mut c_void,
        *mut *mut c_void,
    ) -> CUresult,
    memcpy_dtoh_async: unsafe extern "C" fn(*mut c_void, CUdeviceptr, usize, CUstream) -> CUresult,
    memcpy_htod_async: unsafe extern "C" fn(CUdeviceptr, *const c_void, usize, CUstream) -> CUresult,
    memset_d8_async: unsafe extern "C" fn(CUdeviceptr, u8, usize, CUstream) -> CUresult,
    stream_synchronize: unsafe extern "C" fn(CUstream) -> CUresult,
    stream_query: unsafe extern "C" fn(CUstream) -> CUresult,
    mem_alloc: unsafe extern "C" fn(*mut CUdeviceptr, usize) -> CUresult,
    mem_free: unsafe extern "C" fn(CUdeviceptr) -> CUresult,
    /// Primary contexts retained by this library, per device ordinal (never released: the
    /// driver owns them for the process, as torch's do).
    contexts: Mutex<HashMap<CUdevice, usize>>,
}

// SAFETY: function pointers into a library that is never unloaded; the context map is locked.
unsafe impl Send for Driver {}
unsafe impl Sync for Driver {}

static DRIVER: OnceCell<std::result::Result<Driver, Error>> = OnceCell::new();

/// The driver, loaded and initialised on first use.
pub fn driver() -> Result<&'static Driver> {
    DRIVER.get_or_init(Driver::load).as_ref().map_err(Clone::clone)
}

impl Driver {
    fn load() -> Result<Driver> {
        let lib = load(&SPEC)?;
        // SAFETY: each type is the driver API's declaration of that symbol.
        let driver = unsafe {
            Driver {
                get_error_string: lib.required("cuGetErrorString")?,
                driver_get_version: lib.required("cuDriverGetVersion")?,
                device_get: lib.required("cuDeviceGet")?,
                device_get_attribute: lib.required("cuDeviceGetAttribute")?,
                primary_ctx_retain: lib.required("cuDevicePrimaryCtxRetain")?,
                ctx_get_current: lib.required("cuCtxGetCurrent")?,
                ctx_set_current: lib.required("cuCtxSetCurrent")?,
                ctx_get_device: lib.required("cuCtxGetDevice")?,
                module_load_data: lib.required("cuModuleLoadData")?,
                module_get_function: lib.required("cuModuleGetFunction")?,
                launch_kernel: lib.required("cuLaunchKernel")?,
                memcpy_dtoh_async: lib.required("cuMemcpyDtoHAsync_v2")?,
                memcpy_htod_async: lib.required("cuMemcpyHtoDAsync_v2")?,
                memset_d8_async: lib.required("cuMemsetD8Async")?,
                stream_synchronize: lib.required("cuStreamSynchronize")?,
                stream_query: lib.required("cuStreamQuery")?,
                mem_alloc: lib.required("cuMemAlloc_v2")?,
                mem_free: lib.required("cuMemFree_v2")?,
                contexts: Mutex::new(HashMap::new()),
                lib,
            }
        };
        // SAFETY: cuInit(0) is the documented first call; it is idempotent.
        let init: unsafe extern "C" fn(c_uint) -> CUresult = unsafe { driver.lib.required("cuInit")? };
        driver.check(unsafe { init(0) }, "cuInit")?;
        Ok(driver)
    }

    /// Turns a driver status into an error naming the call and the driver's own text.
    pub fn check(&self, status: CUresult, call: &str) -> Result<()> {
        if status == CUDA_SUCCESS {
            return Ok(());
        }
        let mut text: *const c_char = std::ptr::null();
        // SAFETY: the driver writes a pointer to a static string (or leaves NULL).
        unsafe { (self.get_error_string)(status, &mut text) };
        let text = if text.is_null() {
            "unknown error".to_string()
        } else {
            // SAFETY: a NUL-terminated static string from the driver.
            unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
        };
        Err(Error::new(ErrorKind::Unavailable, format!("CUDA driver: {call} failed with {status} ({text})")))
    }

    /// The driver's CUDA version (e.g. 13000 for 13.0).
    pub fn version(&self) -> Result<i32> {
        let mut v = 0;
        // SAFETY: writes one int.
        self.check(unsafe { (self.driver_get_version)(&mut v) }, "cuDriverGetVersion")?;
        Ok(v)
    }

    /// Makes `device`'s primary context current on this thread unless it already is (torch makes
    /// it current on its own threads; autograd and C++ trainer threads may not have).
    pub fn use_device(&self, device: i32) -> Result<()> {
        let mut current: CUcontext = std::ptr::null_mut();
        // SAFETY: writes one handle.
        self.check(unsafe { (self.ctx_get_current)(&mut current) }, "cuCtxGetCurrent")?;
        if !current.is_null() {
            let mut on = -1;
            // SAFETY: writes one int; a context is current.
            self.check(unsafe { (self.ctx_get_device)(&mut on) }, "cuCtxGetDevice")?;
            if on == device {
                return Ok(());
            }
        }
        let ctx = {
            let mut contexts = self.contexts.lock();
            match contexts.get(&device) {
                Some(&ctx) => ctx as CUcontext,
                None => {
                    let mut dev: CUdevice = 0;
                    // SAFETY: writes one device handle.
                    self.check(unsafe { (self.device_get)(&mut dev, device) }, "cuDeviceGet")?;
                    let mut ctx: CUcontext = std::ptr::null_mut();
                    // SAFETY: writes one context handle.
                    self.check(
                        unsafe { (self.primary_ctx_retain)(&mut ctx, dev) },
                        "cuDevicePrimaryCtxRetain",
                    )?;
                    contexts.insert(device, ctx as usize);
                    ctx
                }
            }
        };
        // SAFETY: a primary context retained above.
        self.check(unsafe { (self.ctx_set_current)(ctx) }, "cuCtxSetCurrent")
    }

    /// Compute capability of `device` as major * 10 + minor (90 for an H100/H200).
    pub fn compute_capability(&self, device: i32) -> Result<u32> {
        let mut dev: CUdevice = 0;
        // SAFETY: writes one device handle.
        self.check(unsafe { (self.device_get)(&mut dev, device) }, "cuDeviceGet")?;
        let (mut major, mut minor) = (0, 0);
        // SAFETY: each call writes one int.
        unsafe {
            self.check(
                (self.device_get_attribute)(&mut major, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR, dev),
                "cuDeviceGetAttribute",
            )?;
            self.check(
                (self.device_get_attribute)(&mut minor, CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR, dev),
                "cuDeviceGetAttribute",
            )?;
        }
        Ok((major * 10 + minor) as u32)
    }

    /// Loads a cubin or PTX image into the current context and resolves `names`.
    pub fn load_module(&self, image: &[u8], names: &[&str]) -> Result<Vec<CUfunction>> {
        let mut bytes = image.to_vec();
        if bytes.last() != Some(&0) {
            bytes.push(0); // PTX must be NUL-terminated; a cubin ignores the byte.
        }
        let mut module: CUmodule = std::ptr::null_mut();
        // SAFETY: a complete image; the module lives as long as the process.
        self.check(
            unsafe { (self.module_load_data)(&mut module, bytes.as_ptr().cast()) },
            "cuModuleLoadData",
        )?;
        names
            .iter()
            .map(|name| {
                let c = CString::new(*name).expect("kernel names have no NUL");
                let mut f: CUfunction = std::ptr::null_mut();
                // SAFETY: a loaded module and a NUL-terminated name.
                self.check(
                    unsafe { (self.module_get_function)(&mut f, module, c.as_ptr()) },
                    &format!("cuModuleGetFunction({name})"),
                )?;
                Ok(f)
            })
            .collect()
    }

    /// Launches `f` on `stream` with a 1-D grid.
    ///
    /// # Safety
    /// `params` point to values of exactly the kernel's parameter types, in order.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn launch(
        &self,
        f: CUfunction,
        grid: u32,
        block: u32,
        shared_bytes: u32,
        stream: Stream,
        params: &mut [*mut c_void],
        name: &str,
    ) -> Result<()> {
        if grid == 0 {
            return Ok(());
        }
        // SAFETY: the caller vouches for the parameters.
        let status = unsafe {
            (self.launch_kernel)(
                f,
                grid,
                1,
                1,
                block,
                1,
                1,
                shared_bytes,
                stream.0,
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        };
        self.check(status, &format!("cuLaunchKernel({name})"))
    }

    /// Sets `bytes` bytes at `dst` to `value`, ordered on `stream`.
    pub fn memset(&self, dst: CUdeviceptr, value: u8, bytes: usize, stream: Stream) -> Result<()> {
        // SAFETY: the caller's device range.
        self.check(unsafe { (self.memset_d8_async)(dst, value, bytes, stream.0) }, "cuMemsetD8Async")
    }

    /// Copies device memory to `dst` after the work already on `stream`, and waits for it.
    pub fn read_back(&self, dst: &mut [u8], src: CUdeviceptr, stream: Stream) -> Result<()> {
        // SAFETY: `dst` is a writable host slice; `src` the caller's device range.
        self.check(
            unsafe { (self.memcpy_dtoh_async)(dst.as_mut_ptr().cast(), src, dst.len(), stream.0) },
            "cuMemcpyDtoHAsync",
        )?;
        // SAFETY: the caller's stream.
        self.check(unsafe { (self.stream_synchronize)(stream.0) }, "cuStreamSynchronize")
    }

    /// Waits for the work ordered on `stream` until `deadline`: true when it finished, false when
    /// the deadline passed first (the work may still run).
    pub fn wait_until(&self, stream: Stream, deadline: std::time::Instant) -> Result<bool> {
        const CUDA_ERROR_NOT_READY: CUresult = 600;
        loop {
            // SAFETY: the caller's stream.
            let status = unsafe { (self.stream_query)(stream.0) };
            if status != CUDA_ERROR_NOT_READY {
                return self.check(status, "cuStreamQuery").map(|()| true);
            }
            if std::time::Instant::now() >= deadline {
                return Ok(false);
            }
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }

    /// Copies host bytes to device memory, ordered on `stream`. The driver stages pageable memory
    /// before returning, so `src` may be dropped afterwards.
    pub fn write(&self, dst: CUdeviceptr, src: &[u8], stream: Stream) -> Result<()> {
        // SAFETY: `src` is a readable host slice; `dst` the caller's device range.
        self.check(
            unsafe { (self.memcpy_htod_async)(dst, src.as_ptr().cast(), src.len(), stream.0) },
            "cuMemcpyHtoDAsync",
        )
    }

    /// Device memory owned by the returned guard (small staging buffers only).
    pub fn alloc(&self, bytes: usize) -> Result<DeviceBuffer<'_>> {
        let mut ptr: CUdeviceptr = 0;
        // SAFETY: writes one device pointer.
        self.check(unsafe { (self.mem_alloc)(&mut ptr, bytes) }, "cuMemAlloc")?;
        Ok(DeviceBuffer { driver: self, ptr })
    }
}

/// A device allocation freed on drop.
pub struct DeviceBuffer<'a> {
    driver: &'a Driver,
    pub ptr: CUdeviceptr,
}

impl Drop for DeviceBuffer<'_> {
    fn drop(&mut self) {
        // SAFETY: allocated by cuMemAlloc and not freed before. A failure here cannot be
        // reported and leaves at worst a leak.
        unsafe { (self.driver.mem_free)(self.ptr) };
    }
}
