// Routing metadata (src/route.rs `route_into`): the histogram of the flat expert ids, the
// stable counting-sort permutation (expert-major, ties by flat index) and the rows sent to each
// ep rank. Four launches, tiles of ROUTE_TILE slots, no atomics on global counters, so the
// result is the same on every run:
//   route_tile_counts: per-tile histograms [tiles, E]; ids outside [0, E) are reported.
//   route_scan_tiles:  per expert, each tile's first row among that expert's rows; the totals.
//   route_starts:      each expert's first row (scan of the totals) and the ep splits.
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

// One block (of ROUTE_TILE threads) per expert: the exclusive scan of its column over the tiles,
// in place (each thread scans a run of consecutive tiles; the runs are combined in order), and
// its total.
extern "C" __global__ void route_scan_tiles(u64* __restrict__ tile_counts, u64 tiles, int num_experts,
                                            i64* __restrict__ counts) {
  __shared__ u64 part[ROUTE_TILE];
  const int e = blockIdx.x;
  const u64 per = (tiles + blockDim.x - 1) / blockDim.x;
  const u64 first = min(threadIdx.x * per, tiles), last = min(first + per, tiles);
  u64 sum = 0;
  for (u64 t = first; t < last; ++t) sum += tile_counts[t * num_experts + e];
  part[threadIdx.x] = sum;
  __syncthreads();
  if (threadIdx.x == 0) {
    u64 run = 0;
    for (unsigned i = 0; i < blockDim.x; ++i) {
      u64 c = part[i];
      part[i] = run;
      run += c;
    }
    counts[e] = (i64)run;
  }
  __syncthreads();
  u64 run = part[threadIdx.x];
  for (u64 t = first; t < last; ++t) {
    u64 c = tile_counts[t * num_experts + e];
    tile_counts[t * num_experts + e] = run;
    run += c;
  }
}

// One block: the first permuted row of each expert (exclusive scan of the counts) and the rows
// sent to each ep rank.
extern "C" __global__ void route_starts(const i64* __restrict__ counts, int num_experts, int ep_size,
                                        u64* __restrict__ start, i64* __restrict__ splits) {
  extern __shared__ u64 count[];
  for (int e = threadIdx.x; e < num_experts; e += blockDim.x) count[e] = (u64)counts[e];
  __syncthreads();
  if (threadIdx.x == 0) {
    u64 run = 0;
    for (int e = 0; e < num_experts; ++e) {
      start[e] = run;
      run += count[e];
    }
  }
  const int local = num_experts / ep_size;
  for (int r = threadIdx.x; r < ep_size; r += blockDim.x) {
    u64 s = 0;
    for (int e = r * local; e < (r + 1) * local; ++e) s += count[e];
    splits[r] = (i64)s;
  }
}

extern "C" __global__ void route_scatter(const i64* __restrict__ ids, u64 slots, int num_experts,
                                         const u64* __restrict__ tile_first, const u64* __restrict__ start,
                                         i64* __restrict__ permutation) {
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
  permutation[start[id] + tile_first[(u64)blockIdx.x * num_experts + id] + rank] = (i64)j;
}
