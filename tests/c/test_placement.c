/* DTensor placements through the header: local shapes and offsets (torch's worked examples),
 * copy plans moving float data to a rank's local tensor and back, and misuse. */
#include <stdint.h>
#include <stdlib.h>

#include "check.h"

static const fsdpturbo_placement_t SHARD0 = {FSDPTURBO_PLACEMENT_SHARD, 0, 0};
static const fsdpturbo_placement_t SHARD1 = {FSDPTURBO_PLACEMENT_SHARD, 1, 0};
static const fsdpturbo_placement_t REPLICATE = {FSDPTURBO_PLACEMENT_REPLICATE, 0, 0};
static const fsdpturbo_placement_t PARTIAL = {FSDPTURBO_PLACEMENT_PARTIAL, 0, 0};

/* The shard of a 1-D tensor of `size` at `coord` of a mesh of `n` under Shard(0). */
static void check_1d(uint64_t size, uint64_t n, uint64_t coord, uint64_t want_size, uint64_t want_offset) {
  uint64_t shape[1] = {size}, mesh[1] = {n}, c[1] = {coord}, local[1] = {99}, offset[1] = {99};
  CHECK_STATUS(fsdpturbo_local_shape_and_offset(shape, 1, mesh, c, 1, &SHARD0, local, offset), FSDPTURBO_OK);
  if (local[0] != want_size || offset[0] != want_offset) {
    fprintf(stderr, "%llu over %llu, coordinate %llu: got (%llu, %llu), want (%llu, %llu)\n",
            (unsigned long long)size, (unsigned long long)n, (unsigned long long)coord,
            (unsigned long long)local[0], (unsigned long long)offset[0], (unsigned long long)want_size,
            (unsigned long long)want_offset);
  }
  CHECK(local[0] == want_size && offset[0] == want_offset);
}

static void test_worked_examples(void) {
  /* 10 over 4: ceil chunks 3, 3, 3, 1 at 0, 3, 6, 9 (torch.chunk, not tensor_split's 3,3,2,2). */
  check_1d(10, 4, 0, 3, 0);
  check_1d(10, 4, 1, 3, 3);
  check_1d(10, 4, 2, 3, 6);
  check_1d(10, 4, 3, 1, 9);
  /* 3 over 4: the last shard is empty and its offset is the dim's size. */
  check_1d(3, 4, 0, 1, 0);
  check_1d(3, 4, 2, 1, 2);
  check_1d(3, 4, 3, 0, 3);
  /* 0 over 2: both empty at offset 0. */
  check_1d(0, 2, 1, 0, 0);

  /* (5, 7) on a (2, 3) mesh, [Shard(0), Shard(1)]: local (rows, cols), offset (row, col). */
  const uint64_t want[6][4] = {{3, 3, 0, 0}, {3, 3, 0, 3}, {3, 1, 0, 6},
                               {2, 3, 3, 0}, {2, 3, 3, 3}, {2, 1, 3, 6}};
  uint64_t shape[2] = {5, 7}, mesh[2] = {2, 3};
  fsdpturbo_placement_t placements[2] = {SHARD0, SHARD1};
  for (uint64_t i = 0; i < 2; ++i) {
    for (uint64_t j = 0; j < 3; ++j) {
      uint64_t c[2] = {i, j}, local[2] = {0}, offset[2] = {0};
      CHECK_STATUS(fsdpturbo_local_shape_and_offset(shape, 2, mesh, c, 2, placements, local, offset), FSDPTURBO_OK);
      const uint64_t *w = want[i * 3 + j];
      CHECK(local[0] == w[0] && local[1] == w[1] && offset[0] == w[2] && offset[1] == w[3]);
    }
  }

  /* Two placements on one dim nest: 10 over (2, 3) → 5, 5 → 2, 2, 1 each; (1, 2) holds row 9. */
  uint64_t ten[1] = {10}, c12[2] = {1, 2}, local1[1] = {0}, offset1[1] = {0};
  fsdpturbo_placement_t nested[2] = {SHARD0, SHARD0};
  CHECK_STATUS(fsdpturbo_local_shape_and_offset(ten, 1, mesh, c12, 2, nested, local1, offset1), FSDPTURBO_OK);
  CHECK(local1[0] == 1 && offset1[0] == 9);

  /* FSDP2 over EP on one dim: [_StridedShard(0, sf=2), Shard(0)] on (2, 2), 8 rows: coordinate
   * (0, 1) holds rows 4, 5 (sharded right to left), not rows 2, 3. */
  uint64_t eight[1] = {8}, mesh22[2] = {2, 2}, c01[2] = {0, 1};
  fsdpturbo_placement_t strided[2] = {{FSDPTURBO_PLACEMENT_STRIDED_SHARD, 0, 2}, SHARD0};
  CHECK_STATUS(fsdpturbo_local_shape_and_offset(eight, 1, mesh22, c01, 2, strided, local1, offset1), FSDPTURBO_OK);
  CHECK(local1[0] == 2 && offset1[0] == 4);

  /* Replicate and Partial keep the whole tensor. */
  uint64_t local2[2] = {0}, offset2[2] = {9, 9};
  fsdpturbo_placement_t rp[2] = {REPLICATE, PARTIAL};
  CHECK_STATUS(fsdpturbo_local_shape_and_offset(shape, 2, mesh, c12, 2, rp, local2, offset2), FSDPTURBO_OK);
  CHECK(local2[0] == 5 && local2[1] == 7 && offset2[0] == 0 && offset2[1] == 0);

  /* A 0-D tensor on a 1-D mesh: nothing to write. */
  uint64_t c0[1] = {0}, m2[1] = {2};
  CHECK_STATUS(fsdpturbo_local_shape_and_offset(NULL, 0, m2, c0, 1, &REPLICATE, NULL, NULL), FSDPTURBO_OK);
}

