//! MC2: all-to-all-v fused with grouped matmul over a named HCCL communicator
//! (`aclnnAlltoAllvGroupedMatMul`, `aclnnGroupedMatMulAlltoAllv`; ops-transformer's mc2/ docs). The
//! shared-expert matmul and the device count tensors are not used (NULL).

use std::ffi::CStr;

use super::{
    Aclnn, AclnnStatus, AclrtStream, Executor, IntArray, OwnedIntArray, OwnedTensor, Tensor, View, Workspace,
};
use crate::error::{Error, Result};

type Name = *const std::ffi::c_char;
#[rustfmt::skip]
pub type AlltoAllvGmm = unsafe extern "C" fn(
    Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Name, i64, IntArray, IntArray, bool, bool, bool,
    Tensor, Tensor, Tensor, *mut u64, *mut Executor,
) -> AclnnStatus;
#[rustfmt::skip]
pub type GmmAlltoAllv = unsafe extern "C" fn(
    Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Name, i64, IntArray, IntArray, bool, bool,
    Tensor, Tensor, *mut u64, *mut Executor,
) -> AclnnStatus;

/// Where rows go: the communicator's name, its size P and, for each of the `e` local experts of
/// every rank, `send_counts[r·e + j]` rows this rank sends to expert j of rank r and
/// `recv_counts[r·e + j]` rows it receives from rank r for its own expert j. With
/// `trans_weight` the weight is [e, N, K] (`x @ w[j]^T`), otherwise [e, K, N].
pub struct Exchange<'a> {
    pub group: &'a CStr,
    pub ep_world_size: i64,
    pub send_counts: &'a [i64],
    pub recv_counts: &'a [i64],
    pub trans_weight: bool,
}

impl Exchange<'_> {
    fn check(&self, op: &str) -> Result<()> {
        let name = self.group.to_bytes().len();
        if name == 0 || name >= 128 {
            return Err(Error::invalid(format!(
                "{op}: the communicator name has {name} bytes; 1 to 127 are accepted"
            )));
        }
        if self.send_counts.len() != self.recv_counts.len() || self.send_counts.is_empty() {
            return Err(Error::invalid(format!(
                "{op}: {} send counts and {} receive counts; both need e · epWorldSize entries",
                self.send_counts.len(),
                self.recv_counts.len()
            )));
        }
        Ok(())
    }
}

/// The descriptors both operators take: rows, weight, output and the two count arrays.
struct Operands<'a> {
    x: OwnedTensor<'a>,
    weight: OwnedTensor<'a>,
    out: OwnedTensor<'a>,
    send: OwnedIntArray<'a>,
    recv: OwnedIntArray<'a>,
}

impl Aclnn {
    fn mc2_operands(
        &self,
        op: &str,
        x: &View,
        weight: &View,
        exchange: &Exchange,
        out: &View,
    ) -> Result<Operands<'_>> {
        exchange.check(op)?;
        Ok(Operands {
            x: self.tensor(x)?,
            weight: self.tensor(weight)?,
            out: self.tensor(out)?,
            send: self.int_array(exchange.send_counts)?,
            recv: self.int_array(exchange.recv_counts)?,
        })
    }

    /// `gmm_y = permute(all_to_all_v(x)) @ weight` per local expert, the permuted rows
    /// (local-expert-major) also written to `permute_out` when given.
    ///
    /// # Safety
    /// The views describe live device memory of their dtypes; `stream` is a live stream; every
    /// rank of the communicator makes the matching call.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn alltoallv_grouped_mm(
        &self,
        x: &View,
        weight: &View,
        exchange: &Exchange,
        gmm_y: &View,
        permute_out: Option<&View>,
        workspace: Workspace,
        stream: AclrtStream,
    ) -> Result<()> {
        let op = "aclnnAlltoAllvGroupedMatMul";
        let (get, launch) = self.alltoallv_grouped_mm.ok_or_else(|| self.missing(op))?;
        let o = self.mc2_operands(op, x, weight, exchange, gmm_y)?;
        let permuted = permute_out.map(|v| self.tensor(v)).transpose()?;
        let permuted_ptr = permuted.as_ref().map_or(std::ptr::null_mut(), |t| t.0);
        let (null, group, trans) = (std::ptr::null_mut(), exchange.group.as_ptr(), exchange.trans_weight);
        let (mut bytes, mut executor) = (0u64, null);
        // SAFETY: aclnn.h's signature; no count tensors, no shared-expert matmul (mmX, mmWeight,
        // transMmWeight, mmY), permuteOutFlag set exactly when permute_out is given.
        #[rustfmt::skip]
        let code = unsafe {
            get(o.x.0, o.weight.0, null, null, null, null, group, exchange.ep_world_size, o.send.0, o.recv.0,
                trans, false, permuted.is_some(), o.out.0, null, permuted_ptr, &mut bytes, &mut executor)
        };
        self.launch(op, code, bytes, executor, launch, workspace, stream)
    }

    /// `y = all_to_all_v(unpermute(x @ weight))`: `x` local-expert-major, `y` back in the order
    /// the rows were sent in.
    ///
    /// # Safety
    /// As [`Aclnn::alltoallv_grouped_mm`].
    pub unsafe fn grouped_mm_alltoallv(
        &self,
        x: &View,
        weight: &View,
        exchange: &Exchange,
        y: &View,
        workspace: Workspace,
        stream: AclrtStream,
    ) -> Result<()> {
        let op = "aclnnGroupedMatMulAlltoAllv";
        let (get, launch) = self.grouped_mm_alltoallv.ok_or_else(|| self.missing(op))?;
        let o = self.mc2_operands(op, x, weight, exchange, y)?;
        let (null, group, trans) = (std::ptr::null_mut(), exchange.group.as_ptr(), exchange.trans_weight);
        let (mut bytes, mut executor) = (0u64, null);
        // SAFETY: aclnn.h's signature; no count tensors, no shared-expert matmul.
        #[rustfmt::skip]
        let code = unsafe {
            get(o.x.0, o.weight.0, null, null, null, null, group, exchange.ep_world_size, o.send.0, o.recv.0,
                trans, false, o.out.0, null, &mut bytes, &mut executor)
        };
        self.launch(op, code, bytes, executor, launch, workspace, stream)
    }
}
