// CUDA kernels of the op library's tensor ops. The op library links no CUDA library: the kernels
// are NVRTC-compiled CUDA C launched by libfsdpturbo through the driver API (loaded at run time)
// on torch's current stream, which comes from c10's device-guard registry (c10::Stream's
// native handle is the cudaStream_t). Scratch memory comes from torch's caching allocator.
//
// grouped_mm and its backward GEMMs run on cuBLAS (cublasGemmGroupedBatchedEx, bf16 in, f32
// compute), or on torch._grouped_mm for bf16 on sm90+ where that is faster; FSDPTURBO_GROUPED_MM
// = cublas | cublas_loop | torch forces one path (the benchmark compares them).
#include <cstdlib>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <c10/core/DeviceGuard.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include "common.h"

namespace fsdpturbo_torch {
namespace {

void* current_stream(const c10::Device& device) {
  return c10::impl::getDeviceGuardImpl(c10::kCUDA)->getStream(device).native_handle();
}

at::Tensor workspace(size_t bytes, const c10::Device& device) {
  return at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).device(device));
}

at::Tensor index_on(const at::Tensor& t, const c10::Device& device, const char* op, const char* name) {
  TORCH_CHECK_VALUE(t.dim() == 1, "fsdpturbo::", op, ": ", name, " must be 1-D, got shape ", t.sizes());
  TORCH_CHECK_VALUE(!at::isFloatingType(t.scalar_type()), "fsdpturbo::", op, ": ", name, " must hold integers, got ",
                    t.scalar_type());
  return t.to(device, at::kLong).contiguous();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_route_cuda(const at::Tensor& expert_ids, int64_t num_experts,
                                                               int64_t ep_size) {
  TORCH_CHECK_VALUE(expert_ids.dim() == 2, "fsdpturbo::moe_route: expert_ids must be [tokens, top_k], got shape ",
                    expert_ids.sizes());
  TORCH_CHECK_VALUE(num_experts > 0 && ep_size > 0, "fsdpturbo::moe_route: num_experts and ep_size must be positive");
  c10::DeviceGuard guard(expert_ids.device());
  auto ids = expert_ids.to(at::kLong).contiguous();
  auto options = ids.options();
  auto counts = at::empty({num_experts}, options);
  auto permutation = at::empty({ids.numel()}, options);
  auto splits = at::empty({ep_size}, options);
  auto ws = workspace(fsdpturbo_cuda_route_workspace(ids.size(0), ids.size(1), num_experts), ids.device());
  check(fsdpturbo_cuda_route(ids.device().index(), current_stream(ids.device()), ids.const_data_ptr<int64_t>(),
                             ids.size(0), ids.size(1), num_experts, ep_size, counts.mutable_data_ptr<int64_t>(),
                             permutation.mutable_data_ptr<int64_t>(), splits.mutable_data_ptr<int64_t>(),
                             ws.mutable_data_ptr(), ws.numel()),
        "fsdpturbo::moe_route");
  return {counts, permutation, splits};
}

at::Tensor moe_permute_cuda(const at::Tensor& hidden, const at::Tensor& rows, int64_t row_divisor) {
  TORCH_CHECK_VALUE(hidden.dim() == 2, "fsdpturbo::moe_permute: hidden must be [tokens, hidden], got ", hidden.sizes());
  TORCH_CHECK_VALUE(row_divisor >= 1, "fsdpturbo::moe_permute: row_divisor must be >= 1, got ", row_divisor);
  c10::DeviceGuard guard(hidden.device());
  auto src = hidden.contiguous();
  auto index = index_on(rows, src.device(), "moe_permute", "rows");
  auto out = at::empty({index.numel(), src.size(1)}, src.options());
  auto ws = workspace(8, src.device());
  check(fsdpturbo_cuda_permute_rows(src.device().index(), current_stream(src.device()), dtype_code(src, "moe_permute"),
                                    src.const_data_ptr(), src.size(0), src.size(1), index.const_data_ptr<int64_t>(),
                                    index.numel(), row_divisor, out.mutable_data_ptr(), ws.mutable_data_ptr(),
                                    ws.numel()),
        "fsdpturbo::moe_permute");
  return out;
}

at::Tensor moe_unpermute_cuda(const at::Tensor& permuted, const at::Tensor& permutation,
                              const std::optional<at::Tensor>& probs, int64_t tokens, int64_t top_k) {
  TORCH_CHECK_VALUE(permuted.dim() == 2, "fsdpturbo::moe_unpermute: permuted must be [rows, hidden], got ",
                    permuted.sizes());
  TORCH_CHECK_VALUE(permuted.size(0) == tokens * top_k, "permuted tokens(", permuted.size(0), ") != sorted indices(",
                    tokens * top_k, ")");
  TORCH_CHECK_VALUE(top_k >= 1, "fsdpturbo::moe_unpermute: top_k must be >= 1, got ", top_k);
  c10::DeviceGuard guard(permuted.device());
  auto src = permuted.contiguous();
  auto index = index_on(permutation, src.device(), "moe_unpermute", "permutation");
  TORCH_CHECK_VALUE(index.numel() == tokens * top_k, "fsdpturbo::moe_unpermute: permutation has ", index.numel(),
                    " entries, expected tokens * top_k = ", tokens * top_k);
  at::Tensor weights;
  if (probs) {
    TORCH_CHECK_VALUE(probs->numel() == tokens * top_k, "fsdpturbo::moe_unpermute: probs must have ", tokens * top_k,
                      " elements, got shape ", probs->sizes());
    weights = probs->to(src.device(), src.scalar_type()).contiguous();
  }
  auto out = at::empty({tokens, src.size(1)}, src.options());
  auto ws = workspace(fsdpturbo_cuda_unpermute_workspace(tokens, top_k), src.device());
  check(fsdpturbo_cuda_unpermute(src.device().index(), current_stream(src.device()), dtype_code(src, "moe_unpermute"),
                                 src.const_data_ptr(), index.const_data_ptr<int64_t>(),
                                 probs ? weights.const_data_ptr() : nullptr, tokens, top_k, src.size(1),
                                 out.mutable_data_ptr(), ws.mutable_data_ptr(), ws.numel()),
        "fsdpturbo::moe_unpermute");
  return out;
}

// ----- Grouped GEMM -------------------------------------------------------------------------

enum class GemmPath { Cublas, CublasLoop, Torch };

GemmPath gemm_path(const at::Tensor& x, int64_t in_features, int64_t out_features) {
  const char* forced = std::getenv("FSDPTURBO_GROUPED_MM");
  if (forced && *forced) {
    std::string f(forced);
    if (f == "cublas") return GemmPath::Cublas;
    if (f == "cublas_loop") return GemmPath::CublasLoop;
    if (f == "torch") return GemmPath::Torch;
    TORCH_CHECK_VALUE(false, "FSDPTURBO_GROUPED_MM is '", f, "'; accepted: cublas, cublas_loop, torch");
  }
  // torch._grouped_mm's CUTLASS kernels: bf16, sm90+, 16-byte aligned rows.
  uint32_t cc = 0;
  bool sm90 = fsdpturbo_cuda_compute_capability(x.device().index(), &cc) == FSDPTURBO_OK && cc >= 90;
  if (x.scalar_type() == at::kBFloat16 && sm90 && in_features % 8 == 0 && out_features % 8 == 0) return GemmPath::Torch;
  return GemmPath::Cublas;
}

std::vector<uint64_t> host_counts(const at::Tensor& counts) {
  auto c = counts.to(at::kCPU, at::kLong).contiguous();
  std::vector<uint64_t> out(c.numel());
  const int64_t* p = c.const_data_ptr<int64_t>();
  for (int64_t i = 0; i < c.numel(); ++i) {
    TORCH_CHECK_VALUE(p[i] >= 0, "fsdpturbo::grouped_mm: counts[", i, "] is negative (", p[i], ")");
    out[i] = static_cast<uint64_t>(p[i]);
  }
  return out;
}

void run_cublas(int32_t kind, const at::Tensor& a, const at::Tensor& b, at::Tensor& c, const std::vector<uint64_t>& counts,
                int64_t in_features, int64_t out_features, bool loop, const char* op) {
  auto ws = workspace(fsdpturbo_cuda_grouped_mm_workspace(counts.size()), a.device());
  check(fsdpturbo_cuda_grouped_mm(a.device().index(), current_stream(a.device()), dtype_code(a, op), kind,
                                      a.const_data_ptr(), b.const_data_ptr(), c.mutable_data_ptr(), counts.data(),
                                      counts.size(), in_features, out_features, loop, ws.mutable_data_ptr(), ws.numel()),
        op);
}

at::Tensor offsets(const at::Tensor& counts, const c10::Device& device) {
  return at::cumsum(counts.to(device, at::kLong), 0).to(at::kInt);
}

void check_rows(const std::vector<uint64_t>& counts, int64_t rows, const char* op) {
  uint64_t total = 0;
  for (auto c : counts) total += c;
  TORCH_CHECK_VALUE(total == static_cast<uint64_t>(rows), "fsdpturbo::", op, ": counts sum to ", total, " but x has ",
                    rows, " rows");
}

at::Tensor grouped_mm_cuda(const at::Tensor& x, const at::Tensor& counts, const at::Tensor& weight) {
  TORCH_CHECK_VALUE(x.dim() == 2 && weight.dim() == 3 && x.size(1) == weight.size(2),
                    "fsdpturbo::grouped_mm: x [N, in] and weight [G, out, in] expected, got ", x.sizes(), " and ",
                    weight.sizes());
  TORCH_CHECK_VALUE(x.scalar_type() == weight.scalar_type(), "fsdpturbo::grouped_mm: x is ", x.scalar_type(),
                    " but weight is ", weight.scalar_type());
  TORCH_CHECK_VALUE(counts.numel() == weight.size(0), "fsdpturbo::grouped_mm: counts has ", counts.numel(),
                    " groups but weight has ", weight.size(0));
  c10::DeviceGuard guard(x.device());
  auto a = x.contiguous(), w = weight.contiguous();
  auto path = gemm_path(a, w.size(2), w.size(1));
  if (path == GemmPath::Torch) return at::_grouped_mm(a, w.transpose(-2, -1), offsets(counts, a.device()));
  auto host = host_counts(counts);
  check_rows(host, a.size(0), "grouped_mm");
  auto y = at::empty({a.size(0), w.size(1)}, a.options());
  run_cublas(FSDPTURBO_GEMM_FORWARD, a, w, y, host, w.size(2), w.size(1), path == GemmPath::CublasLoop,
             "fsdpturbo::grouped_mm");
  return y;
}

at::Tensor grouped_mm_grad_input_cuda(const at::Tensor& grad_y, const at::Tensor& counts, const at::Tensor& weight) {
  c10::DeviceGuard guard(grad_y.device());
  auto g = grad_y.contiguous(), w = weight.contiguous();
  auto path = gemm_path(g, w.size(2), w.size(1));
  if (path == GemmPath::Torch) return at::_grouped_mm(g, w, offsets(counts, g.device()));
  auto host = host_counts(counts);
  check_rows(host, g.size(0), "grouped_mm_grad_input");
  auto grad_x = at::empty({g.size(0), w.size(2)}, g.options());
  run_cublas(FSDPTURBO_GEMM_GRAD_INPUT, g, w, grad_x, host, w.size(2), w.size(1), path == GemmPath::CublasLoop,
             "fsdpturbo::grouped_mm_grad_input");
  return grad_x;
}

at::Tensor grouped_mm_grad_weight_cuda(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& counts) {
  c10::DeviceGuard guard(x.device());
  auto g = grad_y.contiguous(), a = x.contiguous();
  auto path = gemm_path(a, a.size(1), g.size(1));
  if (path == GemmPath::Torch) {
    auto grad_w = at::_grouped_mm(g.t(), a, offsets(counts, a.device()));
    // A group without rows has a zero gradient (the grouped kernel need not write it).
    auto empty = counts.to(a.device()).eq(0).view({-1, 1, 1});
    return at::where(empty, at::zeros({}, grad_w.options()), grad_w);
  }
  auto host = host_counts(counts);
  check_rows(host, a.size(0), "grouped_mm_grad_weight");
  auto grad_w = at::empty({static_cast<int64_t>(host.size()), g.size(1), a.size(1)}, a.options());
  run_cublas(FSDPTURBO_GEMM_GRAD_WEIGHT, g, a, grad_w, host, a.size(1), g.size(1), path == GemmPath::CublasLoop,
             "fsdpturbo::grouped_mm_grad_weight");
  return grad_w;
}

// ----- Multi-tensor gradient-norm kernels ---------------------------------------------------

// The device table of `tensors` (contiguous copies kept in `keep`): built by the library in
// pinned host memory and copied on the current stream.
struct Table {
  at::Tensor device_words;
  size_t chunks = 0;
};

Table table_of(at::TensorList tensors, std::vector<at::Tensor>& keep, const c10::Device& device, const char* op) {
  std::vector<fsdpturbo_grad_t> list(tensors.size());
  keep.reserve(tensors.size());
  for (size_t i = 0; i < tensors.size(); ++i) {
    TORCH_CHECK_VALUE(tensors[i].device() == device, "fsdpturbo::", op, ": tensors[", i, "] is on ",
                      tensors[i].device(), " but tensors[0] is on ", device);
    keep.push_back(tensors[i].contiguous());
    list[i] = fsdpturbo_grad_t{};
    list[i].mut_data = keep.back().numel() ? keep.back().data_ptr() : nullptr;
    list[i].numel = keep.back().numel();
    list[i].dtype = dtype_code(keep.back(), op);
  }
  size_t words = 0, chunks = 0;
  int32_t status = fsdpturbo_cuda_multi_tensor_table(list.data(), list.size(), nullptr, 0, &words, &chunks);
  if (status != FSDPTURBO_ERR_BUFFER_TOO_SMALL) check(status, op);
  auto host = at::empty({static_cast<int64_t>(words)}, at::TensorOptions().dtype(at::kLong).pinned_memory(true));
  check(fsdpturbo_cuda_multi_tensor_table(list.data(), list.size(), reinterpret_cast<uint64_t*>(host.data_ptr<int64_t>()),
                                          words, &words, &chunks),
        op);
  return Table{host.to(device, /*non_blocking=*/true), chunks};
}

at::Tensor power_sum_cuda(at::TensorList tensors, double norm_type, bool accumulate_f64) {
  TORCH_CHECK_VALUE(!tensors.empty(), "fsdpturbo::power_sum: the CUDA kernel needs at least one tensor");
  auto device = tensors[0].device();
  c10::DeviceGuard guard(device);
  std::vector<at::Tensor> keep;
  auto table = table_of(tensors, keep, device, "fsdpturbo::power_sum");
  auto options = at::TensorOptions().dtype(at::kDouble).device(device);
  auto partials = at::empty({static_cast<int64_t>(std::max<size_t>(table.chunks, 1))}, options);
  auto out = at::empty({}, options);
  check(fsdpturbo_cuda_power_sum(device.index(), current_stream(device),
                                 reinterpret_cast<const uint64_t*>(table.device_words.const_data_ptr<int64_t>()),
                                 tensors.size(), table.chunks, norm_type, accumulate_f64,
                                 partials.mutable_data_ptr<double>(), out.mutable_data_ptr<double>()),
        "fsdpturbo::power_sum");
  return out;
}

void foreach_scale_cuda(at::TensorList tensors, double coef) {
  if (tensors.empty()) return;
  auto device = tensors[0].device();
  c10::DeviceGuard guard(device);
  std::vector<at::Tensor> keep;
  auto table = table_of(tensors, keep, device, "fsdpturbo::foreach_scale_");
  check(fsdpturbo_cuda_scale(device.index(), current_stream(device),
                             reinterpret_cast<const uint64_t*>(table.device_words.const_data_ptr<int64_t>()),
                             tensors.size(), table.chunks, coef),
        "fsdpturbo::foreach_scale_");
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (!keep[i].is_same(tensors[i])) tensors[i].copy_(keep[i]);
  }
}

}  // namespace
}  // namespace fsdpturbo_torch

TORCH_LIBRARY_IMPL(fsdpturbo, CUDA, m) {
  m.impl("moe_route", &fsdpturbo_torch::moe_route_cuda);
  m.impl("moe_permute", &fsdpturbo_torch::moe_permute_cuda);
  m.impl("moe_unpermute", &fsdpturbo_torch::moe_unpermute_cuda);
  m.impl("grouped_mm", &fsdpturbo_torch::grouped_mm_cuda);
  m.impl("grouped_mm_grad_input", &fsdpturbo_torch::grouped_mm_grad_input_cuda);
  m.impl("grouped_mm_grad_weight", &fsdpturbo_torch::grouped_mm_grad_weight_cuda);
  m.impl("power_sum", &fsdpturbo_torch::power_sum_cuda);
  m.impl("foreach_scale_", &fsdpturbo_torch::foreach_scale_cuda);
}
