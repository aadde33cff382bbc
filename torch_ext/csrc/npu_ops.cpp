// NPU (PrivateUse1, torch_npu) kernels of the MoE ops and the HCCL all-to-all of the mc2
// dispatcher. Grouped matmul runs aclnnGroupedMatmulV5/V4 and the all-to-all HcclAlltoAllV,
// both through libfsdpturbo (loaded at run time; no CANN headers or libraries at build time)
// on torch_npu's current stream; permute/unpermute are ATen compositions that torch_npu runs;
// routing metadata is computed on the host, where the split sizes must go anyway (DESIGN §4.5).
//
// Test mode (`fsdpturbo::_ascend_test_double_enable`): libfsdpturbo agrees only when every CANN
// library it loaded is fsdpturbo's C test double (csrc/testing, never installed; real CANN
// libraries lack its marker). Then these same kernels are also registered for CPU tensors (the
// double treats device pointers as host pointers) on a stream the double made, so the
// production call sequence runs end to end in CI.
#include <atomic>
#include <mutex>
#include <numeric>
#include <tuple>
#include <vector>

#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/DeviceGuardImplInterface.h>
#include <torch/library.h>

#include "common.h"

namespace fsdpturbo_torch {
namespace {

std::atomic<void*> test_stream{nullptr};

// torch_npu's current stream (an aclrtStream), or the double's stream in test mode.
void* stream_for(const at::Tensor& t, const char* op) {
  if (t.device().type() == c10::DeviceType::PrivateUse1) {
    auto impl = c10::impl::getDeviceGuardImpl(c10::DeviceType::PrivateUse1);
    try {
      return impl->getStream(t.device()).native_handle();
    } catch (const c10::Error& e) {
      TORCH_CHECK(false, "fsdpturbo::", op, ": torch_npu did not give the aclrtStream of its current stream "
                  "(c10::Stream::native_handle): ", e.what_without_backtrace());
    }
  }
  void* stream = test_stream.load();
  TORCH_CHECK(stream != nullptr, "fsdpturbo::", op, ": the NPU kernel got a ", t.device(),
              " tensor outside test mode");
  return stream;
}

int32_t npu_dtype(const at::Tensor& t, const char* op) {
  switch (t.scalar_type()) {
    case at::kFloat: return FSDPTURBO_DTYPE_F32;
    case at::kHalf: return FSDPTURBO_DTYPE_F16;
    case at::kBFloat16: return FSDPTURBO_DTYPE_BF16;
    default:
      TORCH_CHECK_VALUE(false, "fsdpturbo::", op, " on NPU: expected bfloat16, float16 or float32 (aclnn grouped "
                        "matmul), got ", t.scalar_type());
  }
}

// A tensor as aclCreateTensor sees it: the storage's start, its length, offset and strides.
struct NpuView {
  std::vector<int64_t> dims, strides;
  fsdpturbo_npu_view_t view;
  explicit NpuView(const at::Tensor& t) : dims(t.sizes().vec()), strides(t.strides().vec()) {
    view.storage = const_cast<void*>(t.storage().data());
    view.storage_len = static_cast<int64_t>(t.storage().nbytes() / t.element_size());
    view.offset = t.storage_offset();
    view.ndim = dims.size();
    view.dims = dims.data();
    view.strides = strides.data();
  }
};

// Workspaces from torch's allocator on the tensors' device: kept until the launch is queued;
// the caching allocator then reuses them only in stream order.
struct Workspaces {
  c10::Device device;
  std::vector<at::Tensor> keep;
};

void* allocate_workspace(void* ctx, uint64_t bytes) {
  auto* w = static_cast<Workspaces*>(ctx);
  try {
    w->keep.push_back(at::empty({static_cast<int64_t>(bytes)}, at::TensorOptions().dtype(at::kByte).device(w->device)));
    return w->keep.back().mutable_data_ptr();
  } catch (...) {
    return nullptr;
  }
}

void launch_gmm(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& counts, const at::Tensor& out,
                int64_t split_item, int64_t group_type, const char* op) {
  Workspaces workspaces{x.device(), {}};
  NpuView vx(x), vw(weight), vc(counts), vo(out);
  check(fsdpturbo_npu_grouped_matmul(npu_dtype(x, op), &vx.view, &vw.view, &vc.view, &vo.view, split_item, group_type,
                                     &allocate_workspace, &workspaces, stream_for(x, op)),
        op);
}

// The group list: int64 counts on the tensors' device, one per group.
at::Tensor group_list(const at::Tensor& counts, int64_t groups, const at::Tensor& like, const char* op) {
  TORCH_CHECK_VALUE(counts.dim() == 1 && counts.size(0) == groups, "fsdpturbo::", op, ": counts must be 1-D with ",
                    groups, " entries (one per expert), got shape ", counts.sizes());
  TORCH_CHECK_VALUE(!at::isFloatingType(counts.scalar_type()), "fsdpturbo::", op, ": counts must hold integers");
  return counts.to(like.device(), at::kLong).contiguous();
}

void same_dtype(const at::Tensor& a, const at::Tensor& b, const char* op) {
  TORCH_CHECK_VALUE(a.scalar_type() == b.scalar_type(), "fsdpturbo::", op, ": operands are ", a.scalar_type(),
                    " and ", b.scalar_type());
  npu_dtype(a, op);
}

// y = x @ weight[g]^T per group: aclnn weight [G, in, out] is the transposed view (no copy), as
// the seed passes `w_g.T`; every other operand is contiguous.
at::Tensor grouped_mm_npu(const at::Tensor& x, const at::Tensor& counts, const at::Tensor& weight) {
  const char* op = "grouped_mm";
  TORCH_CHECK_VALUE(x.dim() == 2 && weight.dim() == 3 && x.size(1) == weight.size(2),
                    "fsdpturbo::grouped_mm: x [N, in] and weight [G, out, in] expected, got ", x.sizes(), " and ",
                    weight.sizes());
  same_dtype(x, weight, op);
  auto c = group_list(counts, weight.size(0), x, op);
  auto y = at::empty({x.size(0), weight.size(1)}, x.options());
  if (y.numel() == 0) return y;
  launch_gmm(x.contiguous(), weight.contiguous().transpose(1, 2), c, y, 2, 0, "fsdpturbo::grouped_mm");
  return y;
}

at::Tensor grouped_mm_grad_input_npu(const at::Tensor& grad_y, const at::Tensor& counts, const at::Tensor& weight) {
  const char* op = "grouped_mm_grad_input";
  TORCH_CHECK_VALUE(grad_y.dim() == 2 && weight.dim() == 3 && grad_y.size(1) == weight.size(1),
                    "fsdpturbo::grouped_mm_grad_input: grad_y [N, out] and weight [G, out, in] expected, got ",
                    grad_y.sizes(), " and ", weight.sizes());
  same_dtype(grad_y, weight, op);
  auto c = group_list(counts, weight.size(0), grad_y, op);
  auto grad_x = at::empty({grad_y.size(0), weight.size(2)}, grad_y.options());
  if (grad_x.numel() == 0) return grad_x;
  launch_gmm(grad_y.contiguous(), weight.contiguous(), c, grad_x, 2, 0, "fsdpturbo::grouped_mm_grad_input");
  return grad_x;
}

// The seed's weight gradient: x^T [in, N] times grad_y [N, out] split along N (groupType 2),
// giving [G, in, out], returned as [G, out, in].
at::Tensor grouped_mm_grad_weight_npu(const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& counts) {
  const char* op = "grouped_mm_grad_weight";
  TORCH_CHECK_VALUE(grad_y.dim() == 2 && x.dim() == 2 && grad_y.size(0) == x.size(0),
                    "fsdpturbo::grouped_mm_grad_weight: grad_y [N, out] and x [N, in] expected, got ", grad_y.sizes(),
                    " and ", x.sizes());
  same_dtype(grad_y, x, op);
  TORCH_CHECK_VALUE(counts.dim() == 1, "fsdpturbo::grouped_mm_grad_weight: counts must be 1-D");
  auto c = group_list(counts, counts.size(0), x, op);
  auto grad_w = at::empty({c.size(0), x.size(1), grad_y.size(1)}, x.options());
  if (grad_w.numel() == 0) return grad_w.transpose(1, 2).contiguous();
  if (x.size(0) == 0) return grad_w.zero_().transpose(1, 2).contiguous();
  launch_gmm(x.contiguous().t(), grad_y.contiguous(), c, grad_w, 3, 2, "fsdpturbo::grouped_mm_grad_weight");
  return grad_w.transpose(1, 2).contiguous();
}

at::Tensor moe_permute_npu(const at::Tensor& hidden, const at::Tensor& rows, int64_t row_divisor) {
  TORCH_CHECK_VALUE(hidden.dim() == 2, "fsdpturbo::moe_permute: hidden must be [tokens, hidden], got ", hidden.sizes());
  TORCH_CHECK_VALUE(row_divisor >= 1, "fsdpturbo::moe_permute: row_divisor must be >= 1, got ", row_divisor);
  TORCH_CHECK_VALUE(rows.dim() == 1 && !at::isFloatingType(rows.scalar_type()),
                    "fsdpturbo::moe_permute: rows must be 1-D integers, got ", rows.sizes());
  auto index = rows.to(hidden.device(), at::kLong);
  return hidden.index_select(0, row_divisor == 1 ? index : index.div(row_divisor, "floor"));
}

// out[t] = sum_k probs[t, k] * permuted[inverse(permutation)[t * top_k + k]], accumulated in
// f32 (f64 for f64) with probs first rounded to the tokens' dtype, as the host kernel does.
at::Tensor moe_unpermute_npu(const at::Tensor& permuted, const at::Tensor& permutation,
                             const std::optional<at::Tensor>& probs, int64_t tokens, int64_t top_k) {
  check_unpermute_shape(permuted, tokens, top_k);
  TORCH_CHECK_VALUE(permutation.dim() == 1 && permutation.numel() == tokens * top_k,
                    "fsdpturbo::moe_unpermute: permutation must have ", tokens * top_k, " entries");
  auto perm = permutation.to(permuted.device(), at::kLong);
  auto inverse = at::empty_like(perm).scatter_(0, perm, at::arange(perm.numel(), perm.options()));
  auto acc = permuted.scalar_type() == at::kDouble ? at::kDouble : at::kFloat;
  auto per_slot = permuted.index_select(0, inverse).view({tokens, top_k, permuted.size(1)}).to(acc);
  if (probs) {
    TORCH_CHECK_VALUE(probs->numel() == tokens * top_k, "fsdpturbo::moe_unpermute: probs must have ", tokens * top_k,
                      " elements, got shape ", probs->sizes());
    per_slot = per_slot * probs->reshape({tokens, top_k, 1}).to(permuted.scalar_type()).to(acc);
  }
  return per_slot.sum(1).to(permuted.scalar_type());
}

// Routing metadata on the host (the CPU kernels), results back on the device.
template <typename... Args>
std::tuple<at::Tensor, at::Tensor, at::Tensor> on_host(const char* name, const at::Tensor& t, Args... args) {
  auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow(name, "")
                       .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor>(const at::Tensor&, Args...)>();
  auto [a, b, c] = op.call(t.cpu(), args...);
  return {a.to(t.device()), b.to(t.device()), c.to(t.device())};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_route_npu(const at::Tensor& ids, int64_t experts, int64_t ep) {
  return on_host<int64_t, int64_t>("fsdpturbo::moe_route", ids, experts, ep);
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> moe_receive_npu(const at::Tensor& gathered, int64_t rank) {
  return on_host<int64_t>("fsdpturbo::moe_receive", gathered, rank);
}

// Rows of x to and from every rank of an HCCL communicator (`comm`: a fsdpturbo_hccl_comm_t*
// made by fsdpturbo.mc2), packed in rank order.
at::Tensor hccl_all_to_all_v_npu(const at::Tensor& x, int64_t comm, c10::IntArrayRef output_splits,
                                 c10::IntArrayRef input_splits) {
  TORCH_CHECK_VALUE(comm != 0, "fsdpturbo::hccl_all_to_all_v: comm is NULL");
  TORCH_CHECK_VALUE(x.dim() == 2, "fsdpturbo::hccl_all_to_all_v: x must be [rows, width], got ", x.sizes());
  TORCH_CHECK_VALUE(output_splits.size() == input_splits.size(), "fsdpturbo::hccl_all_to_all_v: ",
                    input_splits.size(), " input splits but ", output_splits.size(), " output splits");
  auto sends = unsigned_from(input_splits, "input_splits");
  auto recvs = unsigned_from(output_splits, "output_splits");
  uint64_t sent = std::accumulate(sends.begin(), sends.end(), uint64_t{0});
  uint64_t received = std::accumulate(recvs.begin(), recvs.end(), uint64_t{0});
  TORCH_CHECK_VALUE(sent == static_cast<uint64_t>(x.size(0)), "fsdpturbo::hccl_all_to_all_v: input splits sum to ",
                    sent, " rows but x has ", x.size(0));
  auto src = x.contiguous();
  auto out = at::empty({static_cast<int64_t>(received), x.size(1)}, x.options());
  uint64_t width = static_cast<uint64_t>(x.size(1));
  std::vector<uint64_t> send_counts, send_displs, recv_counts, recv_displs;
  uint64_t s = 0, r = 0;
  for (size_t p = 0; p < sends.size(); ++p) {
    send_counts.push_back(sends[p] * width);
    send_displs.push_back(s);
    s += sends[p] * width;
    recv_counts.push_back(recvs[p] * width);
    recv_displs.push_back(r);
    r += recvs[p] * width;
  }
  int32_t dtype = src.scalar_type() == at::kDouble ? FSDPTURBO_DTYPE_F64 : npu_dtype(src, "hccl_all_to_all_v");
  check(fsdpturbo_hccl_all_to_all_v(reinterpret_cast<const fsdpturbo_hccl_comm_t*>(comm), src.const_data_ptr(),
                                    out.mutable_data_ptr(), send_counts.data(), send_displs.data(), recv_counts.data(),
                                    recv_displs.data(), sends.size(), dtype, stream_for(src, "hccl_all_to_all_v")),
        "fsdpturbo::hccl_all_to_all_v");
  return out;
}

at::Tensor hccl_all_to_all_v_host(const at::Tensor& x, int64_t, c10::IntArrayRef, c10::IntArrayRef) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "fsdpturbo::hccl_all_to_all_v runs on Ascend NPU tensors (HCCL); got ",
                              x.device(), ". On other devices use torch.distributed");
}

void register_device_kernels(torch::Library& m) {
  m.impl("moe_permute", &moe_permute_npu);
  m.impl("moe_unpermute", &moe_unpermute_npu);
  m.impl("grouped_mm", &grouped_mm_npu);
  m.impl("grouped_mm_grad_input", &grouped_mm_grad_input_npu);
  m.impl("grouped_mm_grad_weight", &grouped_mm_grad_weight_npu);
  m.impl("hccl_all_to_all_v", &hccl_all_to_all_v_npu);
}

void ascend_test_double_enable() {
  static std::once_flag once;
  std::call_once(once, [] {
    void* stream = nullptr;
    check(fsdpturbo_ascend_test_double_stream(&stream), "fsdpturbo::_ascend_test_double_enable");
    test_stream.store(stream);
    // Lives as long as the process: the registrations must outlive every call.
    static torch::Library cpu(torch::Library::IMPL, "fsdpturbo", c10::DispatchKey::CPU, __FILE__, __LINE__);
    register_device_kernels(cpu);
  });
}

}  // namespace
}  // namespace fsdpturbo_torch

TORCH_LIBRARY_FRAGMENT(fsdpturbo, m) {
  // All-to-all-v of rows over an HCCL communicator (the mc2 dispatcher's transport); splits in rows.
  m.def("hccl_all_to_all_v(Tensor x, int comm, int[] output_splits, int[] input_splits) -> Tensor");
  // Tests only: run the NPU kernels on CPU tensors over fsdpturbo's C test doubles of CANN.
  // Refused unless every loaded CANN library is the double.
  m.def("_ascend_test_double_enable() -> ()", &fsdpturbo_torch::ascend_test_double_enable);
}

TORCH_LIBRARY_IMPL(fsdpturbo, CPU, m) { m.impl("hccl_all_to_all_v", &fsdpturbo_torch::hccl_all_to_all_v_host); }

TORCH_LIBRARY_IMPL(fsdpturbo, PrivateUse1, m) {
  fsdpturbo_torch::register_device_kernels(m);
  m.impl("moe_route", &fsdpturbo_torch::moe_route_npu);
  m.impl("moe_receive", &fsdpturbo_torch::moe_receive_npu);
}
