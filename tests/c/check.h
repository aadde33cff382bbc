/* A minimal check harness for the C tests: CHECK keeps going and counts, the test's main
 * returns check_summary(). */
#ifndef FSDPTURBO_TEST_CHECK_H
#define FSDPTURBO_TEST_CHECK_H

#include <stdio.h>
#include <string.h>

#include "fsdpturbo_internal.h"

static int check_failures = 0;
static int check_count = 0;

#define CHECK(cond)                                                              \
  do {                                                                           \
    ++check_count;                                                               \
    if (!(cond)) {                                                               \
      ++check_failures;                                                          \
      fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);   \
    }                                                                            \
  } while (0)

#define CHECK_STATUS(expr, expected)                                                         \
  do {                                                                                       \
    int32_t check_status_ = (expr);                                                          \
    ++check_count;                                                                           \
    if (check_status_ != (expected)) {                                                       \
      char check_msg_[1024];                                                                 \
      fsdpturbo_last_error(check_msg_, sizeof check_msg_);                                   \
      ++check_failures;                                                                      \
      fprintf(stderr, "%s:%d: %s returned %s, expected %s (last error: %s)\n", __FILE__,     \
              __LINE__, #expr, fsdpturbo_status_name(check_status_),                         \
              fsdpturbo_status_name(expected), check_msg_);                                  \
    }                                                                                        \
  } while (0)

/* The last error text contains `needle`. */
static int last_error_contains(const char *needle) {
  char msg[4096];
  fsdpturbo_last_error(msg, sizeof msg);
  if (strstr(msg, needle) == NULL) {
    fprintf(stderr, "last error \"%s\" does not contain \"%s\"\n", msg, needle);
    return 0;
  }
  return 1;
}

static int check_summary(const char *name) {
  printf("%s: %d checks, %d failed\n", name, check_count, check_failures);
  return check_failures == 0 ? 0 : 1;
}

#endif
