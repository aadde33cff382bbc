// A C++ trainer's translation unit: fsdpturbo.h first, then the system and vendor headers such
// a file includes anyway (consumer_headers.c has the other order). C++20, pedantic, warnings as
// errors; linked and run. With FSDPTURBO_CONSUMER_TORCH (where torch is found) it also includes
// <torch/extension.h> and is built as what a torch C++ extension is, a shared library whose
// Python symbols the interpreter provides: the test loads it from Python and calls
// consumer_main.
#include <fsdpturbo.h>

#include <sys/param.h>

#include "ascend/acl.h"
#include "ascend/aclnn.h"
#include "ascend/hccl.h"
#include "nccl/nccl.h"

#ifdef FSDPTURBO_CONSUMER_TORCH
#include <torch/extension.h>
#endif

#include <cstdio>
#include <cstring>

static_assert(MAX(1, 2) == 2 && MIN(1, 2) == 1, "<sys/param.h>'s MAX and MIN are untouched");
static_assert(FSDPTURBO_HCCL_ROOT_INFO_BYTES == HCCL_ROOT_INFO_BYTES, "HCCL root info size");
static_assert(sizeof(HcclRootInfo) == FSDPTURBO_HCCL_ROOT_INFO_BYTES, "HcclRootInfo size");
static_assert(FSDPTURBO_NCCL_UNIQUE_ID_BYTES == NCCL_UNIQUE_ID_BYTES, "NCCL unique id size");
static_assert(sizeof(ncclUniqueId) == FSDPTURBO_NCCL_UNIQUE_ID_BYTES, "ncclUniqueId size");

#ifdef FSDPTURBO_CONSUMER_TORCH
extern "C" __attribute__((visibility("default"))) int consumer_main();
extern "C" int consumer_main() {
#else
int main() {
#endif
  const char* version = fsdpturbo_version();
  if (version == nullptr || std::strlen(version) == 0 || fsdpturbo_abi_version() != FSDPTURBO_ABI_VERSION) {
    std::fprintf(stderr, "consumer_headers.cpp: bad version\n");
    return 1;
  }
#ifdef FSDPTURBO_CONSUMER_TORCH
  const char* with = "CANN, NCCL and torch";
#else
  const char* with = "CANN and NCCL";
#endif
  std::printf("consumer_headers.cpp: libfsdpturbo %s beside %s\n", version, with);
  return 0;
}
