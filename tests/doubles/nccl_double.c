/* Test double of libnccl.so.2 for the deadline of the library's NCCL communicator
 * (tests/nccl_deadline.rs): the ranks are threads of one process, "device" buffers host memory
 * (the CUDA driver double's). A communicator made with a config whose `blocking` is 0 is
 * nonblocking as NCCL's are: joining, and each all-reduce, returns ncclInProgress until every
 * rank has made the same call, which ncclCommGetAsyncError then reports as ncclSuccess, or as
 * ncclRemoteError once a rank has left the joined communicator (aborted or destroyed). Only
 * the float32/float64 sum all-reduce computes; the other collectives fail as unsupported.
 * fsdpturbo_nccl_double_aborts() and _destroys() count what freed communicators. */
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "double_common.h"
#include "nccl/nccl.h"

#define MAX_RANKS 8
#define BLOCKING_SECONDS 30

typedef struct { /* the head of ncclConfig_t, NCCL 2.14 */
  size_t size;
  unsigned int magic, version;
  int blocking, cgaClusterSize;
} ConfigHead;

typedef struct Clique {
  char id[NCCL_UNIQUE_ID_BYTES];
  int nranks, joined, live, left; /* left: ranks that freed their communicator after all joined */
  uint64_t generation; /* all-reduces completed */
  int arrived;
  const void *send[MAX_RANKS];
  void *recv[MAX_RANKS];
  size_t count;
  ncclDataType_t type;
  struct Clique *next;
} Clique;

struct ncclComm {
  Clique *clique;
  int rank, blocking, pending; /* pending: an all-reduce not complete yet */
  uint64_t pending_generation;
};

static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t changed = PTHREAD_COND_INITIALIZER;
static Clique *cliques;
static int aborts, destroys, next_id = 1;

DOUBLE_EXPORT int fsdpturbo_nccl_double_aborts(void) { return __atomic_load_n(&aborts, __ATOMIC_SEQ_CST); }
DOUBLE_EXPORT int fsdpturbo_nccl_double_destroys(void) { return __atomic_load_n(&destroys, __ATOMIC_SEQ_CST); }

DOUBLE_EXPORT ncclResult_t ncclGetVersion(int *version) { *version = 22800; return ncclSuccess; }
DOUBLE_EXPORT const char *ncclGetErrorString(ncclResult_t result) {
  switch (result) {
    case ncclSuccess: return "no error";
    case ncclInvalidArgument: return "invalid argument";
    case ncclInvalidUsage: return "invalid usage";
    case ncclInProgress: return "NCCL operation in progress";
    case ncclRemoteError: return "remote process exited or there was a network error";
    default: return "unhandled error";
  }
}
DOUBLE_EXPORT const char *ncclGetLastError(ncclComm_t comm) { return ""; }
DOUBLE_EXPORT ncclResult_t ncclGetUniqueId(ncclUniqueId *id) {
  memset(id->internal, 0, NCCL_UNIQUE_ID_BYTES);
  pthread_mutex_lock(&lock);
  int n = next_id++;
  pthread_mutex_unlock(&lock);
  memcpy(id->internal, "nccl-double", 11);
  memcpy(id->internal + 16, &n, sizeof n);
  return ncclSuccess;
}

/* Waits on `changed` until `done` holds, at most BLOCKING_SECONDS (a blocking call). */
static ncclResult_t wait_blocking(int (*done)(ncclComm_t), ncclComm_t comm) {
  struct timespec deadline;
  clock_gettime(CLOCK_REALTIME, &deadline);
  deadline.tv_sec += BLOCKING_SECONDS;
  while (!done(comm)) {
    if (pthread_cond_timedwait(&changed, &lock, &deadline) != 0) {
      double_violation("NCCL double: a blocking call of rank %d waited %d s", comm->rank, BLOCKING_SECONDS);
      return ncclSystemError;
    }
  }
  return ncclSuccess;
}

static int all_joined(ncclComm_t comm) { return comm->clique->joined == comm->clique->nranks; }
static int reduce_done(ncclComm_t comm) { return !comm->pending || comm->clique->generation > comm->pending_generation; }

static ncclResult_t join(ncclComm_t *out, int nranks, ncclUniqueId id, int rank, int blocking) {
  if (nranks < 1 || nranks > MAX_RANKS || rank < 0 || rank >= nranks) return ncclInvalidArgument;
  pthread_mutex_lock(&lock);
  Clique *c = cliques;
  while (c && memcmp(c->id, id.internal, NCCL_UNIQUE_ID_BYTES) != 0) c = c->next;
  if (!c) {
    c = calloc(1, sizeof *c);
    memcpy(c->id, id.internal, NCCL_UNIQUE_ID_BYTES);
    c->nranks = nranks;
    c->next = cliques;
    cliques = c;
  }
  ncclComm_t comm = calloc(1, sizeof *comm);
  comm->clique = c;
  comm->rank = rank;
  comm->blocking = blocking;
  c->joined++;
  c->live++;
  pthread_cond_broadcast(&changed);
  *out = comm;
  ncclResult_t result = ncclSuccess;
  if (!all_joined(comm)) result = blocking ? wait_blocking(all_joined, comm) : ncclInProgress;
  pthread_mutex_unlock(&lock);
  return result;
}

