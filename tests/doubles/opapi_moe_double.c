/* The libopapi double's MoE token permute and unpermute (paddedMode false, as fsdpturbo calls
 * them): sortedIndices maps every flat (token, k) slot to its row of the permuted tokens
 * (ops-transformer's moe/ operator docs), computed and applied on the host buffers. */
#include <stdlib.h>
#include <string.h>

#include "opapi_double.h"

enum { PERMUTE_TOKENS, PERMUTE_INDICES, PERMUTE_OUT, PERMUTE_SORTED };
enum { UNPERMUTE_TOKENS, UNPERMUTE_SORTED, UNPERMUTE_PROBS, UNPERMUTE_OUT };

static int float_dtype(aclDataType t) { return t == ACL_FLOAT || t == ACL_FLOAT16 || t == ACL_BF16; }

static int64_t top_k_of(const Obj *indices) { return indices->ndim == 2 ? indices->dims[1] : 1; }

static aclnnStatus permute_compute(Obj *e, aclrtStream stream) {
  Obj *tokens = e->inputs[PERMUTE_TOKENS], *indices = e->inputs[PERMUTE_INDICES];
  Obj *out = e->inputs[PERMUTE_OUT], *sorted = e->inputs[PERMUTE_SORTED];
  int64_t k = top_k_of(indices), slots = tokens->dims[0] * k, hidden = tokens->dims[1];
  size_t es = double_dtype_size(tokens->dtype);
  int64_t *key = (int64_t *)malloc((size_t)(slots ? slots : 1) * sizeof *key);
  for (int64_t s = 0; s < slots; ++s) {
    int64_t at = indices->ndim == 2 ? (s / k) * indices->strides[0] + (s % k) * indices->strides[1]
                                    : s * indices->strides[0];
    const unsigned char *p = indices->data + (size_t)(indices->offset + at) * double_dtype_size(indices->dtype);
    if (indices->dtype == ACL_INT32) {
      int32_t v;
      memcpy(&v, p, 4);
      key[s] = v;
    } else {
      memcpy(&key[s], p, 8);
    }
  }
  /* A stable sort by key: the row of slot s is the number of slots before it in that order. */
  int64_t row = 0;
  char *placed = (char *)calloc((size_t)(slots ? slots : 1), 1);
  while (row < slots) {
    int64_t best = -1;
    for (int64_t s = 0; s < slots; ++s)
      if (!placed[s] && (best < 0 || key[s] < key[best])) best = s;
    placed[best] = 1;
    int32_t r32 = (int32_t)row;
    memcpy(sorted->data + (size_t)(sorted->offset + best * sorted->strides[0]) * 4, &r32, 4);
    for (int64_t c = 0; c < hidden; ++c) memcpy(double_at2(out, row, c), double_at2(tokens, best / k, c), es);
    ++row;
  }
  free(placed);
  free(key);
  return 0;
}

DOUBLE_EXPORT aclnnStatus aclnnMoeTokenPermuteGetWorkspaceSize(const aclTensor *tokens, const aclTensor *indices,
                                                               int64_t numOutTokens, bool paddedMode,
                                                               const aclTensor *permuteTokensOut,
                                                               const aclTensor *sortedIndicesOut,
                                                               uint64_t *workspaceSize, aclOpExecutor **executor) {
  const char *what = "aclnnMoeTokenPermuteGetWorkspaceSize";
  Obj *t = double_live(tokens, KIND_TENSOR, what, "tokens"), *ix = double_live(indices, KIND_TENSOR, what, "indices");
  Obj *o = double_live(permuteTokensOut, KIND_TENSOR, what, "permuteTokensOut");
  Obj *s = double_live(sortedIndicesOut, KIND_TENSOR, what, "sortedIndicesOut");
  if (!t || !ix || !o || !s) return ACLNN_ERR_PARAM_NULLPTR;
  if (paddedMode || numOutTokens != 0) {
    double_violation("%s: paddedMode %d numOutTokens %ld (only false and 0, no dropping, are used)", what,
                     (int)paddedMode, (long)numOutTokens);
    return ACLNN_ERR_PARAM_INVALID;
  }
  int64_t k = top_k_of(ix);
  int ok = t->ndim == 2 && (ix->ndim == 1 || ix->ndim == 2) && ix->dims[0] == t->dims[0] && k <= 512 &&
           o->ndim == 2 && o->dims[0] == t->dims[0] * k && o->dims[1] == t->dims[1] && s->ndim == 1 &&
           s->dims[0] == o->dims[0] && float_dtype(t->dtype) && o->dtype == t->dtype && s->dtype == ACL_INT32 &&
           (ix->dtype == ACL_INT32 || ix->dtype == ACL_INT64);
  if (!ok) {
    double_violation("%s: tokens [T,H] float, indices [T] or [T,K<=512] INT32/INT64, permuteTokensOut [T*K,H] of "
                     "the tokens' dtype and sortedIndicesOut [T*K] INT32 expected (dtypes %d, %d, %d, %d)",
                     what, (int)t->dtype, (int)ix->dtype, (int)o->dtype, (int)s->dtype);
    return ACLNN_ERR_PARAM_INVALID;
  }
  Obj *e = double_new_executor(what, "aclnnMoeTokenPermute", permute_compute, 128 + 8 * (uint64_t)o->dims[0],
                               workspaceSize, executor);
  if (!e) return ACLNN_ERR_PARAM_NULLPTR;
  e->inputs[PERMUTE_TOKENS] = t;
  e->inputs[PERMUTE_INDICES] = ix;
  e->inputs[PERMUTE_OUT] = o;
  e->inputs[PERMUTE_SORTED] = s;
  double_log("%s tokens=T%d indices=T%d numOutTokens=%ld paddedMode=%d permuteTokensOut=T%d sortedIndicesOut=T%d "
             "-> workspace=%lu E%d",
             what, t->id, ix->id, (long)numOutTokens, (int)paddedMode, o->id, s->id, (unsigned long)e->workspace, e->id);
  return 0;
}

