/* Test double of libopapi.so: tensors, lists, int arrays and the two-phase protocol (this file),
 * grouped matmul V4/V5 (here; built a second time without V5 for the fallback test), MoE token
 * permute/unpermute (opapi_moe_double.c) and the MC2 operators (opapi_mc2_double.c). Every
 * object is tracked: use after destroy, a tensor destroyed while its list owns it, an input
 * destroyed before the launch that reads it, an executor launched twice or with another
 * workspace size or a foreign stream are violations. Launches compute real results on the
 * (host) buffers. */
#include <pthread.h>
#include <string.h>

#include "opapi_double.h"

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int next_id = 1;
static int64_t live_objects;

DOUBLE_EXPORT const char *fsdpturbo_test_double_marker(void) { return DOUBLE_MARKER; }

/* Tensors, lists, int arrays and executors neither destroyed nor consumed by a launch. */
DOUBLE_EXPORT int64_t fsdpturbo_double_live_objects(void) { return __atomic_load_n(&live_objects, __ATOMIC_SEQ_CST); }

/* Objects are never freed, so a stale pointer is still recognised as destroyed. */
Obj *double_new_obj(int kind) {
  Obj *o = (Obj *)calloc(1, sizeof *o);
  o->magic = OBJ_MAGIC;
  o->kind = kind;
  o->live = 1;
  pthread_mutex_lock(&lock);
  o->id = next_id++;
  pthread_mutex_unlock(&lock);
  __atomic_add_fetch(&live_objects, 1, __ATOMIC_SEQ_CST);
  return o;
}

void double_kill_obj(Obj *o) {
  o->live = 0;
  __atomic_sub_fetch(&live_objects, 1, __ATOMIC_SEQ_CST);
}

static const char KIND_LETTER[] = "?TLEA";

Obj *double_live(const void *p, int kind, const char *what, const char *arg) {
  Obj *o = (Obj *)p;
  static const char *names[] = {"", "aclTensor", "aclTensorList", "aclOpExecutor", "aclIntArray"};
  if (!o || o->magic != OBJ_MAGIC || o->kind != kind) {
    double_violation("%s: %s is not an %s made by this library", what, arg, names[kind]);
    return NULL;
  }
  if (!o->live) {
    double_violation("%s: %s (%c%d) was already destroyed", what, arg, KIND_LETTER[kind], o->id);
    return NULL;
  }
  return o;
}

size_t double_dtype_size(aclDataType t) {
  switch (t) {
    case ACL_FLOAT: case ACL_INT32: case ACL_UINT32: return 4;
    case ACL_FLOAT16: case ACL_BF16: case ACL_INT16: case ACL_UINT16: return 2;
    case ACL_INT8: case ACL_UINT8: case ACL_BOOL: case ACL_FLOAT8_E5M2: case ACL_FLOAT8_E4M3FN: return 1;
    case ACL_INT64: case ACL_UINT64: case ACL_DOUBLE: return 8;
    default: return 0;
  }
}

void double_format_dims(char *out, size_t cap, const int64_t *v, uint64_t n) {
  size_t at = (size_t)snprintf(out, cap, "[");
  for (uint64_t i = 0; i < n && at < cap; ++i) at += (size_t)snprintf(out + at, cap - at, i ? ",%ld" : "%ld", (long)v[i]);
  if (at < cap) snprintf(out + at, cap - at, "]");
}

