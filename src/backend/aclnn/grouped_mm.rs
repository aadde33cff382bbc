//! Grouped matmul (`aclnnGroupedMatmulV5`, or V4 where V5 is absent: op-plugin's probe) with
//! per-group counts (ops-transformer's gmm/ docs).

use std::ffi::c_void;

use super::{
    Aclnn, AclnnStatus, AclrtStream, Executor, Launch, List, Loaded, Tensor, View, Workspace, find_op,
};
use crate::error::Result;

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

    /// V5 from the first library that has both its phases, else V4.
    pub(super) fn find(libs: &[Loaded]) -> Option<GroupedMatmul> {
        // SAFETY: the types are aclnn.h's.
        unsafe {
            match find_op::<Gmm5>(libs, "aclnnGroupedMatmulV5") {
                Some((ws, launch)) => Some(GroupedMatmul::V5(ws, launch)),
                None => find_op::<Gmm4>(libs, "aclnnGroupedMatmulV4")
                    .map(|(ws, launch)| GroupedMatmul::V4(ws, launch)),
            }
        }
    }
}

impl Aclnn {
    /// Grouped matmul with per-group counts (`groupListType` 1), no bias, no activation.
    /// `group_type` 0 splits the rows of `x` ([M,K] × weight [G,K,N] → out [M,N], `split_item`
    /// 2); `group_type` 2 splits K (x [M,K] × weight [K,N] → out [G,M,N], `split_item` 3).
    ///
    /// # Safety
    /// The views describe live device memory of their dtypes; `stream` is a live stream.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn grouped_mm(
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
        let (code, launch, op) = match self.grouped_mm {
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
                (code, launch, "aclnnGroupedMatmulV5")
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
                (code, launch, "aclnnGroupedMatmulV4")
            },
        };
        self.launch(op, code, bytes, executor, launch, workspace, stream)
    }
}
