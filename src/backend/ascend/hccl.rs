//! HCCL (`libhccl.so`), loaded at run time. Signatures from `third_party/vendor-headers/ascend/hccl.h`
//! (CANN's `hccl_types.h`, `hccl.h`): HCCL's own data-type and reduce-op numbering (not NCCL's; no
//! AVG), a 4108-byte root info, and the communicator out-pointer last.

use std::ffi::{CStr, c_char, c_int, c_void};
use std::sync::OnceLock;

use super::acl::{AclrtStream, ascend_lib_dirs};
use crate::backend::{LibrarySpec, Loaded, load};
use crate::error::{Error, ErrorKind, Result};

pub type HcclResult = c_int;
pub type HcclComm = *mut c_void;
pub const HCCL_SUCCESS: HcclResult = 0;
pub const HCCL_ROOT_INFO_BYTES: usize = 4108;
/// Bytes `HcclGetCommName` may write, NUL included.
pub const HCCL_COMM_NAME_BYTES: usize = 128;

/// `HcclRootInfo`: opaque bytes a root rank makes and every rank receives.
#[repr(C)]
pub struct HcclRootInfo {
    pub internal: [u8; HCCL_ROOT_INFO_BYTES],
}

/// `HcclDataType` values (hccl_types.h).
pub mod dtype {
    pub const INT32: i32 = 2;
    pub const FP16: i32 = 3;
    pub const FP32: i32 = 4;
    pub const INT64: i32 = 5;
    pub const UINT8: i32 = 7;
    pub const FP64: i32 = 10;
    pub const BFP16: i32 = 11;
}

/// `HcclReduceOp` values: there is no AVG.
pub mod reduce {
    pub const SUM: i32 = 0;
    pub const PROD: i32 = 1;
    pub const MAX: i32 = 2;
    pub const MIN: i32 = 3;
}

pub static SPEC: LibrarySpec = LibrarySpec {
    what: "HCCL (libhccl.so)",
    env_var: "FSDPTURBO_HCCL_PATH",
    file_names: &["libhccl.so"],
    extra_dirs: ascend_lib_dirs,
};

type Buf = *mut c_void;
type CBuf = *const c_void;

pub struct Hccl {
    pub get_root_info: unsafe extern "C" fn(*mut HcclRootInfo) -> HcclResult,
    pub comm_init_root_info: unsafe extern "C" fn(u32, *const HcclRootInfo, u32, *mut HcclComm) -> HcclResult,
    pub all_reduce: unsafe extern "C" fn(Buf, Buf, u64, c_int, c_int, HcclComm, AclrtStream) -> HcclResult,
    pub all_gather: unsafe extern "C" fn(Buf, Buf, u64, c_int, HcclComm, AclrtStream) -> HcclResult,
    pub reduce_scatter:
        unsafe extern "C" fn(Buf, Buf, u64, c_int, c_int, HcclComm, AclrtStream) -> HcclResult,
    #[allow(clippy::type_complexity)]
    pub all_to_all_v: unsafe extern "C" fn(
        CBuf,
        CBuf,
        CBuf,
        c_int,
        CBuf,
        CBuf,
        CBuf,
        c_int,
        HcclComm,
        AclrtStream,
    ) -> HcclResult,
    pub comm_destroy: unsafe extern "C" fn(HcclComm) -> HcclResult,
    pub get_error_string: unsafe extern "C" fn(HcclResult) -> *const c_char,
    /// `HcclGetCommName` (the name aclnn MC2 operators take); absent from old CANN releases.
    pub get_comm_name: Option<unsafe extern "C" fn(HcclComm, *mut c_char) -> HcclResult>,
    pub lib: Loaded,
}

impl Hccl {
    /// Loads the library and resolves every symbol (not cached; see [`Hccl::get`]).
    pub fn load() -> Result<Hccl> {
        let lib = load(&SPEC)?;
        // SAFETY: the types are hccl.h's (third_party/vendor-headers/ascend/hccl.h).
        unsafe {
            Ok(Hccl {
                get_root_info: lib.required("HcclGetRootInfo")?,
                comm_init_root_info: lib.required("HcclCommInitRootInfo")?,
                all_reduce: lib.required("HcclAllReduce")?,
                all_gather: lib.required("HcclAllGather")?,
                reduce_scatter: lib.required("HcclReduceScatter")?,
                all_to_all_v: lib.required("HcclAlltoAllV")?,
                comm_destroy: lib.required("HcclCommDestroy")?,
                get_error_string: lib.required("HcclGetErrorString")?,
                get_comm_name: lib.optional("HcclGetCommName"),
                lib,
            })
        }
    }

    /// The process's HCCL, loaded once.
    pub fn get() -> Result<&'static Hccl> {
        static HCCL: OnceLock<Result<Hccl>> = OnceLock::new();
        HCCL.get_or_init(Hccl::load).as_ref().map_err(Clone::clone)
    }

    /// An error carrying HCCL's own text for a failed call.
    pub fn check(&self, status: HcclResult, call: &str) -> Result<()> {
        if status == HCCL_SUCCESS {
            return Ok(());
        }
        // SAFETY: HcclGetErrorString returns a static string (or NULL).
        let text = unsafe { (self.get_error_string)(status) };
        let text = if text.is_null() {
            String::from("no description")
        } else {
            unsafe { CStr::from_ptr(text) }.to_string_lossy().into_owned()
        };
        Err(Error::new(ErrorKind::Unavailable, format!("{call} failed with HcclResult {status}: {text}")))
    }
}
