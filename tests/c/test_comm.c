/* Communicators through the header: one rank, a process group lent through host callbacks (a
 * simulated second rank whose values the callbacks add), the grad norm over them, and misuse. */
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
  fsdpturbo_comm_free(comm);
  fsdpturbo_comm_free(NULL);
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
  test_misuse();
  return check_summary("test_comm");
}
