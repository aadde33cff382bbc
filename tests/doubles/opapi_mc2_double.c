/* The libopapi double's MC2 operators (ops-transformer's mc2/ operator docs): aclnnAlltoAllvGroupedMatMul (the
 * all-to-all-v, the permute from source-rank-major to local-expert-major, the grouped matmul) and
 * aclnnGroupedMatMulAlltoAllv (the grouped matmul, the unpermute back, the all-to-all-v). Like
 * the real operators they find their HCCL communicator by name and move the rows over it (the
 * HCCL double's all-to-all, on the launch stream); results are computed on the host buffers. */
#include <stdlib.h>
#include <string.h>

#include "ascend/hccl.h"
#include "opapi_double.h"

HcclComm fsdpturbo_double_comm_named(const char *name);
HcclResult fsdpturbo_double_all_to_all_v(const char *what, const void *sendBuf, const void *sendCounts,
                                         const void *sdispls, HcclDataType sendType, const void *recvBuf,
                                         const void *recvCounts, const void *rdispls, HcclDataType recvType,
                                         HcclComm comm, aclrtStream stream);

enum { MC2_X, MC2_WEIGHT, MC2_Y, MC2_PERMUTE_OUT };
enum { ATTR_EP, ATTR_TRANS };

/* Everything both operators check before they make an executor; returns the executor or NULL. */
static Obj *mc2_executor(const char *what, const char *launch_name, Compute compute, const aclTensor *gmmX,
                         const aclTensor *gmmWeight, const aclTensor *sendCountsTensor,
                         const aclTensor *recvCountsTensor, const aclTensor *mmX, const aclTensor *mmWeight,
                         const aclTensor *mmY, const char *group, int64_t epWorldSize, const aclIntArray *sendCounts,
                         const aclIntArray *recvCounts, bool transGmmWeight, bool transMmWeight, const aclTensor *y,
                         uint64_t *workspaceSize, aclOpExecutor **executor, aclnnStatus *status) {
  *status = ACLNN_ERR_PARAM_NULLPTR;
  Obj *x = double_live(gmmX, KIND_TENSOR, what, "gmmX"), *w = double_live(gmmWeight, KIND_TENSOR, what, "gmmWeight");
  Obj *out = double_live(y, KIND_TENSOR, what, "gmmY/y");
  Obj *send = double_live(sendCounts, KIND_INT_ARRAY, what, "sendCounts");
  Obj *recv = double_live(recvCounts, KIND_INT_ARRAY, what, "recvCounts");
  if (!x || !w || !out || !send || !recv) return NULL;
  if (sendCountsTensor || recvCountsTensor) {
    double_violation("%s: sendCountsTensorOptional and recvCountsTensorOptional must be NULL", what);
    return NULL;
  }
  if (mmX || mmWeight || mmY || transMmWeight) {
    double_violation("%s: the shared-expert matmul (mmX, mmWeight, mmY, transMmWeight) is not used by fsdpturbo", what);
    *status = ACLNN_ERR_PARAM_INVALID;
    return NULL;
  }
  if (!group || !*group || strnlen(group, 128) >= 128) {
    double_violation("%s: group must be a communicator name of 1 to 127 bytes", what);
    return NULL;
  }
  *status = ACLNN_ERR_PARAM_INVALID;
  HcclComm comm = fsdpturbo_double_comm_named(group);
  uint32_t ranks = 0;
  if (!comm || HcclGetRankSize(comm, &ranks) != HCCL_SUCCESS || (int64_t)ranks != epWorldSize) {
    double_violation("%s: group '%s' is not a communicator of %ld ranks in this process", what, group,
                     (long)epWorldSize);
    return NULL;
  }
  if (x->ndim != 2 || w->ndim != 3 || out->ndim != 2 || (x->dtype != ACL_FLOAT16 && x->dtype != ACL_BF16) ||
      w->dtype != x->dtype || out->dtype != x->dtype) {
    double_violation("%s: gmmX 2-D, gmmWeight 3-D and the output 2-D, all FLOAT16 or all BFLOAT16 (dtypes %d, %d, %d)",
                     what, (int)x->dtype, (int)w->dtype, (int)out->dtype);
    return NULL;
  }
  int64_t experts = w->dims[0], k = transGmmWeight ? w->dims[2] : w->dims[1];
  if (experts > 32) {
    double_violation("%s: %ld local experts; the operator takes at most 32", what, (long)experts);
    return NULL;
  }
  int64_t n = transGmmWeight ? w->dims[1] : w->dims[2];
  if ((int64_t)send->size != experts * epWorldSize || (int64_t)recv->size != experts * epWorldSize ||
      send->size > 256) {
    double_violation("%s: sendCounts and recvCounts need e * epWorldSize = %ld entries (at most 256), got %lu and %lu",
                     what, (long)(experts * epWorldSize), (unsigned long)send->size, (unsigned long)recv->size);
    return NULL;
  }
  int64_t sent = 0, received = 0;
  for (uint64_t i = 0; i < send->size; ++i) {
    if (send->values[i] < 0 || recv->values[i] < 0) {
      double_violation("%s: negative count at %lu", what, (unsigned long)i);
      return NULL;
    }
    sent += send->values[i];
    received += recv->values[i];
  }
  if (x->dims[1] != k || x->dims[0] != sent || out->dims[1] != n || out->dims[0] != received) {
    double_violation("%s: gmmX [%ld,%ld] and gmmWeight (trans %d) [%ld,%ld,%ld] give K %ld, N %ld; rows %ld (sum of "
                     "sendCounts) in and %ld (sum of recvCounts) out expected, output [%ld,%ld]",
                     what, (long)x->dims[0], (long)x->dims[1], (int)transGmmWeight, (long)w->dims[0], (long)w->dims[1],
                     (long)w->dims[2], (long)k, (long)n, (long)sent, (long)received, (long)out->dims[0],
                     (long)out->dims[1]);
    return NULL;
  }
  Obj *e = double_new_executor(what, launch_name, compute, 1024 + 16 * send->size, workspaceSize, executor);
  if (!e) return NULL;
  e->inputs[MC2_X] = x;
  e->inputs[MC2_WEIGHT] = w;
  e->inputs[MC2_Y] = out;
  e->attrs[ATTR_EP] = epWorldSize;
  e->attrs[ATTR_TRANS] = transGmmWeight;
  memcpy(e->send, send->values, send->size * sizeof(int64_t));
  memcpy(e->recv, recv->values, recv->size * sizeof(int64_t));
  snprintf(e->group, sizeof e->group, "%s", group);
  *status = 0;
  return e;
}

