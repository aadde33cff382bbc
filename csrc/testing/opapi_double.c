/* Test double of libopapi.so: aclCreateTensor/List and grouped matmul (V4 and V5; built a second
 * time without V5 for the fallback test). Every object is tracked: use after destroy, a tensor
 * destroyed while its list owns it, a list destroyed before the launch that reads it, an
 * executor launched twice or launched with another workspace size or a foreign stream are
 * violations. The launch computes the real result on the (host) buffers. */
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#include "ascend/aclnn.h"
#include "double_common.h"

#define MAX_DIMS 8
#define OBJ_MAGIC 0x4f424a4543542121ull

enum { KIND_TENSOR = 1, KIND_LIST, KIND_EXECUTOR };
enum { EXEC_CREATED = 0, EXEC_LAUNCHED, EXEC_DESTROYED };

typedef struct Obj Obj;
struct Obj {
  uint64_t magic;
  int kind, id, live;
  /* tensor */
  aclDataType dtype;
  uint64_t ndim;
  int64_t dims[MAX_DIMS], strides[MAX_DIMS], offset, storage;
  unsigned char *data;
  Obj *owner;
  /* list */
  uint64_t size;
  Obj **items;
  /* executor */
  int state, version;
  uint64_t workspace;
  Obj *x, *weight, *group_list, *out;
  int64_t group_type;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static int next_id = 1;
static int64_t live_objects;

DOUBLE_EXPORT const char *fsdpturbo_test_double_marker(void) { return DOUBLE_MARKER; }

/* Tensors, lists and executors neither destroyed nor consumed by a launch. */
DOUBLE_EXPORT int64_t fsdpturbo_double_live_objects(void) { return __atomic_load_n(&live_objects, __ATOMIC_SEQ_CST); }

/* Objects are never freed, so a stale pointer is still recognised as destroyed. */
static Obj *new_obj(int kind) {
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

static void kill_obj(Obj *o) {
  o->live = 0;
  __atomic_sub_fetch(&live_objects, 1, __ATOMIC_SEQ_CST);
}

static Obj *live(const void *p, int kind, const char *what, const char *arg) {
  Obj *o = (Obj *)p;
  static const char *names[] = {"", "aclTensor", "aclTensorList", "aclOpExecutor"};
  if (!o || o->magic != OBJ_MAGIC || o->kind != kind) {
    double_violation("%s: %s is not an %s made by this library", what, arg, names[kind]);
    return NULL;
  }
  if (!o->live) {
    double_violation("%s: %s (%c%d) was already destroyed", what, arg, "?TLE"[kind], o->id);
    return NULL;
  }
  return o;
}

static size_t dtype_size(aclDataType t) {
  switch (t) {
    case ACL_FLOAT: case ACL_INT32: case ACL_UINT32: return 4;
    case ACL_FLOAT16: case ACL_BF16: case ACL_INT16: case ACL_UINT16: return 2;
    case ACL_INT8: case ACL_UINT8: case ACL_BOOL: case ACL_FLOAT8_E5M2: case ACL_FLOAT8_E4M3FN: return 1;
    case ACL_INT64: case ACL_UINT64: case ACL_DOUBLE: return 8;
    default: return 0;
  }
}

static void format_dims(char *out, size_t cap, const int64_t *v, uint64_t n) {
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
  if (!dtype_size(dataType)) {
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
  Obj *t = new_obj(KIND_TENSOR);
  t->dtype = dataType;
  t->ndim = viewDimsNum;
  memcpy(t->dims, viewDims, viewDimsNum * sizeof(int64_t));
  memcpy(t->strides, stride, viewDimsNum * sizeof(int64_t));
  t->offset = offset;
  t->storage = storageDims[0];
  t->data = (unsigned char *)tensorData;
  char d[160], s[160];
  format_dims(d, sizeof d, viewDims, viewDimsNum);
  format_dims(s, sizeof s, stride, viewDimsNum);
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
    Obj *t = live(value[i], KIND_TENSOR, "aclCreateTensorList", "an element");
    if (!t) return NULL;
    if (t->owner) {
      double_violation("aclCreateTensorList: T%d already belongs to L%d", t->id, t->owner->id);
      return NULL;
    }
    items[i] = t;
    at += (size_t)snprintf(ids + at, sizeof ids - at, i ? ",T%d" : "T%d", t->id);
  }
  snprintf(ids + at, sizeof ids - at, "]");
  Obj *l = new_obj(KIND_LIST);
  l->size = size;
  l->items = items;
  for (uint64_t i = 0; i < size; ++i) items[i]->owner = l;
  double_log("aclCreateTensorList L%d %s", l->id, ids);
  return (aclTensorList *)l;
}

DOUBLE_EXPORT int aclDestroyTensor(const aclTensor *tensor) {
  Obj *t = live(tensor, KIND_TENSOR, "aclDestroyTensor", "tensor");
  if (!t) return ACLNN_ERR_PARAM_INVALID;
  if (t->owner) {
    double_violation("aclDestroyTensor: T%d is owned by L%d, which destroys it", t->id, t->owner->id);
    return ACLNN_ERR_PARAM_INVALID;
  }
  kill_obj(t);
  double_log("aclDestroyTensor T%d", t->id);
  return 0;
}

DOUBLE_EXPORT int aclDestroyTensorList(const aclTensorList *list) {
  Obj *l = live(list, KIND_LIST, "aclDestroyTensorList", "list");
  if (!l) return ACLNN_ERR_PARAM_INVALID;
  for (uint64_t i = 0; i < l->size; ++i) kill_obj(l->items[i]);
  kill_obj(l);
  double_log("aclDestroyTensorList L%d", l->id);
  return 0;
}

/* Element access through dims/strides/offset, as the device would read the view. */
static unsigned char *at2(Obj *t, int64_t i, int64_t j) {
  return t->data + (size_t)(t->offset + i * t->strides[0] + j * t->strides[1]) * dtype_size(t->dtype);
}
static unsigned char *at3(Obj *t, int64_t g, int64_t i, int64_t j) {
  return t->data + (size_t)(t->offset + g * t->strides[0] + i * t->strides[1] + j * t->strides[2]) *
                       dtype_size(t->dtype);
}
static double get(const unsigned char *p, aclDataType t) {
  if (t == ACL_FLOAT) { float v; memcpy(&v, p, 4); return v; }
  uint16_t b; memcpy(&b, p, 2); uint32_t u = (uint32_t)b << 16; float v; memcpy(&v, &u, 4); return v;
}
static void put(unsigned char *p, aclDataType t, double x) {
  float f = (float)x;
  if (t == ACL_FLOAT) { memcpy(p, &f, 4); return; }
  uint32_t u; memcpy(&u, &f, 4);
  uint16_t b = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); memcpy(p, &b, 2);
}
static int64_t group_count(Obj *g, int64_t e) {
  int64_t v;
  memcpy(&v, g->data + (size_t)(g->offset + e * (g->ndim ? g->strides[0] : 0)) * 8, 8);
  return v;
}

static Obj *single(const aclTensorList *list, const char *arg, const char *what) {
  Obj *l = live(list, KIND_LIST, what, arg);
  if (!l) return NULL;
  if (l->size != 1) {
    double_violation("%s: %s holds %lu tensors; the double takes exactly one", what, arg, (unsigned long)l->size);
    return NULL;
  }
  return l;
}

static aclnnStatus gmm_workspace(int version, const aclTensorList *x, const aclTensorList *weight,
                                 const void *const optional[9], const aclTensor *groupList, int64_t splitItem,
                                 int64_t groupType, int64_t groupListType, int64_t actType, const void *tuning,
                                 aclTensorList *out, const void *const outs_optional[2], uint64_t *workspaceSize,
                                 aclOpExecutor **executor) {
  char what[64];
  snprintf(what, sizeof what, "aclnnGroupedMatmulV%dGetWorkspaceSize", version);
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
  Obj *g = live(groupList, KIND_TENSOR, what, "groupListOptional");
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
    int64_t n = group_count(g, e);
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
  Obj *e = new_obj(KIND_EXECUTOR);
  e->version = version;
  e->workspace = 256 + 64 * (uint64_t)groups;
  e->x = xl;
  e->weight = wl;
  e->out = ol;
  e->group_list = g;
  e->group_type = groupType;
  *workspaceSize = e->workspace;
  *executor = (aclOpExecutor *)e;
  double_log("%s x=L%d weight=L%d groupList=T%d splitItem=%ld groupType=%ld groupListType=%ld actType=%ld out=L%d "
             "-> workspace=%lu E%d",
             what, xl->id, wl->id, g->id, (long)splitItem, (long)groupType, (long)groupListType, (long)actType, ol->id,
             (unsigned long)e->workspace, e->id);
  return 0;
}

static void gmm_compute(Obj *e) {
  Obj *x = e->x->items[0], *w = e->weight->items[0], *o = e->out->items[0], *g = e->group_list;
  aclDataType t = x->dtype;
  int64_t start = 0;
  for (int64_t grp = 0; grp < g->dims[0]; ++grp) {
    int64_t n = group_count(g, grp);
    if (e->group_type == 0) {
      for (int64_t i = start; i < start + n; ++i)
        for (int64_t j = 0; j < w->dims[2]; ++j) {
          double acc = 0;
          for (int64_t k = 0; k < x->dims[1]; ++k) acc += get(at2(x, i, k), t) * get(at3(w, grp, k, j), t);
          put(at2(o, i, j), t, acc);
        }
    } else {
      for (int64_t i = 0; i < x->dims[0]; ++i)
        for (int64_t j = 0; j < w->dims[1]; ++j) {
          double acc = 0;
          for (int64_t k = start; k < start + n; ++k) acc += get(at2(x, i, k), t) * get(at2(w, k, j), t);
          put(at3(o, grp, i, j), t, acc);
        }
    }
    start += n;
  }
}

static aclnnStatus gmm_launch(int version, void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
                              aclrtStream stream) {
  char what[32];
  snprintf(what, sizeof what, "aclnnGroupedMatmulV%d", version);
  Obj *e = (Obj *)executor;
  if (e && e->magic == OBJ_MAGIC && e->kind == KIND_EXECUTOR && e->state != EXEC_CREATED) {
    double_violation("%s: E%d was already %s; run GetWorkspaceSize again for every launch", what, e->id,
                     e->state == EXEC_LAUNCHED ? "launched" : "destroyed");
    return ACLNN_ERR_PARAM_INVALID;
  }
  if (!live(executor, KIND_EXECUTOR, what, "executor")) return ACLNN_ERR_PARAM_INVALID;
  if (e->version != version) {
    double_violation("%s: E%d came from aclnnGroupedMatmulV%dGetWorkspaceSize", what, e->id, e->version);
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
  if (!live(e->x, KIND_LIST, what, "x (destroyed before launch)") ||
      !live(e->weight, KIND_LIST, what, "weight (destroyed before launch)") ||
      !live(e->out, KIND_LIST, what, "out (destroyed before launch)") ||
      !live(e->group_list, KIND_TENSOR, what, "groupList (destroyed before launch)"))
    return ACLNN_ERR_PARAM_INVALID;
  memset(workspace, 0xA5, workspaceSize); /* the workspace must be writable device memory */
  gmm_compute(e);
  e->state = EXEC_LAUNCHED;
  kill_obj(e);
  double_log("%s workspace=%lu E%d stream=S%d", what, (unsigned long)workspaceSize, e->id, sid);
  return 0;
}

DOUBLE_EXPORT aclnnStatus fsdpturbo_double_destroy_executor(aclOpExecutor *executor) {
  Obj *e = (Obj *)executor;
  if (e && e->magic == OBJ_MAGIC && e->kind == KIND_EXECUTOR && e->state != EXEC_CREATED) {
    double_violation("aclDestroyAclOpExecutor: E%d was already %s", e->id,
                     e->state == EXEC_LAUNCHED ? "released by its launch" : "destroyed");
    return ACLNN_ERR_PARAM_INVALID;
  }
  if (!live(executor, KIND_EXECUTOR, "aclDestroyAclOpExecutor", "executor")) return ACLNN_ERR_PARAM_INVALID;
  e->state = EXEC_DESTROYED;
  kill_obj(e);
  double_log("aclDestroyAclOpExecutor E%d", e->id);
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
  return gmm_launch(4, workspace, workspaceSize, executor, stream);
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
  return gmm_launch(5, workspace, workspaceSize, executor, stream);
}
#endif
