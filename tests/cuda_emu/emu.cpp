// The launch sequences of src/backend/cuda/kernels.rs, over the host-emulated kernels (cuda_emu.h).
// KERNELS_CU is the generated file holding src/backend/cuda/kernels/common.cuh and the three sources.
#include "cuda_emu.h"
#include KERNELS_CU

namespace {
unsigned round32(int n) { return (unsigned)min(1024, (n + 31) / 32 * 32); }
}  // namespace

// Returns the smallest bad flat index, or -1.
extern "C" long long emu_route(const i64* ids, u64 tokens, int top_k, int num_experts, int ep_size, i64* counts,
                               i64* permutation, i64* splits) {
  u64 slots = tokens * top_k, tiles = (slots + ROUTE_TILE - 1) / ROUTE_TILE;
  std::vector<u64> tile_counts(tiles * num_experts + 1), starts(num_experts);
  u64 bad = ~0ull;
  emu_launch(tiles, ROUTE_TILE, [&] { route_tile_counts(ids, slots, num_experts, tile_counts.data(), &bad); });
  emu_launch(num_experts, ROUTE_TILE, [&] { route_scan_tiles(tile_counts.data(), tiles, num_experts, counts); });
  emu_launch(1, round32(num_experts), [&] { route_starts(counts, num_experts, ep_size, starts.data(), splits); });
  emu_launch(tiles, ROUTE_TILE, [&] {
    route_scatter(ids, slots, num_experts, tile_counts.data(), starts.data(), permutation);
  });
  return bad == ~0ull ? -1 : (long long)bad;
}

extern "C" long long emu_permute(const void* src, u64 src_rows, u64 row_bytes, const i64* rows, u64 n_rows,
                                 i64 divisor, void* dst) {
  u64 bad = ~0ull;
  bool v16 = row_bytes % 16 == 0 && (uintptr_t)src % 16 == 0 && (uintptr_t)dst % 16 == 0;
  unsigned grid = (unsigned)min<u64>(n_rows, 1 << 20);
  if (v16) {
    emu_launch(grid, 128, [&] {
      permute_rows_v16((const uint4*)src, src_rows, row_bytes / 16, rows, n_rows, divisor, (uint4*)dst, &bad);
    });
  } else {
    emu_launch(grid, 256, [&] {
      permute_rows_u16((const u16*)src, src_rows, row_bytes / 2, rows, n_rows, divisor, (u16*)dst, &bad);
    });
  }
  return bad == ~0ull ? -1 : (long long)bad;
}

// dtype: FSDPTURBO_DTYPE_* (0 f32, 1 f64, 2 f16, 3 bf16).
extern "C" long long emu_unpermute(int dtype, const void* y, const i64* permutation, const void* probs, u64 tokens,
                                   int top_k, u64 hidden, void* out) {
  u64 slots = tokens * top_k, bad = ~0ull;
  std::vector<i64> inv(slots, -1);
  emu_launch((unsigned)((slots + 255) / 256), 256, [&] { invert_permutation(permutation, slots, inv.data(), &bad); });
  static const int sizes[4] = {4, 8, 2, 2};
  u64 per_vec = 16 / sizes[dtype];
  bool v16 = hidden % per_vec == 0 && (uintptr_t)y % 16 == 0 && (uintptr_t)out % 16 == 0;
  u64 packs = tokens * (v16 ? hidden / per_vec : hidden);
  unsigned grid = (unsigned)min<u64>((packs + 255) / 256, 1 << 20);
  using K = void (*)(const void*, const i64*, const void*, u64, int, u64, void*);
  K table[2][4] = {
      {(K)unpermute_f32_v1, (K)unpermute_f64_v1, (K)unpermute_f16_v1, (K)unpermute_bf16_v1},
      {(K)unpermute_f32_v16, (K)unpermute_f64_v16, (K)unpermute_f16_v16, (K)unpermute_bf16_v16}};
  K k = table[v16][dtype];
  emu_launch(grid, 256, [&] { k(y, inv.data(), probs, tokens, top_k, hidden, out); });
  return bad == ~0ull ? -1 : (long long)bad;
}

// kind: 0 abs, 1 square, 2 pow, 3 max (as kernels.rs passes it).
extern "C" double emu_power_sum(const u64* table, u64 n, u64 chunks, int kind, double p, int acc_f64) {
  std::vector<double> partials(chunks + 1);
  double out = -1;
  emu_launch((unsigned)chunks, NORM_THREADS, [&] {
    if (acc_f64) power_sum_partials_f64(table, n, kind, p, partials.data());
    else power_sum_partials_f32(table, n, kind, p, partials.data());
  });
  emu_launch(1, NORM_THREADS, [&] { power_sum_finalize(partials.data(), chunks, kind == 3, &out); });
  return out;
}

extern "C" void emu_scale(const u64* table, u64 n, u64 chunks, double coef) {
  emu_launch((unsigned)chunks, NORM_THREADS, [&] { scale_in_place(table, n, coef); });
}