/* out row i (of `rows` rows in `buf`, `width` elements each) = rows of x grouped by local expert:
 * group j holds `group_rows[j]` rows and multiplies weight j. */
static void grouped_matmul(Obj *e, const unsigned char *x, int64_t rows, int64_t width, const int64_t *group_rows,
                           unsigned char *out) {
  Obj *w = e->inputs[MC2_WEIGHT];
  aclDataType t = w->dtype;
  size_t es = double_dtype_size(t);
  int trans = (int)e->attrs[ATTR_TRANS];
  int64_t n = trans ? w->dims[1] : w->dims[2], start = 0;
  for (int64_t j = 0; j < w->dims[0]; ++j) {
    for (int64_t i = start; i < start + group_rows[j] && i < rows; ++i)
      for (int64_t c = 0; c < n; ++c) {
        double acc = 0;
        for (int64_t k = 0; k < width; ++k)
          acc += double_get(x + (size_t)(i * width + k) * es, t) *
                 double_get(trans ? double_at3(w, j, c, k) : double_at3(w, j, k, c), t);
        double_put(out + (size_t)(i * n + c) * es, t, acc);
      }
    start += group_rows[j];
  }
}

/* Row offsets of the block (rank r, local expert j) in source-rank-major and in
 * local-expert-major order, for `counts` indexed r * e + j. */
