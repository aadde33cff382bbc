//! aclnn operators (`libopapi.so` and friends) and the executor destructor (`libnnopbase.so`),
//! loaded at run time. Signatures from `csrc/include/ascend/aclnn.h` (abi-and-apis.md §6).
//!
//! Symbols are looked up in op-plugin's order (`GetOpApiFuncAddr`): a custom `libcust_opapi.so`,
//! the `libopapi_*.so` files under `$ASCEND_HOME_PATH/lib64`, `libopapi.so`, then the feature
//! libraries. Every operator is called with the two-phase protocol: `…GetWorkspaceSize`, a
//! workspace of that size from the caller's allocator, then the launch on the caller's stream,
//! with a new executor for every launch. Tensor descriptors and lists are destroyed after the
//! launch (a list owns its tensors); an executor that is never launched is destroyed.

use std::ffi::{c_int, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

use super::acl::{ACL_FORMAT_ND, AclrtStream, ascend_lib_dirs};
use super::{LibrarySpec, Loaded, load};
use crate::error::{Error, ErrorKind, Result};

pub type AclnnStatus = c_int;
type Tensor = *mut c_void;
type List = *mut c_void;
type Executor = *mut c_void;

static CUSTOM_SPEC: LibrarySpec = LibrarySpec {
    what: "Custom aclnn operators (libcust_opapi.so)",
    env_var: "FSDPTURBO_CUST_OPAPI_PATH",
    file_names: &["libcust_opapi.so"],
    extra_dirs: ascend_lib_dirs,
};

pub static OPAPI_SPEC: LibrarySpec = LibrarySpec {
    what: "aclnn operators (libopapi.so)",
    env_var: "FSDPTURBO_OPAPI_PATH",
    file_names: &["libopapi.so"],
    extra_dirs: ascend_lib_dirs,
};

static FEATURE_SPEC: LibrarySpec = LibrarySpec {
    what: "aclnn feature libraries",
    env_var: "FSDPTURBO_ACLNN_FEATURE_PATH",
    file_names: &[
        "libaclnn_ops_infer.so",
        "libaclnn_ops_train.so",
        "libaclnn_math.so",
        "libaclnn_sparse.so",
        "libaclnn_fft.so",
        "libaclnn_rand.so",
    ],
    extra_dirs: ascend_lib_dirs,
};

pub static NNOPBASE_SPEC: LibrarySpec = LibrarySpec {
    what: "The aclnn executor library (libnnopbase.so)",
    env_var: "FSDPTURBO_NNOPBASE_PATH",
    file_names: &["libnnopbase.so"],
    extra_dirs: ascend_lib_dirs,
};

/// The `libopapi_*.so` files under `$ASCEND_HOME_PATH/lib64`, sorted by name.
fn vendor_opapi_files() -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = ascend_lib_dirs()
        .iter()
        .filter_map(|dir| std::fs::read_dir(dir).ok())
        .flat_map(|entries| entries.filter_map(|e| e.ok().map(|e| e.path())))
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("libopapi_") && n.ends_with(".so"))
        })
        .collect();
    files.sort();
    files
}

type CreateTensor = unsafe extern "C" fn(
    *const i64,
    u64,
    c_int,
    *const i64,
    i64,
    c_int,
    *const i64,
    u64,
    *mut c_void,
) -> Tensor;
type Launch = unsafe extern "C" fn(*mut c_void, u64, Executor, AclrtStream) -> AclnnStatus;
type Gmm4 = unsafe extern "C" fn(
    List,
    List,
    List,
    List,
    List,
    List,
    List,
    List,
    Tensor,
    List,
    List,
    List,
    i64,
    i64,
    i64,
    i64,
    List,
    List,
    List,
    *mut u64,
    *mut Executor,
) -> AclnnStatus;
type Gmm5 = unsafe extern "C" fn(
    List,
    List,
    List,
    List,
    List,
    List,
    List,
    List,
    Tensor,
    List,
    List,
    List,
    i64,
    i64,
    i64,
    i64,
    *mut c_void,
    List,
    List,
    List,
    *mut u64,
    *mut Executor,
) -> AclnnStatus;

