/* A C trainer's translation unit: fsdpturbo.h after the system and vendor headers such a file
 * includes anyway. The header must add nothing but fsdpturbo_ and FSDPTURBO_ names, so none of
 * them can clash with <sys/param.h>'s MAX/MIN or with CANN's and NCCL's own declarations
 * (third_party/vendor-headers: ours, quoted from the vendors' headers). C11, pedantic, warnings as errors;
 * linked with the shared library and run. consumer_headers.cpp does the same in C++20 with the
 * headers in the other order (and <torch/extension.h> where torch is found). */
#include <sys/param.h>

#include "ascend/acl.h"
#include "ascend/aclnn.h"
#include "ascend/hccl.h"
#include "nccl/nccl.h"

#include <fsdpturbo.h>

#include <stdio.h>

_Static_assert(MAX(1, 2) == 2 && MIN(1, 2) == 1, "<sys/param.h>'s MAX and MIN are untouched");
_Static_assert(FSDPTURBO_HCCL_ROOT_INFO_BYTES == HCCL_ROOT_INFO_BYTES, "HCCL root info size");
_Static_assert(sizeof(HcclRootInfo) == FSDPTURBO_HCCL_ROOT_INFO_BYTES, "HcclRootInfo size");
_Static_assert(FSDPTURBO_NCCL_UNIQUE_ID_BYTES == NCCL_UNIQUE_ID_BYTES, "NCCL unique id size");
_Static_assert(sizeof(ncclUniqueId) == FSDPTURBO_NCCL_UNIQUE_ID_BYTES, "ncclUniqueId size");

int main(void) {
  const char *version = fsdpturbo_version();
  if (version == NULL || version[0] == '\0' || fsdpturbo_abi_version() != FSDPTURBO_ABI_VERSION) {
    fprintf(stderr, "consumer_headers.c: bad version\n");
    return 1;
  }
  HcclResult hccl = HCCL_SUCCESS;
  ncclResult_t nccl = ncclSuccess;
  aclError acl = ACL_SUCCESS;
  printf("consumer_headers.c: libfsdpturbo %s beside CANN and NCCL (%d %d %d)\n", version, (int)hccl, (int)nccl,
         (int)acl);
  return 0;
}
