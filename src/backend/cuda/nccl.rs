//! NCCL (`libnccl.so.2`), loaded at run time. Declarations hand-written from NVIDIA/nccl
//! `src/nccl.h.in`: `ncclUniqueId` is a 128-byte struct passed
//! by value, streams are opaque pointers. `ncclAlltoAll` (2.28.3+) is optional; the all-to-all-v
//! uses grouped send/recv, which every NCCL since 2.7 has.

use std::ffi::{CStr, c_char, c_int, c_void};

use once_cell::sync::OnceCell;

use crate::backend::{LibrarySpec, Loaded, load};
use crate::error::{Error, ErrorKind, Result};

pub type NcclResult = c_int;
pub type NcclComm = *mut c_void;
pub type CudaStream = *mut c_void;

pub const NCCL_UNIQUE_ID_BYTES: usize = 128;

/// `ncclInProgress`: a call on a nonblocking communicator that has not finished yet.
pub const NCCL_IN_PROGRESS: NcclResult = 7;

/// The head of nccl.h's `ncclConfig_t` as NCCL 2.14 laid it out (the first version with a
/// config). NCCL copies `size` bytes of it over its defaults and treats the fields that a
/// struct of `version` lacks as unset, so later fields keep NCCL's defaults.
#[repr(C)]
pub struct NcclConfig {
    pub size: usize,
    pub magic: std::ffi::c_uint,
    pub version: std::ffi::c_uint,
    pub blocking: c_int,
    pub cga_cluster_size: c_int,
}

impl NcclConfig {
    /// A nonblocking communicator (its calls return `NCCL_IN_PROGRESS` until they finish, which
    /// `ncclCommGetAsyncError` reports), everything else NCCL's default.
    pub fn nonblocking() -> NcclConfig {
        const NCCL_CONFIG_UNDEF_INT: c_int = c_int::MIN;
        NcclConfig {
            size: std::mem::size_of::<NcclConfig>(),
            magic: 0xcafe_beef,
            version: 21400,
            blocking: 0,
            cga_cluster_size: NCCL_CONFIG_UNDEF_INT,
        }
    }
}

#[repr(C)]
#[derive(Clone, Copy)]
pub struct NcclUniqueId {
    pub internal: [c_char; NCCL_UNIQUE_ID_BYTES],
}

/// `ncclDataType_t` values.
pub const NCCL_UINT8: c_int = 1;
pub const NCCL_INT32: c_int = 2;
pub const NCCL_INT64: c_int = 4;
pub const NCCL_FLOAT16: c_int = 6;
pub const NCCL_FLOAT32: c_int = 7;
pub const NCCL_FLOAT64: c_int = 8;
pub const NCCL_BFLOAT16: c_int = 9;

/// `ncclRedOp_t` values.
pub const NCCL_SUM: c_int = 0;
pub const NCCL_PROD: c_int = 1;
pub const NCCL_MAX: c_int = 2;
pub const NCCL_MIN: c_int = 3;

pub static SPEC: LibrarySpec = LibrarySpec {
    what: "NCCL",
    env_var: "FSDPTURBO_NCCL_PATH",
    file_names: &["libnccl.so.2", "libnccl.so"],
    extra_dirs: LibrarySpec::no_extra_dirs,
};

type Coll =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, c_int, NcclComm, CudaStream) -> NcclResult;
type P2p = unsafe extern "C" fn(*const c_void, usize, c_int, c_int, NcclComm, CudaStream) -> NcclResult;
type Recv = unsafe extern "C" fn(*mut c_void, usize, c_int, c_int, NcclComm, CudaStream) -> NcclResult;
type Gather =
    unsafe extern "C" fn(*const c_void, *mut c_void, usize, c_int, NcclComm, CudaStream) -> NcclResult;

/// What a nonblocking communicator needs (NCCL 2.14 and later): without it communicators
/// block and have no deadline.
pub struct NcclNonblocking {
    pub comm_init_rank_config:
        unsafe extern "C" fn(*mut NcclComm, c_int, NcclUniqueId, c_int, *mut NcclConfig) -> NcclResult,
    pub comm_get_async_error: unsafe extern "C" fn(NcclComm, *mut NcclResult) -> NcclResult,
    pub comm_abort: unsafe extern "C" fn(NcclComm) -> NcclResult,
}

