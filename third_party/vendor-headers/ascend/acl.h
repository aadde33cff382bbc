/* Minimal ACL runtime declarations (libascendcl.so) used by libfsdpturbo, quoted from torch_npu
 * @fda6165 third_party/acl/inc/acl/{acl_base.h,acl_rt.h}.
 * libfsdpturbo never calls aclInit/aclFinalize:
 * torch_npu owns the runtime. Checked by tests/c/test_ascend_headers.c. */
#ifndef FSDPTURBO_ASCEND_ACL_H
#define FSDPTURBO_ASCEND_ACL_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef int aclError;
#define ACL_SUCCESS 0
#define ACL_ERROR_REPEAT_INITIALIZE 100002

typedef void *aclrtStream;

typedef enum {
  ACL_MEMCPY_HOST_TO_HOST = 0,
  ACL_MEMCPY_HOST_TO_DEVICE = 1,
  ACL_MEMCPY_DEVICE_TO_HOST = 2,
  ACL_MEMCPY_DEVICE_TO_DEVICE = 3,
  ACL_MEMCPY_DEFAULT = 4
} aclrtMemcpyKind;

typedef enum {
  ACL_MEM_MALLOC_HUGE_FIRST = 0,
  ACL_MEM_MALLOC_HUGE_ONLY = 1,
  ACL_MEM_MALLOC_NORMAL_ONLY = 2
} aclrtMemMallocPolicy;

typedef enum {
  ACL_DT_UNDEFINED = -1,
  ACL_FLOAT = 0,
  ACL_FLOAT16 = 1,
  ACL_INT8 = 2,
  ACL_INT32 = 3,
  ACL_UINT8 = 4,
  ACL_INT16 = 6,
  ACL_UINT16 = 7,
  ACL_UINT32 = 8,
  ACL_INT64 = 9,
  ACL_UINT64 = 10,
  ACL_DOUBLE = 11,
  ACL_BOOL = 12,
  ACL_BF16 = 27,
  ACL_FLOAT8_E5M2 = 35,
  ACL_FLOAT8_E4M3FN = 36
} aclDataType;

typedef enum {
  ACL_FORMAT_NCHW = 0,
  ACL_FORMAT_ND = 2,
  ACL_FORMAT_FRACTAL_NZ = 29
} aclFormat;

aclError aclrtGetDevice(int32_t *deviceId);
aclError aclrtCreateStream(aclrtStream *stream);
aclError aclrtDestroyStream(aclrtStream stream);
aclError aclrtSynchronizeStream(aclrtStream stream);

#ifdef __cplusplus
}
#endif
#endif
