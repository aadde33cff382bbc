/* Internals shared by the parts of the libopapi test double (tests only): tracked objects
 * (tensors, lists, int arrays, executors), element access through a tensor's view, and the
 * two-phase launch protocol every operator shares. */
#ifndef FSDPTURBO_OPAPI_DOUBLE_H
#define FSDPTURBO_OPAPI_DOUBLE_H

#include <stdint.h>

#include "ascend/aclnn.h"
#include "double_common.h"

#define MAX_DIMS 8
#define MAX_COUNTS 256
#define OBJ_MAGIC 0x4f424a4543542121ull

enum { KIND_TENSOR = 1, KIND_LIST, KIND_EXECUTOR, KIND_INT_ARRAY };
enum { EXEC_CREATED = 0, EXEC_LAUNCHED, EXEC_DESTROYED };

typedef struct Obj Obj;
/* Computes an executor's result at launch on `stream`; returns 0 or an aclnn status. */
typedef aclnnStatus (*Compute)(Obj *executor, aclrtStream stream);

struct Obj {
  uint64_t magic;
  int kind, id, live;
  /* tensor */
  aclDataType dtype;
  uint64_t ndim;
  int64_t dims[MAX_DIMS], strides[MAX_DIMS], offset, storage;
  unsigned char *data;
  Obj *owner;
  /* list; an int array keeps its values in `values` */
  uint64_t size;
  Obj **items;
  int64_t values[MAX_COUNTS];
  /* executor: the operator's launch name, what it reads at launch and its attributes */
  int state;
  const char *launch_name;
  Compute compute;
  uint64_t workspace;
  Obj *inputs[6];
  int64_t attrs[4];
  int64_t send[MAX_COUNTS], recv[MAX_COUNTS];
  char group[128];
};

Obj *double_new_obj(int kind);
void double_kill_obj(Obj *o);
/* `p` as a live object of `kind`, or NULL after logging a violation naming `what` and `arg`. */
Obj *double_live(const void *p, int kind, const char *what, const char *arg);
size_t double_dtype_size(aclDataType t);
void double_format_dims(char *out, size_t cap, const int64_t *v, uint64_t n);

/* Element (i, j) / (g, i, j) of a 2-D / 3-D view; float values of FLOAT, FLOAT16 and BF16. */
unsigned char *double_at2(const Obj *t, int64_t i, int64_t j);
unsigned char *double_at3(const Obj *t, int64_t g, int64_t i, int64_t j);
double double_get(const unsigned char *p, aclDataType t);
void double_put(unsigned char *p, aclDataType t, double x);
/* Element i of a 1-D INT32 or INT64 tensor. */
int64_t double_index(const Obj *t, int64_t i);

/* A new executor for `launch_name`, computed by `compute`, its workspace size stored in
 * *workspaceSize; NULL (violation logged) when an out-pointer is missing. */
Obj *double_new_executor(const char *what, const char *launch_name, Compute compute, uint64_t workspace,
                         uint64_t *workspaceSize, aclOpExecutor **executor);
/* Phase 2: checks the protocol (executor from this operator, launched once, its workspace size,
 * a stream of the ACL double, its inputs still alive), computes, releases the executor. */
aclnnStatus double_launch(const char *what, void *workspace, uint64_t workspaceSize, aclOpExecutor *executor,
                          aclrtStream stream);

#endif
