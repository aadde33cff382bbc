//! MoE token permute and unpermute (`aclnnMoeTokenPermute` / `aclnnMoeTokenUnpermute`, paddedMode
//! false), per ops-transformer's moe/ docs. Their `sortedIndices` (INT32) maps every flat (token, k) slot to
//! its row of the permuted tokens.

use super::{Aclnn, AclnnStatus, AclrtStream, Executor, IntArray, Tensor, View, Workspace};
use crate::error::Result;

pub type Permute =
    unsafe extern "C" fn(Tensor, Tensor, i64, bool, Tensor, Tensor, *mut u64, *mut Executor) -> AclnnStatus;
pub type Unpermute = unsafe extern "C" fn(
    Tensor,
    Tensor,
    Tensor,
    bool,
    IntArray,
    Tensor,
    *mut u64,
    *mut Executor,
) -> AclnnStatus;

impl Aclnn {
    /// `permuted[sorted_indices[s]] = tokens[s / top_k]` with `sorted_indices` the rank of slot
    /// `s` in a stable sort of `indices` ([T] or [T, top_k], INT32/INT64) — written to
    /// `sorted_indices` ([T·top_k], INT32). No token is dropped (numOutTokens 0).
    ///
    /// # Safety
    /// The views describe live device memory of their dtypes; `stream` is a live stream.
    pub unsafe fn token_permute(
        &self,
        tokens: &View,
        indices: &View,
        permuted: &View,
        sorted_indices: &View,
        workspace: Workspace,
        stream: AclrtStream,
    ) -> Result<()> {
        let op = "aclnnMoeTokenPermute";
        let (get, launch) = self.token_permute.ok_or_else(|| self.missing(op))?;
        let (t, i, p, s) = (
            self.tensor(tokens)?,
            self.tensor(indices)?,
            self.tensor(permuted)?,
            self.tensor(sorted_indices)?,
        );
        let (mut bytes, mut executor) = (0u64, std::ptr::null_mut());
        // SAFETY: aclnn.h's signature; numOutTokens 0 (keep all), paddedMode false.
        let code = unsafe { get(t.0, i.0, 0, false, p.0, s.0, &mut bytes, &mut executor) };
        self.launch(op, code, bytes, executor, launch, workspace, stream)
    }

    /// `out[t] = Σ_k permuted[sorted_indices[t·K + k]] · probs[t, k]`; without probs K is 1.
    ///
    /// # Safety
    /// As [`Aclnn::token_permute`]; `sorted_indices` holds rows of `permuted`.
    pub unsafe fn token_unpermute(
        &self,
        permuted: &View,
        sorted_indices: &View,
        probs: Option<&View>,
        out: &View,
        workspace: Workspace,
        stream: AclrtStream,
    ) -> Result<()> {
        let op = "aclnnMoeTokenUnpermute";
        let (get, launch) = self.token_unpermute.ok_or_else(|| self.missing(op))?;
        let (p, s, o) = (self.tensor(permuted)?, self.tensor(sorted_indices)?, self.tensor(out)?);
        let probs = probs.map(|v| self.tensor(v)).transpose()?;
        let probs_ptr = probs.as_ref().map_or(std::ptr::null_mut(), |t| t.0);
        let (mut bytes, mut executor) = (0u64, std::ptr::null_mut());
        // SAFETY: aclnn.h's signature; paddedMode false, restoreShapeOptional NULL.
        let code =
            unsafe { get(p.0, s.0, probs_ptr, false, std::ptr::null_mut(), o.0, &mut bytes, &mut executor) };
        self.launch(op, code, bytes, executor, launch, workspace, stream)
    }
}
