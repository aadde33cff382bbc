/* Test double of libnnopbase.so: the executor destructor, checked by the libopapi double. */
#include "ascend/aclnn.h"
#include "double_common.h"

aclnnStatus fsdpturbo_double_destroy_executor(aclOpExecutor *executor);

DOUBLE_EXPORT const char *fsdpturbo_test_double_marker(void) { return DOUBLE_MARKER; }

DOUBLE_EXPORT aclnnStatus aclDestroyAclOpExecutor(aclOpExecutor *executor) {
  return fsdpturbo_double_destroy_executor(executor);
}
