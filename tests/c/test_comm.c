/* Communicators through the header: one rank, a process group lent through host callbacks (a
 * simulated second rank whose values the callbacks add), the grad norm over them, and misuse. */
#include <stdint.h>

#include "check.h"

static double absd(double x) { return x < 0 ? -x : x; }

/* The simulated peer: its contribution to every all-reduce of one double (SUM or MAX), and the
 * rows it sends in the all-to-all-v. */
typedef struct {
  double peer_value;
  int calls;
} peer_t;

static int32_t all_reduce(void *user, const void *send, void *recv, size_t count, int32_t dtype, int32_t op) {
  peer_t *peer = (peer_t *)user;
  ++peer->calls;
  if (dtype != FSDPTURBO_DTYPE_F64 || count != 1) return 5;
  double mine = *(const double *)send;
  *(double *)recv = op == FSDPTURBO_REDUCE_MAX ? (mine > peer->peer_value ? mine : peer->peer_value)
                                                         : mine + peer->peer_value;
  return 0;
}

static int32_t failing_all_reduce(void *user, const void *send, void *recv, size_t count, int32_t dtype, int32_t op) {
  (void)user, (void)send, (void)recv, (void)count, (void)dtype, (void)op;
  return 42;
}

/* The peer's `count` floats of an all-gather are all peer_value; rank 0 comes first. */
static int32_t all_gather(void *user, const void *send, void *recv, size_t count, int32_t dtype) {
  peer_t *peer = (peer_t *)user;
  ++peer->calls;
  if (dtype != FSDPTURBO_DTYPE_F32) return 5;
  for (size_t i = 0; i < count; ++i) {
    ((float *)recv)[i] = ((const float *)send)[i];
    ((float *)recv)[count + i] = (float)peer->peer_value;
  }
  return 0;
}

/* Rank 0 receives block 0 reduced with the peer's block 0, whose floats are all peer_value. */
static int32_t reduce_scatter(void *user, const void *send, void *recv, size_t count, int32_t dtype, int32_t op) {
  peer_t *peer = (peer_t *)user;
  ++peer->calls;
  if (dtype != FSDPTURBO_DTYPE_F32) return 5;
  for (size_t i = 0; i < count; ++i) {
    float mine = ((const float *)send)[i], theirs = (float)peer->peer_value;
    ((float *)recv)[i] = op == FSDPTURBO_REDUCE_MAX ? (mine > theirs ? mine : theirs) : mine + theirs;
  }
  return 0;
}

static fsdpturbo_host_collective_t callbacks(peer_t *peer) {
  fsdpturbo_host_collective_t c;
  memset(&c, 0, sizeof c);
  c.struct_size = sizeof c;
  c.rank = 0;
  c.world_size = 2;
  c.user = peer;
  c.all_reduce = all_reduce;
  return c;
}

