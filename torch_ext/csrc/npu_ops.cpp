// NPU (PrivateUse1, torch_npu) kernels of the MoE ops, through libfsdpturbo's aclnn bindings
// (loaded at run time; no CANN headers or libraries at build time), on torch_npu's current
// stream: grouped matmul (aclnnGroupedMatmulV5/V4), token permute/unpermute
// (aclnnMoeTokenPermute/Unpermute) and the MC2 operators (aclnnAlltoAllvGroupedMatMul,
// aclnnGroupedMatMulAlltoAllv) over a process group's HCCL communicator named by the caller.
// The generic row gather/combine (moe_permute/moe_unpermute) are ATen compositions torch_npu
// runs; routing metadata is computed on the host, where the split sizes must go anyway
// (docs/design.md §4.5).
//
// Test mode (`fsdpturbo::_ascend_test_double_enable`): libfsdpturbo agrees only when every CANN
// library it loaded is fsdpturbo's C test double (tests/doubles, never installed; real CANN
// libraries lack its marker). Then these same kernels are also registered for CPU tensors (the
// double treats device pointers as host pointers) on a stream the double made, so the
// production call sequence runs end to end in CI.
#include <atomic>
#include <mutex>
#include <numeric>
#include <optional>
#include <string>
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
  check(fsdpturbo_npu_grouped_mm(npu_dtype(x, op), &vx.view, &vw.view, &vc.view, &vo.view, split_item, group_type,
                                     &allocate_workspace, &workspaces, stream_for(x, op)),
        op);
}

// aclnnMoeTokenPermute: the rows of `tokens` in the stable order of `indices`, and every slot's row.
std::tuple<at::Tensor, at::Tensor> moe_token_permute_npu(const at::Tensor& tokens, const at::Tensor& indices) {
  const char* name = "moe_token_permute";
  const char* op = "fsdpturbo::moe_token_permute";
  int64_t top_k = check_token_permute(tokens, indices);
  auto src = tokens.contiguous();
  auto ids = indices.to(tokens.device(), at::kInt).contiguous();
  auto permuted = at::empty({tokens.size(0) * top_k, tokens.size(1)}, tokens.options());
  auto sorted = at::empty({tokens.size(0) * top_k}, tokens.options().dtype(at::kInt));
  if (sorted.numel() == 0) return {permuted, sorted};
  Workspaces workspaces{tokens.device(), {}};
  NpuView vt(src), vi(ids), vp(permuted), vs(sorted);
  check(fsdpturbo_npu_moe_token_permute(npu_dtype(src, name), &vt.view, &vi.view, &vp.view, &vs.view,
                                        &allocate_workspace, &workspaces, stream_for(src, name)),
        op);
  return {permuted, sorted};
}

// aclnnMoeTokenUnpermute; probs are first rounded to the tokens' dtype, as the host kernels do.
at::Tensor moe_token_unpermute_npu(const at::Tensor& permuted, const at::Tensor& sorted_indices,
                                   const std::optional<at::Tensor>& probs) {
  const char* name = "moe_token_unpermute";
  const char* op = "fsdpturbo::moe_token_unpermute";
  int64_t top_k = check_token_unpermute(permuted, sorted_indices, probs);
  auto src = permuted.contiguous();
  auto rows = sorted_indices.to(permuted.device(), at::kInt).contiguous();
  auto out = at::empty({sorted_indices.numel() / top_k, permuted.size(1)}, permuted.options());
  if (out.numel() == 0) return out;
  std::optional<at::Tensor> weights;
  if (probs) weights = probs->to(permuted.device(), permuted.scalar_type()).contiguous();
  Workspaces workspaces{permuted.device(), {}};
  NpuView vp(src), vs(rows), vo(out);
  std::optional<NpuView> vw;
  if (weights) vw.emplace(*weights);
  check(fsdpturbo_npu_moe_token_unpermute(npu_dtype(src, name), &vp.view, &vs.view, vw ? &vw->view : nullptr, &vo.view,
                                          &allocate_workspace, &workspaces, stream_for(src, name)),
        op);
  return out;
}

