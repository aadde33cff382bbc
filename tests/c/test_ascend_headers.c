/* Header conformance: our hand-written CANN declarations (third_party/vendor-headers/ascend) against the values
 * of CANN's public headers (each quoted below). Compiling is the test; main() only exists so
 * ctest can run it. The signatures are checked by assigning each function to a pointer of the
 * header's exact type (a mismatch is a compile error under -Werror). */
#include <assert.h>
#include <stddef.h>

#include "ascend/acl.h"
#include "ascend/aclnn.h"
#include "ascend/hccl.h"

/* HCCL (hccl_types.h): HcclResult (every value), HcclReduceOp (no AVG), HcclDataType, root info. */
static_assert(HCCL_SUCCESS == 0 && HCCL_E_PARA == 1 && HCCL_E_PTR == 2 && HCCL_E_MEMORY == 3, "HcclResult");
static_assert(HCCL_E_INTERNAL == 4 && HCCL_E_NOT_SUPPORT == 5 && HCCL_E_NOT_FOUND == 6 && HCCL_E_UNAVAIL == 7,
              "HcclResult");
static_assert(HCCL_E_SYSCALL == 8 && HCCL_E_TIMEOUT == 9 && HCCL_E_OPEN_FILE_FAILURE == 10, "HcclResult");
static_assert(HCCL_E_TCP_CONNECT == 11 && HCCL_E_ROCE_CONNECT == 12 && HCCL_E_TCP_TRANSFER == 13, "HcclResult");
static_assert(HCCL_E_ROCE_TRANSFER == 14 && HCCL_E_RUNTIME == 15 && HCCL_E_DRV == 16 && HCCL_E_PROFILING == 17,
              "HcclResult");
static_assert(HCCL_E_CCE == 18 && HCCL_E_NETWORK == 19 && HCCL_E_AGAIN == 20 && HCCL_E_REMOTE == 21, "HcclResult");
static_assert(HCCL_E_SUSPENDING == 22 && HCCL_E_OPRETRY_FAIL == 23 && HCCL_E_OOM == 24, "HcclResult");
static_assert(HCCL_REDUCE_SUM == 0 && HCCL_REDUCE_PROD == 1 && HCCL_REDUCE_MAX == 2 && HCCL_REDUCE_MIN == 3 &&
                  HCCL_REDUCE_RESERVED == 255,
              "HcclReduceOp");
static_assert(HCCL_DATA_TYPE_INT8 == 0 && HCCL_DATA_TYPE_INT16 == 1 && HCCL_DATA_TYPE_INT32 == 2, "HcclDataType");
static_assert(HCCL_DATA_TYPE_FP16 == 3 && HCCL_DATA_TYPE_FP32 == 4 && HCCL_DATA_TYPE_INT64 == 5, "HcclDataType");
static_assert(HCCL_DATA_TYPE_UINT64 == 6 && HCCL_DATA_TYPE_UINT8 == 7 && HCCL_DATA_TYPE_UINT16 == 8, "HcclDataType");
static_assert(HCCL_DATA_TYPE_UINT32 == 9 && HCCL_DATA_TYPE_FP64 == 10 && HCCL_DATA_TYPE_BFP16 == 11, "HcclDataType");
static_assert(HCCL_DATA_TYPE_INT128 == 12 && HCCL_DATA_TYPE_HIF8 == 14 && HCCL_DATA_TYPE_FP8E4M3 == 15, "HcclDataType");
static_assert(HCCL_DATA_TYPE_FP8E5M2 == 16 && HCCL_DATA_TYPE_FP8E8M0 == 17 && HCCL_DATA_TYPE_RESERVED == 255,
              "HcclDataType");
static_assert(HCCL_ROOT_INFO_BYTES == 4108 && sizeof(HcclRootInfo) == 4108, "HcclRootInfo is 4108 bytes");
static_assert(sizeof(HcclComm) == sizeof(void *) && sizeof(aclrtStream) == sizeof(void *), "handles are pointers");

