//! Test hooks: entry points that exist so tests (tests/c, the Python suite) can reach states no
//! production call should produce. In the internal header only.

use std::ffi::c_void;

use crate::backend::ascend::acl::{self, Acl};
use crate::backend::ascend::aclnn::Aclnn;
use crate::backend::ascend::hccl::Hccl;
use crate::ffi::error::FfiError;
use crate::ffi::handle::write_out;
use crate::ffi::panic::boundary;
use crate::ffi::status::FSDPTURBO_ERR_UNAVAILABLE;

/// Provokes a panic inside the boundary, so embedders and tests can check that panics come
/// back as FSDPTURBO_ERR_PANIC with a message rather than aborting the process.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_debug_panic() -> i32 {
    boundary(|| panic!("fsdpturbo_debug_panic was called"))
}

/// Test mode only: succeeds only when libascendcl, libhccl, libopapi and libnnopbase are all
/// fsdpturbo's C test doubles (tests/doubles; they export a marker no CANN library has), and
/// then makes a stream of the double's runtime. With real CANN libraries it always fails, so
/// the op library's switch onto the doubles cannot be thrown in production.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_ascend_test_double_stream(out: *mut *mut c_void) -> i32 {
    boundary(|| {
        let acl = Acl::get()?;
        let libs =
            std::iter::once(&acl.lib).chain(std::iter::once(&Hccl::get()?.lib)).chain(&Aclnn::get()?.libs);
        if let Some(real) = libs.into_iter().find(|lib| !acl::is_test_double(lib)) {
            return Err(FfiError::new(
                FSDPTURBO_ERR_UNAVAILABLE,
                format!(
                    "{} is not fsdpturbo's Ascend test double: test mode is refused",
                    real.path().display()
                ),
            ));
        }
        let mut stream = std::ptr::null_mut();
        // SAFETY: an out-pointer for the new stream.
        acl::check(unsafe { (acl.create_stream)(&mut stream) }, "aclrtCreateStream")?;
        write_out(out, "out", stream)
    })
}
