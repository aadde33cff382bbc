/* The ABI foundation: versions, status names, the host kernels' instruction set, the last-error
 * protocol, the panic boundary. */
#include "check.h"

static void test_versions(void) {
  CHECK(fsdpturbo_abi_version() == FSDPTURBO_ABI_VERSION);
  const char *version = fsdpturbo_version();
  CHECK(version != NULL && strlen(version) >= 5);
  CHECK(strchr(version, '.') != NULL);
}

static void test_status_names(void) {
  CHECK(strcmp(fsdpturbo_status_name(FSDPTURBO_OK), "FSDPTURBO_OK") == 0);
  CHECK(strcmp(fsdpturbo_status_name(FSDPTURBO_ERR_PANIC), "FSDPTURBO_ERR_PANIC") == 0);
  CHECK(strcmp(fsdpturbo_status_name(FSDPTURBO_ERR_NULL_ARGUMENT), "FSDPTURBO_ERR_NULL_ARGUMENT") == 0);
  CHECK(strcmp(fsdpturbo_status_name(-12345), "FSDPTURBO_UNKNOWN_STATUS") == 0);
}

static void test_host_isa(void) {
  const char *isa = NULL;
  CHECK_STATUS(fsdpturbo_host_isa(&isa), FSDPTURBO_OK);
  CHECK(isa != NULL && (strcmp(isa, "portable") == 0 || strcmp(isa, "avx2") == 0 || strcmp(isa, "avx512") == 0));
  CHECK_STATUS(fsdpturbo_host_isa(NULL), FSDPTURBO_ERR_NULL_ARGUMENT);
  CHECK(last_error_contains("out_name"));
}

static void test_panic_boundary_and_last_error(void) {
  CHECK_STATUS(fsdpturbo_debug_panic(), FSDPTURBO_ERR_PANIC);
  CHECK(last_error_contains("panic"));
  CHECK(last_error_contains("fsdpturbo_debug_panic was called"));

  /* Length query with no buffer, then truncation to a short buffer. */
  size_t full = fsdpturbo_last_error(NULL, 0);
  CHECK(full > 10);
  char small[8];
  memset(small, 'x', sizeof small);
  CHECK(fsdpturbo_last_error(small, sizeof small) == full);
  CHECK(small[7] == '\0' && strlen(small) == 7);

  /* The library still works after a panic. */
  CHECK(fsdpturbo_abi_version() == FSDPTURBO_ABI_VERSION);
  CHECK_STATUS(fsdpturbo_debug_panic(), FSDPTURBO_ERR_PANIC);
}

int main(void) {
  test_versions();
  test_status_names();
  test_host_isa();
  test_panic_boundary_and_last_error();
  return check_summary("test_abi");
}