DOUBLE_EXPORT aclTensor *aclCreateTensor(const int64_t *viewDims, uint64_t viewDimsNum, aclDataType dataType,
                                         const int64_t *stride, int64_t offset, aclFormat format,
                                         const int64_t *storageDims, uint64_t storageDimsNum, void *tensorData) {
  const char *what = "aclCreateTensor";
  if (viewDimsNum > MAX_DIMS || (viewDimsNum && (!viewDims || !stride))) {
    double_violation("%s: %lu view dims (dims and strides must be given)", what, (unsigned long)viewDimsNum);
    return NULL;
  }
  if (!double_dtype_size(dataType)) {
    double_violation("%s: dataType %d is not an aclDataType", what, (int)dataType);
    return NULL;
  }
  if (format != ACL_FORMAT_ND) {
    double_violation("%s: format %d is not ACL_FORMAT_ND (offset %ld and format swapped?)", what, (int)format,
                     (long)offset);
    return NULL;
  }
  if (storageDimsNum != 1 || !storageDims || storageDims[0] < 0 || offset < 0) {
    double_violation("%s: storage must be one dim of elements and offset >= 0 (offset %ld)", what, (long)offset);
    return NULL;
  }
  int64_t last = offset, numel = 1;
  for (uint64_t i = 0; i < viewDimsNum; ++i) {
    if (viewDims[i] < 0 || stride[i] < 0) {
      double_violation("%s: negative dim or stride", what);
      return NULL;
    }
    numel *= viewDims[i];
    if (viewDims[i]) last += (viewDims[i] - 1) * stride[i];
  }
  if (numel && (last >= storageDims[0] || !tensorData)) {
    double_violation("%s: the view reaches element %ld of a storage of %ld elements", what, (long)last,
                     (long)storageDims[0]);
    return NULL;
  }
  Obj *t = double_new_obj(KIND_TENSOR);
  t->dtype = dataType;
  t->ndim = viewDimsNum;
  memcpy(t->dims, viewDims, viewDimsNum * sizeof(int64_t));
  memcpy(t->strides, stride, viewDimsNum * sizeof(int64_t));
  t->offset = offset;
  t->storage = storageDims[0];
  t->data = (unsigned char *)tensorData;
  char d[160], s[160];
  double_format_dims(d, sizeof d, viewDims, viewDimsNum);
  double_format_dims(s, sizeof s, stride, viewDimsNum);
  double_log("aclCreateTensor T%d dtype=%d dims=%s strides=%s offset=%ld format=%d storage=[%ld]", t->id,
             (int)dataType, d, s, (long)offset, (int)format, (long)storageDims[0]);
  return (aclTensor *)t;
}

DOUBLE_EXPORT aclTensorList *aclCreateTensorList(const aclTensor *const *value, uint64_t size) {
  if (size && !value) {
    double_violation("aclCreateTensorList: value is NULL for %lu tensors", (unsigned long)size);
    return NULL;
  }
  Obj **items = (Obj **)calloc(size ? size : 1, sizeof *items);
  char ids[256];
  size_t at = (size_t)snprintf(ids, sizeof ids, "[");
  for (uint64_t i = 0; i < size; ++i) {
    Obj *t = double_live(value[i], KIND_TENSOR, "aclCreateTensorList", "an element");
    if (!t) return NULL;
    if (t->owner) {
      double_violation("aclCreateTensorList: T%d already belongs to L%d", t->id, t->owner->id);
      return NULL;
    }
    items[i] = t;
    at += (size_t)snprintf(ids + at, sizeof ids - at, i ? ",T%d" : "T%d", t->id);
  }
  snprintf(ids + at, sizeof ids - at, "]");
  Obj *l = double_new_obj(KIND_LIST);
  l->size = size;
  l->items = items;
  for (uint64_t i = 0; i < size; ++i) items[i]->owner = l;
  double_log("aclCreateTensorList L%d %s", l->id, ids);
  return (aclTensorList *)l;
}

DOUBLE_EXPORT aclIntArray *aclCreateIntArray(const int64_t *value, uint64_t size) {
  if ((size && !value) || size > MAX_COUNTS) {
    double_violation("aclCreateIntArray: %lu values at %p (the double holds at most %d)", (unsigned long)size,
                     (const void *)value, MAX_COUNTS);
    return NULL;
  }
  Obj *a = double_new_obj(KIND_INT_ARRAY);
  a->size = size;
  if (size) memcpy(a->values, value, size * sizeof(int64_t));
  char v[1024];
  double_format_dims(v, sizeof v, value, size);
  double_log("aclCreateIntArray A%d %s", a->id, v);
  return (aclIntArray *)a;
}