static void block_offsets(const int64_t *counts, int64_t ranks, int64_t experts, int64_t *source_major,
                          int64_t *expert_major) {
  int64_t at = 0;
  for (int64_t i = 0; i < ranks * experts; ++i) {
    source_major[i] = at;
    at += counts[i];
  }
  at = 0;
  for (int64_t j = 0; j < experts; ++j)
    for (int64_t r = 0; r < ranks; ++r) {
      expert_major[r * experts + j] = at;
      at += counts[r * experts + j];
    }
}

/* All-to-all of rows: to rank r go the rows of `send` [r*e, (r+1)*e), from it come those of `recv`. */
static aclnnStatus move_rows(Obj *e, const char *what, const unsigned char *from, const int64_t *send,
                             unsigned char *to, const int64_t *recv, int64_t width, aclrtStream stream) {
  int64_t ranks = e->attrs[ATTR_EP], experts = e->inputs[MC2_WEIGHT]->dims[0];
  uint64_t sc[8], sd[8], rc[8], rd[8], s_at = 0, r_at = 0;
  for (int64_t r = 0; r < ranks; ++r) {
    sc[r] = rc[r] = 0;
    for (int64_t j = 0; j < experts; ++j) {
      sc[r] += (uint64_t)(send[r * experts + j] * width);
      rc[r] += (uint64_t)(recv[r * experts + j] * width);
    }
    sd[r] = s_at;
    rd[r] = r_at;
    s_at += sc[r];
    r_at += rc[r];
  }
  HcclDataType type = e->inputs[MC2_X]->dtype == ACL_BF16 ? HCCL_DATA_TYPE_BFP16 : HCCL_DATA_TYPE_FP16;
  HcclResult r = fsdpturbo_double_all_to_all_v(what, from, sc, sd, type, to, rc, rd, type,
                                               fsdpturbo_double_comm_named(e->group), stream);
  return r == HCCL_SUCCESS ? 0 : ACLNN_ERR_PARAM_INVALID;
}

static unsigned char *rows_of(const Obj *t) {
  size_t es = double_dtype_size(t->dtype);
  unsigned char *buf = (unsigned char *)malloc((size_t)(t->dims[0] * t->dims[1]) * es + 1);
  for (int64_t i = 0; i < t->dims[0]; ++i)
    for (int64_t c = 0; c < t->dims[1]; ++c) memcpy(buf + (size_t)(i * t->dims[1] + c) * es, double_at2(t, i, c), es);
  return buf;
}

static void store_rows(Obj *t, const unsigned char *buf) {
  size_t es = double_dtype_size(t->dtype);
  for (int64_t i = 0; i < t->dims[0]; ++i)
    for (int64_t c = 0; c < t->dims[1]; ++c) memcpy(double_at2(t, i, c), buf + (size_t)(i * t->dims[1] + c) * es, es);
}

static aclnnStatus alltoallv_gmm_compute(Obj *e, aclrtStream stream) {
  Obj *x = e->inputs[MC2_X], *y = e->inputs[MC2_Y], *permute_out = e->inputs[MC2_PERMUTE_OUT];
  int64_t ranks = e->attrs[ATTR_EP], experts = e->inputs[MC2_WEIGHT]->dims[0], h = x->dims[1], a = y->dims[0];
  size_t es = double_dtype_size(x->dtype), row = (size_t)h * es;
  unsigned char *sent = rows_of(x), *received = (unsigned char *)malloc((size_t)a * row + 1);
  aclnnStatus status = move_rows(e, "aclnnAlltoAllvGroupedMatMul/all-to-all", sent, e->send, received, e->recv, h, stream);
  free(sent);
  if (status != 0) {
    free(received);
    return status;
  }
  unsigned char *permuted = (unsigned char *)malloc((size_t)a * row + 1);
  int64_t source_major[256], expert_major[256], group_rows[32] = {0};
  block_offsets(e->recv, ranks, experts, source_major, expert_major);
  for (int64_t i = 0; i < ranks * experts; ++i) {
    memcpy(permuted + (size_t)expert_major[i] * row, received + (size_t)source_major[i] * row, (size_t)e->recv[i] * row);
    group_rows[i % experts] += e->recv[i];
  }
  unsigned char *out = (unsigned char *)malloc((size_t)(a * y->dims[1]) * es + 1);
  grouped_matmul(e, permuted, a, h, group_rows, out);
  store_rows(y, out);
  if (permute_out) store_rows(permute_out, permuted);
  free(received);
  free(permuted);
  free(out);
  return status;
}