static fsdpturbo_copy_plan_t *make_plan(const uint64_t *shape, size_t ndim, const uint64_t *mesh,
                                        const uint64_t *coord, size_t mesh_ndim,
                                        const fsdpturbo_placement_t *placements) {
  fsdpturbo_copy_plan_t *plan = NULL;
  CHECK_STATUS(fsdpturbo_copy_plan_new(shape, ndim, mesh, coord, mesh_ndim, placements, &plan), FSDPTURBO_OK);
  return plan;
}

/* (5, 7) floats on a (2, 3) mesh [Shard(0), Shard(1)]: every rank's local tensor is the
 * block its shape and offset say; writing every local back rebuilds the full tensor. */
static void test_round_trip_2d(void) {
  uint64_t shape[2] = {5, 7}, mesh[2] = {2, 3};
  fsdpturbo_placement_t placements[2] = {SHARD0, SHARD1};
  float full[35], rebuilt[35];
  for (int i = 0; i < 35; ++i) {
    full[i] = 0.5f * (float)i - 3.0f;
    rebuilt[i] = -1000.0f;
  }
  size_t total = 0;
  for (uint64_t i = 0; i < 2; ++i) {
    for (uint64_t j = 0; j < 3; ++j) {
      uint64_t c[2] = {i, j}, local_shape[2] = {0}, offset[2] = {0}, numel = 0;
      CHECK_STATUS(fsdpturbo_local_shape_and_offset(shape, 2, mesh, c, 2, placements, local_shape, offset),
                   FSDPTURBO_OK);
      fsdpturbo_copy_plan_t *plan = make_plan(shape, 2, mesh, c, 2, placements);
      CHECK_STATUS(fsdpturbo_copy_plan_local_numel(plan, &numel), FSDPTURBO_OK);
      CHECK(numel == local_shape[0] * local_shape[1]);
      uint64_t plan_shape[2] = {0};
      size_t plan_ndim = 0;
      CHECK_STATUS(fsdpturbo_copy_plan_local_shape(plan, plan_shape, 2, &plan_ndim), FSDPTURBO_OK);
      CHECK(plan_ndim == 2 && plan_shape[0] == local_shape[0] && plan_shape[1] == local_shape[1]);
      /* One run per local row: rows are cut by the column shard. */
      size_t n_runs = 0;
      CHECK_STATUS(fsdpturbo_copy_plan_runs(plan, NULL, 0, &n_runs), FSDPTURBO_ERR_BUFFER_TOO_SMALL);
      CHECK(n_runs == local_shape[0]);
      uint64_t runs[3 * 3] = {0};
      CHECK_STATUS(fsdpturbo_copy_plan_runs(plan, runs, 3, &n_runs), FSDPTURBO_OK);
      CHECK(runs[0] == offset[0] * 7 + offset[1] && runs[1] == 0 && runs[2] == local_shape[1]);

      float local[9];
      for (int k = 0; k < 9; ++k) local[k] = 12345.0f;
      CHECK_STATUS(fsdpturbo_copy_bytes(plan, sizeof(float), full, sizeof full, local, numel * sizeof(float)),
                   FSDPTURBO_OK);
      for (uint64_t r = 0; r < local_shape[0]; ++r) {
        for (uint64_t q = 0; q < local_shape[1]; ++q) {
          CHECK(local[r * local_shape[1] + q] == full[(offset[0] + r) * 7 + offset[1] + q]);
        }
      }
      CHECK(numel == 9 || local[numel] == 12345.0f); /* nothing written past the local tensor */
      CHECK_STATUS(fsdpturbo_copy_bytes_back(plan, sizeof(float), local, numel * sizeof(float), rebuilt,
                                             sizeof rebuilt),
                   FSDPTURBO_OK);
      total += numel;
      fsdpturbo_copy_plan_free(plan);
    }
  }
  CHECK(total == 35);
  CHECK(memcmp(full, rebuilt, sizeof full) == 0);
}

