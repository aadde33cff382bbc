// Runs the CUDA C of src/backend/cuda/kernels on the host, for CI machines without a GPU: every CUDA thread
// of a block is a std::thread, __syncthreads is a barrier, blocks run one after another (so
// `__shared__` may be a function-static), atomics are std::atomic_ref. The f16 conversions
// (PTX inline assembly on the device) become _Float16 conversions; tests/python/
// test_cuda_kernels_emulated.py rewrites those lines before compiling.
#pragma once
#include <atomic>
#include <barrier>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <functional>
#include <thread>
#include <vector>

struct emu_dim3 { unsigned x = 0, y = 0, z = 0; };
inline thread_local emu_dim3 threadIdx;
inline emu_dim3 blockIdx, blockDim, gridDim;
inline std::barrier<>* emu_barrier = nullptr;
alignas(16) inline unsigned char emu_dynamic_shared[1 << 16];

#define __global__
#define __device__
#define __forceinline__ inline
#define __shared__ static
#define __syncthreads() emu_barrier->arrive_and_wait()

struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
template <class T> T __ldg(const T* p) { return *p; }
inline float __uint_as_float(unsigned u) { float f; std::memcpy(&f, &u, 4); return f; }
inline unsigned __float_as_uint(float f) { unsigned u; std::memcpy(&u, &f, 4); return u; }
inline double __longlong_as_double(long long v) { double d; std::memcpy(&d, &v, 8); return d; }
inline unsigned atomicAdd(unsigned* p, unsigned v) { return std::atomic_ref<unsigned>(*p).fetch_add(v); }
inline unsigned long long atomicMin(unsigned long long* p, unsigned long long v) {
  std::atomic_ref<unsigned long long> a(*p);
  unsigned long long old = a.load();
  while (v < old && !a.compare_exchange_weak(old, v)) {}
  return old;
}
inline unsigned long long atomicCAS(unsigned long long* p, unsigned long long expected, unsigned long long v) {
  std::atomic_ref<unsigned long long>(*p).compare_exchange_strong(expected, v);
  return expected;
}
template <class T> T min(T a, T b) { return b < a ? b : a; }
template <class T> T max(T a, T b) { return a < b ? b : a; }
inline float emu_f16_to_f32(unsigned short h) { _Float16 x; std::memcpy(&x, &h, 2); return (float)x; }
inline unsigned short emu_f32_to_f16(float f) { _Float16 x = (_Float16)f; unsigned short h; std::memcpy(&h, &x, 2); return h; }

// Runs `kernel` on a 1-D grid; `dynamic_shared` bytes of `extern __shared__` memory.
inline void emu_launch(unsigned grid, unsigned block, const std::function<void()>& kernel) {
  gridDim = {grid, 1, 1};
  blockDim = {block, 1, 1};
  for (unsigned b = 0; b < grid; ++b) {
    blockIdx = {b, 1, 1};
    std::barrier<> barrier(block);
    emu_barrier = &barrier;
    std::vector<std::thread> threads;
    for (unsigned t = 0; t < block; ++t) {
      threads.emplace_back([t, &kernel] { threadIdx = {t, 0, 0}; kernel(); });
    }
    for (auto& th : threads) th.join();
  }
}
