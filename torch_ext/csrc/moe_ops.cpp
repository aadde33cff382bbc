// Kernels of the MoE ops: routing metadata (Rust counting sort), row permute/unpermute and the
// experts' grouped matmul with its two backward GEMMs, all on the Rust host kernels. Their fake
// (meta) kernels are in Python (fsdpturbo/moe/ops.py), where symbolic shapes are natural.
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "common.h"

namespace fsdpturbo_torch {
namespace {

// uint64 host indices as the C ABI takes them (int64 tensors hold non-negative values here).
const uint64_t* u64(const at::Tensor& t) { return reinterpret_cast<const uint64_t*>(t.const_data_ptr<int64_t>()); }
uint64_t* u64_mut(at::Tensor& t) { return reinterpret_cast<uint64_t*>(t.mutable_data_ptr<int64_t>()); }

at::Tensor index_tensor(const at::Tensor& t, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 1, "fsdpturbo::", op, ": ", name, " must be 1-D, got shape ", t.sizes());
  TORCH_CHECK_VALUE(!at::isFloatingType(t.scalar_type()), "fsdpturbo::", op, ": ", name,
                    " must hold integers, got ", t.scalar_type());
  return t.to(at::kLong).contiguous();
}

size_t bytes(const at::Tensor& t) { return t.numel() * t.element_size(); }

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_route_cpu(const at::Tensor& expert_ids, int64_t num_experts,
                                                              int64_t ep_size) {
  TORCH_CHECK_VALUE(expert_ids.dim() == 2, "fsdpturbo::moe_route: expert_ids must be [tokens, top_k], got shape ",
                    expert_ids.sizes());
  TORCH_CHECK_VALUE(num_experts > 0 && ep_size > 0, "fsdpturbo::moe_route: num_experts and ep_size must be positive");
  auto ids = expert_ids.to(at::kLong).contiguous();
  auto options = at::TensorOptions().dtype(at::kLong);
  auto counts = at::empty({num_experts}, options);
  auto permutation = at::empty({ids.numel()}, options);
  auto splits = at::empty({ep_size}, options);
  check(fsdpturbo_route(ids.const_data_ptr<int64_t>(), ids.size(0), ids.size(1), num_experts, ep_size,
                        u64_mut(counts), u64_mut(permutation), u64_mut(splits)),
        "fsdpturbo::moe_route");
  return {counts, permutation, splits};
}

at::Tensor moe_permute_cpu(const at::Tensor& hidden, const at::Tensor& rows, int64_t row_divisor) {
  TORCH_CHECK_VALUE(hidden.dim() == 2, "fsdpturbo::moe_permute: hidden must be [tokens, hidden], got ", hidden.sizes());
  TORCH_CHECK_VALUE(row_divisor >= 1, "fsdpturbo::moe_permute: row_divisor must be >= 1, got ", row_divisor);
  auto src = hidden.contiguous();
  auto index = index_tensor(rows, "moe_permute", "rows");
  auto out = at::empty({index.numel(), src.size(1)}, src.options());
  check(fsdpturbo_permute_rows(dtype_code(src, "moe_permute"), src.const_data_ptr(), bytes(src), src.size(1), u64(index),
                               index.numel(), row_divisor, out.mutable_data_ptr(), bytes(out)),
        "fsdpturbo::moe_permute");
  return out;
}

at::Tensor moe_unpermute_cpu(const at::Tensor& permuted, const at::Tensor& permutation,
                             const std::optional<at::Tensor>& probs, int64_t tokens, int64_t top_k) {
  check_unpermute_shape(permuted, tokens, top_k);
  auto src = permuted.contiguous();
  auto index = index_tensor(permutation, "moe_unpermute", "permutation");
  at::Tensor weights;
  if (probs) {
    TORCH_CHECK_VALUE(probs->numel() == tokens * top_k, "fsdpturbo::moe_unpermute: probs must have ", tokens * top_k,
                      " elements, got shape ", probs->sizes());
    weights = probs->to(src.scalar_type()).contiguous();
  }
  auto out = at::empty({tokens, src.size(1)}, src.options());
  check(fsdpturbo_unpermute(dtype_code(src, "moe_unpermute"), src.const_data_ptr(), bytes(src), src.size(1), u64(index),
                            tokens, top_k, probs ? weights.const_data_ptr() : nullptr, probs ? bytes(weights) : 0,
                            out.mutable_data_ptr(), bytes(out)),
        "fsdpturbo::moe_unpermute");
  return out;
}

at::Tensor counts_tensor(const at::Tensor& counts) { return index_tensor(counts, "grouped_mm", "counts"); }

at::Tensor grouped_mm_cpu(const at::Tensor& x, const at::Tensor& counts, const at::Tensor& weight) {
  TORCH_CHECK_VALUE(x.dim() == 2 && weight.dim() == 3 && x.size(1) == weight.size(2),
                    "fsdpturbo::grouped_mm: x [N, in] and weight [G, out, in] expected, got ", x.sizes(), " and ",
                    weight.sizes());
  TORCH_CHECK_VALUE(x.scalar_type() == weight.scalar_type(), "fsdpturbo::grouped_mm: x is ", x.scalar_type(),
                    " but weight is ", weight.scalar_type());
  auto a = x.contiguous(), w = weight.contiguous(), c = counts_tensor(counts);
  auto y = at::empty({a.size(0), w.size(1)}, a.options());
  check(fsdpturbo_grouped_mm(dtype_code(a, "grouped_mm"), a.const_data_ptr(), bytes(a), u64(c), c.numel(), w.size(2),
                                 w.size(1), w.const_data_ptr(), bytes(w), y.mutable_data_ptr(), bytes(y)),
        "fsdpturbo::grouped_mm");
  return y;
}

at::Tensor grouped_mm_grad_input_cpu(const at::Tensor& grad_y, const at::Tensor& counts, const at::Tensor& weight) {
  auto g = grad_y.contiguous(), w = weight.contiguous(), c = counts_tensor(counts);
  auto grad_x = at::empty({g.size(0), w.size(2)}, g.options());
  check(fsdpturbo_grouped_mm_grad_input(dtype_code(g, "grouped_mm"), g.const_data_ptr(), bytes(g), u64(c), c.numel(),
                                            w.size(2), w.size(1), w.const_data_ptr(), bytes(w),
                                            grad_x.mutable_data_ptr(), bytes(grad_x)),
        "fsdpturbo::grouped_mm_grad_input");
  return grad_x;
}

at::Tensor grouped_mm_grad_weight_cpu(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& counts) {
  auto g = grad_y.contiguous(), a = x.contiguous(), c = counts_tensor(counts);
  auto grad_w = at::empty({c.numel(), g.size(1), a.size(1)}, a.options());
  check(fsdpturbo_grouped_mm_grad_weight(dtype_code(a, "grouped_mm"), g.const_data_ptr(), bytes(g), a.const_data_ptr(),
                                             bytes(a), u64(c), c.numel(), a.size(1), g.size(1),
                                             grad_w.mutable_data_ptr(), bytes(grad_w)),
        "fsdpturbo::grouped_mm_grad_weight");
  return grad_w;
}

}  // namespace
}  // namespace fsdpturbo_torch

TORCH_LIBRARY_IMPL(fsdpturbo, CPU, m) {
  m.impl("moe_route", &fsdpturbo_torch::moe_route_cpu);
  m.impl("moe_permute", &fsdpturbo_torch::moe_permute_cpu);
  m.impl("moe_unpermute", &fsdpturbo_torch::moe_unpermute_cpu);
  m.impl("grouped_mm", &fsdpturbo_torch::grouped_mm_cpu);
  m.impl("grouped_mm_grad_input", &fsdpturbo_torch::grouped_mm_grad_input_cpu);
  m.impl("grouped_mm_grad_weight", &fsdpturbo_torch::grouped_mm_grad_weight_cpu);
}


