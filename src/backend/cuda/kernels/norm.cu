// Multi-tensor kernels of the gradient norm (src/norm.rs `local_power_sum`, `scale_in_place`).
// The tensors are described by a table in device memory, built by the host
// (src/backend/cuda/kernels.rs `MultiTensorTable`): `chunk_first[n + 1]` (the first chunk of each
// tensor; chunks are NORM_CHUNK elements) then `n` segments. One block per chunk.
//
// power_sum_partials_*: per chunk, sum |x|^p (kind ABS p = 1, SQUARE p = 2, POW any other p) in the
//   accumulator type (f64, or f32 for f32/f16/bf16 data when asked; f64 data always in f64), or
//   max |x| (kind MAX) as the max of the sign-cleared bit patterns, where every NaN is above inf
//   (so NaN propagates). Block sums are combined in f64 in a fixed tree: no atomics, the same
//   result on every run.
// power_sum_finalize: one block adds (or NaN-propagating max) the partials in a fixed order.
// scale_in_place: x *= coef, in f64 for f64 data, else f32 arithmetic rounded once to the storage
//   type (torch's `mul_` by a Python float).
#define NORM_CHUNK 65536
#define NORM_THREADS 256
#define KIND_ABS 0
#define KIND_SQUARE 1
#define KIND_POW 2
#define KIND_MAX 3

struct Segment {
  u64 ptr;
  u64 numel;
  int dtype;
  int pad;
};

__device__ __forceinline__ u64 find_tensor(const u64* chunk_first, u64 n, u64 chunk) {
  u64 lo = 0, hi = n;  // chunk_first[lo] <= chunk < chunk_first[hi]
  while (hi - lo > 1) {
    u64 mid = (lo + hi) / 2;
    if (chunk_first[mid] <= chunk) lo = mid; else hi = mid;
  }
  return lo;
}

__device__ __forceinline__ double nan_max(double a, double b) {
  if (a != a) return a;
  if (b != b) return b;
  return a > b ? a : b;
}

template <typename A>
__device__ __forceinline__ A term(float v, int kind, double p) {
  switch (kind) {
    case KIND_ABS: return (A)fabsf(v);
    case KIND_SQUARE: return (A)v * (A)v;
    default: return sizeof(A) == 8 ? (A)pow(fabs((double)v), p) : (A)powf(fabsf(v), (float)p);
  }
}

__device__ __forceinline__ double term64(double v, int kind, double p) {
  switch (kind) {
    case KIND_ABS: return fabs(v);
    case KIND_SQUARE: return v * v;
    default: return pow(fabs(v), p);
  }
}

// Chunk [begin, end) of one tensor: this thread's share, vector loads where aligned.
template <typename A>
__device__ double chunk_sum(const Segment& s, u64 begin, u64 end, int kind, double p) {
  A acc = 0;
  if (s.dtype == DT_F64) {
    const double* x = reinterpret_cast<const double*>(s.ptr);
    double a = 0;
    for (u64 i = begin + threadIdx.x; i < end; i += blockDim.x) a += term64(x[i], kind, p);
    return a;
  }
  if (s.dtype == DT_F32) {
    const float* x = reinterpret_cast<const float*>(s.ptr);
    if ((s.ptr & 15) == 0) {
      u64 vec_end = begin + (end - begin) / 4 * 4;
#pragma unroll 4
      for (u64 i = begin + 4 * threadIdx.x; i < vec_end; i += 4 * blockDim.x) {
        float4 v = __ldg(reinterpret_cast<const float4*>(x + i));
        acc += term<A>(v.x, kind, p) + term<A>(v.y, kind, p) + term<A>(v.z, kind, p) + term<A>(v.w, kind, p);
      }
      begin = vec_end;
    }
    for (u64 i = begin + threadIdx.x; i < end; i += blockDim.x) acc += term<A>(x[i], kind, p);
    return (double)acc;
  }
  const u16* x = reinterpret_cast<const u16*>(s.ptr);
  const bool bf = s.dtype == DT_BF16;
  if ((s.ptr & 15) == 0) {
    u64 vec_end = begin + (end - begin) / 8 * 8;
#pragma unroll 4
    for (u64 i = begin + 8 * threadIdx.x; i < vec_end; i += 8 * blockDim.x) {
      uint4 v = __ldg(reinterpret_cast<const uint4*>(x + i));
      unsigned w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        u16 lo = (u16)(w[j] & 0xffffu), hi = (u16)(w[j] >> 16);
        float a = bf ? bf16_to_f32(lo) : f16_to_f32(lo), b = bf ? bf16_to_f32(hi) : f16_to_f32(hi);
        acc += term<A>(a, kind, p) + term<A>(b, kind, p);
      }
    }
    begin = vec_end;
  }
  for (u64 i = begin + threadIdx.x; i < end; i += blockDim.x) {
    acc += term<A>(bf ? bf16_to_f32(x[i]) : f16_to_f32(x[i]), kind, p);
  }
  return (double)acc;
}