DOUBLE_EXPORT aclnnStatus aclnnMoeTokenPermute(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
                                               aclrtStream stream) {
  return double_launch("aclnnMoeTokenPermute", workspace, workspaceSize, executor, stream);
}

static aclnnStatus unpermute_compute(Obj *e, aclrtStream stream) {
  Obj *tokens = e->inputs[UNPERMUTE_TOKENS], *sorted = e->inputs[UNPERMUTE_SORTED];
  Obj *probs = e->inputs[UNPERMUTE_PROBS], *out = e->inputs[UNPERMUTE_OUT];
  int64_t k = probs ? probs->dims[1] : 1;
  for (int64_t i = 0; i < out->dims[0]; ++i)
    for (int64_t c = 0; c < out->dims[1]; ++c) {
      double acc = 0;
      for (int64_t j = 0; j < k; ++j) {
        double p = probs ? double_get(double_at2(probs, i, j), probs->dtype) : 1.0;
        acc += double_get(double_at2(tokens, double_index(sorted, i * k + j), c), tokens->dtype) * p;
      }
      double_put(double_at2(out, i, c), out->dtype, acc);
    }
  return 0;
}

DOUBLE_EXPORT aclnnStatus aclnnMoeTokenUnpermuteGetWorkspaceSize(const aclTensor *permutedTokens,
                                                                 const aclTensor *sortedIndices,
                                                                 const aclTensor *probsOptional, bool paddedMode,
                                                                 const aclIntArray *restoreShapeOptional,
                                                                 aclTensor *out, uint64_t *workspaceSize,
                                                                 aclOpExecutor **executor) {
  const char *what = "aclnnMoeTokenUnpermuteGetWorkspaceSize";
  Obj *t = double_live(permutedTokens, KIND_TENSOR, what, "permutedTokens");
  Obj *s = double_live(sortedIndices, KIND_TENSOR, what, "sortedIndices");
  Obj *o = double_live(out, KIND_TENSOR, what, "out");
  Obj *p = probsOptional ? double_live(probsOptional, KIND_TENSOR, what, "probsOptional") : NULL;
  if (!t || !s || !o || (probsOptional && !p)) return ACLNN_ERR_PARAM_NULLPTR;
  if (paddedMode || restoreShapeOptional) {
    double_violation("%s: paddedMode must be false and restoreShapeOptional NULL", what);
    return ACLNN_ERR_PARAM_INVALID;
  }
  int64_t k = p ? (p->ndim == 2 ? p->dims[1] : -1) : 1;
  int ok = t->ndim == 2 && s->ndim == 1 && s->dtype == ACL_INT32 && o->ndim == 2 && o->dims[1] == t->dims[1] &&
           k >= 1 && k <= 512 && s->dims[0] == o->dims[0] * k && t->dims[0] == s->dims[0] &&
           float_dtype(t->dtype) && o->dtype == t->dtype && (!p || (p->dims[0] == o->dims[0] && p->dtype == t->dtype));
  if (ok)
    for (int64_t i = 0; i < s->dims[0] && ok; ++i) ok = double_index(s, i) >= 0 && double_index(s, i) < t->dims[0];
  if (!ok) {
    double_violation("%s: permutedTokens [T*K,H] float, sortedIndices [T*K] INT32 rows of it, probs [T,K<=512] of "
                     "the tokens' dtype or NULL (K 1), out [T,H] expected (dtypes %d, %d, %d)",
                     what, (int)t->dtype, (int)s->dtype, (int)o->dtype);
    return ACLNN_ERR_PARAM_INVALID;
  }
  Obj *e = double_new_executor(what, "aclnnMoeTokenUnpermute", unpermute_compute, 128 + 8 * (uint64_t)s->dims[0],
                               workspaceSize, executor);
  if (!e) return ACLNN_ERR_PARAM_NULLPTR;
  e->inputs[UNPERMUTE_TOKENS] = t;
  e->inputs[UNPERMUTE_SORTED] = s;
  e->inputs[UNPERMUTE_PROBS] = p;
  e->inputs[UNPERMUTE_OUT] = o;
  char probs_id[24] = "NULL";
  if (p) snprintf(probs_id, sizeof probs_id, "T%d", p->id);
  double_log("%s permutedTokens=T%d sortedIndices=T%d probs=%s paddedMode=%d out=T%d -> workspace=%lu E%d", what,
             t->id, s->id, probs_id, (int)paddedMode, o->id, (unsigned long)e->workspace, e->id);
  return 0;
}

DOUBLE_EXPORT aclnnStatus aclnnMoeTokenUnpermute(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
                                                 aclrtStream stream) {
  return double_launch("aclnnMoeTokenUnpermute", workspace, workspaceSize, executor, stream);
}
