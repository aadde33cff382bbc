// Prepended to every kernel source by src/backend/cuda/kernels.rs. NVRTC compiles these without any
// header, so the few types and conversions the kernels need are written here; the conversions
// are those of the host kernels (src/norm.rs), so results match bit for bit where the host
// kernels define the order of operations. Compiled with --fmad=false for the same reason.
typedef unsigned long long u64;
typedef long long i64;
typedef unsigned short u16;

// FSDPTURBO_DTYPE_* codes.
#define DT_F32 0
#define DT_F64 1
#define DT_F16 2
#define DT_BF16 3

__device__ __forceinline__ float bf16_to_f32(u16 b) { return __uint_as_float(((unsigned)b) << 16); }

// Round to nearest, ties to even; NaN stays a quiet NaN with its sign (src/norm.rs f32_to_bf16).
__device__ __forceinline__ u16 f32_to_bf16(float x) {
  unsigned bits = __float_as_uint(x);
  if (x != x) return (u16)((bits >> 16) | 0x40u);
  return (u16)((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

__device__ __forceinline__ float f16_to_f32(u16 h) {
  float f;
  asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
  return f;
}

__device__ __forceinline__ u16 f32_to_f16(float x) {
  u16 h;
  asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(x));
  return h;
}

// Records the smallest offending index of a launch (the host reports the first bad entry, as
// the host kernels do). `flag` starts at all ones.
__device__ __forceinline__ void report_bad(u64* flag, u64 index) { atomicMin(flag, index); }
