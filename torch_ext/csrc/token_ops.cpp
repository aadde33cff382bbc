// The seed's token permute/unpermute contract (torch_npu's npu_moe_token_permute/_unpermute):
// `sorted_indices` (int32) gives every flat (token, k) slot its row of the permuted tokens. The
// schemas, and ATen kernels for every device without a fused one (NPU: npu_ops.cpp, aclnn).
#include <optional>
#include <tuple>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "common.h"

namespace fsdpturbo_torch {
namespace {

std::tuple<at::Tensor, at::Tensor> moe_token_permute_aten(const at::Tensor& tokens, const at::Tensor& indices) {
  int64_t top_k = check_token_permute(tokens, indices);
  auto rows = at::argsort(indices.reshape(-1).to(at::kLong), /*stable=*/true);
  auto sorted = at::empty_like(rows, rows.options().dtype(at::kInt))
                    .scatter_(0, rows, at::arange(rows.numel(), rows.options().dtype(at::kInt)));
  return {tokens.index_select(0, rows.div(top_k, "floor")), sorted};
}

// Accumulated in f32 (f64 for f64) with probs first rounded to the tokens' dtype.
at::Tensor moe_token_unpermute_aten(const at::Tensor& permuted, const at::Tensor& sorted_indices,
                                    const std::optional<at::Tensor>& probs) {
  int64_t top_k = check_token_unpermute(permuted, sorted_indices, probs);
  auto acc = permuted.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto per_slot = permuted.index_select(0, sorted_indices.to(at::kLong))
                      .view({sorted_indices.numel() / top_k, top_k, permuted.size(1)})
                      .to(acc);
  if (probs) per_slot = per_slot * probs->unsqueeze(-1).to(permuted.scalar_type()).to(acc);
  return per_slot.sum(1).to(permuted.scalar_type());
}

}  // namespace
}  // namespace fsdpturbo_torch

TORCH_LIBRARY_FRAGMENT(fsdpturbo, m) {
  // (the rows of tokens [T, H] in the stable order of indices [T] or [T, K], the row of every
  // flat slot as int32 [T * K])
  m.def("moe_token_permute(Tensor tokens, Tensor indices) -> (Tensor, Tensor)");
  // out[t] = sum_k permuted[sorted_indices[t * K + k]] * probs[t, k]; K = 1 without probs.
  m.def("moe_token_unpermute(Tensor permuted, Tensor sorted_indices, Tensor? probs) -> Tensor");
}

TORCH_LIBRARY_IMPL(fsdpturbo, CompositeExplicitAutograd, m) {
  m.impl("moe_token_permute", &fsdpturbo_torch::moe_token_permute_aten);
  m.impl("moe_token_unpermute", &fsdpturbo_torch::moe_token_unpermute_aten);
}