// What an MC2 operator needs besides its tensors: the communicator's name and the counts.
struct Exchange {
  std::string group;
  std::vector<int64_t> send, recv;
  fsdpturbo_npu_exchange_t spec;
  Exchange(c10::string_view name, int64_t ep_world_size, c10::IntArrayRef send_counts, c10::IntArrayRef recv_counts,
           bool trans_weight)
      : group(name), send(send_counts.vec()), recv(recv_counts.vec()) {
    spec.group = group.c_str();
    spec.ep_world_size = ep_world_size;
    spec.counts_len = send.size();
    spec.send_counts = send.data();
    spec.recv_counts = recv.data();
    spec.trans_weight = trans_weight;
  }
};

int64_t total(c10::IntArrayRef counts) { return std::accumulate(counts.begin(), counts.end(), int64_t{0}); }

// Shape and dtype constraints of both MC2 operators, checked before launch. Returns N.
int64_t check_mc2(const at::Tensor& x, const at::Tensor& weight, int64_t ep_world_size, c10::IntArrayRef send_counts,
                  c10::IntArrayRef recv_counts, bool trans_weight, const char* op) {
  TORCH_CHECK_VALUE(x.dim() == 2 && weight.dim() == 3, op, ": x [rows, in] and a 3-D weight expected, got ", x.sizes(),
                    " and ", weight.sizes());
  TORCH_CHECK_VALUE(x.scalar_type() == weight.scalar_type() &&
                        (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kHalf),
                    op, ": the MC2 operators take bfloat16 or float16 (one dtype), got ", x.scalar_type(), " and ",
                    weight.scalar_type());
  int64_t in = trans_weight ? weight.size(2) : weight.size(1), experts = weight.size(0);
  TORCH_CHECK_VALUE(x.size(1) == in, op, ": x has ", x.size(1), " columns but the weight (",
                    trans_weight ? "[experts, out, in]" : "[experts, in, out]", ") takes ", in);
  TORCH_CHECK_VALUE(ep_world_size >= 1 && static_cast<int64_t>(send_counts.size()) == experts * ep_world_size &&
                        recv_counts.size() == send_counts.size(),
                    op, ": send_counts and recv_counts need ", experts, " local experts x ", ep_world_size,
                    " ranks = ", experts * ep_world_size, " entries, got ", send_counts.size(), " and ",
                    recv_counts.size());
  TORCH_CHECK_VALUE(experts <= 32 && experts * ep_world_size <= 256, op,
                    ": the operator takes at most 32 local experts and 256 counts, got ", experts, " x ", ep_world_size);
  unsigned_from(send_counts, "send_counts");
  unsigned_from(recv_counts, "recv_counts");
  TORCH_CHECK_VALUE(total(send_counts) == x.size(0), op, ": send_counts sum to ", total(send_counts), " rows but x has ",
                    x.size(0));
  return trans_weight ? weight.size(1) : weight.size(2);
}

// aclnnAlltoAllvGroupedMatMul: (rows times their expert's weight, the permuted rows).
std::tuple<at::Tensor, at::Tensor> alltoallv_grouped_mm_npu(const at::Tensor& x, const at::Tensor& weight,
                                                            c10::string_view group, int64_t ep_world_size,
                                                            c10::IntArrayRef send_counts,
                                                            c10::IntArrayRef recv_counts, bool trans_weight) {
  const char* name = "alltoallv_grouped_mm";
  const char* op = "fsdpturbo::alltoallv_grouped_mm";
  int64_t out = check_mc2(x, weight, ep_world_size, send_counts, recv_counts, trans_weight, op);
  auto src = x.contiguous(), w = weight.contiguous();
  auto y = at::empty({total(recv_counts), out}, x.options());
  auto permuted = at::empty({total(recv_counts), x.size(1)}, x.options());
  Exchange exchange(group, ep_world_size, send_counts, recv_counts, trans_weight);
  Workspaces workspaces{x.device(), {}};
  NpuView vx(src), vw(w), vy(y), vp(permuted);
  check(fsdpturbo_npu_alltoallv_grouped_mm(npu_dtype(src, name), &vx.view, &vw.view, &exchange.spec, &vy.view,
                                               &vp.view, &allocate_workspace, &workspaces, stream_for(src, name)),
        op);
  return {y, permuted};
}