/* 8 rows of 3 floats under [_StridedShard(0, sf=2), Shard(0)] on (2, 2) (FSDP2 over EP), and
 * an empty shard (3 rows over 4): the plan moves exactly torch's rows. */
static void test_round_trip_strided_and_empty(void) {
  uint64_t shape[2] = {8, 3}, mesh[2] = {2, 2};
  fsdpturbo_placement_t placements[2] = {{FSDPTURBO_PLACEMENT_STRIDED_SHARD, 0, 2}, SHARD0};
  /* torch: coordinate (i, j) holds rows of the EP block j (rows 4j..4j+3) chunked over i. */
  const uint64_t rows[4][2] = {{0, 1}, {4, 5}, {2, 3}, {6, 7}};
  float full[24], rebuilt[24];
  for (int k = 0; k < 24; ++k) {
    full[k] = (float)k + 0.25f;
    rebuilt[k] = 0.0f;
  }
  for (uint64_t i = 0; i < 2; ++i) {
    for (uint64_t j = 0; j < 2; ++j) {
      uint64_t c[2] = {i, j};
      fsdpturbo_copy_plan_t *plan = make_plan(shape, 2, mesh, c, 2, placements);
      float local[6] = {0};
      CHECK_STATUS(fsdpturbo_copy_bytes(plan, sizeof(float), full, sizeof full, local, sizeof local), FSDPTURBO_OK);
      for (int r = 0; r < 2; ++r) {
        CHECK(memcmp(&local[r * 3], &full[rows[i * 2 + j][r] * 3], 3 * sizeof(float)) == 0);
      }
      CHECK_STATUS(fsdpturbo_copy_bytes_back(plan, sizeof(float), local, sizeof local, rebuilt, sizeof rebuilt),
                   FSDPTURBO_OK);
      fsdpturbo_copy_plan_free(plan);
    }
  }
  CHECK(memcmp(full, rebuilt, sizeof full) == 0);

  /* An empty shard: 0 elements, 0 runs, NULL buffers accepted for 0 bytes. */
  uint64_t three[1] = {3}, four[1] = {4}, last[1] = {3}, numel = 99;
  fsdpturbo_copy_plan_t *empty = make_plan(three, 1, four, last, 1, &SHARD0);
  CHECK_STATUS(fsdpturbo_copy_plan_local_numel(empty, &numel), FSDPTURBO_OK);
  CHECK(numel == 0);
  size_t n_runs = 99;
  CHECK_STATUS(fsdpturbo_copy_plan_runs(empty, NULL, 0, &n_runs), FSDPTURBO_OK);
  CHECK(n_runs == 0);
  CHECK_STATUS(fsdpturbo_copy_bytes(empty, sizeof(float), full, 3 * sizeof(float), NULL, 0), FSDPTURBO_OK);
  fsdpturbo_copy_plan_free(empty);
}