DOUBLE_EXPORT int aclDestroyTensor(const aclTensor *tensor) {
  Obj *t = double_live(tensor, KIND_TENSOR, "aclDestroyTensor", "tensor");
  if (!t) return ACLNN_ERR_PARAM_INVALID;
  if (t->owner) {
    double_violation("aclDestroyTensor: T%d is owned by L%d, which destroys it", t->id, t->owner->id);
    return ACLNN_ERR_PARAM_INVALID;
  }
  double_kill_obj(t);
  double_log("aclDestroyTensor T%d", t->id);
  return 0;
}

DOUBLE_EXPORT int aclDestroyTensorList(const aclTensorList *list) {
  Obj *l = double_live(list, KIND_LIST, "aclDestroyTensorList", "list");
  if (!l) return ACLNN_ERR_PARAM_INVALID;
  for (uint64_t i = 0; i < l->size; ++i) double_kill_obj(l->items[i]);
  double_kill_obj(l);
  double_log("aclDestroyTensorList L%d", l->id);
  return 0;
}

DOUBLE_EXPORT int aclDestroyIntArray(const aclIntArray *array) {
  Obj *a = double_live(array, KIND_INT_ARRAY, "aclDestroyIntArray", "array");
  if (!a) return ACLNN_ERR_PARAM_INVALID;
  double_kill_obj(a);
  double_log("aclDestroyIntArray A%d", a->id);
  return 0;
}

/* Element access through dims/strides/offset, as the device would read the view. */
unsigned char *double_at2(const Obj *t, int64_t i, int64_t j) {
  return t->data + (size_t)(t->offset + i * t->strides[0] + j * t->strides[1]) * double_dtype_size(t->dtype);
}
unsigned char *double_at3(const Obj *t, int64_t g, int64_t i, int64_t j) {
  return t->data + (size_t)(t->offset + g * t->strides[0] + i * t->strides[1] + j * t->strides[2]) *
                       double_dtype_size(t->dtype);
}

static float half_to_float(uint16_t h) {
  uint32_t sign = (uint32_t)(h >> 15) << 31, exp = (h >> 10) & 0x1f, man = h & 0x3ffu, u;
  if (exp == 0x1f) {
    u = sign | 0x7f800000u | (man << 13);
  } else if (exp) {
    u = sign | ((exp + 112) << 23) | (man << 13);
  } else if (man) { /* subnormal: renormalise */
    int e = -1;
    do { man <<= 1; ++e; } while (!(man & 0x400u));
    u = sign | ((uint32_t)(112 - e) << 23) | ((man & 0x3ffu) << 13);
  } else {
    u = sign;
  }
  float f;
  memcpy(&f, &u, 4);
  return f;
}

/* Round to nearest even; finite test values only (no overflow to infinity handling needed). */
static uint16_t float_to_half(float f) {
  uint32_t u;
  memcpy(&u, &f, 4);
  uint32_t sign = (u >> 16) & 0x8000u;
  int32_t exp = (int32_t)((u >> 23) & 0xff) - 112;
  uint32_t man = u & 0x7fffffu;
  if (exp >= 0x1f) return (uint16_t)(sign | 0x7c00u);
  if (exp <= 0) {
    if (exp < -10) return (uint16_t)sign;
    man |= 0x800000u;
    uint32_t shift = (uint32_t)(14 - exp), half = 1u << (shift - 1);
    uint32_t v = man >> shift, rest = man & ((1u << shift) - 1);
    if (rest > half || (rest == half && (v & 1u))) ++v;
    return (uint16_t)(sign | v);
  }
  uint32_t v = ((uint32_t)exp << 10) | (man >> 13), rest = man & 0x1fffu;
  if (rest > 0x1000u || (rest == 0x1000u && (v & 1u))) ++v;
  return (uint16_t)(sign | v);
}

