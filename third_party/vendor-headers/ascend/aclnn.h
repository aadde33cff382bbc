/* Minimal aclnn declarations used by libfsdpturbo: the tensor/list constructors and grouped
 * matmul (libopapi.so and the op-plugin search order) and the executor destructor
 * (libnnopbase.so), quoted from op-plugin op_plugin/utils/op_api_common_base.h and
 * hicann/ops-transformer gmm/, moe/ and mc2/ op_host/op_api/ headers. Checked by tests/c/test_ascend_headers.c. */
#ifndef FSDPTURBO_ASCEND_ACLNN_H
#define FSDPTURBO_ASCEND_ACLNN_H

#include <stdbool.h>
#include <stdint.h>

#include "acl.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef int aclnnStatus;
#define ACLNN_ERR_PARAM_NULLPTR 161001
#define ACLNN_ERR_PARAM_INVALID 161002

typedef struct aclTensor aclTensor;
typedef struct aclTensorList aclTensorList;
typedef struct aclIntArray aclIntArray;
typedef struct aclOpExecutor aclOpExecutor;

/* Strides and offset in elements; offset is the 5th argument and format the 6th. */
aclTensor *aclCreateTensor(const int64_t *viewDims, uint64_t viewDimsNum, aclDataType dataType, const int64_t *stride,
                           int64_t offset, aclFormat format, const int64_t *storageDims, uint64_t storageDimsNum,
                           void *tensorData);
aclTensorList *aclCreateTensorList(const aclTensor *const *value, uint64_t size);
int aclDestroyTensor(const aclTensor *tensor);
int aclDestroyTensorList(const aclTensorList *list);
aclIntArray *aclCreateIntArray(const int64_t *value, uint64_t size);
int aclDestroyIntArray(const aclIntArray *array);

typedef enum {
  GMM_ACT_TYPE_NONE = 0,
  GMM_ACT_TYPE_RELU = 1,
  GMM_ACT_TYPE_GELU_TANH = 2,
  GMM_ACT_TYPE_GELU_ERR_FUNC = 3,
  GMM_ACT_TYPE_FAST_GELU = 4,
  GMM_ACT_TYPE_SILU = 5
} GMMActType;

aclnnStatus aclnnGroupedMatmulV4GetWorkspaceSize(
    const aclTensorList *x, const aclTensorList *weight, const aclTensorList *biasOptional,
    const aclTensorList *scaleOptional, const aclTensorList *offsetOptional,
    const aclTensorList *antiquantScaleOptional, const aclTensorList *antiquantOffsetOptional,
    const aclTensorList *perTokenScaleOptional, const aclTensor *groupListOptional,
    const aclTensorList *activationInputOptional, const aclTensorList *activationQuantScaleOptional,
    const aclTensorList *activationQuantOffsetOptional, int64_t splitItem, int64_t groupType, int64_t groupListType,
    int64_t actType, aclTensorList *out, aclTensorList *activationFeatureOutOptional,
    aclTensorList *dynQuantScaleOutOptional, uint64_t *workspaceSize, aclOpExecutor **executor);
aclnnStatus aclnnGroupedMatmulV4(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream);

/* V5: V4 plus tuningConfigOptional after actType. */
aclnnStatus aclnnGroupedMatmulV5GetWorkspaceSize(
    const aclTensorList *x, const aclTensorList *weight, const aclTensorList *biasOptional,
    const aclTensorList *scaleOptional, const aclTensorList *offsetOptional,
    const aclTensorList *antiquantScaleOptional, const aclTensorList *antiquantOffsetOptional,
    const aclTensorList *perTokenScaleOptional, const aclTensor *groupListOptional,
    const aclTensorList *activationInputOptional, const aclTensorList *activationQuantScaleOptional,
    const aclTensorList *activationQuantOffsetOptional, int64_t splitItem, int64_t groupType, int64_t groupListType,
    int64_t actType, aclIntArray *tuningConfigOptional, aclTensorList *out,
    aclTensorList *activationFeatureOutOptional, aclTensorList *dynQuantScaleOutOptional, uint64_t *workspaceSize,
    aclOpExecutor **executor);
aclnnStatus aclnnGroupedMatmulV5(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream);

/* MoE token permute/unpermute (paddedMode false only). sortedIndices maps every flat
 * (token, k) slot to its row of the permuted tokens (INT32). */
aclnnStatus aclnnMoeTokenPermuteGetWorkspaceSize(const aclTensor *tokens, const aclTensor *indices, int64_t numOutTokens,
                                                 bool paddedMode, const aclTensor *permuteTokensOut,
                                                 const aclTensor *sortedIndicesOut, uint64_t *workspaceSize,
                                                 aclOpExecutor **executor);
aclnnStatus aclnnMoeTokenPermute(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor, aclrtStream stream);
aclnnStatus aclnnMoeTokenUnpermuteGetWorkspaceSize(const aclTensor *permutedTokens, const aclTensor *sortedIndices,
                                                   const aclTensor *probsOptional, bool paddedMode,
                                                   const aclIntArray *restoreShapeOptional, aclTensor *out,
                                                   uint64_t *workspaceSize, aclOpExecutor **executor);
aclnnStatus aclnnMoeTokenUnpermute(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
                                   aclrtStream stream);

/* MC2 (ops-transformer mc2/): all-to-all-v fused with grouped matmul over the HCCL communicator
 * named `group` (HcclGetCommName). Counts: e * epWorldSize INT64 entries. */
aclnnStatus aclnnAlltoAllvGroupedMatMulGetWorkspaceSize(
    const aclTensor *gmmX, const aclTensor *gmmWeight, const aclTensor *sendCountsTensorOptional,
    const aclTensor *recvCountsTensorOptional, const aclTensor *mmXOptional, const aclTensor *mmWeightOptional,
    const char *group, int64_t epWorldSize, const aclIntArray *sendCounts, const aclIntArray *recvCounts,
    bool transGmmWeight, bool transMmWeight, bool permuteOutFlag, aclTensor *gmmY, aclTensor *mmYOptional,
    aclTensor *permuteOutOptional, uint64_t *workspaceSize, aclOpExecutor **executor);
aclnnStatus aclnnAlltoAllvGroupedMatMul(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
                                        aclrtStream stream);
aclnnStatus aclnnGroupedMatMulAlltoAllvGetWorkspaceSize(
    const aclTensor *gmmX, const aclTensor *gmmWeight, const aclTensor *sendCountsTensorOptional,
    const aclTensor *recvCountsTensorOptional, const aclTensor *mmXOptional, const aclTensor *mmWeightOptional,
    const char *group, int64_t epWorldSize, const aclIntArray *sendCounts, const aclIntArray *recvCounts,
    bool transGmmWeight, bool transMmWeight, aclTensor *y, aclTensor *mmYOptional, uint64_t *workspaceSize,
    aclOpExecutor **executor);
aclnnStatus aclnnGroupedMatMulAlltoAllv(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
                                        aclrtStream stream);

/* libnnopbase.so */
aclnnStatus aclDestroyAclOpExecutor(aclOpExecutor *executor);

#ifdef __cplusplus
}
#endif
#endif