static void test_misuse(void) {
  uint64_t shape[2] = {10, 4}, mesh[1] = {4}, c[1] = {1}, local[2] = {0}, offset[2] = {0};
  fsdpturbo_copy_plan_t *plan = NULL;

  /* NULL arrays and outputs. */
  CHECK_STATUS(fsdpturbo_local_shape_and_offset(NULL, 2, mesh, c, 1, &SHARD0, local, offset),
               FSDPTURBO_ERR_NULL_ARGUMENT);
  CHECK(last_error_contains("global_shape"));
  CHECK_STATUS(fsdpturbo_local_shape_and_offset(shape, 2, mesh, c, 1, NULL, local, offset),
               FSDPTURBO_ERR_NULL_ARGUMENT);
  CHECK_STATUS(fsdpturbo_local_shape_and_offset(shape, 2, mesh, c, 1, &SHARD0, NULL, offset),
               FSDPTURBO_ERR_NULL_ARGUMENT);
  CHECK(last_error_contains("local_shape"));
  CHECK_STATUS(fsdpturbo_copy_plan_new(shape, 2, mesh, c, 1, &SHARD0, NULL), FSDPTURBO_ERR_NULL_ARGUMENT);
  uint64_t numel = 0;
  CHECK_STATUS(fsdpturbo_copy_plan_local_numel(NULL, &numel), FSDPTURBO_ERR_NULL_ARGUMENT);
  CHECK_STATUS(fsdpturbo_copy_bytes(NULL, 4, NULL, 0, NULL, 0), FSDPTURBO_ERR_NULL_ARGUMENT);

  /* Kind integers C can put anything into, and fields a kind does not use. */
  const fsdpturbo_placement_t bad[] = {
      {7, 0, 0},  {-1, 0, 0}, {FSDPTURBO_PLACEMENT_SHARD, 0, 2}, {FSDPTURBO_PLACEMENT_REPLICATE, 1, 0},
      {FSDPTURBO_PLACEMENT_STRIDED_SHARD, 0, 0}, {FSDPTURBO_PLACEMENT_SHARD, -1, 0}, {FSDPTURBO_PLACEMENT_SHARD, 2, 0},
  };
  const char *needles[] = {"kind", "kind", "split_factor", "dim", "split_factor", "dim", "dim"};
  for (size_t k = 0; k < sizeof bad / sizeof bad[0]; ++k) {
    CHECK_STATUS(fsdpturbo_local_shape_and_offset(shape, 2, mesh, c, 1, &bad[k], local, offset),
                 FSDPTURBO_ERR_INVALID_ARGUMENT);
    CHECK(last_error_contains(needles[k]));
    CHECK_STATUS(fsdpturbo_copy_plan_new(shape, 2, mesh, c, 1, &bad[k], &plan), FSDPTURBO_ERR_INVALID_ARGUMENT);
    CHECK(plan == NULL);
  }
  CHECK(last_error_contains("placements[0]"));
  /* A coordinate outside the mesh; a Partial copy plan (not a selection of elements). */
  uint64_t c9[1] = {9};
  CHECK_STATUS(fsdpturbo_local_shape_and_offset(shape, 2, mesh, c9, 1, &SHARD0, local, offset),
               FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("coordinate"));
  CHECK_STATUS(fsdpturbo_copy_plan_new(shape, 2, mesh, c, 1, &PARTIAL, &plan), FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("Partial"));

  /* Byte lengths must be exact; buffers must not overlap; elem_size must not be 0. */
  plan = make_plan(shape, 2, mesh, c, 1, &SHARD0); /* rows 3..5: 12 floats of 40 */
  float full[40] = {0}, loc[12] = {0};
  CHECK_STATUS(fsdpturbo_copy_bytes(plan, 4, full, sizeof full - 4, loc, sizeof loc), FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("full_bytes"));
  CHECK_STATUS(fsdpturbo_copy_bytes(plan, 4, full, sizeof full, loc, sizeof loc + 4), FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("local_bytes"));
  CHECK_STATUS(fsdpturbo_copy_bytes(plan, 2, full, sizeof full, loc, sizeof loc), FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(fsdpturbo_copy_bytes(plan, 0, full, 0, loc, 0), FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("elem_size"));
  CHECK_STATUS(fsdpturbo_copy_bytes(plan, 4, full, sizeof full, full + 4, sizeof loc), FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("overlap"));
  CHECK_STATUS(fsdpturbo_copy_bytes_back(plan, 4, loc, sizeof loc, full, sizeof full + 4),
               FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(fsdpturbo_copy_bytes(plan, 4, NULL, sizeof full, loc, sizeof loc), FSDPTURBO_ERR_NULL_ARGUMENT);
  CHECK_STATUS(fsdpturbo_copy_bytes_back(plan, 4, loc, sizeof loc, NULL, sizeof full), FSDPTURBO_ERR_NULL_ARGUMENT);

  /* Buffers too small: the needed size is still reported, nothing is written. */
  size_t n = 0;
  uint64_t one_dim[1] = {77};
  CHECK_STATUS(fsdpturbo_copy_plan_local_shape(plan, one_dim, 1, &n), FSDPTURBO_ERR_BUFFER_TOO_SMALL);
  CHECK(n == 2 && one_dim[0] == 77);
  uint64_t runs[3] = {5, 5, 5};
  CHECK_STATUS(fsdpturbo_copy_plan_runs(plan, runs, 1, &n), FSDPTURBO_OK); /* rows 3..5 are one run */
  CHECK(n == 1 && runs[0] == 12 && runs[1] == 0 && runs[2] == 12);
  fsdpturbo_copy_plan_free(plan);
  fsdpturbo_placement_t cols[1] = {SHARD1}; /* columns: one run per row */
  plan = make_plan(shape, 2, mesh, c, 1, cols);
  CHECK_STATUS(fsdpturbo_copy_plan_runs(plan, runs, 1, &n), FSDPTURBO_ERR_BUFFER_TOO_SMALL);
  CHECK(n == 10 && runs[0] == 12);
  fsdpturbo_copy_plan_free(plan);
}

int main(void) {
  test_worked_examples();
  test_round_trip_2d();
  test_round_trip_strided_and_empty();
  test_misuse();
  return check_summary("test_placement");
}
