// The C++ trainer path of libfsdpturbo, end to end through the C ABI:
//   parse a training config → build the topology → resolve the EP plan of a model (HF
//   config.json) → compute this rank's slice of the expert weights → clip the gradients with a
//   collective (NCCL when FSDPTURBO_TRAINER_COMM=nccl, one rank otherwise).
//
//   cpp_trainer CONFIG.yaml MODEL.json [--world N] [--rank R]
//
// --world/--rank describe the planned job (default 8 / 0); the grad norm runs over the processes
// actually started: one, or WORLD_SIZE NCCL ranks (RANK, LOCAL_RANK; rank 0 writes the NCCL id
// to FSDPTURBO_NCCL_ID_FILE, the others read it). Gradients are a deterministic function of the
// global element index, so every rank can compute the exact expected total norm and check it.
// Exit: 0 checked, 1 failure, 77 NCCL asked for but no GPU/NCCL (ctest SKIP_RETURN_CODE).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "fsdpturbo.h"

namespace {

[[noreturn]] void fail(const char* what, int32_t status) {
  char message[2048];
  fsdpturbo_last_error(message, sizeof message);
  std::fprintf(stderr, "cpp_trainer: %s failed (%s): %s\n", what, fsdpturbo_status_name(status), message);
  std::exit(1);
}

void ok(int32_t status, const char* what) {
  if (status != FSDPTURBO_OK) fail(what, status);
}

std::string read_file(const char* path) {
  std::ifstream in(path);
  if (!in) {
    std::fprintf(stderr, "cpp_trainer: cannot read %s\n", path);
    std::exit(1);
  }
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

uint64_t env_u64(const char* name, uint64_t fallback) {
  const char* v = std::getenv(name);
  return v && *v ? std::strtoull(v, nullptr, 10) : fallback;
}

// Gradient element i of the global expert gradient (and of the plain one, offset by `salt`).
float grad_value(uint64_t i, uint64_t salt) { return static_cast<float>(((i * 2654435761u + salt) % 1000) / 500.0 - 1.0); }

// The communicator of the processes started: NCCL or one rank.
fsdpturbo_comm_t* make_comm(bool nccl, size_t world, size_t rank) {
  fsdpturbo_comm_t* comm = nullptr;
  if (!nccl) {
    ok(fsdpturbo_comm_single_new(&comm), "fsdpturbo_comm_single_new");
    return comm;
  }
  int32_t version = 0;
  if (fsdpturbo_nccl_version(&version) != FSDPTURBO_OK) {
    std::printf("cpp_trainer: NCCL is not available here, skipping\n");
    std::exit(77);
  }
  uint8_t id[FSDPTURBO_NCCL_UNIQUE_ID_BYTES];
  const char* id_file = std::getenv("FSDPTURBO_NCCL_ID_FILE");
  if (rank == 0) {
    ok(fsdpturbo_nccl_unique_id(id), "fsdpturbo_nccl_unique_id");
    if (world > 1) {
      if (!id_file) fail("FSDPTURBO_NCCL_ID_FILE must name a shared file for several ranks", FSDPTURBO_ERR_INVALID_ARGUMENT);
      std::string tmp = std::string(id_file) + ".tmp";
      std::ofstream(tmp, std::ios::binary).write(reinterpret_cast<const char*>(id), sizeof id);
      std::rename(tmp.c_str(), id_file);
    }
  } else {
    for (int i = 0;; ++i) {
      std::ifstream in(id_file ? id_file : "", std::ios::binary);
      if (in && in.read(reinterpret_cast<char*>(id), sizeof id)) break;
      if (i > 600) fail("waiting for the NCCL id file", FSDPTURBO_ERR_UNAVAILABLE);
      std::this_thread::sleep_for(std::chrono::milliseconds(100));
    }
  }
  int32_t device = static_cast<int32_t>(env_u64("LOCAL_RANK", rank));
  int32_t status = fsdpturbo_comm_nccl_new(id, world, rank, device, &comm);
  if (status == FSDPTURBO_ERR_UNAVAILABLE) {
    char message[1024];
    fsdpturbo_last_error(message, sizeof message);
    std::printf("cpp_trainer: no CUDA device for NCCL (%s), skipping\n", message);
    std::exit(77);
  }
  ok(status, "fsdpturbo_comm_nccl_new");
  std::printf("cpp_trainer: NCCL %d communicator, rank %zu of %zu on device %d\n", version, rank, world, device);
  return comm;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 3) {
    std::fprintf(stderr, "usage: %s CONFIG.yaml MODEL.json [--world N] [--rank R]\n", argv[0]);
    return 1;
  }
  uint64_t world = 8, rank = 0;
  for (int i = 3; i + 1 < argc; i += 2) {
    if (!std::strcmp(argv[i], "--world")) world = std::strtoull(argv[i + 1], nullptr, 10);
    else if (!std::strcmp(argv[i], "--rank")) rank = std::strtoull(argv[i + 1], nullptr, 10);
  }
  std::printf("cpp_trainer: libfsdpturbo %s\n", fsdpturbo_version());

  // 1. Config and topology.
  std::string yaml = read_file(argv[1]);
  fsdpturbo_config_t* config = nullptr;
  ok(fsdpturbo_config_parse(yaml.c_str(), yaml.size(), &config), "fsdpturbo_config_parse");
  fsdpturbo_topology_t* topology = nullptr;
  ok(fsdpturbo_topology_from_config(config, world, &topology), "fsdpturbo_topology_from_config");
  uint64_t ep = 0;
  ok(fsdpturbo_topology_size(topology, "ep", &ep), "fsdpturbo_topology_size(ep)");

  // 2. The plan of the model.
  std::string model = read_file(argv[2]);
  fsdpturbo_plan_t* plan = nullptr;
  ok(fsdpturbo_plan_resolve_hf(model.c_str(), config, topology, &plan), "fsdpturbo_plan_resolve_hf");
  size_t modules = 0;
  ok(fsdpturbo_plan_num_ep_modules(plan, &modules), "fsdpturbo_plan_num_ep_modules");
  char name[256];
  size_t name_len = 0;
  uint64_t experts = 0, local_experts = 0;
  ok(fsdpturbo_plan_ep_module(plan, 0, name, sizeof name, &name_len, &experts, &local_experts),
     "fsdpturbo_plan_ep_module");
  std::vector<uint64_t> mine(local_experts);
  size_t n_mine = 0;
  ok(fsdpturbo_plan_local_experts(plan, rank, mine.data(), mine.size(), &n_mine), "fsdpturbo_plan_local_experts");
  fsdpturbo_memory_t memory{};
  ok(fsdpturbo_plan_memory(plan, rank, &memory), "fsdpturbo_plan_memory");
  std::printf("cpp_trainer: world %llu, ep %llu, %zu EP modules (%s: %llu experts, %llu per rank); rank %llu holds "
              "experts %llu..%llu and %.2f GiB of parameters\n",
              (unsigned long long)world, (unsigned long long)ep, modules, name, (unsigned long long)experts,
              (unsigned long long)local_experts, (unsigned long long)rank, (unsigned long long)mine.front(),
              (unsigned long long)mine.back(), memory.param_bytes / 1073741824.0);

  // 3. This rank's slice of an expert weight [experts, 2 * I, H] (Shard(0) over ep): it must be
  //    the plan's local experts.
  uint64_t members[4096];
  size_t n_members = 0;
  ok(fsdpturbo_topology_group(topology, FSDPTURBO_MESH_EXPERT, "ep", rank, members, 4096, &n_members),
     "fsdpturbo_topology_group(ep)");
  uint64_t ep_rank = 0;
  while (ep_rank < n_members && members[ep_rank] != rank) ++ep_rank;
  uint64_t global_shape[3] = {experts, 1536, 2048}, mesh_shape[1] = {ep}, coordinate[1] = {ep_rank};
  fsdpturbo_placement_t shard = {FSDPTURBO_PLACEMENT_SHARD, 0, 0};
  uint64_t local_shape[3], offset[3];
  ok(fsdpturbo_local_shape_and_offset(global_shape, 3, mesh_shape, coordinate, 1, &shard, local_shape, offset),
     "fsdpturbo_local_shape_and_offset");
  if (local_shape[0] != local_experts || offset[0] != mine.front()) {
    std::fprintf(stderr, "cpp_trainer: the weight slice (%llu experts from %llu) is not the plan's local experts\n",
                 (unsigned long long)local_shape[0], (unsigned long long)offset[0]);
    return 1;
  }
  std::printf("cpp_trainer: gate_up_proj slice [%llu, %llu, %llu] at expert %llu\n", (unsigned long long)local_shape[0],
              (unsigned long long)local_shape[1], (unsigned long long)local_shape[2], (unsigned long long)offset[0]);

  // 4. Grad norm over the processes started: expert gradients sharded over them (mesh-dim id 0),
  //    one plain gradient replicated. 64 elements per expert keep it small.
  const char* comm_kind = std::getenv("FSDPTURBO_TRAINER_COMM");
  bool nccl = comm_kind && !std::strcmp(comm_kind, "nccl");
  size_t procs = nccl ? env_u64("WORLD_SIZE", 1) : 1, me = nccl ? env_u64("RANK", 0) : 0;
  fsdpturbo_comm_t* comm = make_comm(nccl, procs, me);
  const uint64_t per_expert = 64, plain_numel = 1000;
  if (experts % procs) fail("the experts do not divide over the started processes", FSDPTURBO_ERR_INVALID_ARGUMENT);
  uint64_t shard_numel = experts / procs * per_expert, first = me * shard_numel;
  std::vector<float> expert_grad(shard_numel), plain_grad(plain_numel);
  double want = 0;
  for (uint64_t i = 0; i < experts * per_expert; ++i) want += std::pow(static_cast<double>(grad_value(i, 0)), 2);
  for (uint64_t i = 0; i < plain_numel; ++i) want += std::pow(static_cast<double>(grad_value(i, 7)), 2);
  want = std::sqrt(want);
  for (uint64_t i = 0; i < shard_numel; ++i) expert_grad[i] = grad_value(first + i, 0);
  for (uint64_t i = 0; i < plain_numel; ++i) plain_grad[i] = grad_value(i, 7);
  uint32_t dim = 0;
  int32_t role = FSDPTURBO_DIM_SHARD;
  fsdpturbo_grad_t grads[2] = {};
  grads[0].mut_data = expert_grad.data();
  grads[0].numel = shard_numel;
  grads[0].dtype = FSDPTURBO_DTYPE_F32;
  grads[0].dims = &dim;
  grads[0].roles = &role;
  grads[0].n_dims = 1;
  grads[1].mut_data = plain_grad.data();
  grads[1].numel = plain_numel;
  grads[1].dtype = FSDPTURBO_DTYPE_F32;
  fsdpturbo_comm_group_t group = {&dim, 1, comm};
  fsdpturbo_clip_options_t clip = FSDPTURBO_CLIP_OPTIONS_INIT;
  double total = 0;
  ok(fsdpturbo_clip_grad_norm_comm(&clip, grads, 2, &group, 1, &total), "fsdpturbo_clip_grad_norm_comm");
  double coef = 1.0 / (want + 1e-6);
  bool scaled = std::fabs(expert_grad[1] - grad_value(first + 1, 0) * coef) < 1e-5;
  bool right = std::fabs(total - want) <= 1e-9 * want;
  std::printf("cpp_trainer: grad norm over %zu %s rank(s): %.9f (expected %.9f), gradients %s\n", procs,
              nccl ? "NCCL" : "single", total, want, scaled ? "clipped" : "NOT clipped");

  fsdpturbo_comm_free(comm);
  fsdpturbo_plan_free(plan);
  fsdpturbo_topology_free(topology);
  fsdpturbo_config_free(config);
  if (!right || !scaled) return 1;
  std::printf("cpp_trainer: OK\n");
  return 0;
}
