// The `fsdpturbo` op namespace: the schemas of the MoE, slicing and grad-norm ops, and the kernels
// that take no tensors. Tensor kernels are registered per dispatch key next to their
// implementation; the NPU token ops and MC2 ops define their schemas with their kernels
// (token_ops.cpp, npu_ops.cpp).
#include <string>
#include <tuple>
#include <vector>

#include <ATen/Parallel.h>
#include <torch/library.h>

#include "common.h"

namespace fsdpturbo_torch {
namespace {

std::string version() { return fsdpturbo_version(); }

// torch 2.15 `_compute_local_shape_and_global_offset`, computed by the Rust core.
std::tuple<std::vector<int64_t>, std::vector<int64_t>> local_shape_and_offset(
    c10::IntArrayRef global_shape, c10::IntArrayRef mesh_shape, c10::IntArrayRef coordinate,
    c10::IntArrayRef placements) {
  auto global = unsigned_from(global_shape, "global_shape");
  auto mesh = unsigned_from(mesh_shape, "mesh_shape");
  auto coord = unsigned_from(coordinate, "coordinate");
  TORCH_CHECK_VALUE(coord.size() == mesh.size(), "coordinate has ", coord.size(),
                    " entries but the mesh has ", mesh.size(), " dims");
  auto placed = placements_from(placements, mesh.size());
  std::vector<uint64_t> local(global.size()), offset(global.size());
  check(fsdpturbo_local_shape_and_offset(global.data(), global.size(), mesh.data(), coord.data(), mesh.size(),
                                         placed.data(), local.data(), offset.data()),
        "fsdpturbo::local_shape_and_offset");
  return {std::vector<int64_t>(local.begin(), local.end()), std::vector<int64_t>(offset.begin(), offset.end())};
}

// The host kernels' workers run on torch's intra-op threads: threads of their own would compete
// for the cores with OpenMP workers that spin after each torch op (BENCHMARKS.md). Only where
// at::parallel_for runs in parallel here: torch's OpenMP build inlines it, which needs -fopenmp.
#if !AT_PARALLEL_OPENMP || defined(_OPENMP)
#define FSDPTURBO_TORCH_THREADS 1
void run_on_torch_threads(void*, size_t workers, fsdpturbo_host_work_fn work, void* arg) {
  at::parallel_for(0, static_cast<int64_t>(workers), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) work(arg, static_cast<size_t>(i));
  });
}
#endif

}  // namespace
}  // namespace fsdpturbo_torch

TORCH_LIBRARY(fsdpturbo, m) {
#ifdef FSDPTURBO_TORCH_THREADS
  fsdpturbo_torch::check(fsdpturbo_set_host_thread_pool(&fsdpturbo_torch::run_on_torch_threads, nullptr),
                         "fsdpturbo_set_host_thread_pool");
#endif
  m.def("version() -> str", &fsdpturbo_torch::version);
  m.def("local_shape_and_offset(int[] global_shape, int[] mesh_shape, int[] coordinate, int[] placements)"
        " -> (int[], int[])",
        &fsdpturbo_torch::local_shape_and_offset);
  // Copies this rank's slice of `full` (the whole tensor) into `local`; placements as
  // [kind, dim, split_factor] per mesh dim. Same dtype; `full` is read, `local` written.
  m.def("copy_slice_(Tensor(a!) local, Tensor full, int[] mesh_shape, int[] coordinate, int[] placements) -> ()");
  // The inverse: writes `local` to its place in `full` (one rank's part of a gather).
  m.def("scatter_slice_(Tensor(a!) full, Tensor local, int[] mesh_shape, int[] coordinate, int[] placements) -> ()");
  // Σ|x|^p over every element of `tensors` (max |x| for p = inf), as a float64 scalar.
  m.def("power_sum(Tensor[] tensors, float norm_type, bool accumulate_f64=True) -> Tensor");
  // Multiplies every tensor in place by `coef` with one fused pass.
  m.def("foreach_scale_(Tensor(a!)[] tensors, float coef) -> ()");
  // MoE routing: per-expert counts, the stable expert-major permutation of the flat (token, k)
  // slots, and the rows sent to each ep rank. Ids outside [0, num_experts) are an error.
  m.def("moe_route(Tensor expert_ids, int num_experts, int ep_size) -> (Tensor, Tensor, Tensor)");
  // out[i] = hidden[rows[i] // row_divisor] (row_divisor = top_k for the first permute).
  m.def("moe_permute(Tensor hidden, Tensor rows, int row_divisor) -> Tensor");
  // out[t] = sum_k probs[t, k] * permuted[inverse(permutation)[t * top_k + k]], in k order.
  m.def("moe_unpermute(Tensor permuted, Tensor permutation, Tensor? probs, int tokens, int top_k) -> Tensor");
  // y[rows of g] = x[rows of g] @ weight[g]^T for consecutive groups of counts[g] rows.
  m.def("grouped_mm(Tensor x, Tensor counts, Tensor weight) -> Tensor");
  m.def("grouped_mm_grad_input(Tensor grad_y, Tensor counts, Tensor weight) -> Tensor");
  m.def("grouped_mm_grad_weight(Tensor grad_y, Tensor x, Tensor counts) -> Tensor");
}