/// The grouped-matmul entry points found: V5 preferred, V4 otherwise (op-plugin's probe).
#[derive(Clone, Copy)]
pub enum GroupedMatmul {
    V5(Gmm5, Launch),
    V4(Gmm4, Launch),
}

impl GroupedMatmul {
    pub fn version(&self) -> u32 {
        match self {
            GroupedMatmul::V5(..) => 5,
            GroupedMatmul::V4(..) => 4,
        }
    }
}

pub struct Aclnn {
    pub create_tensor: CreateTensor,
    pub destroy_tensor: unsafe extern "C" fn(Tensor) -> c_int,
    pub create_tensor_list: unsafe extern "C" fn(*const Tensor, u64) -> List,
    pub destroy_tensor_list: unsafe extern "C" fn(List) -> c_int,
    pub grouped_matmul: GroupedMatmul,
    pub destroy_executor: unsafe extern "C" fn(Executor) -> AclnnStatus,
    /// The libraries searched, in op-plugin's order, then libnnopbase.
    pub libs: Vec<Loaded>,
}

/// `name` from the first library (in search order) that has it.
unsafe fn find<T: Copy>(libs: &[Loaded], name: &str) -> Option<T> {
    libs.iter().find_map(|lib| unsafe { lib.optional::<T>(name) })
}

/// An operator's two phases from the first library that has both `…GetWorkspaceSize` and the
/// launch (op-plugin's availability check).
unsafe fn find_op<W: Copy>(libs: &[Loaded], op: &str) -> Option<(W, Launch)> {
    libs.iter().find_map(|lib| unsafe {
        Some((lib.optional::<W>(&format!("{op}GetWorkspaceSize"))?, lib.optional::<Launch>(op)?))
    })
}

impl Aclnn {
    /// Loads the operator libraries and libnnopbase and resolves every symbol (not cached).
    pub fn load() -> Result<Aclnn> {
        let mut libs = Vec::new();
        libs.extend(load(&CUSTOM_SPEC).ok());
        for file in vendor_opapi_files() {
            let name: &'static str = Box::leak(file.to_string_lossy().into_owned().into_boxed_str());
            let spec = LibrarySpec {
                what: "aclnn operators",
                env_var: "FSDPTURBO_VENDOR_OPAPI_PATH",
                file_names: Box::leak(Box::new([name])),
                extra_dirs: LibrarySpec::no_extra_dirs,
            };
            libs.extend(load(&spec).ok());
        }
        let main = load(&OPAPI_SPEC);
        let main_error = main.as_ref().err().cloned();
        libs.extend(main.ok());
        libs.extend(load(&FEATURE_SPEC).ok());
        if libs.is_empty() {
            return Err(main_error.expect("libopapi failed when nothing was loaded"));
        }
        let nnopbase = load(&NNOPBASE_SPEC)?;
        let missing = |symbol: &str| {
            Error::new(
                ErrorKind::Unavailable,
                format!(
                    "no aclnn library has `{symbol}`; searched {}",
                    libs.iter().map(|l| l.path().display().to_string()).collect::<Vec<_>>().join(", ")
                ),
            )
        };
        // SAFETY: the types are aclnn.h's (csrc/include/ascend/aclnn.h).
        unsafe {
            let create_tensor = find(&libs, "aclCreateTensor").ok_or_else(|| missing("aclCreateTensor"))?;
            let destroy_tensor =
                find(&libs, "aclDestroyTensor").ok_or_else(|| missing("aclDestroyTensor"))?;
            let create_tensor_list =
                find(&libs, "aclCreateTensorList").ok_or_else(|| missing("aclCreateTensorList"))?;
            let destroy_tensor_list =
                find(&libs, "aclDestroyTensorList").ok_or_else(|| missing("aclDestroyTensorList"))?;
            let grouped_matmul = match find_op::<Gmm5>(&libs, "aclnnGroupedMatmulV5") {
                Some((ws, launch)) => GroupedMatmul::V5(ws, launch),
                None => {
                    let (ws, launch) = find_op::<Gmm4>(&libs, "aclnnGroupedMatmulV4")
                        .ok_or_else(|| missing("aclnnGroupedMatmulV5 or aclnnGroupedMatmulV4"))?;
                    GroupedMatmul::V4(ws, launch)
                }
            };
            let destroy_executor = nnopbase.required("aclDestroyAclOpExecutor")?;
            libs.push(nnopbase);
            Ok(Aclnn {
                create_tensor,
                destroy_tensor,
                create_tensor_list,
                destroy_tensor_list,
                grouped_matmul,
                destroy_executor,
                libs,
            })
        }
    }

