// Kernels of power_sum and foreach_scale_: the fused multi-tensor host kernels of the Rust
// core (f32 / f64 / f16 / bf16, f64 or f32 accumulation).
#include <vector>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "common.h"

namespace fsdpturbo_torch {
namespace {

// Describes contiguous tensors for the C ABI (`keep` holds contiguous copies where needed).
std::vector<fsdpturbo_grad_t> describe(at::TensorList tensors, std::vector<at::Tensor>& keep, const char* op) {
  std::vector<fsdpturbo_grad_t> grads(tensors.size());
  keep.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    keep.push_back(tensors[i].contiguous());
    const at::Tensor& t = keep.back();
    grads[i] = fsdpturbo_grad_t{};
    grads[i].mut_data = t.numel() ? t.data_ptr() : nullptr;
    grads[i].numel = t.numel();
    grads[i].dtype = dtype_code(t, op);
  }
  return grads;
}

at::Tensor power_sum_cpu(at::TensorList tensors, double norm_type, bool accumulate_f64) {
  std::vector<at::Tensor> keep;
  auto grads = describe(tensors, keep, "power_sum");
  double value = 0;
  check(fsdpturbo_local_power_sum(grads.data(), grads.size(), norm_type, accumulate_f64, &value),
        "fsdpturbo::power_sum");
  return at::scalar_tensor(value, at::TensorOptions().dtype(at::kDouble));
}

void foreach_scale_cpu(at::TensorList tensors, double coef) {
  std::vector<at::Tensor> keep;
  auto grads = describe(tensors, keep, "foreach_scale_");
  check(fsdpturbo_scale_in_place(grads.data(), grads.size(), coef), "fsdpturbo::foreach_scale_");
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!keep[i].is_same(tensors[i])) tensors[i].copy_(keep[i]);
  }
}

at::Tensor power_sum_meta(at::TensorList tensors, double, bool) {
  return at::empty({}, at::TensorOptions().dtype(at::kDouble).device(at::kMeta));
}

void foreach_scale_meta(at::TensorList, double) {}

at::Tensor power_sum_device(at::TensorList tensors, double, bool) {
  not_available("power_sum", tensors.empty() ? c10::Device(c10::kCUDA) : tensors[0].device());
}

void foreach_scale_device(at::TensorList tensors, double) {
  not_available("foreach_scale_", tensors.empty() ? c10::Device(c10::kCUDA) : tensors[0].device());
}

}  // namespace
}  // namespace fsdpturbo_torch

TORCH_LIBRARY_IMPL(fsdpturbo, CPU, m) {
  m.impl("power_sum", &fsdpturbo_torch::power_sum_cpu);
  m.impl("foreach_scale_", &fsdpturbo_torch::foreach_scale_cpu);
}

TORCH_LIBRARY_IMPL(fsdpturbo, Meta, m) {
  m.impl("power_sum", &fsdpturbo_torch::power_sum_meta);
  m.impl("foreach_scale_", &fsdpturbo_torch::foreach_scale_meta);
}

TORCH_LIBRARY_IMPL(fsdpturbo, PrivateUse1, m) {
  m.impl("power_sum", &fsdpturbo_torch::power_sum_device);
  m.impl("foreach_scale_", &fsdpturbo_torch::foreach_scale_device);
}
