//! Grouped matmul (`aclnnGroupedMatmulV5`, or V4 where V5 is absent: op-plugin's probe) with
//! per-group counts (ops-transformer's gmm/ docs).

use std::ffi::c_void;

use super::{
    Aclnn, AclnnStatus, AclrtStream, Executor, Launch, List, Loaded, Tensor, View, Workspace, find_op,
};
use crate::error::Result;

/// The workspace phase of aclnnGroupedMatmulV4, or of V5 with its one extra argument (the
/// tuning config, before the outputs) given as `$tuning`. Inputs: x, weight, bias, scale,
/// offset, antiquant scale and offset, per-token scale, group list, activation input and its
/// quant scale and offset; then split item, group type, group list type, activation type.
macro_rules! grouped_matmul_fn {
    ($($tuning:ty)?) => {
        unsafe extern "C" fn(
            List, List, List, List, List, List, List, List, Tensor, List, List, List,
            i64, i64, i64, i64,
            $($tuning,)?
            List, List, List, *mut u64, *mut Executor,
        ) -> AclnnStatus
    };
}
type Gmm4 = grouped_matmul_fn!();
type Gmm5 = grouped_matmul_fn!(*mut c_void);

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
        // One call of either version: optional inputs NULL; groupListType 1 (counts), actType 0
        // (none); V5's tuning config NULL.
        macro_rules! call {
            ($get:expr $(, $tuning:expr)?) => {
                $get(
                    xs.0, ws.0, null, null, null, null, null, null, groups.0, null, null, null,
                    split_item, group_type, 1, 0,
                    $($tuning,)?
                    outs.0, null, null, &mut bytes, &mut executor,
                )
            };
        }
        // SAFETY: the arguments match the V4/V5 signatures above.
        let (code, launch, op) = match self.grouped_mm {
            GroupedMatmul::V5(get, launch) => (unsafe { call!(get, null) }, launch, "aclnnGroupedMatmulV5"),
            GroupedMatmul::V4(get, launch) => (unsafe { call!(get) }, launch, "aclnnGroupedMatmulV4"),
        };
        self.launch(op, code, bytes, executor, launch, workspace, stream)
    }
}