    /// The process's aclnn libraries, loaded once.
    pub fn get() -> Result<&'static Aclnn> {
        static ACLNN: OnceLock<Result<Aclnn>> = OnceLock::new();
        ACLNN.get_or_init(Aclnn::load).as_ref().map_err(Clone::clone)
    }
}

/// A strided view of device memory, as `aclCreateTensor` takes it: strides and offset in
/// elements from `storage` (the allocation's start), which holds `storage_len` elements.
pub struct View<'a> {
    pub dtype: c_int,
    pub dims: &'a [i64],
    pub strides: &'a [i64],
    pub offset: i64,
    pub storage_len: i64,
    pub storage: *mut c_void,
}

/// One descriptor, destroyed on drop unless a list took it.
struct OwnedTensor<'a>(Tensor, &'a Aclnn);

impl Drop for OwnedTensor<'_> {
    fn drop(&mut self) {
        // SAFETY: made by aclCreateTensor, not owned by a list, destroyed once.
        unsafe { (self.1.destroy_tensor)(self.0) };
    }
}

struct OwnedList<'a>(List, &'a Aclnn);

impl Drop for OwnedList<'_> {
    fn drop(&mut self) {
        // SAFETY: made by aclCreateTensorList; destroys its tensors too.
        unsafe { (self.1.destroy_tensor_list)(self.0) };
    }
}

/// An executor between its two phases: destroyed unless launched (a launch releases it).
struct PendingExecutor<'a>(Executor, &'a Aclnn);

impl PendingExecutor<'_> {
    fn take(self) -> Executor {
        let executor = self.0;
        std::mem::forget(self);
        executor
    }
}

impl Drop for PendingExecutor<'_> {
    fn drop(&mut self) {
        // SAFETY: returned by GetWorkspaceSize and never launched.
        unsafe { (self.1.destroy_executor)(self.0) };
    }
}

fn status(code: AclnnStatus, call: &str) -> Result<()> {
    match code {
        0 => Ok(()),
        161001 => Err(Error::invalid(format!("{call} failed: ACLNN_ERR_PARAM_NULLPTR (161001)"))),
        161002 => Err(Error::invalid(format!("{call} failed: ACLNN_ERR_PARAM_INVALID (161002)"))),
        other => Err(Error::new(ErrorKind::Unavailable, format!("{call} failed with aclnn status {other}"))),
    }
}

/// Where an operator gets its device workspace: a buffer of the given bytes that stays valid
/// for work queued on the launch stream (torch's caching allocator gives exactly that).
pub type Workspace<'w> = &'w mut dyn FnMut(u64) -> Result<*mut c_void>;