double double_get(const unsigned char *p, aclDataType t) {
  if (t == ACL_FLOAT) { float v; memcpy(&v, p, 4); return v; }
  uint16_t b; memcpy(&b, p, 2);
  if (t == ACL_FLOAT16) return half_to_float(b);
  uint32_t u = (uint32_t)b << 16; float v; memcpy(&v, &u, 4); return v;
}

void double_put(unsigned char *p, aclDataType t, double x) {
  float f = (float)x;
  if (t == ACL_FLOAT) { memcpy(p, &f, 4); return; }
  uint16_t b;
  if (t == ACL_FLOAT16) {
    b = float_to_half(f);
  } else {
    uint32_t u; memcpy(&u, &f, 4);
    b = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
  }
  memcpy(p, &b, 2);
}

int64_t double_index(const Obj *t, int64_t i) {
  const unsigned char *p = t->data + (size_t)(t->offset + i * (t->ndim ? t->strides[0] : 0)) * double_dtype_size(t->dtype);
  if (t->dtype == ACL_INT32) { int32_t v; memcpy(&v, p, 4); return v; }
  int64_t v; memcpy(&v, p, 8); return v;
}

Obj *double_new_executor(const char *what, const char *launch_name, Compute compute, uint64_t workspace,
                         uint64_t *workspaceSize, aclOpExecutor **executor) {
  if (!workspaceSize || !executor) {
    double_violation("%s: workspaceSize and executor out-pointers are required", what);
    return NULL;
  }
  Obj *e = double_new_obj(KIND_EXECUTOR);
  e->launch_name = launch_name;
  e->compute = compute;
  e->workspace = workspace;
  *workspaceSize = workspace;
  *executor = (aclOpExecutor *)e;
  return e;
}

aclnnStatus double_launch(const char *what, void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
                          aclrtStream stream) {
  Obj *e = (Obj *)executor;
  if (e && e->magic == OBJ_MAGIC && e->kind == KIND_EXECUTOR && e->state != EXEC_CREATED) {
    double_violation("%s: E%d was already %s; run GetWorkspaceSize again for every launch", what, e->id,
                     e->state == EXEC_LAUNCHED ? "launched" : "destroyed");
    return ACLNN_ERR_PARAM_INVALID;
  }
  if (!double_live(executor, KIND_EXECUTOR, what, "executor")) return ACLNN_ERR_PARAM_INVALID;
  if (strcmp(e->launch_name, what) != 0) {
    double_violation("%s: E%d came from %sGetWorkspaceSize", what, e->id, e->launch_name);
    return ACLNN_ERR_PARAM_INVALID;
  }
  if (workspaceSize != e->workspace || (workspaceSize && !workspace)) {
    double_violation("%s: workspace %p of %lu bytes; GetWorkspaceSize asked for %lu", what, workspace,
                     (unsigned long)workspaceSize, (unsigned long)e->workspace);
    return ACLNN_ERR_PARAM_INVALID;
  }
  int sid = fsdpturbo_double_stream_id(stream);
  if (sid < 0) {
    double_violation("%s: the stream was not made by aclrtCreateStream", what);
    return ACLNN_ERR_PARAM_INVALID;
  }
  for (int i = 0; i < 6; ++i)
    if (e->inputs[i] && !double_live(e->inputs[i], e->inputs[i]->kind, what, "an operand (destroyed before launch)"))
      return ACLNN_ERR_PARAM_INVALID;
  if (workspaceSize) memset(workspace, 0xA5, workspaceSize); /* the workspace must be writable device memory */
  aclnnStatus status = e->compute(e, stream);
  e->state = EXEC_LAUNCHED;
  double_kill_obj(e);
  double_log("%s workspace=%lu E%d stream=S%d", what, (unsigned long)workspaceSize, e->id, sid);
  return status;
}

