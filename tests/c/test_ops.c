/* The device-operator registry through the header, as a C++ trainer uses it: register
 * implementations, keep its own id -> function table, resolve with the CPU fallback and its
 * once-only warning, and the errors. */
#include "check.h"

typedef int (*kernel_fn)(int);

static int cpu_kernel(int x) { return x + 1; }
static int npu_kernel(int x) { return x + 2; }

/* The trainer's own table: implementation id -> function. */
static struct {
  uint64_t id;
  kernel_fn fn;
} table[8];
static size_t table_len = 0;

static void add(const char *op, const char *device, kernel_fn fn) {
  uint64_t id = 0, replaced = 1;
  CHECK_STATUS(fsdpturbo_op_register(op, device, &id, &replaced), FSDPTURBO_OK);
  CHECK(id != 0 && replaced == 0);
  table[table_len].id = id;
  table[table_len].fn = fn;
  ++table_len;
}

static kernel_fn lookup(uint64_t id) {
  for (size_t i = 0; i < table_len; ++i)
    if (table[i].id == id) return table[i].fn;
  return NULL;
}

static void test_resolve_and_fallback(void) {
  add("c_matmul", "cpu", cpu_kernel);
  add("c_matmul", "npu", npu_kernel);
  uint64_t id = 0;
  int32_t how = -1;
  CHECK_STATUS(fsdpturbo_op_resolve("c_matmul", "npu", &id, &how), FSDPTURBO_OK);
  CHECK(how == FSDPTURBO_OP_EXACT && lookup(id) != NULL && lookup(id)(1) == 3);
  CHECK_STATUS(fsdpturbo_op_resolve("c_matmul", "cuda", &id, &how), FSDPTURBO_OK);
  CHECK(how == FSDPTURBO_OP_CPU_FALLBACK_WARN && lookup(id)(1) == 2);
  CHECK_STATUS(fsdpturbo_op_resolve("c_matmul", "cuda", &id, &how), FSDPTURBO_OK);
  CHECK(how == FSDPTURBO_OP_CPU_FALLBACK);

  char text[256];
  size_t len = 0;
  CHECK_STATUS(fsdpturbo_op_fallback_warning("c_matmul", "cuda", text, sizeof text, &len), FSDPTURBO_OK);
  CHECK(strcmp(text, "Operator 'c_matmul' not available for device 'cuda', falling back to CPU implementation") == 0);
  CHECK(len == strlen(text) + 1);

  /* The table as JSON: ask for the size first. */
  CHECK_STATUS(fsdpturbo_op_table_json(NULL, 0, &len), FSDPTURBO_ERR_BUFFER_TOO_SMALL);
  char json[4096];
  CHECK(len <= sizeof json);
  CHECK_STATUS(fsdpturbo_op_table_json(json, sizeof json, &len), FSDPTURBO_OK);
  CHECK(strstr(json, "\"c_matmul\":{\"cpu\":") != NULL);
}

static void test_errors(void) {
  uint64_t id = 0;
  int32_t how = 0;
  CHECK_STATUS(fsdpturbo_op_resolve("c_missing", "cpu", &id, &how), FSDPTURBO_ERR_NOT_FOUND);
  CHECK(last_error_contains("Operator 'c_missing' is not registered"));
  add("c_npu_only", "npu", npu_kernel);
  CHECK_STATUS(fsdpturbo_op_resolve("c_npu_only", "cuda", &id, &how), FSDPTURBO_ERR_NOT_FOUND);
  CHECK(last_error_contains("not available for device 'cuda' and no CPU fallback exists"));
  uint64_t replaced = 0;
  CHECK_STATUS(fsdpturbo_op_register("c_matmul", "cuda:0", &id, &replaced), FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("pass its type, 'cuda'"));
  CHECK_STATUS(fsdpturbo_op_register(NULL, "cpu", &id, &replaced), FSDPTURBO_ERR_NULL_ARGUMENT);
  CHECK(strcmp(fsdpturbo_status_name(FSDPTURBO_ERR_NOT_FOUND), "FSDPTURBO_ERR_NOT_FOUND") == 0);
}

int main(void) {
  test_resolve_and_fallback();
  test_errors();
  return check_summary("test_ops");
}
