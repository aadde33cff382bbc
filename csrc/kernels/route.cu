// Routing metadata (src/route.rs `route_into`): the histogram of the flat expert ids, the
// stable counting-sort permutation (expert-major, ties by flat index) and the rows sent to each
// ep rank. Three launches over tiles of ROUTE_TILE slots, no atomics on global counters, so the
// result is the same on every run:
//   route_tile_counts: per-tile histograms [tiles, E]; ids outside [0, E) are reported.
//   route_offsets:     one block; per expert a running sum over tiles (the tile's first row of
//                      that expert), the totals, their exclusive scan and the ep splits.
//   route_scatter:     each slot's rank among the earlier equal ids of its tile, then its row.
#define ROUTE_TILE 256

extern "C" __global__ void route_tile_counts(const i64* __restrict__ ids, u64 slots, int num_experts,
                                             u64* __restrict__ tile_counts, u64* bad) {
  extern __shared__ unsigned hist[];
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) hist[e] = 0;
  __syncthreads();
  u64 j = (u64)blockIdx.x * ROUTE_TILE + threadIdx.x;
  if (j < slots) {
    i64 id = ids[j];
    if ((u64)id >= (u64)num_experts) {
      report_bad(bad, j);
    } else {
      atomicAdd(&hist[id], 1u);
    }
  }
  __syncthreads();
  u64* row = tile_counts + (u64)blockIdx.x * num_experts;
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) row[e] = hist[e];
}

// tile_counts becomes, in place, the first permuted row of each (tile, expert).
extern "C" __global__ void route_offsets(u64* __restrict__ tile_counts, u64 tiles, int num_experts,
                                         int ep_size, i64* __restrict__ counts, i64* __restrict__ splits) {
  extern __shared__ u64 start[];
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    u64 run = 0;
    for (u64 t = 0; t < tiles; ++t) {
      u64 c = tile_counts[t * num_experts + e];
      tile_counts[t * num_experts + e] = run;
      run += c;
    }
    counts[e] = (i64)run;
    start[e] = run;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    u64 acc = 0;
    int local = num_experts / ep_size;
    for (int e = 0; e < num_experts; ++e) {
      u64 c = start[e];
      start[e] = acc;
      acc += c;
    }
    for (int r = 0; r < ep_size; ++r) {
      u64 s = 0;
      for (int e = r * local; e < (r + 1) * local; ++e) s += (u64)counts[e];
      splits[r] = (i64)s;
    }
  }
  __syncthreads();
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
    for (u64 t = 0; t < tiles; ++t) tile_counts[t * num_experts + e] += start[e];
  }
}

extern "C" __global__ void route_scatter(const i64* __restrict__ ids, u64 slots, int num_experts,
                                         const u64* __restrict__ tile_first, i64* __restrict__ permutation) {
  __shared__ i64 tile_ids[ROUTE_TILE];
  u64 base = (u64)blockIdx.x * ROUTE_TILE;
  u64 j = base + threadIdx.x;
  tile_ids[threadIdx.x] = j < slots ? ids[j] : -1;
  __syncthreads();
  if (j >= slots) return;
  i64 id = tile_ids[threadIdx.x];
  if ((u64)id >= (u64)num_experts) return;  // reported by route_tile_counts
  unsigned rank = 0;
  for (unsigned i = 0; i < threadIdx.x; ++i) rank += tile_ids[i] == id;
  permutation[tile_first[(u64)blockIdx.x * num_experts + id] + rank] = (i64)j;
}