DOUBLE_EXPORT aclnnStatus fsdpturbo_double_destroy_executor(aclOpExecutor *executor) {
  Obj *e = (Obj *)executor;
  if (e && e->magic == OBJ_MAGIC && e->kind == KIND_EXECUTOR && e->state != EXEC_CREATED) {
    double_violation("aclDestroyAclOpExecutor: E%d was already %s", e->id,
                     e->state == EXEC_LAUNCHED ? "released by its launch" : "destroyed");
    return ACLNN_ERR_PARAM_INVALID;
  }
  if (!double_live(executor, KIND_EXECUTOR, "aclDestroyAclOpExecutor", "executor")) return ACLNN_ERR_PARAM_INVALID;
  e->state = EXEC_DESTROYED;
  double_kill_obj(e);
  double_log("aclDestroyAclOpExecutor E%d", e->id);
  return 0;
}

/* ---- grouped matmul (V4, V5) ---- */

enum { GMM_X, GMM_WEIGHT, GMM_OUT, GMM_GROUP_LIST };

static Obj *single(const aclTensorList *list, const char *arg, const char *what) {
  Obj *l = double_live(list, KIND_LIST, what, arg);
  if (!l) return NULL;
  if (l->size != 1) {
    double_violation("%s: %s holds %lu tensors; the double takes exactly one", what, arg, (unsigned long)l->size);
    return NULL;
  }
  return l;
}

static aclnnStatus gmm_compute(Obj *e, aclrtStream stream) {
  Obj *x = e->inputs[GMM_X]->items[0], *w = e->inputs[GMM_WEIGHT]->items[0], *o = e->inputs[GMM_OUT]->items[0];
  Obj *g = e->inputs[GMM_GROUP_LIST];
  aclDataType t = x->dtype;
  int64_t start = 0;
  for (int64_t grp = 0; grp < g->dims[0]; ++grp) {
    int64_t n = double_index(g, grp);
    if (e->attrs[0] == 0) {
      for (int64_t i = start; i < start + n; ++i)
        for (int64_t j = 0; j < w->dims[2]; ++j) {
          double acc = 0;
          for (int64_t k = 0; k < x->dims[1]; ++k) acc += double_get(double_at2(x, i, k), t) * double_get(double_at3(w, grp, k, j), t);
          double_put(double_at2(o, i, j), t, acc);
        }
    } else {
      for (int64_t i = 0; i < x->dims[0]; ++i)
        for (int64_t j = 0; j < w->dims[1]; ++j) {
          double acc = 0;
          for (int64_t k = start; k < start + n; ++k) acc += double_get(double_at2(x, i, k), t) * double_get(double_at2(w, k, j), t);
          double_put(double_at3(o, grp, i, j), t, acc);
        }
    }
    start += n;
  }
  return 0;
}

