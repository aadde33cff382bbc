// Kernels of copy_slice_ and scatter_slice_: the Rust copy plan of a placement moves the
// contiguous runs of this rank's slice between the full tensor and the local one.
#include <memory>
#include <vector>

#include <ATen/ATen.h>
#include <torch/library.h>

#include "common.h"

namespace fsdpturbo_torch {
namespace {

struct PlanDeleter {
  void operator()(fsdpturbo_copy_plan_t* plan) const { fsdpturbo_copy_plan_free(plan); }
};
using CopyPlan = std::unique_ptr<fsdpturbo_copy_plan_t, PlanDeleter>;

// The plan for `full`'s shape, after checking that `local` has the planned local shape.
CopyPlan make_plan(const at::Tensor& local, const at::Tensor& full, c10::IntArrayRef mesh_shape,
                   c10::IntArrayRef coordinate, c10::IntArrayRef placements, const char* op) {
  TORCH_CHECK_VALUE(local.scalar_type() == full.scalar_type(), "fsdpturbo::", op, ": local is ",
                    local.scalar_type(), " but full is ", full.scalar_type(), "; cast first");
  auto global = unsigned_from(full.sizes(), "full.shape");
  auto mesh = unsigned_from(mesh_shape, "mesh_shape");
  auto coord = unsigned_from(coordinate, "coordinate");
  TORCH_CHECK_VALUE(coord.size() == mesh.size(), "coordinate has ", coord.size(),
                    " entries but the mesh has ", mesh.size(), " dims");
  auto placed = placements_from(placements, mesh.size());
  fsdpturbo_copy_plan_t* raw = nullptr;
  check(fsdpturbo_copy_plan_new(global.data(), global.size(), mesh.data(), coord.data(), mesh.size(),
                                placed.data(), &raw),
        op);
  CopyPlan plan(raw);
  std::vector<uint64_t> local_shape(global.size());
  size_t n = 0;
  check(fsdpturbo_copy_plan_local_shape(plan.get(), local_shape.data(), local_shape.size(), &n), op);
  TORCH_CHECK_VALUE(std::vector<int64_t>(local_shape.begin(), local_shape.end()) == local.sizes().vec(),
                    "fsdpturbo::", op, ": local has shape ", local.sizes(), " but this rank's slice of ",
                    full.sizes(), " has shape ", c10::IntArrayRef(reinterpret_cast<int64_t*>(local_shape.data()), n));
  return plan;
}

void copy_slice_cpu(const at::Tensor& local, const at::Tensor& full, c10::IntArrayRef mesh_shape,
                    c10::IntArrayRef coordinate, c10::IntArrayRef placements) {
  auto plan = make_plan(local, full, mesh_shape, coordinate, placements, "copy_slice_");
  auto source = full.contiguous();
  auto target = local.is_contiguous() ? local : at::empty_like(local, at::MemoryFormat::Contiguous);
  size_t elem = source.element_size();
  check(fsdpturbo_copy_bytes(plan.get(), elem, source.const_data_ptr(), source.numel() * elem,
                             target.mutable_data_ptr(), target.numel() * elem),
        "fsdpturbo::copy_slice_");
  if (!target.is_same(local)) local.copy_(target);
}

void scatter_slice_cpu(const at::Tensor& full, const at::Tensor& local, c10::IntArrayRef mesh_shape,
                       c10::IntArrayRef coordinate, c10::IntArrayRef placements) {
  auto plan = make_plan(local, full, mesh_shape, coordinate, placements, "scatter_slice_");
  auto source = local.contiguous();
  auto target = full.is_contiguous() ? full : at::empty_like(full, at::MemoryFormat::Contiguous);
  if (!target.is_same(full)) target.copy_(full);
  size_t elem = source.element_size();
  check(fsdpturbo_copy_bytes_back(plan.get(), elem, source.const_data_ptr(), source.numel() * elem,
                                  target.mutable_data_ptr(), target.numel() * elem),
        "fsdpturbo::scatter_slice_");
  if (!target.is_same(full)) full.copy_(target);
}

void copy_slice_meta(const at::Tensor& local, const at::Tensor& full, c10::IntArrayRef mesh_shape,
                     c10::IntArrayRef coordinate, c10::IntArrayRef placements) {
  make_plan(local, full, mesh_shape, coordinate, placements, "copy_slice_");
}

void scatter_slice_meta(const at::Tensor& full, const at::Tensor& local, c10::IntArrayRef mesh_shape,
                        c10::IntArrayRef coordinate, c10::IntArrayRef placements) {
  make_plan(local, full, mesh_shape, coordinate, placements, "scatter_slice_");
}

void copy_slice_device(const at::Tensor& local, const at::Tensor&, c10::IntArrayRef, c10::IntArrayRef,
                       c10::IntArrayRef) {
  not_available("copy_slice_", local.device());
}

void scatter_slice_device(const at::Tensor& full, const at::Tensor&, c10::IntArrayRef, c10::IntArrayRef,
                          c10::IntArrayRef) {
  not_available("scatter_slice_", full.device());
}

}  // namespace
}  // namespace fsdpturbo_torch

TORCH_LIBRARY_IMPL(fsdpturbo, CPU, m) {
  m.impl("copy_slice_", &fsdpturbo_torch::copy_slice_cpu);
  m.impl("scatter_slice_", &fsdpturbo_torch::scatter_slice_cpu);
}

TORCH_LIBRARY_IMPL(fsdpturbo, Meta, m) {
  m.impl("copy_slice_", &fsdpturbo_torch::copy_slice_meta);
  m.impl("scatter_slice_", &fsdpturbo_torch::scatter_slice_meta);
}

TORCH_LIBRARY_IMPL(fsdpturbo, CUDA, m) {
  m.impl("copy_slice_", &fsdpturbo_torch::copy_slice_device);
  m.impl("scatter_slice_", &fsdpturbo_torch::scatter_slice_device);
}

TORCH_LIBRARY_IMPL(fsdpturbo, PrivateUse1, m) {
  m.impl("copy_slice_", &fsdpturbo_torch::copy_slice_device);
  m.impl("scatter_slice_", &fsdpturbo_torch::scatter_slice_device);
}