DOUBLE_EXPORT ncclResult_t ncclCommInitRank(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank) {
  return join(comm, nranks, id, rank, 1);
}
DOUBLE_EXPORT ncclResult_t ncclCommInitRankConfig(ncclComm_t *comm, int nranks, ncclUniqueId id, int rank,
                                                  ConfigHead *config) {
  if (config && (config->magic != 0xcafebeef || config->size < sizeof(size_t) + 8)) {
    double_violation("NCCL double: a config not set up as NCCL_CONFIG_INITIALIZER does");
    return ncclInvalidArgument;
  }
  return join(comm, nranks, id, rank, config ? config->blocking : 1);
}

DOUBLE_EXPORT ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t *state) {
  pthread_mutex_lock(&lock);
  *state = all_joined(comm) && reduce_done(comm) ? ncclSuccess
           : comm->clique->left > 0               ? ncclRemoteError
                                                  : ncclInProgress;
  if (*state != ncclInProgress) comm->pending = 0;
  pthread_mutex_unlock(&lock);
  return ncclSuccess;
}

static void release(ncclComm_t comm, int *counter) {
  pthread_mutex_lock(&lock);
  Clique *c = comm->clique;
  if (comm->pending && c->arrived > 0) c->arrived--; /* its buffers leave with it */
  if (c->joined == c->nranks) c->left++;
  if (--c->live == 0) {
    Clique **p = &cliques;
    while (*p != c) p = &(*p)->next;
    *p = c->next;
    free(c);
  }
  free(comm);
  (*counter)++;
  pthread_mutex_unlock(&lock);
}

DOUBLE_EXPORT ncclResult_t ncclCommAbort(ncclComm_t comm) { release(comm, &aborts); return ncclSuccess; }
DOUBLE_EXPORT ncclResult_t ncclCommDestroy(ncclComm_t comm) { release(comm, &destroys); return ncclSuccess; }

static void reduce_all(Clique *c) {
  for (size_t i = 0; i < c->count; i++) {
    double sum = 0;
    for (int r = 0; r < c->nranks; r++)
      sum += c->type == ncclFloat64 ? ((const double *)c->send[r])[i] : ((const float *)c->send[r])[i];
    for (int r = 0; r < c->nranks; r++) {
      if (c->type == ncclFloat64) ((double *)c->recv[r])[i] = sum;
      else ((float *)c->recv[r])[i] = (float)sum;
    }
  }
}

DOUBLE_EXPORT ncclResult_t ncclAllReduce(const void *send, void *recv, size_t count, ncclDataType_t type,
                                         ncclRedOp_t op, ncclComm_t comm, fsdpturbo_nccl_stream_t stream) {
  if (op != ncclSum || (type != ncclFloat32 && type != ncclFloat64)) {
    double_violation("NCCL double: only the float32/float64 sum all-reduce computes");
    return ncclInvalidUsage;
  }
  pthread_mutex_lock(&lock);
  Clique *c = comm->clique;
  if (!all_joined(comm) || comm->pending) {
    pthread_mutex_unlock(&lock);
    double_violation("NCCL double: rank %d called ncclAllReduce before its last call finished", comm->rank);
    return ncclInvalidUsage;
  }
  if (c->arrived > 0 && (c->count != count || c->type != type)) {
    pthread_mutex_unlock(&lock);
    double_violation("NCCL double: the ranks' all-reduces differ in count or type");
    return ncclInvalidUsage;
  }
  c->send[comm->rank] = send;
  c->recv[comm->rank] = recv;
  c->count = count;
  c->type = type;
  comm->pending = 1;
  comm->pending_generation = c->generation;
  if (++c->arrived == c->nranks) {
    reduce_all(c);
    c->arrived = 0;
    c->generation++;
    pthread_cond_broadcast(&changed);
  }
  ncclResult_t result = ncclSuccess;
  if (!reduce_done(comm)) result = comm->blocking ? wait_blocking(reduce_done, comm) : ncclInProgress;
  if (result == ncclSuccess) comm->pending = 0;
  pthread_mutex_unlock(&lock);
  return result;
}

static ncclResult_t unsupported(const char *call) {
  double_violation("NCCL double: %s is not part of this double", call);
  return ncclInvalidUsage;
}
DOUBLE_EXPORT ncclResult_t ncclAllGather(const void *s, void *r, size_t n, ncclDataType_t t, ncclComm_t c,
                                         fsdpturbo_nccl_stream_t st) { return unsupported("ncclAllGather"); }
DOUBLE_EXPORT ncclResult_t ncclReduceScatter(const void *s, void *r, size_t n, ncclDataType_t t, ncclRedOp_t o,
                                             ncclComm_t c, fsdpturbo_nccl_stream_t st) {
  return unsupported("ncclReduceScatter");
}
DOUBLE_EXPORT ncclResult_t ncclSend(const void *s, size_t n, ncclDataType_t t, int p, ncclComm_t c,
                                    fsdpturbo_nccl_stream_t st) { return unsupported("ncclSend"); }
DOUBLE_EXPORT ncclResult_t ncclRecv(void *r, size_t n, ncclDataType_t t, int p, ncclComm_t c,
                                    fsdpturbo_nccl_stream_t st) { return unsupported("ncclRecv"); }
DOUBLE_EXPORT ncclResult_t ncclGroupStart(void) { return ncclSuccess; }
DOUBLE_EXPORT ncclResult_t ncclGroupEnd(void) { return ncclSuccess; }
