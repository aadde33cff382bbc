/* Test double of the CUDA driver (libcuda.so.1) for the NCCL double's tests: "device" memory is
 * host memory, streams complete every operation when it is issued, and each thread has its own
 * current context, as with the driver's primary contexts. Kernels cannot be loaded. */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "double_common.h"

typedef int CUresult;
typedef int CUdevice;
typedef void *CUcontext;
typedef unsigned long long CUdeviceptr;

#define CUDA_SUCCESS 0
#define CUDA_ERROR_INVALID_VALUE 1
#define CUDA_ERROR_NOT_SUPPORTED 801

static _Thread_local CUcontext current;

DOUBLE_EXPORT CUresult cuInit(unsigned flags) { return flags == 0 ? CUDA_SUCCESS : CUDA_ERROR_INVALID_VALUE; }
DOUBLE_EXPORT CUresult cuGetErrorString(CUresult status, const char **text) {
  *text = status == CUDA_ERROR_NOT_SUPPORTED ? "not supported by the CUDA driver test double" : "invalid value";
  return CUDA_SUCCESS;
}
DOUBLE_EXPORT CUresult cuDriverGetVersion(int *version) { *version = 13000; return CUDA_SUCCESS; }
DOUBLE_EXPORT CUresult cuDeviceGet(CUdevice *device, int ordinal) {
  if (ordinal < 0 || ordinal > 7) return CUDA_ERROR_INVALID_VALUE;
  *device = ordinal;
  return CUDA_SUCCESS;
}
DOUBLE_EXPORT CUresult cuDeviceGetAttribute(int *value, int attribute, CUdevice device) { *value = 0; return CUDA_SUCCESS; }
/* A context is its device ordinal + 1, as a pointer. */
DOUBLE_EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext *context, CUdevice device) {
  *context = (CUcontext)(uintptr_t)(device + 1);
  return CUDA_SUCCESS;
}
DOUBLE_EXPORT CUresult cuCtxGetCurrent(CUcontext *context) { *context = current; return CUDA_SUCCESS; }
DOUBLE_EXPORT CUresult cuCtxSetCurrent(CUcontext context) { current = context; return CUDA_SUCCESS; }
DOUBLE_EXPORT CUresult cuCtxGetDevice(CUdevice *device) {
  if (!current) return CUDA_ERROR_INVALID_VALUE;
  *device = (CUdevice)(uintptr_t)current - 1;
  return CUDA_SUCCESS;
}
DOUBLE_EXPORT CUresult cuModuleLoadData(void **module, const void *image) { return CUDA_ERROR_NOT_SUPPORTED; }
DOUBLE_EXPORT CUresult cuModuleGetFunction(void **function, void *module, const char *name) {
  return CUDA_ERROR_NOT_SUPPORTED;
}
DOUBLE_EXPORT CUresult cuLaunchKernel(void *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx, unsigned by,
                                      unsigned bz, unsigned shared, void *stream, void **params, void **extra) {
  return CUDA_ERROR_NOT_SUPPORTED;
}
DOUBLE_EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *ptr, size_t bytes) {
  void *p = malloc(bytes ? bytes : 1);
  if (!p) return CUDA_ERROR_INVALID_VALUE;
  *ptr = (CUdeviceptr)(uintptr_t)p;
  return CUDA_SUCCESS;
}
DOUBLE_EXPORT CUresult cuMemFree_v2(CUdeviceptr ptr) { free((void *)(uintptr_t)ptr); return CUDA_SUCCESS; }
DOUBLE_EXPORT CUresult cuMemcpyDtoHAsync_v2(void *dst, CUdeviceptr src, size_t bytes, void *stream) {
  memcpy(dst, (const void *)(uintptr_t)src, bytes);
  return CUDA_SUCCESS;
}
DOUBLE_EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void *src, size_t bytes, void *stream) {
  memcpy((void *)(uintptr_t)dst, src, bytes);
  return CUDA_SUCCESS;
}
DOUBLE_EXPORT CUresult cuMemsetD8Async(CUdeviceptr dst, unsigned char value, size_t bytes, void *stream) {
  memset((void *)(uintptr_t)dst, value, bytes);
  return CUDA_SUCCESS;
}
DOUBLE_EXPORT CUresult cuStreamSynchronize(void *stream) { return CUDA_SUCCESS; }
DOUBLE_EXPORT CUresult cuStreamQuery(void *stream) { return CUDA_SUCCESS; }
