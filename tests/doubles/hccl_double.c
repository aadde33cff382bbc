/* Test double of libhccl.so: the ranks of one test (separate processes or threads on this host)
 * meet in a POSIX shared-memory segment named in the root info. Each collective copies every
 * rank's send buffer into its slot, waits at a process-shared barrier, computes its own result
 * from all slots, and waits again. "Device" buffers are host memory. Every call checks its
 * stream (made by the libascendcl double), its counts and its data types. */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#include "ascend/hccl.h"
#include "double_common.h"

#define MAX_RANKS 8
#define SLOT_META 4096
#define SLOT_BYTES (8u << 20)
#define HEADER_BYTES 4096
#define SEGMENT_BYTES (HEADER_BYTES + (size_t)MAX_RANKS * SLOT_BYTES)
#define ROOT_MAGIC "FSDPTURBO-HCCL-DOUBLE-ROOT"
#define ROOT_TAIL 0x5441494c21ull /* the last 8 bytes: proves all 4108 bytes travelled */
#define COMM_MAGIC 0x434f4d4d21ull
#define BARRIER_SECONDS 30

typedef struct {
  pthread_mutex_t mutex;
  pthread_cond_t cond;
  uint32_t nranks;
  uint32_t arrived;
  uint64_t generation;
} Header;

typedef struct {
  uint64_t magic;
  uint32_t rank, nranks;
  unsigned char *base;
  int id;
  char name[128]; /* the segment's name: the same on every rank, as HCCL's group names are */
  pthread_t owner; /* the thread that made it: ranks that are threads of one process share names */
} Comm;

#define MAX_COMMS 64
static Comm *comms[MAX_COMMS]; /* this process's live communicators, for lookup by name */
static pthread_mutex_t comms_lock = PTHREAD_MUTEX_INITIALIZER;

typedef struct {
  uint64_t counts[MAX_RANKS];
  uint64_t displs[MAX_RANKS];
} SlotMeta;

static int next_comm = 1;

DOUBLE_EXPORT const char *fsdpturbo_test_double_marker(void) { return DOUBLE_MARKER; }

static Header *header(Comm *c) { return (Header *)c->base; }
static SlotMeta *meta(Comm *c, uint32_t r) {
  return (SlotMeta *)(c->base + HEADER_BYTES + (size_t)r * SLOT_BYTES);
}
static unsigned char *slot(Comm *c, uint32_t r) { return c->base + HEADER_BYTES + (size_t)r * SLOT_BYTES + SLOT_META; }

static HcclResult barrier(Comm *c) {
  Header *h = header(c);
  struct timespec deadline;
  clock_gettime(CLOCK_REALTIME, &deadline);
  deadline.tv_sec += BARRIER_SECONDS;
  pthread_mutex_lock(&h->mutex);
  uint64_t gen = h->generation;
  if (++h->arrived == h->nranks) {
    h->arrived = 0;
    h->generation++;
    pthread_cond_broadcast(&h->cond);
  } else {
    while (gen == h->generation) {
      if (pthread_cond_timedwait(&h->cond, &h->mutex, &deadline) == ETIMEDOUT) {
        pthread_mutex_unlock(&h->mutex);
        double_violation("HCCL rank %u waited %d s for the other ranks: they did not make the same call",
                         c->rank, BARRIER_SECONDS);
        return HCCL_E_TIMEOUT;
      }
    }
  }
  pthread_mutex_unlock(&h->mutex);
  return HCCL_SUCCESS;
}

static size_t type_size(HcclDataType t) {
  switch (t) {
    case HCCL_DATA_TYPE_INT8: case HCCL_DATA_TYPE_UINT8: return 1;
    case HCCL_DATA_TYPE_INT16: case HCCL_DATA_TYPE_UINT16: case HCCL_DATA_TYPE_FP16: case HCCL_DATA_TYPE_BFP16: return 2;
    case HCCL_DATA_TYPE_INT32: case HCCL_DATA_TYPE_UINT32: case HCCL_DATA_TYPE_FP32: return 4;
    case HCCL_DATA_TYPE_INT64: case HCCL_DATA_TYPE_UINT64: case HCCL_DATA_TYPE_FP64: return 8;
    default: return 0;
  }
}

