// Row permutes of the MoE dispatch (src/route.rs `gather`, `invert_permutation`, `unpermute`).
//
// permute_rows_*: dst[i, :] = src[rows[i] / divisor, :]; 16-byte vectors when the row length in
//   bytes and both pointers allow it (`v16`), 2-byte elements otherwise (`u16`; every element type
//   is a multiple of 2 bytes). Rows outside `src` are reported and not copied.
// invert_permutation: inv[perm[i]] = i; entries outside [0, n) and repeated entries are reported
//   (inv must start as all ones).
// unpermute_*: out[t, :] = sum_k w[t, k] * y[inv[t*K + k], :], summed over k in k order with
//   f32 accumulation (f64 for f64 data), rounded once; the first term is the product itself;
//   without weights every w is 1 and the first term is the row itself. One thread owns a 16-byte
//   slice of an output row, so no two threads ever add into one element: deterministic.

template <typename V>
__device__ void permute_rows(const V* __restrict__ src, u64 src_rows, u64 row_len, const i64* __restrict__ rows,
                             u64 n_rows, i64 divisor, V* __restrict__ dst, u64* bad) {
  for (u64 r = blockIdx.x; r < n_rows; r += gridDim.x) {
    u64 from = (u64)rows[r] / (u64)divisor;
    if (rows[r] < 0 || from >= src_rows) {
      if (threadIdx.x == 0) report_bad(bad, r);
      continue;
    }
    const V* s = src + from * row_len;
    V* d = dst + r * row_len;
    for (u64 v = threadIdx.x; v < row_len; v += blockDim.x) d[v] = __ldg(s + v);
  }
}

extern "C" __global__ void permute_rows_v16(const uint4* src, u64 src_rows, u64 row_vecs, const i64* rows, u64 n_rows,
                                            i64 divisor, uint4* dst, u64* bad) {
  permute_rows(src, src_rows, row_vecs, rows, n_rows, divisor, dst, bad);
}

extern "C" __global__ void permute_rows_u16(const u16* src, u64 src_rows, u64 row_elems, const i64* rows, u64 n_rows,
                                            i64 divisor, u16* dst, u64* bad) {
  permute_rows(src, src_rows, row_elems, rows, n_rows, divisor, dst, bad);
}

extern "C" __global__ void invert_permutation(const i64* __restrict__ perm, u64 n, i64* inv, u64* bad) {
  u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x;
  if (i >= n) return;
  i64 s = perm[i];
  if (s < 0 || (u64)s >= n) {
    report_bad(bad, i);
    return;
  }
  if (atomicCAS(reinterpret_cast<u64*>(inv + s), ~0ull, (u64)i) != ~0ull) report_bad(bad, i);
}

struct bf16_t { u16 bits; };
struct f16_t { u16 bits; };

__device__ __forceinline__ float decode(bf16_t x) { return bf16_to_f32(x.bits); }
__device__ __forceinline__ float decode(f16_t x) { return f16_to_f32(x.bits); }
__device__ __forceinline__ float decode(float x) { return x; }
__device__ __forceinline__ double decode(double x) { return x; }
__device__ __forceinline__ void encode(float a, bf16_t* out) { out->bits = f32_to_bf16(a); }
__device__ __forceinline__ void encode(float a, f16_t* out) { out->bits = f32_to_f16(a); }
__device__ __forceinline__ void encode(float a, float* out) { *out = a; }
__device__ __forceinline__ void encode(double a, double* out) { *out = a; }

template <typename T, typename A, int VEC>
__device__ void unpermute(const T* __restrict__ y, const i64* __restrict__ inv, const T* __restrict__ probs, u64 tokens,
                          int top_k, u64 hidden, T* __restrict__ out) {
  struct alignas(sizeof(T) * VEC) Pack { T v[VEC]; };
  const u64 packs = hidden / VEC;
  const u64 total = tokens * packs;
  for (u64 i = (u64)blockIdx.x * blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x) {
    const u64 t = i / packs, p = i % packs;
    A acc[VEC];
    for (int k = 0; k < top_k; ++k) {
      const u64 slot = t * top_k + k;
      const i64 row = inv[slot];  // negative only after invert_permutation reported an error
      const Pack in = reinterpret_cast<const Pack*>(y + (u64)(row < 0 ? 0 : row) * hidden)[p];
      if (probs) {
        const A w = decode(probs[slot]);
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] = k == 0 ? w * decode(in.v[e]) : acc[e] + w * decode(in.v[e]);
      } else {
#pragma unroll
        for (int e = 0; e < VEC; ++e) acc[e] = k == 0 ? decode(in.v[e]) : acc[e] + decode(in.v[e]);
      }
    }
    Pack o;
#pragma unroll
    for (int e = 0; e < VEC; ++e) encode(acc[e], &o.v[e]);
    reinterpret_cast<Pack*>(out + t * hidden)[p] = o;
  }
}

#define UNPERMUTE(name, T, A, VEC)                                                                          \
  extern "C" __global__ void name(const T* y, const i64* inv, const T* probs, u64 tokens, int top_k, u64 hidden, \
                                  T* out) {                                                                 \
    unpermute<T, A, VEC>(y, inv, probs, tokens, top_k, hidden, out);                                       \
  }
UNPERMUTE(unpermute_bf16_v16, bf16_t, float, 8)
UNPERMUTE(unpermute_f16_v16, f16_t, float, 8)
UNPERMUTE(unpermute_f32_v16, float, float, 4)
UNPERMUTE(unpermute_f64_v16, double, double, 2)
UNPERMUTE(unpermute_bf16_v1, bf16_t, float, 1)
UNPERMUTE(unpermute_f16_v1, f16_t, float, 1)
UNPERMUTE(unpermute_f32_v1, float, float, 1)
UNPERMUTE(unpermute_f64_v1, double, double, 1)