static aclnnStatus gmm_workspace(int version, const aclTensorList *x, const aclTensorList *weight,
                                 const void *const optional[9], const aclTensor *groupList, int64_t splitItem,
                                 int64_t groupType, int64_t groupListType, int64_t actType, const void *tuning,
                                 aclTensorList *out, const void *const outs_optional[2], uint64_t *workspaceSize,
                                 aclOpExecutor **executor) {
  static const char *launch_names[] = {"aclnnGroupedMatmulV4", "aclnnGroupedMatmulV5"};
  const char *launch_name = launch_names[version - 4];
  char what[64];
  snprintf(what, sizeof what, "%sGetWorkspaceSize", launch_name);
  for (int i = 0; i < 9; ++i)
    if (optional[i]) {
      double_violation("%s: optional input %d is set; fsdpturbo passes none of them", what, i);
      return ACLNN_ERR_PARAM_INVALID;
    }
  if (tuning || outs_optional[0] || outs_optional[1]) {
    double_violation("%s: an optional tuning config or output is set", what);
    return ACLNN_ERR_PARAM_INVALID;
  }
  if (!workspaceSize || !executor) {
    double_violation("%s: workspaceSize and executor out-pointers are required", what);
    return ACLNN_ERR_PARAM_NULLPTR;
  }
  Obj *xl = single(x, "x", what), *wl = single(weight, "weight", what), *ol = single(out, "out", what);
  Obj *g = double_live(groupList, KIND_TENSOR, what, "groupListOptional");
  if (!xl || !wl || !ol || !g) return ACLNN_ERR_PARAM_INVALID;
  Obj *xt = xl->items[0], *wt = wl->items[0], *ot = ol->items[0];
  if (groupListType != 1 || actType != GMM_ACT_TYPE_NONE) {
    double_violation("%s: groupListType %ld (want 1: counts) actType %ld (want 0)", what, (long)groupListType,
                     (long)actType);
    return ACLNN_ERR_PARAM_INVALID;
  }
  if (!((splitItem == 2 && groupType == 0) || (splitItem == 3 && groupType == 2))) {
    double_violation("%s: splitItem %ld with groupType %ld (fsdpturbo uses 2 with 0, 3 with 2)", what,
                     (long)splitItem, (long)groupType);
    return ACLNN_ERR_PARAM_INVALID;
  }
  if (g->dtype != ACL_INT64 || g->ndim != 1) {
    double_violation("%s: groupList must be a 1-D INT64 tensor (dtype %d, %lu dims)", what, (int)g->dtype,
                     (unsigned long)g->ndim);
    return ACLNN_ERR_PARAM_INVALID;
  }
  if (xt->dtype != wt->dtype || xt->dtype != ot->dtype || (xt->dtype != ACL_FLOAT && xt->dtype != ACL_BF16)) {
    double_violation("%s: x, weight and out dtypes %d, %d, %d (the double computes FLOAT or BF16, all equal)", what,
                     (int)xt->dtype, (int)wt->dtype, (int)ot->dtype);
    return ACLNN_ERR_PARAM_INVALID;
  }
  int64_t groups = g->dims[0], total = 0;
  for (int64_t e = 0; e < groups; ++e) {
    int64_t n = double_index(g, e);
    if (n < 0) {
      double_violation("%s: group %ld has a negative count", what, (long)e);
      return ACLNN_ERR_PARAM_INVALID;
    }
    total += n;
  }
  int ok;
  if (groupType == 0) /* x [M,K], weight [G,K,N], out [M,N], counts over M */
    ok = xt->ndim == 2 && wt->ndim == 3 && ot->ndim == 2 && wt->dims[0] == groups && wt->dims[1] == xt->dims[1] &&
         ot->dims[0] == xt->dims[0] && ot->dims[1] == wt->dims[2] && total == xt->dims[0];
  else /* x [M,K], weight [K,N], out [G,M,N], counts over K */
    ok = xt->ndim == 2 && wt->ndim == 2 && ot->ndim == 3 && wt->dims[0] == xt->dims[1] && ot->dims[0] == groups &&
         ot->dims[1] == xt->dims[0] && ot->dims[2] == wt->dims[1] && total == xt->dims[1];
  if (!ok) {
    double_violation("%s: shapes do not fit groupType %ld (x %lu-D, weight %lu-D, out %lu-D, counts sum %ld)", what,
                     (long)groupType, (unsigned long)xt->ndim, (unsigned long)wt->ndim, (unsigned long)ot->ndim,
                     (long)total);
    return ACLNN_ERR_PARAM_INVALID;
  }
  Obj *e = double_new_executor(what, launch_name, gmm_compute, 256 + 64 * (uint64_t)groups, workspaceSize, executor);
  e->inputs[GMM_X] = xl;
  e->inputs[GMM_WEIGHT] = wl;
  e->inputs[GMM_OUT] = ol;
  e->inputs[GMM_GROUP_LIST] = g;
  e->attrs[0] = groupType;
  double_log("%s x=L%d weight=L%d groupList=T%d splitItem=%ld groupType=%ld groupListType=%ld actType=%ld out=L%d "
             "-> workspace=%lu E%d",
             what, xl->id, wl->id, g->id, (long)splitItem, (long)groupType, (long)groupListType, (long)actType, ol->id,
             (unsigned long)e->workspace, e->id);
  return 0;
}