static double load(const unsigned char *p, HcclDataType t) {
  switch (t) {
    case HCCL_DATA_TYPE_FP32: { float v; memcpy(&v, p, 4); return v; }
    case HCCL_DATA_TYPE_FP64: { double v; memcpy(&v, p, 8); return v; }
    case HCCL_DATA_TYPE_INT32: { int32_t v; memcpy(&v, p, 4); return v; }
    case HCCL_DATA_TYPE_INT64: { int64_t v; memcpy(&v, p, 8); return (double)v; }
    case HCCL_DATA_TYPE_UINT8: return *p;
    case HCCL_DATA_TYPE_BFP16: { uint16_t b; memcpy(&b, p, 2); uint32_t u = (uint32_t)b << 16; float v; memcpy(&v, &u, 4); return v; }
    default: return 0;
  }
}

static void store(unsigned char *p, HcclDataType t, double x) {
  switch (t) {
    case HCCL_DATA_TYPE_FP32: { float v = (float)x; memcpy(p, &v, 4); break; }
    case HCCL_DATA_TYPE_FP64: memcpy(p, &x, 8); break;
    case HCCL_DATA_TYPE_INT32: { int32_t v = (int32_t)x; memcpy(p, &v, 4); break; }
    case HCCL_DATA_TYPE_INT64: { int64_t v = (int64_t)x; memcpy(p, &v, 8); break; }
    case HCCL_DATA_TYPE_UINT8: *p = (unsigned char)x; break;
    case HCCL_DATA_TYPE_BFP16: {
      float f = (float)x; uint32_t u; memcpy(&u, &f, 4);
      uint16_t b = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16); memcpy(p, &b, 2); break;
    }
    default: break;
  }
}

static int reducible(HcclDataType t) {
  return t == HCCL_DATA_TYPE_FP32 || t == HCCL_DATA_TYPE_FP64 || t == HCCL_DATA_TYPE_INT32 ||
         t == HCCL_DATA_TYPE_INT64 || t == HCCL_DATA_TYPE_UINT8 || t == HCCL_DATA_TYPE_BFP16;
}

static double combine(double a, double b, HcclReduceOp op) {
  switch (op) {
    case HCCL_REDUCE_SUM: return a + b;
    case HCCL_REDUCE_PROD: return a * b;
    case HCCL_REDUCE_MAX: return a > b ? a : b;
    default: return a < b ? a : b;
  }
}

/* Checks shared by every collective: a live communicator and a stream of the ACL double. */
static Comm *checked(HcclComm comm, aclrtStream stream, const char *what, int *stream_id) {
  Comm *c = (Comm *)comm;
  if (!c || c->magic != COMM_MAGIC) {
    double_violation("%s: comm is not a communicator made by HcclCommInitRootInfo (or destroyed)", what);
    return NULL;
  }
  *stream_id = fsdpturbo_double_stream_id(stream);
  if (*stream_id < 0) {
    double_violation("%s: the stream was not made by aclrtCreateStream", what);
    return NULL;
  }
  return c;
}

static HcclResult checked_type(HcclDataType t, int reduce, const char *what) {
  if (!type_size(t) || (reduce && !reducible(t))) {
    double_violation("%s: data type %d is not an HcclDataType this double handles", what, (int)t);
    return HCCL_E_PARA;
  }
  return HCCL_SUCCESS;
}

static int fits(size_t bytes, const char *what) {
  if (bytes > SLOT_BYTES - SLOT_META) {
    double_violation("%s: %zu bytes exceed the double's slot (test sizes only)", what, bytes);
    return 0;
  }
  return 1;
}

