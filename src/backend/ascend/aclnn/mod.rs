//! aclnn operators (`libopapi.so` and friends) and the executor destructor (`libnnopbase.so`),
//! loaded at run time. Signatures from `third_party/vendor-headers/ascend/aclnn.h` (ops-transformer's op_api headers). This
//! module loads the libraries and owns the descriptors and the two-phase protocol; the operators
//! are in [`grouped_mm`], [`moe`] (token permute/unpermute) and [`mc2`] (all-to-all-v fused
//! with grouped matmul).
//!
//! Symbols are looked up in op-plugin's order (`GetOpApiFuncAddr`): a custom `libcust_opapi.so`,
//! the `libopapi_*.so` files under `$ASCEND_HOME_PATH/lib64`, `libopapi.so`, then the feature
//! libraries. Every operator is called with the two-phase protocol: `…GetWorkspaceSize`, a
//! workspace of that size from the caller's allocator, then the launch on the caller's stream,
//! with a new executor for every launch. Tensor descriptors and lists are destroyed after the
//! launch (a list owns its tensors); an executor that is never launched is destroyed.

mod grouped_mm;
pub mod mc2;
mod moe;

use std::ffi::{c_int, c_void};
use std::path::PathBuf;
use std::sync::OnceLock;

pub use grouped_mm::GroupedMatmul;

use super::acl::{ACL_FORMAT_ND, AclrtStream, ascend_lib_dirs};
use crate::backend::{LibrarySpec, Loaded, load};
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
type IntArray = *mut c_void;
pub struct Aclnn {
    pub create_tensor: CreateTensor,
    pub destroy_tensor: unsafe extern "C" fn(Tensor) -> c_int,
    pub create_tensor_list: unsafe extern "C" fn(*const Tensor, u64) -> List,
    pub destroy_tensor_list: unsafe extern "C" fn(List) -> c_int,
    pub create_int_array: Option<unsafe extern "C" fn(*const i64, u64) -> IntArray>,
    pub destroy_int_array: Option<unsafe extern "C" fn(IntArray) -> c_int>,
    pub grouped_mm: GroupedMatmul,
    pub token_permute: Option<(moe::Permute, Launch)>,
    pub token_unpermute: Option<(moe::Unpermute, Launch)>,
    pub alltoallv_grouped_mm: Option<(mc2::AlltoAllvGmm, Launch)>,
    pub grouped_mm_alltoallv: Option<(mc2::GmmAlltoAllv, Launch)>,
    pub destroy_executor: unsafe extern "C" fn(Executor) -> AclnnStatus,
    /// The libraries searched, in op-plugin's order, then libnnopbase.
    pub libs: Vec<Loaded>,
}

fn missing_symbol(libs: &[Loaded], symbol: &str) -> Error {
    Error::new(
        ErrorKind::Unavailable,
        format!(
            "no aclnn library has `{symbol}`; searched {}",
            libs.iter().map(|l| l.path().display().to_string()).collect::<Vec<_>>().join(", ")
        ),
    )
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
        let missing = |symbol: &str| missing_symbol(&libs, symbol);
        // SAFETY: the types are aclnn.h's (third_party/vendor-headers/ascend/aclnn.h).
        unsafe {
            let create_tensor = find(&libs, "aclCreateTensor").ok_or_else(|| missing("aclCreateTensor"))?;
            let destroy_tensor =
                find(&libs, "aclDestroyTensor").ok_or_else(|| missing("aclDestroyTensor"))?;
            let create_tensor_list =
                find(&libs, "aclCreateTensorList").ok_or_else(|| missing("aclCreateTensorList"))?;
            let destroy_tensor_list =
                find(&libs, "aclDestroyTensorList").ok_or_else(|| missing("aclDestroyTensorList"))?;
            let grouped_mm =
                GroupedMatmul::find(&libs).ok_or_else(|| missing("aclnnGroupedMatmulV5 or V4"))?;
            // Operators come from the operator libraries only, before libnnopbase joins the list.
            let mut api = Aclnn {
                create_tensor,
                destroy_tensor,
                create_tensor_list,
                destroy_tensor_list,
                create_int_array: find(&libs, "aclCreateIntArray"),
                destroy_int_array: find(&libs, "aclDestroyIntArray"),
                grouped_mm,
                token_permute: find_op(&libs, "aclnnMoeTokenPermute"),
                token_unpermute: find_op(&libs, "aclnnMoeTokenUnpermute"),
                alltoallv_grouped_mm: find_op(&libs, "aclnnAlltoAllvGroupedMatMul"),
                grouped_mm_alltoallv: find_op(&libs, "aclnnGroupedMatMulAlltoAllv"),
                destroy_executor: nnopbase.required("aclDestroyAclOpExecutor")?,
                libs,
            };
            api.libs.push(nnopbase);
            Ok(api)
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

/// An `aclIntArray` (host values copied by the library), destroyed on drop.
struct OwnedIntArray<'a>(IntArray, &'a Aclnn);

impl Drop for OwnedIntArray<'_> {
    fn drop(&mut self) {
        if let Some(destroy) = self.1.destroy_int_array {
            // SAFETY: made by aclCreateIntArray, destroyed once.
            unsafe { destroy(self.0) };
        }
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

    fn int_array(&self, values: &[i64]) -> Result<OwnedIntArray<'_>> {
        let (create, _) = self
            .create_int_array
            .zip(self.destroy_int_array)
            .ok_or_else(|| self.missing("aclCreateIntArray and aclDestroyIntArray"))?;
        // SAFETY: `values.len()` readable values.
        let array = unsafe { create(values.as_ptr(), values.len() as u64) };
        if array.is_null() {
            return Err(Error::invalid(format!("aclCreateIntArray refused {} values", values.len())));
        }
        Ok(OwnedIntArray(array, self))
    }

    /// The error for an operator or constructor that no loaded library has.
    fn missing(&self, symbol: &str) -> Error {
        missing_symbol(&self.libs, symbol)
    }

    /// Phase 2 after `op`'s phase 1 returned `code`, `bytes` and `executor`: the workspace from
    /// the caller's allocator, then the launch on `stream`. A failed phase 1 made no executor; one
    /// made but never launched is destroyed.
    #[allow(clippy::too_many_arguments)]
    fn launch(
        &self,
        op: &str,
        code: AclnnStatus,
        bytes: u64,
        executor: Executor,
        launch: Launch,
        workspace: Workspace,
        stream: AclrtStream,
    ) -> Result<()> {
        status(code, &format!("{op}GetWorkspaceSize"))?;
        let pending = PendingExecutor(executor, self);
        let buffer = if bytes > 0 { workspace(bytes)? } else { std::ptr::null_mut() };
        // SAFETY: the executor from this GetWorkspaceSize, its workspace size, launched once.
        status(unsafe { launch(buffer, bytes, pending.take(), stream) }, op)
    }
}