impl Aclnn {
    fn tensor(&self, view: &View) -> Result<OwnedTensor<'_>> {
        if view.dims.len() != view.strides.len() {
            return Err(Error::invalid(format!(
                "aclCreateTensor: {} dims but {} strides",
                view.dims.len(),
                view.strides.len()
            )));
        }
        let storage = [view.storage_len];
        // SAFETY: arrays of the stated lengths; offset (5th) and format (6th) in this order.
        let t = unsafe {
            (self.create_tensor)(
                view.dims.as_ptr(),
                view.dims.len() as u64,
                view.dtype,
                view.strides.as_ptr(),
                view.offset,
                ACL_FORMAT_ND,
                storage.as_ptr(),
                1,
                view.storage,
            )
        };
        if t.is_null() {
            return Err(Error::invalid(format!(
                "aclCreateTensor refused a view (dtype {}, dims {:?}, strides {:?}, offset {})",
                view.dtype, view.dims, view.strides, view.offset
            )));
        }
        Ok(OwnedTensor(t, self))
    }

    fn list(&self, view: &View) -> Result<OwnedList<'_>> {
        let tensor = self.tensor(view)?;
        // SAFETY: one live tensor; on success the list owns it.
        let list = unsafe { (self.create_tensor_list)(&tensor.0, 1) };
        if list.is_null() {
            return Err(Error::invalid("aclCreateTensorList refused a list of one tensor"));
        }
        std::mem::forget(tensor);
        Ok(OwnedList(list, self))
    }

    /// Grouped matmul with per-group counts (`groupListType` 1), no bias, no activation.
    /// `group_type` 0 splits the rows of `x` ([M,K] × weight [G,K,N] → out [M,N], `split_item`
    /// 2); `group_type` 2 splits K (x [M,K] × weight [K,N] → out [G,M,N], `split_item` 3).
    ///
    /// # Safety
    /// The views describe live device memory of their dtypes; `stream` is a live stream.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn grouped_matmul(
        &self,
        x: &View,
        weight: &View,
        group_list: &View,
        out: &View,
        split_item: i64,
        group_type: i64,
        workspace: Workspace,
        stream: AclrtStream,
    ) -> Result<()> {
        let xs = self.list(x)?;
        let ws = self.list(weight)?;
        let groups = self.tensor(group_list)?;
        let outs = self.list(out)?;
        let null = std::ptr::null_mut();
        let mut bytes = 0u64;
        let mut executor: Executor = null;
        let (call, launch) = match self.grouped_matmul {
            // SAFETY: V4/V5 signatures; optional inputs NULL; groupListType 1, actType NONE.
            GroupedMatmul::V5(get, launch) => unsafe {
                let code = get(
                    xs.0,
                    ws.0,
                    null,
                    null,
                    null,
                    null,
                    null,
                    null,
                    groups.0,
                    null,
                    null,
                    null,
                    split_item,
                    group_type,
                    1,
                    0,
                    null,
                    outs.0,
                    null,
                    null,
                    &mut bytes,
                    &mut executor,
                );
                (status(code, "aclnnGroupedMatmulV5GetWorkspaceSize"), (launch, "aclnnGroupedMatmulV5"))
            },
            GroupedMatmul::V4(get, launch) => unsafe {
                let code = get(
                    xs.0,
                    ws.0,
                    null,
                    null,
                    null,
                    null,
                    null,
                    null,
                    groups.0,
                    null,
                    null,
                    null,
                    split_item,
                    group_type,
                    1,
                    0,
                    outs.0,
                    null,
                    null,
                    &mut bytes,
                    &mut executor,
                );
                (status(code, "aclnnGroupedMatmulV4GetWorkspaceSize"), (launch, "aclnnGroupedMatmulV4"))
            },
        };
        call?;
        let pending = PendingExecutor(executor, self);
        let buffer = if bytes > 0 { workspace(bytes)? } else { null };
        // SAFETY: the executor from this GetWorkspaceSize, its workspace size, launched once.
        status(unsafe { (launch.0)(buffer, bytes, pending.take(), stream) }, launch.1)
    }
}