/* The ACL runtime (acl_base.h, acl_rt.h). */
static_assert(ACL_SUCCESS == 0 && ACL_ERROR_REPEAT_INITIALIZE == 100002, "aclError");
static_assert(sizeof(aclError) == sizeof(int), "aclError is int");
static_assert(ACL_MEMCPY_HOST_TO_HOST == 0 && ACL_MEMCPY_HOST_TO_DEVICE == 1 && ACL_MEMCPY_DEVICE_TO_HOST == 2 &&
                  ACL_MEMCPY_DEVICE_TO_DEVICE == 3 && ACL_MEMCPY_DEFAULT == 4,
              "aclrtMemcpyKind");
static_assert(ACL_MEM_MALLOC_HUGE_FIRST == 0 && ACL_MEM_MALLOC_HUGE_ONLY == 1 && ACL_MEM_MALLOC_NORMAL_ONLY == 2,
              "aclrtMemMallocPolicy");

/* What aclCreateTensor takes (aclDataType, aclFormat: acl_base.h), and aclnn's statuses. */
static_assert(ACL_FLOAT == 0 && ACL_FLOAT16 == 1 && ACL_INT8 == 2 && ACL_INT32 == 3 && ACL_UINT8 == 4, "aclDataType");
static_assert(ACL_INT16 == 6 && ACL_UINT16 == 7 && ACL_UINT32 == 8 && ACL_INT64 == 9 && ACL_UINT64 == 10, "aclDataType");
static_assert(ACL_DOUBLE == 11 && ACL_BOOL == 12 && ACL_BF16 == 27 && ACL_FLOAT8_E5M2 == 35 &&
                  ACL_FLOAT8_E4M3FN == 36 && ACL_DT_UNDEFINED == -1,
              "aclDataType");
static_assert(ACL_FORMAT_ND == 2 && ACL_FORMAT_NCHW == 0 && ACL_FORMAT_FRACTAL_NZ == 29, "aclFormat");
static_assert(ACLNN_ERR_PARAM_NULLPTR == 161001 && ACLNN_ERR_PARAM_INVALID == 161002, "aclnnStatus");
/* aclnnGroupedMatmul's GMMActType. */
static_assert(GMM_ACT_TYPE_NONE == 0 && GMM_ACT_TYPE_RELU == 1 && GMM_ACT_TYPE_GELU_TANH == 2 &&
                  GMM_ACT_TYPE_GELU_ERR_FUNC == 3 && GMM_ACT_TYPE_FAST_GELU == 4 && GMM_ACT_TYPE_SILU == 5,
              "GMMActType");

/* Signatures, written out again from CANN's headers. */
typedef HcclResult (*init_root_info_t)(uint32_t, const HcclRootInfo *, uint32_t, HcclComm *);
typedef HcclResult (*all_reduce_t)(void *, void *, uint64_t, HcclDataType, HcclReduceOp, HcclComm, aclrtStream);
typedef HcclResult (*all_gather_t)(void *, void *, uint64_t, HcclDataType, HcclComm, aclrtStream);
typedef HcclResult (*all_to_all_v_t)(const void *, const void *, const void *, HcclDataType, const void *,
                                     const void *, const void *, HcclDataType, HcclComm, aclrtStream);
typedef aclTensor *(*create_tensor_t)(const int64_t *, uint64_t, aclDataType, const int64_t *, int64_t, aclFormat,
                                      const int64_t *, uint64_t, void *);
typedef aclTensorList *(*create_list_t)(const aclTensor *const *, uint64_t);
typedef aclnnStatus (*launch_t)(void *, uint64_t, aclOpExecutor *, aclrtStream);
typedef aclnnStatus (*gmm_v4_t)(const aclTensorList *, const aclTensorList *, const aclTensorList *,
                                const aclTensorList *, const aclTensorList *, const aclTensorList *,
                                const aclTensorList *, const aclTensorList *, const aclTensor *,
                                const aclTensorList *, const aclTensorList *, const aclTensorList *, int64_t, int64_t,
                                int64_t, int64_t, aclTensorList *, aclTensorList *, aclTensorList *, uint64_t *,
                                aclOpExecutor **);