DOUBLE_EXPORT aclnnStatus aclnnGroupedMatmulV4GetWorkspaceSize(
    const aclTensorList *x, const aclTensorList *weight, const aclTensorList *biasOptional,
    const aclTensorList *scaleOptional, const aclTensorList *offsetOptional,
    const aclTensorList *antiquantScaleOptional, const aclTensorList *antiquantOffsetOptional,
    const aclTensorList *perTokenScaleOptional, const aclTensor *groupListOptional,
    const aclTensorList *activationInputOptional, const aclTensorList *activationQuantScaleOptional,
    const aclTensorList *activationQuantOffsetOptional, int64_t splitItem, int64_t groupType, int64_t groupListType,
    int64_t actType, aclTensorList *out, aclTensorList *activationFeatureOutOptional,
    aclTensorList *dynQuantScaleOutOptional, uint64_t *workspaceSize, aclOpExecutor **executor) {
  const void *optional[9] = {biasOptional, scaleOptional, offsetOptional, antiquantScaleOptional,
                             antiquantOffsetOptional, perTokenScaleOptional, activationInputOptional,
                             activationQuantScaleOptional, activationQuantOffsetOptional};
  const void *outs[2] = {activationFeatureOutOptional, dynQuantScaleOutOptional};
  return gmm_workspace(4, x, weight, optional, groupListOptional, splitItem, groupType, groupListType, actType, NULL,
                       out, outs, workspaceSize, executor);
}

DOUBLE_EXPORT aclnnStatus aclnnGroupedMatmulV4(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
                                               aclrtStream stream) {
  return double_launch("aclnnGroupedMatmulV4", workspace, workspaceSize, executor, stream);
}

#ifndef FSDPTURBO_DOUBLE_NO_V5
DOUBLE_EXPORT aclnnStatus aclnnGroupedMatmulV5GetWorkspaceSize(
    const aclTensorList *x, const aclTensorList *weight, const aclTensorList *biasOptional,
    const aclTensorList *scaleOptional, const aclTensorList *offsetOptional,
    const aclTensorList *antiquantScaleOptional, const aclTensorList *antiquantOffsetOptional,
    const aclTensorList *perTokenScaleOptional, const aclTensor *groupListOptional,
    const aclTensorList *activationInputOptional, const aclTensorList *activationQuantScaleOptional,
    const aclTensorList *activationQuantOffsetOptional, int64_t splitItem, int64_t groupType, int64_t groupListType,
    int64_t actType, aclIntArray *tuningConfigOptional, aclTensorList *out,
    aclTensorList *activationFeatureOutOptional, aclTensorList *dynQuantScaleOutOptional, uint64_t *workspaceSize,
    aclOpExecutor **executor) {
  const void *optional[9] = {biasOptional, scaleOptional, offsetOptional, antiquantScaleOptional,
                             antiquantOffsetOptional, perTokenScaleOptional, activationInputOptional,
                             activationQuantScaleOptional, activationQuantOffsetOptional};
  const void *outs[2] = {activationFeatureOutOptional, dynQuantScaleOutOptional};
  return gmm_workspace(5, x, weight, optional, groupListOptional, splitItem, groupType, groupListType, actType,
                       tuningConfigOptional, out, outs, workspaceSize, executor);
}

DOUBLE_EXPORT aclnnStatus aclnnGroupedMatmulV5(void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
                                               aclrtStream stream) {
  return double_launch("aclnnGroupedMatmulV5", workspace, workspaceSize, executor, stream);
}
#endif
