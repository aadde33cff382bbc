/* Shared by the C test doubles of the CANN libraries (tests only; never installed).
 * Every call is appended to the file named by FSDPTURBO_DOUBLE_LOG (when set), one line a call;
 * a protocol violation is logged as a line starting with "VIOLATION" (and printed to stderr),
 * and the call fails with the library's parameter error. */
#ifndef FSDPTURBO_DOUBLE_COMMON_H
#define FSDPTURBO_DOUBLE_COMMON_H

#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>

#define DOUBLE_EXPORT __attribute__((visibility("default")))

/* What the library's switch into test mode looks for: real CANN libraries do not export it. */
#define DOUBLE_MARKER "fsdpturbo-ascend-test-double"

static inline void double_vlog(const char *prefix, const char *fmt, va_list ap) {
  const char *path = getenv("FSDPTURBO_DOUBLE_LOG");
  if (prefix) {
    va_list copy;
    va_copy(copy, ap);
    fprintf(stderr, "ascend test double: %s", prefix);
    vfprintf(stderr, fmt, copy);
    fputc('\n', stderr);
    va_end(copy);
  }
  if (!path || !*path) return;
  FILE *f = fopen(path, "a");
  if (!f) return;
  if (prefix) fputs(prefix, f);
  vfprintf(f, fmt, ap);
  fputc('\n', f);
  fclose(f);
}

__attribute__((format(printf, 1, 2))) static inline void double_log(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  double_vlog(NULL, fmt, ap);
  va_end(ap);
}

__attribute__((format(printf, 1, 2))) static inline void double_violation(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  double_vlog("VIOLATION ", fmt, ap);
  va_end(ap);
}

/* Id of a stream made by this double's aclrtCreateStream, or -1 (libascendcl double). */
int fsdpturbo_double_stream_id(const void *stream);

#endif
