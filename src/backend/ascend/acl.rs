//! The ACL runtime (`libascendcl.so`), loaded at run time: streams only. libfsdpturbo never calls
//! `aclInit`/`aclFinalize` (and does not even resolve them): torch_npu owns the runtime and
//! tolerates no second owner (torch_npu's own docs). Signatures from `third_party/vendor-headers/ascend/acl.h`.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

use crate::backend::{LibrarySpec, Loaded, load};
use crate::dtype::Dtype;
use crate::error::{Error, ErrorKind, Result};

pub type AclError = c_int;
pub type AclrtStream = *mut c_void;
pub const ACL_SUCCESS: AclError = 0;

/// `aclDataType` values used here (acl_base.h).
pub const ACL_FLOAT: c_int = 0;
pub const ACL_FLOAT16: c_int = 1;
pub const ACL_INT32: c_int = 3;
pub const ACL_UINT8: c_int = 4;
pub const ACL_INT64: c_int = 9;
pub const ACL_DOUBLE: c_int = 11;
pub const ACL_BF16: c_int = 27;
/// `aclFormat` ND.
pub const ACL_FORMAT_ND: c_int = 2;

/// The `aclDataType` of an element type.
pub fn acl_dtype(dtype: Dtype) -> c_int {
    match dtype {
        Dtype::F32 => ACL_FLOAT,
        Dtype::F64 => ACL_DOUBLE,
        Dtype::F16 => ACL_FLOAT16,
        Dtype::Bf16 => ACL_BF16,
        Dtype::U8 => ACL_UINT8,
        Dtype::I32 => ACL_INT32,
        Dtype::I64 => ACL_INT64,
    }
}

/// The CANN libraries live in `$ASCEND_HOME_PATH/lib64` (set by CANN's `set_env.sh`).
pub fn ascend_lib_dirs() -> Vec<PathBuf> {
    std::env::var_os("ASCEND_HOME_PATH")
        .filter(|v| !v.is_empty())
        .map(|home| vec![PathBuf::from(home).join("lib64")])
        .unwrap_or_default()
}

pub static SPEC: LibrarySpec = LibrarySpec {
    what: "The Ascend ACL runtime (libascendcl.so)",
    env_var: "FSDPTURBO_ACL_PATH",
    file_names: &["libascendcl.so"],
    extra_dirs: ascend_lib_dirs,
};

/// The marker only fsdpturbo's C test doubles export (tests/doubles); never a CANN library.
pub fn is_test_double(lib: &Loaded) -> bool {
    type Marker = unsafe extern "C" fn() -> *const c_char;
    // SAFETY: the doubles define it with this type; CANN libraries do not define it at all.
    match unsafe { lib.optional::<Marker>("fsdpturbo_test_double_marker") } {
        Some(marker) => unsafe { CStr::from_ptr(marker()) }.to_bytes() == b"fsdpturbo-ascend-test-double",
        None => false,
    }
}

pub struct Acl {
    pub get_device: unsafe extern "C" fn(*mut i32) -> AclError,
    pub create_stream: unsafe extern "C" fn(*mut AclrtStream) -> AclError,
    pub destroy_stream: unsafe extern "C" fn(AclrtStream) -> AclError,
    pub synchronize_stream: unsafe extern "C" fn(AclrtStream) -> AclError,
    pub lib: Loaded,
}

impl Acl {
    /// Loads the library and resolves every symbol (not cached; see [`Acl::get`]).
    pub fn load() -> Result<Acl> {
        let lib = load(&SPEC)?;
        // SAFETY: the types are acl_rt.h's (third_party/vendor-headers/ascend/acl.h).
        unsafe {
            Ok(Acl {
                get_device: lib.required("aclrtGetDevice")?,
                create_stream: lib.required("aclrtCreateStream")?,
                destroy_stream: lib.required("aclrtDestroyStream")?,
                synchronize_stream: lib.required("aclrtSynchronizeStream")?,
                lib,
            })
        }
    }

    /// The process's ACL runtime, loaded once.
    pub fn get() -> Result<&'static Acl> {
        static ACL: OnceLock<Result<Acl>> = OnceLock::new();
        ACL.get_or_init(Acl::load).as_ref().map_err(Clone::clone)
    }
}

/// An error for a failed ACL call.
pub fn check(status: AclError, call: &str) -> Result<()> {
    if status == ACL_SUCCESS {
        return Ok(());
    }
    Err(Error::new(ErrorKind::Unavailable, format!("{call} failed with aclError {status}")))
}