DOUBLE_EXPORT aclnnStatus aclnnAlltoAllvGroupedMatMulGetWorkspaceSize(
    const aclTensor *gmmX, const aclTensor *gmmWeight, const aclTensor *sendCountsTensorOptional,
    const aclTensor *recvCountsTensorOptional, const aclTensor *mmXOptional, const aclTensor *mmWeightOptional,
    const char *group, int64_t epWorldSize, const aclIntArray *sendCounts, const aclIntArray *recvCounts,
    bool transGmmWeight, bool transMmWeight, bool permuteOutFlag, aclTensor *gmmY, aclTensor *mmYOptional,
    aclTensor *permuteOutOptional, uint64_t *workspaceSize, aclOpExecutor **executor) {
  const char *what = "aclnnAlltoAllvGroupedMatMulGetWorkspaceSize";
  if (permuteOutFlag != (permuteOutOptional != NULL)) {
    double_violation("%s: permuteOutFlag %d but permuteOutOptional is %s", what, (int)permuteOutFlag,
                     permuteOutOptional ? "set" : "NULL");
    return ACLNN_ERR_PARAM_INVALID;
  }
  aclnnStatus status;
  Obj *e = mc2_executor(what, "aclnnAlltoAllvGroupedMatMul", alltoallv_gmm_compute, gmmX, gmmWeight,
                        sendCountsTensorOptional, recvCountsTensorOptional, mmXOptional, mmWeightOptional, mmYOptional,
                        group, epWorldSize, sendCounts, recvCounts, transGmmWeight, transMmWeight, gmmY, workspaceSize,
                        executor, &status);
  if (!e) return status;
  char permute_id[24] = "NULL";
  if (permuteOutOptional) {
    Obj *p = double_live(permuteOutOptional, KIND_TENSOR, what, "permuteOutOptional");
    Obj *x = e->inputs[MC2_X], *y = e->inputs[MC2_Y];
    if (!p || p->ndim != 2 || p->dims[0] != y->dims[0] || p->dims[1] != x->dims[1] || p->dtype != x->dtype) {
      if (p) double_violation("%s: permuteOutOptional must be [sum of recvCounts, H] of gmmX's dtype", what);
      double_kill_obj(e);
      return ACLNN_ERR_PARAM_INVALID;
    }
    e->inputs[MC2_PERMUTE_OUT] = p;
    snprintf(permute_id, sizeof permute_id, "T%d", p->id);
  }
  char s[1024], r[1024];
  double_format_dims(s, sizeof s, e->send, (uint64_t)(e->inputs[MC2_WEIGHT]->dims[0] * epWorldSize));
  double_format_dims(r, sizeof r, e->recv, (uint64_t)(e->inputs[MC2_WEIGHT]->dims[0] * epWorldSize));
  double_log("%s gmmX=T%d gmmWeight=T%d group=%s epWorldSize=%ld sendCounts=%s recvCounts=%s transGmmWeight=%d "
             "permuteOutFlag=%d gmmY=T%d permuteOut=%s -> workspace=%lu E%d",
             what, e->inputs[MC2_X]->id, e->inputs[MC2_WEIGHT]->id, group, (long)epWorldSize, s, r,
             (int)transGmmWeight, (int)permuteOutFlag, e->inputs[MC2_Y]->id, permute_id, (unsigned long)e->workspace,
             e->id);
  return 0;
}

DOUBLE_EXPORT aclnnStatus aclnnAlltoAllvGroupedMatMul(void *workspace, uint64_t workspaceSize,
                                                      aclOpExecutor *executor, aclrtStream stream) {
  return double_launch("aclnnAlltoAllvGroupedMatMul", workspace, workspaceSize, executor, stream);
}