static void test_single_rank(void) {
  fsdpturbo_comm_t *comm = NULL;
  CHECK_STATUS(fsdpturbo_comm_single_new(&comm), FSDPTURBO_OK);
  size_t rank = 9, world = 9;
  CHECK_STATUS(fsdpturbo_comm_rank(comm, &rank, &world), FSDPTURBO_OK);
  CHECK(rank == 0 && world == 1);
  float send[3] = {1, 2, 3}, recv[3] = {0, 0, 0};
  CHECK_STATUS(fsdpturbo_comm_all_reduce(comm, send, recv, 3, FSDPTURBO_DTYPE_F32, FSDPTURBO_REDUCE_SUM, NULL),
               FSDPTURBO_OK);
  CHECK(recv[0] == 1 && recv[2] == 3);
  CHECK_STATUS(fsdpturbo_comm_all_reduce(comm, send, recv, 3, 17, FSDPTURBO_REDUCE_SUM, NULL),
               FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("not an FSDPTURBO_DTYPE_* value"));
  size_t counts[1] = {2}, displs[1] = {1};
  CHECK_STATUS(fsdpturbo_comm_all_to_all_v(comm, send, recv, counts, displs, counts, displs, FSDPTURBO_DTYPE_F32, NULL),
               FSDPTURBO_OK);
  CHECK(recv[1] == 2 && recv[2] == 3);
  /* All-gather and reduce-scatter of one rank are copies. */
  float gathered[3] = {0, 0, 0};
  CHECK_STATUS(fsdpturbo_comm_all_gather(comm, send, gathered, 3, FSDPTURBO_DTYPE_F32, NULL), FSDPTURBO_OK);
  CHECK(gathered[0] == 1 && gathered[1] == 2 && gathered[2] == 3);
  float scattered[3] = {0, 0, 0};
  CHECK_STATUS(fsdpturbo_comm_reduce_scatter(comm, send, scattered, 3, FSDPTURBO_DTYPE_F32, FSDPTURBO_REDUCE_MAX, NULL),
               FSDPTURBO_OK);
  CHECK(scattered[0] == 1 && scattered[1] == 2 && scattered[2] == 3);
  CHECK_STATUS(fsdpturbo_comm_all_gather(comm, NULL, NULL, 0, FSDPTURBO_DTYPE_F32, NULL), FSDPTURBO_OK);
  /* Misuse: NULL buffers, codes outside the enums, overlap (all-reduce alone may be in place). */
  CHECK_STATUS(fsdpturbo_comm_all_gather(comm, NULL, gathered, 3, FSDPTURBO_DTYPE_F32, NULL),
               FSDPTURBO_ERR_NULL_ARGUMENT);
  CHECK(last_error_contains("argument `send` is NULL but must hold 3 elements"));
  CHECK_STATUS(fsdpturbo_comm_reduce_scatter(comm, send, NULL, 3, FSDPTURBO_DTYPE_F32, FSDPTURBO_REDUCE_SUM, NULL),
               FSDPTURBO_ERR_NULL_ARGUMENT);
  CHECK(last_error_contains("argument `recv` is NULL but must hold 3 elements"));
  CHECK_STATUS(fsdpturbo_comm_all_reduce(comm, NULL, recv, 3, FSDPTURBO_DTYPE_F32, FSDPTURBO_REDUCE_SUM, NULL),
               FSDPTURBO_ERR_NULL_ARGUMENT);
  CHECK(last_error_contains("argument `send` is NULL but must hold 3 elements"));
  CHECK_STATUS(fsdpturbo_comm_all_gather(comm, send, gathered, 3, 17, NULL), FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("not an FSDPTURBO_DTYPE_* value"));
  CHECK_STATUS(fsdpturbo_comm_reduce_scatter(comm, send, scattered, 3, FSDPTURBO_DTYPE_F32, 9, NULL),
               FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("`op` is 9, not an FSDPTURBO_REDUCE_* value"));
  CHECK_STATUS(fsdpturbo_comm_all_gather(comm, send, send + 1, 2, FSDPTURBO_DTYPE_F32, NULL),
               FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("buffers `recv` and `send` overlap"));
  CHECK_STATUS(fsdpturbo_comm_reduce_scatter(comm, send, send, 3, FSDPTURBO_DTYPE_F32, FSDPTURBO_REDUCE_SUM, NULL),
               FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(fsdpturbo_comm_all_reduce(comm, send, send + 1, 2, FSDPTURBO_DTYPE_F32, FSDPTURBO_REDUCE_SUM, NULL),
               FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(fsdpturbo_comm_all_reduce(comm, send, send, 3, FSDPTURBO_DTYPE_F32, FSDPTURBO_REDUCE_SUM, NULL),
               FSDPTURBO_OK);
  CHECK(send[0] == 1 && send[2] == 3);
  CHECK_STATUS(fsdpturbo_comm_all_gather(NULL, send, gathered, 3, FSDPTURBO_DTYPE_F32, NULL),
               FSDPTURBO_ERR_NULL_ARGUMENT);
  fsdpturbo_comm_free(comm);
  fsdpturbo_comm_free(NULL);
}

/* All-gather and reduce-scatter over the lent group of two ranks, and without their callbacks. */
static void test_gather_and_scatter_over_host_callbacks(void) {
  peer_t peer = {10.0, 0};
  fsdpturbo_host_collective_t c = callbacks(&peer);
  c.all_gather = all_gather;
  c.reduce_scatter = reduce_scatter;
  fsdpturbo_comm_t *comm = NULL;
  CHECK_STATUS(fsdpturbo_comm_host_new(&c, &comm), FSDPTURBO_OK);
  float mine[2] = {1, 2}, gathered[4] = {0, 0, 0, 0};
  CHECK_STATUS(fsdpturbo_comm_all_gather(comm, mine, gathered, 2, FSDPTURBO_DTYPE_F32, NULL), FSDPTURBO_OK);
  CHECK(gathered[0] == 1 && gathered[1] == 2 && gathered[2] == 10 && gathered[3] == 10);
  float blocks[4] = {1, 20, 3, 4}, out[2] = {0, 0};
  CHECK_STATUS(fsdpturbo_comm_reduce_scatter(comm, blocks, out, 2, FSDPTURBO_DTYPE_F32, FSDPTURBO_REDUCE_SUM, NULL),
               FSDPTURBO_OK);
  CHECK(out[0] == 11 && out[1] == 30);
  CHECK_STATUS(fsdpturbo_comm_reduce_scatter(comm, blocks, out, 2, FSDPTURBO_DTYPE_F32, FSDPTURBO_REDUCE_MAX, NULL),
               FSDPTURBO_OK);
  CHECK(out[0] == 10 && out[1] == 20);
  CHECK(peer.calls == 3);
  /* The gathered side is count x 2 elements: its size overflows before any callback runs. */
  CHECK_STATUS(fsdpturbo_comm_all_gather(comm, mine, gathered, SIZE_MAX / 2 + 1, FSDPTURBO_DTYPE_F32, NULL),
               FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("the group's 2 ranks overflows"));
  /* The scattered side is checked as count x 2 elements: it may not overlap the output. */
  CHECK_STATUS(fsdpturbo_comm_reduce_scatter(comm, blocks, blocks + 1, 1, FSDPTURBO_DTYPE_F32, FSDPTURBO_REDUCE_SUM, NULL),
               FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("buffers `recv` and `send` overlap"));
  CHECK(peer.calls == 3);
  fsdpturbo_comm_free(comm);

  /* Made with all_reduce only: the others fail naming the callback that is missing. */
  c = callbacks(&peer);
  CHECK_STATUS(fsdpturbo_comm_host_new(&c, &comm), FSDPTURBO_OK);
  CHECK_STATUS(fsdpturbo_comm_all_gather(comm, mine, gathered, 2, FSDPTURBO_DTYPE_F32, NULL),
               FSDPTURBO_ERR_UNAVAILABLE);
  CHECK(last_error_contains("this host communicator has no `all_gather` callback "
                            "(`fsdpturbo_host_collective_t.all_gather` was NULL when it was made)"));
  CHECK_STATUS(fsdpturbo_comm_reduce_scatter(comm, blocks, out, 2, FSDPTURBO_DTYPE_F32, FSDPTURBO_REDUCE_SUM, NULL),
               FSDPTURBO_ERR_UNAVAILABLE);
  CHECK(last_error_contains("no `reduce_scatter` callback"));
  size_t counts[2] = {1, 1}, displs[2] = {0, 1};
  CHECK_STATUS(fsdpturbo_comm_all_to_all_v(comm, mine, out, counts, displs, counts, displs, FSDPTURBO_DTYPE_F32, NULL),
               FSDPTURBO_ERR_UNAVAILABLE);
  CHECK(last_error_contains("no `all_to_all_v` callback"));
  CHECK(peer.calls == 3);
  fsdpturbo_comm_free(comm);
}

static void test_grad_norm_over_host_callbacks(void) {
  peer_t peer = {9.0, 0}; /* the other rank's share of the sharded gradient: sum of squares 9 */
  fsdpturbo_host_collective_t c = callbacks(&peer);
  fsdpturbo_comm_t *comm = NULL;
  CHECK_STATUS(fsdpturbo_comm_host_new(&c, &comm), FSDPTURBO_OK);

  float sharded[2] = {1.0f, 2.0f}; /* 1 + 4 here, 9 on the peer */
  float plain[1] = {4.0f};         /* replicated: counted once */
  uint32_t dim = 3;
  int32_t shard = FSDPTURBO_DIM_SHARD;
  fsdpturbo_grad_t grads[2];
  memset(grads, 0, sizeof grads);
  grads[0].mut_data = sharded;
  grads[0].numel = 2;
  grads[0].dtype = FSDPTURBO_DTYPE_F32;
  grads[0].dims = &dim;
  grads[0].roles = &shard;
  grads[0].n_dims = 1;
  grads[1].mut_data = plain;
  grads[1].numel = 1;
  grads[1].dtype = FSDPTURBO_DTYPE_F32;
  fsdpturbo_comm_group_t group = {&dim, 1, comm};
  fsdpturbo_clip_options_t options = FSDPTURBO_CLIP_OPTIONS_INIT;
  options.max_norm = 3.0;
  double total = 0;
  CHECK_STATUS(fsdpturbo_clip_grad_norm_comm(&options, grads, 2, &group, 1, &total), FSDPTURBO_OK);
  CHECK(absd(total * total - (1 + 4 + 9 + 16)) < 1e-9);
  CHECK(peer.calls == 1);
  CHECK(absd(sharded[1] - 2.0 * 3.0 / (total + 1e-6)) < 1e-6);

  /* A sharded set without a communicator. */
  uint32_t other = 4;
  fsdpturbo_comm_group_t wrong = {&other, 1, comm};
  CHECK_STATUS(fsdpturbo_clip_grad_norm_comm(&options, grads, 2, &wrong, 1, &total), FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("no entry of `groups` has the mesh dims [3]"));
  fsdpturbo_comm_free(comm);

  /* A failing callback names itself and leaves the gradients alone. */
  c.all_reduce = failing_all_reduce;
  CHECK_STATUS(fsdpturbo_comm_host_new(&c, &comm), FSDPTURBO_OK);
  group.comm = comm;
  float before = sharded[0];
  CHECK_STATUS(fsdpturbo_clip_grad_norm_comm(&options, grads, 2, &group, 1, &total), FSDPTURBO_ERR_UNAVAILABLE);
  CHECK(last_error_contains("all_reduce callback failed with status 42"));
  CHECK(sharded[0] == before);
  /* Callbacks it was not given. */
  CHECK_STATUS(fsdpturbo_comm_all_to_all_v(comm, sharded, sharded, NULL, NULL, NULL, NULL, FSDPTURBO_DTYPE_F32, NULL),
               FSDPTURBO_ERR_NULL_ARGUMENT);
  fsdpturbo_comm_free(comm);
}

static void test_misuse(void) {
  peer_t peer = {0, 0};
  fsdpturbo_host_collective_t c = callbacks(&peer);
  fsdpturbo_comm_t *comm = NULL;
  c.all_reduce = NULL;
  CHECK_STATUS(fsdpturbo_comm_host_new(&c, &comm), FSDPTURBO_ERR_NULL_ARGUMENT);
  c = callbacks(&peer);
  c.rank = 2;
  CHECK_STATUS(fsdpturbo_comm_host_new(&c, &comm), FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("rank 2 is outside a group of 2 ranks"));
  c = callbacks(&peer);
  c.struct_size = 8;
  CHECK_STATUS(fsdpturbo_comm_host_new(&c, &comm), FSDPTURBO_ERR_STRUCT_SIZE);
  CHECK(comm == NULL);
  /* NCCL: loads where the library is found, else a clear UNAVAILABLE listing what was tried. */
  int32_t version = 0;
  int32_t status = fsdpturbo_nccl_version(&version);
  CHECK(status == FSDPTURBO_OK || status == FSDPTURBO_ERR_UNAVAILABLE);
  if (status == FSDPTURBO_OK) CHECK(version >= 20700);
  else CHECK(last_error_contains("NCCL is not available on this host; tried:"));
}

int main(void) {
  test_single_rank();
  test_grad_norm_over_host_callbacks();
  test_gather_and_scatter_over_host_callbacks();
  test_misuse();
  return check_summary("test_comm");
}