// aclnnGroupedMatMulAlltoAllv: local-expert-major rows times their expert's weight, back to the
// ranks (and the order) they came from.
at::Tensor grouped_mm_alltoallv_npu(const at::Tensor& x, const at::Tensor& weight, c10::string_view group,
                                    int64_t ep_world_size, c10::IntArrayRef send_counts, c10::IntArrayRef recv_counts,
                                    bool trans_weight) {
  const char* name = "grouped_mm_alltoallv";
  const char* op = "fsdpturbo::grouped_mm_alltoallv";
  int64_t out = check_mc2(x, weight, ep_world_size, send_counts, recv_counts, trans_weight, op);
  auto src = x.contiguous(), w = weight.contiguous();
  auto y = at::empty({total(recv_counts), out}, x.options());
  Exchange exchange(group, ep_world_size, send_counts, recv_counts, trans_weight);
  Workspaces workspaces{x.device(), {}};
  NpuView vx(src), vw(w), vy(y);
  check(fsdpturbo_npu_grouped_mm_alltoallv(npu_dtype(src, name), &vx.view, &vw.view, &exchange.spec, &vy.view,
                                               &allocate_workspace, &workspaces, stream_for(src, name)),
        op);
  return y;
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

std::tuple<at::Tensor, at::Tensor> alltoallv_grouped_mm_host(const at::Tensor& x, const at::Tensor&, c10::string_view,
                                                             int64_t, c10::IntArrayRef, c10::IntArrayRef, bool) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "fsdpturbo::alltoallv_grouped_mm runs on Ascend NPU tensors (MC2); got ",
                              x.device());
}

at::Tensor grouped_mm_alltoallv_host(const at::Tensor& x, const at::Tensor&, c10::string_view, int64_t,
                                     c10::IntArrayRef, c10::IntArrayRef, bool) {
  TORCH_CHECK_NOT_IMPLEMENTED(false, "fsdpturbo::grouped_mm_alltoallv runs on Ascend NPU tensors (MC2); got ",
                              x.device());
}

void register_device_kernels(torch::Library& m) {
  m.impl("moe_permute", &moe_permute_npu);
  m.impl("moe_unpermute", &moe_unpermute_npu);
  m.impl("grouped_mm", &grouped_mm_npu);
  m.impl("grouped_mm_grad_input", &grouped_mm_grad_input_npu);
  m.impl("grouped_mm_grad_weight", &grouped_mm_grad_weight_npu);
  m.impl("moe_token_permute", &moe_token_permute_npu);
  m.impl("moe_token_unpermute", &moe_token_unpermute_npu);
  m.impl("alltoallv_grouped_mm", &alltoallv_grouped_mm_npu);
  m.impl("grouped_mm_alltoallv", &grouped_mm_alltoallv_npu);
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
  // MC2 (Ascend): `x` rows grouped by destination expert (send_counts[r * e + j] to local expert
  // j of rank r) to their experts over the HCCL communicator named `group`, permuted
  // local-expert-major, times their expert's weight ([e, out, in] with trans_weight, else
  // [e, in, out]). Returns (y, the permuted rows).
  m.def("alltoallv_grouped_mm(Tensor x, Tensor weight, str group, int ep_world_size, int[] send_counts, "
        "int[] recv_counts, bool trans_weight) -> (Tensor, Tensor)");
  // The way back: local-expert-major rows times their expert's weight, returned to their ranks
  // in the order they were sent (send_counts here are the rows each expert got from each rank).
  m.def("grouped_mm_alltoallv(Tensor x, Tensor weight, str group, int ep_world_size, int[] send_counts, "
        "int[] recv_counts, bool trans_weight) -> Tensor");
  // Tests only: run the NPU kernels on CPU tensors over fsdpturbo's C test doubles of CANN.
  // Refused unless every loaded CANN library is the double.
  m.def("_ascend_test_double_enable() -> ()", &fsdpturbo_torch::ascend_test_double_enable);
}

TORCH_LIBRARY_IMPL(fsdpturbo, CPU, m) {
  m.impl("alltoallv_grouped_mm", &fsdpturbo_torch::alltoallv_grouped_mm_host);
  m.impl("grouped_mm_alltoallv", &fsdpturbo_torch::grouped_mm_alltoallv_host);
}

TORCH_LIBRARY_IMPL(fsdpturbo, PrivateUse1, m) {
  fsdpturbo_torch::register_device_kernels(m);
  m.impl("moe_route", &fsdpturbo_torch::moe_route_npu);
}
