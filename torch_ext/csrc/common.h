// Shared helpers of the op library: turning library statuses into torch errors, and
// encoding placements in op schemas.
#pragma once

#include <string>
#include <optional>
#include <vector>

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include "fsdpturbo_internal.h"

namespace fsdpturbo_torch {

// The FSDPTURBO_DTYPE_* code of a floating-point tensor, or op's error naming what is accepted.
inline int32_t dtype_code(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat: return FSDPTURBO_DTYPE_F32;
    case at::kDouble: return FSDPTURBO_DTYPE_F64;
    case at::kHalf: return FSDPTURBO_DTYPE_F16;
    case at::kBFloat16: return FSDPTURBO_DTYPE_BF16;
    default:
      TORCH_CHECK_VALUE(false, "fsdpturbo::", op, ": expected float32, float64, float16 or bfloat16, got ",
                        t.scalar_type());
  }
}

// Throws a torch error carrying the library's message: a ValueError for bad input, a
// RuntimeError naming the status otherwise (fsdpturbo_status_class, the table Python uses too).
inline void check(int32_t status, const char* what) {
  if (status == FSDPTURBO_OK) return;
  size_t len = fsdpturbo_last_error(nullptr, 0);
  std::string message(len + 1, '\0');
  fsdpturbo_last_error(message.data(), message.size());
  message.resize(len);
  TORCH_CHECK_VALUE(fsdpturbo_status_class(status) != FSDPTURBO_STATUS_CLASS_BAD_INPUT, what, ": ", message);
  TORCH_CHECK(false, what, ": ", message, " (", fsdpturbo_status_name(status), ")");
}

// Placements travel through schemas as flat [kind, dim, split_factor] triples
// (FSDPTURBO_PLACEMENT_* kinds), one triple per mesh dim.
inline std::vector<fsdpturbo_placement_t> placements_from(c10::IntArrayRef triples, size_t mesh_ndim) {
  TORCH_CHECK_VALUE(triples.size() == 3 * mesh_ndim, "placements: expected ", 3 * mesh_ndim,
                    " integers (kind, dim, split_factor per mesh dim), got ", triples.size());
  std::vector<fsdpturbo_placement_t> out(mesh_ndim);
  for (size_t i = 0; i < mesh_ndim; ++i) {
    out[i].kind = static_cast<int32_t>(triples[3 * i]);
    out[i].dim = triples[3 * i + 1];
    out[i].split_factor = triples[3 * i + 2];
  }
  return out;
}

// Non-negative int lists (shapes, coordinates) as the uint64 arrays of the C ABI.
inline std::vector<uint64_t> unsigned_from(c10::IntArrayRef values, const char* name) {
  std::vector<uint64_t> out;
  out.reserve(values.size());
  for (size_t i = 0; i < values.size(); ++i) {
    TORCH_CHECK_VALUE(values[i] >= 0, name, "[", i, "] must be non-negative, got ", values[i]);
    out.push_back(static_cast<uint64_t>(values[i]));
  }
  return out;
}

// The shape checks of moe_unpermute shared by its kernels (the second keeps the seed's text).
inline void check_unpermute_shape(const at::Tensor& permuted, int64_t tokens, int64_t top_k) {
  TORCH_CHECK_VALUE(permuted.dim() == 2, "fsdpturbo::moe_unpermute: permuted must be [rows, hidden], got ",
                    permuted.sizes());
  TORCH_CHECK_VALUE(permuted.size(0) == tokens * top_k, "permuted tokens(", permuted.size(0), ") != sorted indices(",
                    tokens * top_k, ")");
}

// Checks of moe_token_permute shared by its kernels; returns top_k.
inline int64_t check_token_permute(const at::Tensor& tokens, const at::Tensor& indices) {
  const char* op = "fsdpturbo::moe_token_permute";
  TORCH_CHECK_VALUE(tokens.dim() == 2, op, ": tokens must be [tokens, hidden], got ", tokens.sizes());
  TORCH_CHECK_VALUE((indices.dim() == 1 || indices.dim() == 2) && indices.size(0) == tokens.size(0) &&
                        !at::isFloatingType(indices.scalar_type()),
                    op, ": indices must be integer expert ids [", tokens.size(0), "] or [", tokens.size(0),
                    ", top_k], got ", indices.scalar_type(), " ", indices.sizes());
  int64_t top_k = indices.dim() == 2 ? indices.size(1) : 1;
  TORCH_CHECK_VALUE(top_k <= 512, op, ": top_k must be <= 512 (aclnnMoeTokenPermute), got ", top_k);
  return top_k;
}

// Checks of moe_token_unpermute shared by its kernels; returns top_k (1 without probs).
inline int64_t check_token_unpermute(const at::Tensor& permuted, const at::Tensor& sorted_indices,
                                     const std::optional<at::Tensor>& probs) {
  const char* op = "fsdpturbo::moe_token_unpermute";
  TORCH_CHECK_VALUE(permuted.dim() == 2, op, ": permuted must be [rows, hidden], got ", permuted.sizes());
  TORCH_CHECK_VALUE(sorted_indices.dim() == 1 && sorted_indices.numel() == permuted.size(0) &&
                        !at::isFloatingType(sorted_indices.scalar_type()),
                    op, ": sorted_indices must hold one integer row per permuted row (", permuted.size(0), "), got ",
                    sorted_indices.scalar_type(), " ", sorted_indices.sizes());
  TORCH_CHECK_VALUE(!probs || (probs->dim() == 2 && probs->numel() == sorted_indices.numel()), op,
                    ": probs must be [tokens, top_k] with tokens * top_k = ", sorted_indices.numel(), ", got ",
                    probs ? probs->sizes() : c10::IntArrayRef{});
  int64_t top_k = probs ? probs->size(1) : 1;
  TORCH_CHECK_VALUE(top_k <= 512, op, ": top_k must be <= 512 (aclnnMoeTokenUnpermute), got ", top_k);
  return top_k;
}

// The kernel of a device an op has no kernel for: an error naming the op, the device and where
// it runs.
[[noreturn]] inline void not_available(const char* op, const c10::Device& device) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "fsdpturbo::", op, " has no kernel for ", device.str(),
                              " tensors; it runs on CPU tensors");
}

}  // namespace fsdpturbo_torch