static aclnnStatus gmm_alltoallv_compute(Obj *e, aclrtStream stream) {
  Obj *x = e->inputs[MC2_X], *y = e->inputs[MC2_Y];
  int64_t ranks = e->attrs[ATTR_EP], experts = e->inputs[MC2_WEIGHT]->dims[0], rows = x->dims[0];
  int64_t n = y->dims[1];
  size_t es = double_dtype_size(x->dtype), row = (size_t)n * es;
  int64_t source_major[256], expert_major[256], group_rows[32] = {0};
  block_offsets(e->send, ranks, experts, source_major, expert_major);
  for (int64_t i = 0; i < ranks * experts; ++i) group_rows[i % experts] += e->send[i];
  unsigned char *in = rows_of(x), *products = (unsigned char *)malloc((size_t)rows * row + 1);
  grouped_matmul(e, in, rows, x->dims[1], group_rows, products);
  unsigned char *unpermuted = (unsigned char *)malloc((size_t)rows * row + 1);
  for (int64_t i = 0; i < ranks * experts; ++i)
    memcpy(unpermuted + (size_t)source_major[i] * row, products + (size_t)expert_major[i] * row,
           (size_t)e->send[i] * row);
  unsigned char *back = (unsigned char *)malloc((size_t)y->dims[0] * row + 1);
  aclnnStatus status = move_rows(e, "aclnnGroupedMatMulAlltoAllv/all-to-all", unpermuted, e->send, back, e->recv, n,
                                 stream);
  if (status == 0) store_rows(y, back);
  free(in);
  free(products);
  free(unpermuted);
  free(back);
  return status;
}

DOUBLE_EXPORT aclnnStatus aclnnGroupedMatMulAlltoAllvGetWorkspaceSize(
    const aclTensor *gmmX, const aclTensor *gmmWeight, const aclTensor *sendCountsTensorOptional,
    const aclTensor *recvCountsTensorOptional, const aclTensor *mmXOptional, const aclTensor *mmWeightOptional,
    const char *group, int64_t epWorldSize, const aclIntArray *sendCounts, const aclIntArray *recvCounts,
    bool transGmmWeight, bool transMmWeight, aclTensor *y, aclTensor *mmYOptional, uint64_t *workspaceSize,
    aclOpExecutor **executor) {
  const char *what = "aclnnGroupedMatMulAlltoAllvGetWorkspaceSize";
  aclnnStatus status;
  Obj *e = mc2_executor(what, "aclnnGroupedMatMulAlltoAllv", gmm_alltoallv_compute, gmmX, gmmWeight,
                        sendCountsTensorOptional, recvCountsTensorOptional, mmXOptional, mmWeightOptional, mmYOptional,
                        group, epWorldSize, sendCounts, recvCounts, transGmmWeight, transMmWeight, y, workspaceSize,
                        executor, &status);
  if (!e) return status;
  char s[1024], r[1024];
  double_format_dims(s, sizeof s, e->send, (uint64_t)(e->inputs[MC2_WEIGHT]->dims[0] * epWorldSize));
  double_format_dims(r, sizeof r, e->recv, (uint64_t)(e->inputs[MC2_WEIGHT]->dims[0] * epWorldSize));
  double_log("%s gmmX=T%d gmmWeight=T%d group=%s epWorldSize=%ld sendCounts=%s recvCounts=%s transGmmWeight=%d y=T%d "
             "-> workspace=%lu E%d",
             what, e->inputs[MC2_X]->id, e->inputs[MC2_WEIGHT]->id, group, (long)epWorldSize, s, r,
             (int)transGmmWeight, e->inputs[MC2_Y]->id, (unsigned long)e->workspace, e->id);
  return 0;
}

DOUBLE_EXPORT aclnnStatus aclnnGroupedMatMulAlltoAllv(void *workspace, uint64_t workspaceSize,
                                                      aclOpExecutor *executor, aclrtStream stream) {
  return double_launch("aclnnGroupedMatMulAlltoAllv", workspace, workspaceSize, executor, stream);
}