pub struct Nccl {
    lib: Loaded,
    pub get_error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    pub get_last_error: Option<unsafe extern "C" fn(NcclComm) -> *const c_char>,
    pub get_version: unsafe extern "C" fn(*mut c_int) -> NcclResult,
    pub get_unique_id: unsafe extern "C" fn(*mut NcclUniqueId) -> NcclResult,
    pub comm_init_rank: unsafe extern "C" fn(*mut NcclComm, c_int, NcclUniqueId, c_int) -> NcclResult,
    pub comm_destroy: unsafe extern "C" fn(NcclComm) -> NcclResult,
    pub all_reduce: Coll,
    pub reduce_scatter: Coll,
    pub all_gather: Gather,
    pub send: P2p,
    pub recv: Recv,
    pub group_start: unsafe extern "C" fn() -> NcclResult,
    pub group_end: unsafe extern "C" fn() -> NcclResult,
    /// Equal-count all-to-all, NCCL 2.28.3 and later.
    pub all_to_all: Option<Gather>,
    pub nonblocking: Option<NcclNonblocking>,
}

// SAFETY: function pointers into a library that is never unloaded; NCCL's API is thread-safe
// for distinct communicators.
unsafe impl Send for Nccl {}
unsafe impl Sync for Nccl {}

static NCCL: OnceCell<std::result::Result<Nccl, Error>> = OnceCell::new();

/// NCCL, loaded on first use.
pub fn nccl() -> Result<&'static Nccl> {
    NCCL.get_or_init(Nccl::load).as_ref().map_err(Clone::clone)
}

impl Nccl {
    fn load() -> Result<Nccl> {
        let lib = load(&SPEC)?;
        // SAFETY: each type is nccl.h's declaration of that symbol.
        unsafe {
            Ok(Nccl {
                get_error_string: lib.required("ncclGetErrorString")?,
                get_last_error: lib.optional("ncclGetLastError"),
                get_version: lib.required("ncclGetVersion")?,
                get_unique_id: lib.required("ncclGetUniqueId")?,
                comm_init_rank: lib.required("ncclCommInitRank")?,
                comm_destroy: lib.required("ncclCommDestroy")?,
                all_reduce: lib.required("ncclAllReduce")?,
                reduce_scatter: lib.required("ncclReduceScatter")?,
                all_gather: lib.required("ncclAllGather")?,
                send: lib.required("ncclSend")?,
                recv: lib.required("ncclRecv")?,
                group_start: lib.required("ncclGroupStart")?,
                group_end: lib.required("ncclGroupEnd")?,
                all_to_all: lib.optional("ncclAlltoAll"),
                nonblocking: (|| {
                    Some(NcclNonblocking {
                        comm_init_rank_config: lib.optional("ncclCommInitRankConfig")?,
                        comm_get_async_error: lib.optional("ncclCommGetAsyncError")?,
                        comm_abort: lib.optional("ncclCommAbort")?,
                    })
                })(),
                lib,
            })
        }
    }

    /// Where the library was loaded from.
    pub fn path(&self) -> &std::path::Path {
        self.lib.path()
    }

    /// Turns an NCCL status into an error with NCCL's text (and the communicator's last error).
    pub(crate) fn check(&self, status: NcclResult, call: &str, comm: NcclComm) -> Result<()> {
        if status == 0 {
            return Ok(());
        }
        // SAFETY: static strings from NCCL.
        let text = unsafe { CStr::from_ptr((self.get_error_string)(status)) }.to_string_lossy().into_owned();
        let detail = match self.get_last_error {
            // SAFETY: NULL is accepted (the thread's last error) and so is a live communicator.
            Some(f) => {
                let p = unsafe { f(comm) };
                if p.is_null() {
                    String::new()
                } else {
                    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
                }
            }
            None => String::new(),
        };
        let detail = if detail.is_empty() { String::new() } else { format!(": {detail}") };
        Err(Error::new(ErrorKind::Unavailable, format!("NCCL: {call} failed with {status} ({text}){detail}")))
    }

    /// The version code: X*10000 + Y*100 + Z (X*1000 + Y*100 + Z before 2.9).
    pub fn version(&self) -> Result<i32> {
        let mut v = 0;
        // SAFETY: writes one int.
        self.check(unsafe { (self.get_version)(&mut v) }, "ncclGetVersion", std::ptr::null_mut())?;
        Ok(v)
    }

    /// A fresh unique id (rank 0 makes it; the embedder broadcasts it to the other ranks).
    pub fn unique_id(&self) -> Result<NcclUniqueId> {
        let mut id = NcclUniqueId { internal: [0; NCCL_UNIQUE_ID_BYTES] };
        // SAFETY: writes one id.
        self.check(unsafe { (self.get_unique_id)(&mut id) }, "ncclGetUniqueId", std::ptr::null_mut())?;
        Ok(id)
    }
}

/// "2.30.7" from a version code.
pub fn version_string(code: i32) -> String {
    if code >= 20900 {
        format!("{}.{}.{}", code / 10000, (code % 10000) / 100, code % 100)
    } else {
        format!("{}.{}.{}", code / 1000, (code % 1000) / 100, code % 100)
    }
}
