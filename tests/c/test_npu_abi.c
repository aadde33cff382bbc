/* The Ascend operator C ABI through the header: what is refused before any CANN library is
 * loaded (these checks need no NPU and no test double), with the error naming what and why. */
#include "check.h"

static void *never_alloc(void *ctx, uint64_t bytes) {
  (void)ctx, (void)bytes;
  return NULL;
}

int main(void) {
  int64_t dims[2] = {2, 4}, strides[2] = {4, 1};
  uint16_t data[8] = {0};
  fsdpturbo_npu_view_t v = {data, 8, 0, 2, dims, strides};
  int64_t counts[2] = {1, 1};
  fsdpturbo_npu_exchange_t exchange = {"hccl_world_group", 2, 2, counts, counts, true};

  CHECK_STATUS(fsdpturbo_npu_alltoallv_grouped_mm(FSDPTURBO_DTYPE_F32, &v, &v, &exchange, &v, NULL, never_alloc,
                                                      NULL, NULL),
               FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("bfloat16 or float16"));
  CHECK_STATUS(fsdpturbo_npu_grouped_mm_alltoallv(FSDPTURBO_DTYPE_BF16, &v, &v, NULL, &v, never_alloc, NULL, NULL),
               FSDPTURBO_ERR_NULL_ARGUMENT);
  CHECK(last_error_contains("exchange"));
  exchange.group = NULL;
  CHECK_STATUS(fsdpturbo_npu_alltoallv_grouped_mm(FSDPTURBO_DTYPE_BF16, &v, &v, &exchange, &v, NULL, never_alloc,
                                                      NULL, NULL),
               FSDPTURBO_ERR_NULL_ARGUMENT);
  CHECK(last_error_contains("exchange.group"));
  exchange.group = "hccl_world_group";
  exchange.send_counts = NULL;
  CHECK_STATUS(fsdpturbo_npu_grouped_mm_alltoallv(FSDPTURBO_DTYPE_F16, &v, &v, &exchange, &v, never_alloc, NULL,
                                                      NULL),
               FSDPTURBO_ERR_NULL_ARGUMENT);
  CHECK(last_error_contains("exchange.send_counts"));
  CHECK_STATUS(fsdpturbo_npu_moe_token_permute(FSDPTURBO_DTYPE_BF16, &v, &v, &v, &v, NULL, NULL, NULL),
               FSDPTURBO_ERR_NULL_ARGUMENT);
  CHECK(last_error_contains("argument `alloc` must not be NULL"));
  CHECK_STATUS(fsdpturbo_npu_moe_token_unpermute(99, &v, &v, NULL, &v, never_alloc, NULL, NULL),
               FSDPTURBO_ERR_INVALID_ARGUMENT);
  char name[16];
  CHECK_STATUS(fsdpturbo_hccl_comm_name(NULL, name, sizeof name), FSDPTURBO_ERR_NULL_ARGUMENT);
  return check_summary("test_npu_abi");
}