// max |x| of this thread's share as a sign-cleared bit pattern of the tensor's own type.
__device__ double chunk_max(const Segment& s, u64 begin, u64 end) {
  if (s.dtype == DT_F64) {
    const u64* x = reinterpret_cast<const u64*>(s.ptr);
    u64 m = 0;
    for (u64 i = begin + threadIdx.x; i < end; i += blockDim.x) m = max(m, x[i] & 0x7fffffffffffffffull);
    return __longlong_as_double((long long)m);
  }
  if (s.dtype == DT_F32) {
    const unsigned* x = reinterpret_cast<const unsigned*>(s.ptr);
    unsigned m = 0;
    for (u64 i = begin + threadIdx.x; i < end; i += blockDim.x) m = max(m, x[i] & 0x7fffffffu);
    return (double)__uint_as_float(m);
  }
  const u16* x = reinterpret_cast<const u16*>(s.ptr);
  unsigned m = 0;
  for (u64 i = begin + threadIdx.x; i < end; i += blockDim.x) m = max(m, (unsigned)(x[i] & 0x7fffu));
  return (double)(s.dtype == DT_BF16 ? bf16_to_f32((u16)m) : f16_to_f32((u16)m));
}

__device__ double block_combine(double v, bool is_max) {
  __shared__ double part[NORM_THREADS];
  part[threadIdx.x] = v;
  __syncthreads();
  for (unsigned stride = blockDim.x / 2; stride > 0; stride /= 2) {
    if (threadIdx.x < stride) {
      double a = part[threadIdx.x], b = part[threadIdx.x + stride];
      part[threadIdx.x] = is_max ? nan_max(a, b) : a + b;
    }
    __syncthreads();
  }
  return part[0];
}

template <typename A>
__device__ void power_sum_partials(const u64* table, u64 n, int kind, double p, double* partials) {
  const Segment* segs = reinterpret_cast<const Segment*>(table + n + 1);
  const u64 chunk = blockIdx.x;
  const u64 t = find_tensor(table, n, chunk);
  const Segment s = segs[t];
  const u64 begin = (chunk - table[t]) * NORM_CHUNK;
  const u64 end = min(begin + (u64)NORM_CHUNK, s.numel);
  const bool is_max = kind == KIND_MAX;
  double v = is_max ? chunk_max(s, begin, end) : chunk_sum<A>(s, begin, end, kind, p);
  v = block_combine(v, is_max);
  if (threadIdx.x == 0) partials[chunk] = v;
}

extern "C" __global__ void power_sum_partials_f64(const u64* table, u64 n, int kind, double p, double* partials) {
  power_sum_partials<double>(table, n, kind, p, partials);
}

extern "C" __global__ void power_sum_partials_f32(const u64* table, u64 n, int kind, double p, double* partials) {
  power_sum_partials<float>(table, n, kind, p, partials);
}

extern "C" __global__ void power_sum_finalize(const double* partials, u64 n, int is_max, double* out) {
  double v = 0;
  for (u64 i = threadIdx.x; i < n; i += blockDim.x) v = is_max ? nan_max(v, partials[i]) : v + partials[i];
  v = block_combine(v, is_max != 0);
  if (threadIdx.x == 0) out[0] = v;
}

extern "C" __global__ void scale_in_place(const u64* table, u64 n, double coef) {
  const Segment* segs = reinterpret_cast<const Segment*>(table + n + 1);
  const u64 chunk = blockIdx.x;
  const u64 t = find_tensor(table, n, chunk);
  const Segment s = segs[t];
  u64 begin = (chunk - table[t]) * NORM_CHUNK;
  const u64 end = min(begin + (u64)NORM_CHUNK, s.numel);
  const float c = (float)coef;
  if (s.dtype == DT_F64) {
    double* x = reinterpret_cast<double*>(s.ptr);
    for (u64 i = begin + threadIdx.x; i < end; i += blockDim.x) x[i] *= coef;
    return;
  }
  if (s.dtype == DT_F32) {
    float* x = reinterpret_cast<float*>(s.ptr);
    if ((s.ptr & 15) == 0) {
      u64 vec_end = begin + (end - begin) / 4 * 4;
      for (u64 i = begin + 4 * threadIdx.x; i < vec_end; i += 4 * blockDim.x) {
        float4 v = *reinterpret_cast<float4*>(x + i);
        v.x *= c; v.y *= c; v.z *= c; v.w *= c;
        *reinterpret_cast<float4*>(x + i) = v;
      }
      begin = vec_end;
    }
    for (u64 i = begin + threadIdx.x; i < end; i += blockDim.x) x[i] *= c;
    return;
  }
  u16* x = reinterpret_cast<u16*>(s.ptr);
  const bool bf = s.dtype == DT_BF16;
  if ((s.ptr & 15) == 0) {
    u64 vec_end = begin + (end - begin) / 8 * 8;
    for (u64 i = begin + 8 * threadIdx.x; i < vec_end; i += 8 * blockDim.x) {
      uint4 v = *reinterpret_cast<uint4*>(x + i);
      unsigned* w = reinterpret_cast<unsigned*>(&v);
#pragma unroll
      for (int j = 0; j < 4; ++j) {
        u16 lo = (u16)(w[j] & 0xffffu), hi = (u16)(w[j] >> 16);
        lo = bf ? f32_to_bf16(bf16_to_f32(lo) * c) : f32_to_f16(f16_to_f32(lo) * c);
        hi = bf ? f32_to_bf16(bf16_to_f32(hi) * c) : f32_to_f16(f16_to_f32(hi) * c);
        w[j] = (unsigned)lo | ((unsigned)hi << 16);
      }
      *reinterpret_cast<uint4*>(x + i) = v;
    }
    begin = vec_end;
  }
  for (u64 i = begin + threadIdx.x; i < end; i += blockDim.x) {
    x[i] = bf ? f32_to_bf16(bf16_to_f32(x[i]) * c) : f32_to_f16(f16_to_f32(x[i]) * c);
  }
}
