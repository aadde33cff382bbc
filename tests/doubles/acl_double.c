/* Test double of libascendcl.so: streams are tagged host objects so the other doubles can check
 * that every launch gets a stream this runtime made. */
#include <pthread.h>
#include <stdint.h>

#include "ascend/acl.h"
#include "double_common.h"

#define STREAM_MAGIC 0x53545245414d2121ull

typedef struct {
  uint64_t magic;
  int id;
  int live;
} DoubleStream;

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int next_stream = 1;

DOUBLE_EXPORT const char *fsdpturbo_test_double_marker(void) { return DOUBLE_MARKER; }

DOUBLE_EXPORT int fsdpturbo_double_stream_id(const void *stream) {
  const DoubleStream *s = (const DoubleStream *)stream;
  if (!s || s->magic != STREAM_MAGIC || !s->live) return -1;
  return s->id;
}

DOUBLE_EXPORT aclError aclrtGetDevice(int32_t *deviceId) {
  if (!deviceId) return 1;
  *deviceId = 0;
  return ACL_SUCCESS;
}

DOUBLE_EXPORT aclError aclrtCreateStream(aclrtStream *stream) {
  if (!stream) {
    double_violation("aclrtCreateStream stream=NULL");
    return 1;
  }
  /* Never freed: a destroyed stream stays recognisable as destroyed. */
  DoubleStream *s = (DoubleStream *)calloc(1, sizeof *s);
  pthread_mutex_lock(&lock);
  s->id = next_stream++;
  pthread_mutex_unlock(&lock);
  s->magic = STREAM_MAGIC;
  s->live = 1;
  *stream = s;
  double_log("aclrtCreateStream S%d", s->id);
  return ACL_SUCCESS;
}

DOUBLE_EXPORT aclError aclrtDestroyStream(aclrtStream stream) {
  int id = fsdpturbo_double_stream_id(stream);
  if (id < 0) {
    double_violation("aclrtDestroyStream of a stream this runtime did not make (or destroyed twice)");
    return 1;
  }
  ((DoubleStream *)stream)->live = 0;
  double_log("aclrtDestroyStream S%d", id);
  return ACL_SUCCESS;
}

DOUBLE_EXPORT aclError aclrtSynchronizeStream(aclrtStream stream) {
  int id = fsdpturbo_double_stream_id(stream);
  if (id < 0) {
    double_violation("aclrtSynchronizeStream of a stream this runtime did not make");
    return 1;
  }
  double_log("aclrtSynchronizeStream S%d", id);
  return ACL_SUCCESS;
}