typedef aclnnStatus (*gmm_v5_t)(const aclTensorList *, const aclTensorList *, const aclTensorList *,
                                const aclTensorList *, const aclTensorList *, const aclTensorList *,
                                const aclTensorList *, const aclTensorList *, const aclTensor *,
                                const aclTensorList *, const aclTensorList *, const aclTensorList *, int64_t, int64_t,
                                int64_t, int64_t, aclIntArray *, aclTensorList *, aclTensorList *, aclTensorList *,
                                uint64_t *, aclOpExecutor **);
typedef aclIntArray *(*create_int_array_t)(const int64_t *, uint64_t);
typedef int (*destroy_int_array_t)(const aclIntArray *);
typedef HcclResult (*comm_name_t)(HcclComm, char *);
/* Token permute / unpermute (aclnnMoeTokenPermute, aclnnMoeTokenUnpermute). */
typedef aclnnStatus (*permute_t)(const aclTensor *, const aclTensor *, int64_t, bool, const aclTensor *,
                                 const aclTensor *, uint64_t *, aclOpExecutor **);
typedef aclnnStatus (*unpermute_t)(const aclTensor *, const aclTensor *, const aclTensor *, bool, const aclIntArray *,
                                   aclTensor *, uint64_t *, aclOpExecutor **);
/* MC2: the all-to-all-v fused with the grouped matmul, both ways (aclnnAlltoAllvGroupedMatMul,
 * aclnnGroupedMatMulAlltoAllv). */
typedef aclnnStatus (*alltoallv_gmm_t)(const aclTensor *, const aclTensor *, const aclTensor *, const aclTensor *,
                                       const aclTensor *, const aclTensor *, const char *, int64_t,
                                       const aclIntArray *, const aclIntArray *, bool, bool, bool, aclTensor *,
                                       aclTensor *, aclTensor *, uint64_t *, aclOpExecutor **);
typedef aclnnStatus (*gmm_alltoallv_t)(const aclTensor *, const aclTensor *, const aclTensor *, const aclTensor *,
                                       const aclTensor *, const aclTensor *, const char *, int64_t,
                                       const aclIntArray *, const aclIntArray *, bool, bool, aclTensor *, aclTensor *,
                                       uint64_t *, aclOpExecutor **);

int main(void) {
  init_root_info_t init = HcclCommInitRootInfo;
  all_reduce_t all_reduce = HcclAllReduce;
  all_reduce_t reduce_scatter = HcclReduceScatter;
  all_gather_t all_gather = HcclAllGather;
  all_to_all_v_t all_to_all_v = HcclAlltoAllV;
  create_tensor_t create_tensor = aclCreateTensor;
  create_list_t create_list = aclCreateTensorList;
  launch_t launches[2] = {aclnnGroupedMatmulV4, aclnnGroupedMatmulV5};
  gmm_v4_t v4 = aclnnGroupedMatmulV4GetWorkspaceSize;
  gmm_v5_t v5 = aclnnGroupedMatmulV5GetWorkspaceSize;
  create_int_array_t create_int_array = aclCreateIntArray;
  destroy_int_array_t destroy_int_array = aclDestroyIntArray;
  comm_name_t comm_name = HcclGetCommName;
  permute_t permute = aclnnMoeTokenPermuteGetWorkspaceSize;
  unpermute_t unpermute = aclnnMoeTokenUnpermuteGetWorkspaceSize;
  alltoallv_gmm_t alltoallv_gmm = aclnnAlltoAllvGroupedMatMulGetWorkspaceSize;
  gmm_alltoallv_t gmm_alltoallv = aclnnGroupedMatMulAlltoAllvGetWorkspaceSize;
  launch_t more_launches[4] = {aclnnMoeTokenPermute, aclnnMoeTokenUnpermute, aclnnAlltoAllvGroupedMatMul,
                               aclnnGroupedMatMulAlltoAllv};
  /* Referenced only, never called: the test links the C test doubles, which define them. */
  return !(init && all_reduce && reduce_scatter && all_gather && all_to_all_v && create_tensor && create_list &&
           launches[0] && launches[1] && v4 && v5 && create_int_array && destroy_int_array && comm_name && permute &&
           unpermute && alltoallv_gmm && gmm_alltoallv && more_launches[0] && more_launches[1] && more_launches[2] &&
           more_launches[3]);
}