DOUBLE_EXPORT HcclResult HcclGetRootInfo(HcclRootInfo *rootInfo) {
  if (!rootInfo) return HCCL_E_PTR;
  static int counter;
  char name[96];
  snprintf(name, sizeof name, "/fsdpturbo-hccl-double-%d-%d-%ld", (int)getpid(), counter++, (long)time(NULL));
  int fd = shm_open(name, O_CREAT | O_EXCL | O_RDWR, 0600);
  if (fd < 0) return HCCL_E_SYSCALL;
  if (ftruncate(fd, (off_t)SEGMENT_BYTES) != 0) {
    close(fd);
    shm_unlink(name);
    return HCCL_E_SYSCALL;
  }
  Header *h = (Header *)mmap(NULL, HEADER_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (h == MAP_FAILED) return HCCL_E_SYSCALL;
  pthread_mutexattr_t ma;
  pthread_mutexattr_init(&ma);
  pthread_mutexattr_setpshared(&ma, PTHREAD_PROCESS_SHARED);
  pthread_mutex_init(&h->mutex, &ma);
  pthread_condattr_t ca;
  pthread_condattr_init(&ca);
  pthread_condattr_setpshared(&ca, PTHREAD_PROCESS_SHARED);
  pthread_cond_init(&h->cond, &ca);
  munmap(h, HEADER_BYTES);
  memset(rootInfo, 0, sizeof *rootInfo);
  snprintf(rootInfo->internal, 128, "%s %s", ROOT_MAGIC, name);
  uint64_t tail = ROOT_TAIL;
  memcpy(rootInfo->internal + HCCL_ROOT_INFO_BYTES - 8, &tail, 8);
  double_log("HcclGetRootInfo");
  return HCCL_SUCCESS;
}

DOUBLE_EXPORT HcclResult HcclCommInitRootInfo(uint32_t nRanks, const HcclRootInfo *rootInfo, uint32_t rank,
                                              HcclComm *comm) {
  uint64_t tail = 0;
  if (rootInfo) memcpy(&tail, rootInfo->internal + HCCL_ROOT_INFO_BYTES - 8, 8);
  if (!rootInfo || strncmp(rootInfo->internal, ROOT_MAGIC, strlen(ROOT_MAGIC)) != 0 || tail != ROOT_TAIL) {
    double_violation("HcclCommInitRootInfo: rootInfo is not 4108 bytes from HcclGetRootInfo");
    return HCCL_E_PARA;
  }
  if (!comm || nRanks == 0 || nRanks > MAX_RANKS || rank >= nRanks) {
    double_violation("HcclCommInitRootInfo: nRanks=%u rank=%u comm=%p (argument order nRanks, root, rank, comm)",
                     nRanks, rank, (void *)comm);
    return HCCL_E_PARA;
  }
  const char *name = rootInfo->internal + strlen(ROOT_MAGIC) + 1;
  int fd = shm_open(name, O_RDWR, 0600);
  if (fd < 0) return HCCL_E_SYSCALL;
  unsigned char *base = (unsigned char *)mmap(NULL, SEGMENT_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  close(fd);
  if (base == MAP_FAILED) return HCCL_E_SYSCALL;
  Comm *c = (Comm *)calloc(1, sizeof *c);
  c->magic = COMM_MAGIC;
  c->rank = rank;
  c->nranks = nRanks;
  c->base = base;
  c->id = __atomic_fetch_add(&next_comm, 1, __ATOMIC_SEQ_CST);
  snprintf(c->name, sizeof c->name, "%s", name + 1);
  c->owner = pthread_self();
  Header *h = header(c);
  pthread_mutex_lock(&h->mutex);
  int agree = h->nranks == 0 || h->nranks == nRanks;
  if (h->nranks == 0) h->nranks = nRanks;
  pthread_mutex_unlock(&h->mutex);
  if (!agree) {
    double_violation("HcclCommInitRootInfo: ranks disagree on nRanks (%u here)", nRanks);
    return HCCL_E_PARA;
  }
  HcclResult r = barrier(c);
  if (r != HCCL_SUCCESS) return r;
  if (rank == 0) shm_unlink(name);
  pthread_mutex_lock(&comms_lock);
  for (int i = 0; i < MAX_COMMS; ++i)
    if (!comms[i]) {
      comms[i] = c;
      break;
    }
  pthread_mutex_unlock(&comms_lock);
  *comm = c;
  double_log("HcclCommInitRootInfo nRanks=%u rank=%u", nRanks, rank);
  return HCCL_SUCCESS;
}

DOUBLE_EXPORT HcclResult HcclCommDestroy(HcclComm comm) {
  Comm *c = (Comm *)comm;
  if (!c || c->magic != COMM_MAGIC) {
    double_violation("HcclCommDestroy of a communicator not made by HcclCommInitRootInfo (or destroyed twice)");
    return HCCL_E_PARA;
  }
  c->magic = 0;
  pthread_mutex_lock(&comms_lock);
  for (int i = 0; i < MAX_COMMS; ++i)
    if (comms[i] == c) comms[i] = NULL;
  pthread_mutex_unlock(&comms_lock);
  munmap(c->base, SEGMENT_BYTES);
  double_log("HcclCommDestroy rank=%u", c->rank);
  return HCCL_SUCCESS;
}

DOUBLE_EXPORT const char *HcclGetErrorString(HcclResult code) {
  return code == HCCL_SUCCESS ? "no error (test double)" : "error reported by the HCCL test double";
}

DOUBLE_EXPORT HcclResult HcclGetRankSize(HcclComm comm, uint32_t *rankSize) {
  Comm *c = (Comm *)comm;
  if (!c || c->magic != COMM_MAGIC || !rankSize) return HCCL_E_PARA;
  *rankSize = c->nranks;
  return HCCL_SUCCESS;
}

DOUBLE_EXPORT HcclResult HcclGetRankId(HcclComm comm, uint32_t *rank) {
  Comm *c = (Comm *)comm;
  if (!c || c->magic != COMM_MAGIC || !rank) return HCCL_E_PARA;
  *rank = c->rank;
  return HCCL_SUCCESS;
}

DOUBLE_EXPORT HcclResult HcclGetCommName(HcclComm comm, char *commName) {
  Comm *c = (Comm *)comm;
  if (!c || c->magic != COMM_MAGIC || !commName) {
    double_violation("HcclGetCommName: comm %p is not a live communicator or commName is NULL", comm);
    return HCCL_E_PARA;
  }
  snprintf(commName, 128, "%s", c->name);
  double_log("HcclGetCommName rank=%u", c->rank);
  return HCCL_SUCCESS;
}

/* For the libopapi double's MC2 operators: this process's communicator called `name` (the one
 * made by the calling thread when ranks are threads), or NULL. */
DOUBLE_EXPORT HcclComm fsdpturbo_double_comm_named(const char *name) {
  Comm *found = NULL;
  pthread_mutex_lock(&comms_lock);
  for (int i = 0; i < MAX_COMMS && name; ++i)
    if (comms[i] && strcmp(comms[i]->name, name) == 0 && (!found || pthread_equal(comms[i]->owner, pthread_self())))
      found = comms[i];
  pthread_mutex_unlock(&comms_lock);
  return found;
}

/* result[i] = op over ranks r of slot r, element `first + i`. */
static void reduce_slots(Comm *c, size_t first, uint64_t count, HcclDataType t, HcclReduceOp op, unsigned char *out) {
  size_t es = type_size(t);
  for (uint64_t i = 0; i < count; ++i) {
    double acc = load(slot(c, 0) + (first + i) * es, t);
    for (uint32_t r = 1; r < c->nranks; ++r) acc = combine(acc, load(slot(c, r) + (first + i) * es, t), op);
    store(out + i * es, t, acc);
  }
}

static HcclResult reduction(const char *what, void *send, void *recv, uint64_t count, uint64_t per_rank,
                            HcclDataType t, HcclReduceOp op, HcclComm comm, aclrtStream stream) {
  int sid;
  Comm *c = checked(comm, stream, what, &sid);
  if (!c) return HCCL_E_PARA;
  if (checked_type(t, 1, what) != HCCL_SUCCESS) return HCCL_E_PARA;
  if (op != HCCL_REDUCE_SUM && op != HCCL_REDUCE_PROD && op != HCCL_REDUCE_MAX && op != HCCL_REDUCE_MIN) {
    double_violation("%s: op %d is not an HcclReduceOp (SUM 0, PROD 1, MAX 2, MIN 3)", what, (int)op);
    return HCCL_E_PARA;
  }
  uint64_t send_count = per_rank ? count * c->nranks : count;
  if (!fits(send_count * type_size(t), what) || ((!send || !recv) && count)) return HCCL_E_PTR;
  memcpy(slot(c, c->rank), send, send_count * type_size(t));
  HcclResult r = barrier(c);
  if (r != HCCL_SUCCESS) return r;
  reduce_slots(c, per_rank ? (size_t)c->rank * count : 0, count, t, op, (unsigned char *)recv);
  r = barrier(c);
  double_log("%s count=%lu dtype=%d op=%d rank=%u stream=S%d", what, (unsigned long)count, (int)t, (int)op, c->rank,
             sid);
  return r;
}

DOUBLE_EXPORT HcclResult HcclAllReduce(void *sendBuf, void *recvBuf, uint64_t count, HcclDataType dataType,
                                       HcclReduceOp op, HcclComm comm, aclrtStream stream) {
  return reduction("HcclAllReduce", sendBuf, recvBuf, count, 0, dataType, op, comm, stream);
}

DOUBLE_EXPORT HcclResult HcclReduceScatter(void *sendBuf, void *recvBuf, uint64_t recvCount, HcclDataType dataType,
                                           HcclReduceOp op, HcclComm comm, aclrtStream stream) {
  return reduction("HcclReduceScatter", sendBuf, recvBuf, recvCount, 1, dataType, op, comm, stream);
}

DOUBLE_EXPORT HcclResult HcclAllGather(void *sendBuf, void *recvBuf, uint64_t sendCount, HcclDataType dataType,
                                       HcclComm comm, aclrtStream stream) {
  int sid;
  Comm *c = checked(comm, stream, "HcclAllGather", &sid);
  if (!c || checked_type(dataType, 0, "HcclAllGather") != HCCL_SUCCESS) return HCCL_E_PARA;
  size_t bytes = sendCount * type_size(dataType);
  if (!fits(bytes, "HcclAllGather")) return HCCL_E_PARA;
  memcpy(slot(c, c->rank), sendBuf, bytes);
  HcclResult r = barrier(c);
  if (r != HCCL_SUCCESS) return r;
  for (uint32_t p = 0; p < c->nranks; ++p) memcpy((unsigned char *)recvBuf + p * bytes, slot(c, p), bytes);
  r = barrier(c);
  double_log("HcclAllGather count=%lu dtype=%d rank=%u stream=S%d", (unsigned long)sendCount, (int)dataType, c->rank,
             sid);
  return r;
}

static void format_list(char *out, size_t cap, const uint64_t *v, uint32_t n) {
  size_t at = (size_t)snprintf(out, cap, "[");
  for (uint32_t i = 0; i < n && at < cap; ++i) at += (size_t)snprintf(out + at, cap - at, i ? ",%lu" : "%lu", (unsigned long)v[i]);
  if (at < cap) snprintf(out + at, cap - at, "]");
}

/* The all-to-all-v of HcclAlltoAllV, logged as `what` (the MC2 operators of the libopapi double
 * move their rows with it too). */
DOUBLE_EXPORT HcclResult fsdpturbo_double_all_to_all_v(const char *what, const void *sendBuf, const void *sendCounts,
                                                       const void *sdispls, HcclDataType sendType, const void *recvBuf,
                                                       const void *recvCounts, const void *rdispls,
                                                       HcclDataType recvType, HcclComm comm, aclrtStream stream) {
  int sid;
  Comm *c = checked(comm, stream, what, &sid);
  if (!c || checked_type(sendType, 0, what) != HCCL_SUCCESS) return HCCL_E_PARA;
  if (sendType != recvType) {
    double_violation("%s: sendType %d differs from recvType %d", what, (int)sendType, (int)recvType);
    return HCCL_E_PARA;
  }
  if (!sendCounts || !sdispls || !recvCounts || !rdispls) {
    double_violation("%s: counts and displacements must be host uint64_t arrays", what);
    return HCCL_E_PTR;
  }
  const uint64_t *sc = (const uint64_t *)sendCounts, *sd = (const uint64_t *)sdispls;
  const uint64_t *rc = (const uint64_t *)recvCounts, *rd = (const uint64_t *)rdispls;
  size_t es = type_size(sendType);
  uint64_t extent = 0;
  SlotMeta *mine = meta(c, c->rank);
  for (uint32_t p = 0; p < c->nranks; ++p) {
    mine->counts[p] = sc[p];
    mine->displs[p] = sd[p];
    if (sd[p] + sc[p] > extent) extent = sd[p] + sc[p];
  }
  if (!fits(extent * es, what)) return HCCL_E_PARA;
  if (extent) memcpy(slot(c, c->rank), sendBuf, extent * es);
  HcclResult r = barrier(c);
  if (r != HCCL_SUCCESS) return r;
  HcclResult status = HCCL_SUCCESS;
  for (uint32_t p = 0; p < c->nranks; ++p) {
    SlotMeta *theirs = meta(c, p);
    if (theirs->counts[c->rank] != rc[p]) {
      double_violation("%s: rank %u sends %lu elements to rank %u, which expects %lu", what, p,
                       (unsigned long)theirs->counts[c->rank], c->rank, (unsigned long)rc[p]);
      status = HCCL_E_PARA;
      continue;
    }
    memcpy((unsigned char *)recvBuf + rd[p] * es, slot(c, p) + theirs->displs[c->rank] * es, rc[p] * es);
  }
  r = barrier(c);
  char s1[256], s2[256], s3[256], s4[256];
  format_list(s1, sizeof s1, sc, c->nranks);
  format_list(s2, sizeof s2, sd, c->nranks);
  format_list(s3, sizeof s3, rc, c->nranks);
  format_list(s4, sizeof s4, rd, c->nranks);
  double_log("%s sendCounts=%s sdispls=%s recvCounts=%s rdispls=%s dtype=%d rank=%u stream=S%d", what, s1, s2,
             s3, s4, (int)sendType, c->rank, sid);
  return status != HCCL_SUCCESS ? status : r;
}

DOUBLE_EXPORT HcclResult HcclAlltoAllV(const void *sendBuf, const void *sendCounts, const void *sdispls,
                                       HcclDataType sendType, const void *recvBuf, const void *recvCounts,
                                       const void *rdispls, HcclDataType recvType, HcclComm comm, aclrtStream stream) {
  return fsdpturbo_double_all_to_all_v("HcclAlltoAllV", sendBuf, sendCounts, sdispls, sendType, recvBuf, recvCounts,
                                       rdispls, recvType, comm, stream);
}
