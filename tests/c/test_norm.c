/* The gradient norm through the header: the fused host p-power sum, placement-aware clipping
 * with a reduce callback that stands in for the other ranks, in-place scaling, the options
 * initialiser, and misuse. Values are chosen so that every expected result is exact. */
#include <math.h>
#include <stdlib.h>

#include "check.h"

/* bfloat16 / binary16 bit patterns of small exact values. */
#define BF16_0_5 0x3F00
#define BF16_1 0x3F80
#define BF16_1_5 0x3FC0
#define BF16_2 0x4000
#define BF16_3 0x4040
#define BF16_4 0x4080
#define BF16_MINUS_4 0xC080
#define BF16_NAN 0x7FC0
#define F16_2 0x4000
#define F16_MINUS_0_5 0xB800

static double absd(double x) { return x < 0 ? -x : x; }

static int close_rel(double a, double b, double rel) { return absd(a - b) <= rel * absd(b); }

static fsdpturbo_grad_t grad_of(void *data, size_t numel, int32_t dtype, const uint32_t *dims,
                                const int32_t *roles, size_t n_dims) {
  fsdpturbo_grad_t g;
  memset(&g, 0, sizeof g);
  g.mut_data = data;
  g.numel = numel;
  g.dtype = dtype;
  g.dims = dims;
  g.roles = roles;
  g.n_dims = n_dims;
  return g;
}

static fsdpturbo_grad_t readonly_of(const void *data, size_t numel, int32_t dtype) {
  fsdpturbo_grad_t g;
  memset(&g, 0, sizeof g);
  g.data = data;
  g.numel = numel;
  g.dtype = dtype;
  return g;
}

static void test_local_power_sum(void) {
  const float f32[4] = {3.0f, -4.0f, 0.0f, 1.5f};
  const uint16_t bf16[3] = {BF16_3, BF16_MINUS_4, BF16_1_5};
  const double f64[2] = {-2.0, 0.5};
  const uint16_t f16[2] = {F16_2, F16_MINUS_0_5};
  double v = -1;

  fsdpturbo_grad_t one = readonly_of(f32, 4, FSDPTURBO_DTYPE_F32);
  CHECK_STATUS(fsdpturbo_local_power_sum(&one, 1, 2.0, true, &v), FSDPTURBO_OK);
  CHECK(v == 27.25);
  CHECK_STATUS(fsdpturbo_local_power_sum(&one, 1, 1.0, true, &v), FSDPTURBO_OK);
  CHECK(v == 8.5);
  CHECK_STATUS(fsdpturbo_local_power_sum(&one, 1, 3.0, true, &v), FSDPTURBO_OK);
  CHECK(v == 27.0 + 64.0 + 3.375);
  CHECK_STATUS(fsdpturbo_local_power_sum(&one, 1, INFINITY, true, &v), FSDPTURBO_OK);
  CHECK(v == 4.0);
  CHECK_STATUS(fsdpturbo_local_power_sum(&one, 1, 2.0, false, &v), FSDPTURBO_OK);
  CHECK(v == 27.25);

  /* bf16 alone, then every dtype fused in one call (mut_data is read when data is NULL). */
  fsdpturbo_grad_t b = readonly_of(bf16, 3, FSDPTURBO_DTYPE_BF16);
  CHECK_STATUS(fsdpturbo_local_power_sum(&b, 1, 2.0, true, &v), FSDPTURBO_OK);
  CHECK(v == 27.25);
  CHECK_STATUS(fsdpturbo_local_power_sum(&b, 1, INFINITY, true, &v), FSDPTURBO_OK);
  CHECK(v == 4.0);
  double f64_copy[2] = {f64[0], f64[1]};
  fsdpturbo_grad_t all[5] = {one, b, readonly_of(f64, 2, FSDPTURBO_DTYPE_F64), readonly_of(f16, 2, FSDPTURBO_DTYPE_F16),
                             grad_of(f64_copy, 2, FSDPTURBO_DTYPE_F64, NULL, NULL, 0)};
  CHECK_STATUS(fsdpturbo_local_power_sum(all, 5, 2.0, true, &v), FSDPTURBO_OK);
  CHECK(v == 27.25 + 27.25 + 4.25 + 4.25 + 4.25);
  CHECK_STATUS(fsdpturbo_local_power_sum(all, 5, 1.0, true, &v), FSDPTURBO_OK);
  CHECK(v == 8.5 + 8.5 + 2.5 + 2.5 + 2.5);

  /* Empty inputs give 0; NaN propagates for p and for the max. */
  CHECK_STATUS(fsdpturbo_local_power_sum(NULL, 0, 2.0, true, &v), FSDPTURBO_OK);
  CHECK(v == 0.0);
  fsdpturbo_grad_t empty = readonly_of(NULL, 0, FSDPTURBO_DTYPE_BF16);
  CHECK_STATUS(fsdpturbo_local_power_sum(&empty, 1, INFINITY, true, &v), FSDPTURBO_OK);
  CHECK(v == 0.0);
  const uint16_t with_nan[3] = {BF16_1, BF16_NAN, BF16_4};
  fsdpturbo_grad_t n = readonly_of(with_nan, 3, FSDPTURBO_DTYPE_BF16);
  CHECK_STATUS(fsdpturbo_local_power_sum(&n, 1, 2.0, true, &v), FSDPTURBO_OK);
  CHECK(isnan(v));
  CHECK_STATUS(fsdpturbo_local_power_sum(&n, 1, INFINITY, true, &v), FSDPTURBO_OK);
  CHECK(isnan(v));

  /* Above the threaded threshold (2^20 elements): still exact, and f32 accumulation agrees
   * on values whose partial sums are exact in float. */
  size_t big = (size_t)3 << 20;
  uint16_t *ones = malloc(big * sizeof *ones);
  for (size_t i = 0; i < big; ++i) ones[i] = (i % 3 == 0) ? BF16_2 : BF16_1;
  fsdpturbo_grad_t g = readonly_of(ones, big, FSDPTURBO_DTYPE_BF16);
  CHECK_STATUS(fsdpturbo_local_power_sum(&g, 1, 2.0, true, &v), FSDPTURBO_OK);
  CHECK(v == (double)(big / 3) * 4.0 + (double)(big - big / 3));
  double v32 = -1;
  CHECK_STATUS(fsdpturbo_local_power_sum(&g, 1, 1.0, false, &v32), FSDPTURBO_OK);
  CHECK(v32 == (double)(big / 3) * 2.0 + (double)(big - big / 3));
  CHECK_STATUS(fsdpturbo_local_power_sum(&g, 1, INFINITY, true, &v), FSDPTURBO_OK);
  CHECK(v == 2.0);
  free(ones);
}

/* The reduce callback simulates this rank plus peers: every mesh dim has 2 ranks holding the
 * same local values, so a SUM over n dims multiplies by 2^n; a MAX takes the larger of the
 * value and `peer_max` (what the peers hold). It records every call. */
typedef struct {
  int calls;
  size_t set_index[8];
  size_t n_dims[8];
  uint32_t dims[8][4];
  int32_t op[8];
  double peer_max;
  int32_t fail_with;
} reduce_log_t;

static int32_t simulate(void *user, size_t set_index, const uint32_t *dims, size_t n_dims, int32_t op,
                        double *value) {
  reduce_log_t *log = user;
  if (log->calls < 8) {
    log->set_index[log->calls] = set_index;
    log->n_dims[log->calls] = n_dims;
    for (size_t i = 0; i < n_dims && i < 4; ++i) log->dims[log->calls][i] = dims[i];
    log->op[log->calls] = op;
  }
  ++log->calls;
  if (log->fail_with) return log->fail_with;
  if (op == FSDPTURBO_REDUCE_SUM) {
    for (size_t i = 0; i < n_dims; ++i) *value *= 2.0;
  } else if (*value < log->peer_max) {
    *value = log->peer_max;
  }
  return 0;
}

/* The gradient list of the clip tests (one rank's view of a mixed layout):
 *   g0 plain f32 [3, 4]              set {}      Σx² = 25, no collective
 *   g1 Shard on dim 0, f32 [2, 4]    set {0}     Σx² = 20
 *   g2 (Replicate 1, Shard 0) [4]    set {0}     Σx² = 16
 *   g3 (Shard 1, Shard 0) f32 [1,1,2] set {0,1}  Σx² = 6
 *   g4 plain bf16 [3, 4]             set {}      Σx² = 25
 * With 2 ranks per mesh dim: total² = 25 + 25 + 2·(20 + 16) + 4·6 = 146. */
typedef struct {
  float g0[2], g1[2], g2[1], g3[3];
  uint16_t g4[2];
  fsdpturbo_grad_t grads[5];
} layout_t;

static const uint32_t DIM0[1] = {0};
static const int32_t SHARD1[1] = {FSDPTURBO_DIM_SHARD};
static const uint32_t DIMS10[2] = {1, 0};
static const int32_t REP_SHARD[2] = {FSDPTURBO_DIM_REPLICATE, FSDPTURBO_DIM_SHARD};
static const int32_t SHARD_SHARD[2] = {FSDPTURBO_DIM_SHARD, FSDPTURBO_DIM_SHARD};

static void layout_init(layout_t *l) {
  const float g0[2] = {3, 4}, g1[2] = {2, 4}, g2[1] = {4}, g3[3] = {1, 1, 2};
  memcpy(l->g0, g0, sizeof g0);
  memcpy(l->g1, g1, sizeof g1);
  memcpy(l->g2, g2, sizeof g2);
  memcpy(l->g3, g3, sizeof g3);
  l->g4[0] = BF16_3;
  l->g4[1] = BF16_4;
  l->grads[0] = grad_of(l->g0, 2, FSDPTURBO_DTYPE_F32, NULL, NULL, 0);
  l->grads[1] = grad_of(l->g1, 2, FSDPTURBO_DTYPE_F32, DIM0, SHARD1, 1);
  l->grads[2] = grad_of(l->g2, 1, FSDPTURBO_DTYPE_F32, DIMS10, REP_SHARD, 2);
  l->grads[3] = grad_of(l->g3, 3, FSDPTURBO_DTYPE_F32, DIMS10, SHARD_SHARD, 2);
  l->grads[4] = grad_of(l->g4, 2, FSDPTURBO_DTYPE_BF16, NULL, NULL, 0);
}

static int layout_untouched(const layout_t *l) {
  layout_t fresh;
  layout_init(&fresh);
  return memcmp(l->g0, fresh.g0, sizeof l->g0) == 0 && memcmp(l->g1, fresh.g1, sizeof l->g1) == 0 &&
         memcmp(l->g2, fresh.g2, sizeof l->g2) == 0 && memcmp(l->g3, fresh.g3, sizeof l->g3) == 0 &&
         memcmp(l->g4, fresh.g4, sizeof l->g4) == 0;
}

static void test_clip_two_ranks(void) {
  layout_t l;
  layout_init(&l);
  reduce_log_t log;
  memset(&log, 0, sizeof log);
  fsdpturbo_clip_options_t options = FSDPTURBO_CLIP_OPTIONS_INIT;
  double total = -1;

  /* p = 2 without clipping (max_norm above the norm). */
  double expected2 = 25.0 + 25.0 + 2.0 * (20.0 + 16.0) + 4.0 * 6.0;
  options.max_norm = 1e9;
  CHECK_STATUS(fsdpturbo_clip_grad_norm(&options, l.grads, 5, simulate, &log, &total), FSDPTURBO_OK);
  CHECK(close_rel(total * total, expected2, 1e-15));
  CHECK(layout_untouched(&l));
  /* One call per non-empty set, in first-seen order; set 0 is the empty set (no call). */
  CHECK(log.calls == 2);
  CHECK(log.set_index[0] == 1 && log.n_dims[0] == 1 && log.dims[0][0] == 0 && log.op[0] == FSDPTURBO_REDUCE_SUM);
  CHECK(log.set_index[1] == 2 && log.n_dims[1] == 2 && log.dims[1][0] == 0 && log.dims[1][1] == 1);

  /* p = 1 with clipping to half: total = 7 + 7 + 2·(6 + 4) + 4·4 = 50, max_norm 25. */
  memset(&log, 0, sizeof log);
  options.norm_type = 1.0;
  options.max_norm = 25.0;
  CHECK_STATUS(fsdpturbo_clip_grad_norm(&options, l.grads, 5, simulate, &log, &total), FSDPTURBO_OK);
  CHECK(total == 50.0);
  float coef = (float)(25.0 / (50.0 + 1e-6));
  CHECK(l.g0[0] == 3.0f * coef && l.g0[1] == 4.0f * coef);
  CHECK(l.g1[0] == 2.0f * coef && l.g1[1] == 4.0f * coef && l.g2[0] == 4.0f * coef);
  CHECK(l.g3[0] == 1.0f * coef && l.g3[2] == 2.0f * coef);
  CHECK(l.g4[0] == BF16_1_5 && l.g4[1] == BF16_2); /* 1.49999997 and 1.99999996 round to bf16 1.5 and 2 */

  /* p = inf: MAX, a peer holds 8 → total 8, every gradient scaled by 2/8. */
  layout_init(&l);
  memset(&log, 0, sizeof log);
  log.peer_max = 8.0;
  options.norm_type = INFINITY;
  options.max_norm = 2.0;
  CHECK_STATUS(fsdpturbo_clip_grad_norm(&options, l.grads, 5, simulate, &log, &total), FSDPTURBO_OK);
  CHECK(total == 8.0);
  CHECK(log.calls == 2 && log.op[0] == FSDPTURBO_REDUCE_MAX && log.op[1] == FSDPTURBO_REDUCE_MAX);
  double c = 2.0 / (8.0 + 1e-6);
  CHECK(close_rel(l.g1[1], 4.0 * c, 1e-7) && close_rel(l.g0[0], 3.0 * c, 1e-7) && close_rel(l.g3[2], 2.0 * c, 1e-7));
  CHECK(l.g4[0] == 0x3F40 && l.g4[1] == BF16_1); /* bf16 0.75 and 1 */

  /* A rank that holds no elements still calls reduce once per set (value 0) and gets the
   * peers' total. */
  layout_init(&l);
  memset(&log, 0, sizeof log);
  log.peer_max = 5.0;
  for (int i = 0; i < 5; ++i) {
    l.grads[i].mut_data = NULL;
    l.grads[i].numel = 0;
  }
  CHECK_STATUS(fsdpturbo_clip_grad_norm(&options, l.grads, 5, simulate, &log, &total), FSDPTURBO_OK);
  CHECK(log.calls == 2 && total == 5.0);

  /* max_norm = inf never scales. */
  layout_init(&l);
  memset(&log, 0, sizeof log);
  options.norm_type = 2.0;
  options.max_norm = INFINITY;
  CHECK_STATUS(fsdpturbo_clip_grad_norm(&options, l.grads, 5, simulate, &log, &total), FSDPTURBO_OK);
  CHECK(close_rel(total * total, expected2, 1e-15) && layout_untouched(&l));

  /* Only plain gradients: no collective, so reduce may be NULL. */
  options.max_norm = 1.0;
  CHECK_STATUS(fsdpturbo_clip_grad_norm(&options, l.grads, 1, NULL, NULL, &total), FSDPTURBO_OK);
  CHECK(close_rel(total, 5.0, 1e-15));
  CHECK(close_rel(l.g0[0], 3.0 / (5.0 + 1e-6), 1e-7));
}

static void test_clip_nonfinite(void) {
  layout_t l;
  reduce_log_t log;
  fsdpturbo_clip_options_t options = FSDPTURBO_CLIP_OPTIONS_INIT;
  double total = 0;
  const float values[2] = {NAN, INFINITY};
  for (int k = 0; k < 2; ++k) {
    for (int strict = 0; strict < 2; ++strict) {
      layout_init(&l);
      l.g1[1] = values[k];
      memset(&log, 0, sizeof log);
      options.error_if_nonfinite = strict;
      total = 0;
      CHECK_STATUS(fsdpturbo_clip_grad_norm(&options, l.grads, 5, simulate, &log, &total),
                   strict ? FSDPTURBO_ERR_INVALID_ARGUMENT : FSDPTURBO_OK);
      CHECK(k == 0 ? isnan(total) : (isinf(total) && total > 0));
      CHECK(log.calls == 2); /* the collectives still ran on every rank */
      /* Untouched: the seed multiplies by 0 for an inf norm, turning inf into nan. */
      CHECK(l.g0[0] == 3.0f && l.g1[0] == 2.0f && l.g4[1] == BF16_4);
      CHECK(k == 0 ? isnan(l.g1[1]) : isinf(l.g1[1]));
      if (strict) CHECK(last_error_contains("is non-finite"));
    }
  }
}

static void test_scale_in_place(void) {
  float f32[3] = {1.0f, -3.0f, 0.25f};
  double f64[2] = {1.0, -0.1};
  uint16_t f16[1] = {F16_2};
  uint16_t bf16[4] = {BF16_1, BF16_1, BF16_4, BF16_MINUS_4};
  fsdpturbo_grad_t g[4] = {grad_of(f32, 3, FSDPTURBO_DTYPE_F32, NULL, NULL, 0),
                           grad_of(f64, 2, FSDPTURBO_DTYPE_F64, NULL, NULL, 0),
                           grad_of(f16, 1, FSDPTURBO_DTYPE_F16, NULL, NULL, 0),
                           grad_of(bf16, 2, FSDPTURBO_DTYPE_BF16, NULL, NULL, 0)};
  CHECK_STATUS(fsdpturbo_scale_in_place(g, 4, 0.5), FSDPTURBO_OK);
  CHECK(f32[0] == 0.5f && f32[1] == -1.5f && f32[2] == 0.125f);
  CHECK(f64[0] == 0.5 && f64[1] == -0.05);
  CHECK(f16[0] == 0x3C00); /* 1.0 */
  CHECK(bf16[0] == BF16_0_5 && bf16[1] == BF16_0_5 && bf16[2] == BF16_4); /* only 2 elements */

  /* bf16 rounds to nearest, ties to even: 1 · (1 + 2^-8) is a tie → 1.0; a hair above → up. */
  bf16[0] = BF16_1;
  fsdpturbo_grad_t one = grad_of(bf16, 1, FSDPTURBO_DTYPE_BF16, NULL, NULL, 0);
  CHECK_STATUS(fsdpturbo_scale_in_place(&one, 1, 1.0 + 1.0 / 256), FSDPTURBO_OK);
  CHECK(bf16[0] == BF16_1);
  CHECK_STATUS(fsdpturbo_scale_in_place(&one, 1, 1.0 + 1.0 / 256 + 1.0 / 512), FSDPTURBO_OK);
  CHECK(bf16[0] == BF16_1 + 1);

  /* Empty lists and empty buffers are fine; overlapping buffers are not. */
  CHECK_STATUS(fsdpturbo_scale_in_place(NULL, 0, 0.5), FSDPTURBO_OK);
  fsdpturbo_grad_t empty = grad_of(NULL, 0, FSDPTURBO_DTYPE_F32, NULL, NULL, 0);
  CHECK_STATUS(fsdpturbo_scale_in_place(&empty, 1, 0.5), FSDPTURBO_OK);
  fsdpturbo_grad_t overlap[2] = {grad_of(f32, 3, FSDPTURBO_DTYPE_F32, NULL, NULL, 0),
                                 grad_of(f32 + 2, 1, FSDPTURBO_DTYPE_F32, NULL, NULL, 0)};
  f32[0] = 1.0f;
  CHECK_STATUS(fsdpturbo_scale_in_place(overlap, 2, 0.5), FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("overlap"));
  CHECK(f32[0] == 1.0f);
}

static void test_options_init(void) {
  fsdpturbo_clip_options_t options = FSDPTURBO_CLIP_OPTIONS_INIT;
  CHECK(options.struct_size == sizeof(fsdpturbo_clip_options_t));
  CHECK(options.max_norm == 1.0 && options.norm_type == 2.0);
  CHECK(!options.error_if_nonfinite && options.accumulate_f64);
  /* The defaults clip a plain [3, 4] (norm 5) to norm 1. */
  float g[2] = {3.0f, 4.0f};
  fsdpturbo_grad_t grad = grad_of(g, 2, FSDPTURBO_DTYPE_F32, NULL, NULL, 0);
  double total = 0;
  CHECK_STATUS(fsdpturbo_clip_grad_norm(&options, &grad, 1, NULL, NULL, &total), FSDPTURBO_OK);
  CHECK(total == 5.0);
  CHECK(close_rel(g[0], 0.6, 1e-6) && close_rel(g[1], 0.8, 1e-6));

  /* A newer, larger struct is accepted. */
  struct {
    fsdpturbo_clip_options_t options;
    char future[32];
  } larger;
  memset(&larger, 0, sizeof larger);
  larger.options = options;
  larger.options.struct_size = sizeof larger;
  CHECK_STATUS(fsdpturbo_clip_grad_norm(&larger.options, &grad, 1, NULL, NULL, &total), FSDPTURBO_OK);
}

static void test_misuse(void) {
  float g[2] = {3.0f, 4.0f};
  fsdpturbo_grad_t grad = grad_of(g, 2, FSDPTURBO_DTYPE_F32, DIM0, SHARD1, 1);
  fsdpturbo_clip_options_t options = FSDPTURBO_CLIP_OPTIONS_INIT;
  reduce_log_t log;
  memset(&log, 0, sizeof log);
  double total = -7;

  /* NULLs. */
  CHECK_STATUS(fsdpturbo_clip_grad_norm(NULL, &grad, 1, simulate, &log, &total), FSDPTURBO_ERR_NULL_ARGUMENT);
  CHECK(last_error_contains("options"));
  CHECK_STATUS(fsdpturbo_clip_grad_norm(&options, &grad, 1, simulate, &log, NULL), FSDPTURBO_ERR_NULL_ARGUMENT);
  CHECK(last_error_contains("out_total_norm"));
  CHECK_STATUS(fsdpturbo_clip_grad_norm(&options, NULL, 2, simulate, &log, &total), FSDPTURBO_ERR_NULL_ARGUMENT);
  CHECK_STATUS(fsdpturbo_clip_grad_norm(&options, &grad, 1, NULL, NULL, &total), FSDPTURBO_ERR_NULL_ARGUMENT);
  CHECK(last_error_contains("reduce"));
  CHECK_STATUS(fsdpturbo_local_power_sum(&grad, 1, 2.0, true, NULL), FSDPTURBO_ERR_NULL_ARGUMENT);
  CHECK_STATUS(fsdpturbo_local_power_sum(NULL, 1, 2.0, true, &total), FSDPTURBO_ERR_NULL_ARGUMENT);
  CHECK_STATUS(fsdpturbo_scale_in_place(NULL, 1, 0.5), FSDPTURBO_ERR_NULL_ARGUMENT);
  fsdpturbo_grad_t null_data = grad_of(NULL, 2, FSDPTURBO_DTYPE_F32, NULL, NULL, 0);
  CHECK_STATUS(fsdpturbo_scale_in_place(&null_data, 1, 0.5), FSDPTURBO_ERR_NULL_ARGUMENT);
  CHECK(last_error_contains("numel"));
  fsdpturbo_grad_t null_dims = grad_of(g, 2, FSDPTURBO_DTYPE_F32, NULL, SHARD1, 1);
  CHECK_STATUS(fsdpturbo_clip_grad_norm(&options, &null_dims, 1, simulate, &log, &total),
               FSDPTURBO_ERR_NULL_ARGUMENT);

  /* Bad integers: dtype, role; the callback is never reached. */
  fsdpturbo_grad_t bad = grad;
  bad.dtype = 7;
  CHECK_STATUS(fsdpturbo_clip_grad_norm(&options, &bad, 1, simulate, &log, &total), FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("FSDPTURBO_DTYPE_"));
  bad.dtype = -1;
  CHECK_STATUS(fsdpturbo_local_power_sum(&bad, 1, 2.0, true, &total), FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(fsdpturbo_scale_in_place(&bad, 1, 2.0), FSDPTURBO_ERR_INVALID_ARGUMENT);
  const int32_t bad_role[1] = {3};
  bad = grad_of(g, 2, FSDPTURBO_DTYPE_F32, DIM0, bad_role, 1);
  CHECK_STATUS(fsdpturbo_clip_grad_norm(&options, &bad, 1, simulate, &log, &total), FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("FSDPTURBO_DIM_"));
  const int32_t partial[1] = {FSDPTURBO_DIM_PARTIAL};
  bad = grad_of(g, 2, FSDPTURBO_DTYPE_F32, DIM0, partial, 1);
  CHECK_STATUS(fsdpturbo_clip_grad_norm(&options, &bad, 1, simulate, &log, &total), FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("Partial"));
  const uint32_t twice[2] = {3, 3};
  bad = grad_of(g, 2, FSDPTURBO_DTYPE_F32, twice, SHARD_SHARD, 2);
  CHECK_STATUS(fsdpturbo_clip_grad_norm(&options, &bad, 1, simulate, &log, &total), FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("appears twice"));
  CHECK(log.calls == 0);

  /* Options: too-small struct, norm types, max_norm, a bool byte that is not 0/1. */
  fsdpturbo_clip_options_t small = options;
  small.struct_size = sizeof(size_t);
  CHECK_STATUS(fsdpturbo_clip_grad_norm(&small, &grad, 1, simulate, &log, &total), FSDPTURBO_ERR_STRUCT_SIZE);
  CHECK(last_error_contains("struct_size"));
  const double bad_p[4] = {0.0, -2.0, NAN, -INFINITY};
  for (int i = 0; i < 4; ++i) {
    fsdpturbo_clip_options_t o = options;
    o.norm_type = bad_p[i];
    CHECK_STATUS(fsdpturbo_clip_grad_norm(&o, &grad, 1, simulate, &log, &total), FSDPTURBO_ERR_INVALID_ARGUMENT);
    CHECK(last_error_contains("norm_type"));
    CHECK_STATUS(fsdpturbo_local_power_sum(&grad, 1, bad_p[i], true, &total), FSDPTURBO_ERR_INVALID_ARGUMENT);
  }
  CHECK(last_error_contains("norm_type"));
  fsdpturbo_clip_options_t o = options;
  o.norm_type = 0.0;
  CHECK_STATUS(fsdpturbo_clip_grad_norm(&o, &grad, 1, simulate, &log, &total), FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("p = 0"));
  o = options;
  o.max_norm = -1.0;
  CHECK_STATUS(fsdpturbo_clip_grad_norm(&o, &grad, 1, simulate, &log, &total), FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("max_norm"));
  o = options;
  memset(&o.error_if_nonfinite, 2, 1);
  CHECK_STATUS(fsdpturbo_clip_grad_norm(&o, &grad, 1, simulate, &log, &total), FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("not a bool"));
  CHECK(log.calls == 0);

  /* Misaligned data; data and mut_data that disagree. */
  float raw[4] = {0};
  fsdpturbo_grad_t misaligned = grad_of((char *)raw + 1, 2, FSDPTURBO_DTYPE_F32, NULL, NULL, 0);
  CHECK_STATUS(fsdpturbo_scale_in_place(&misaligned, 1, 0.5), FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("aligned"));
  float other[2] = {1.0f, 1.0f};
  fsdpturbo_grad_t two_pointers = grad;
  two_pointers.data = other;
  CHECK_STATUS(fsdpturbo_clip_grad_norm(&options, &two_pointers, 1, simulate, &log, &total),
               FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("mut_data"));

  /* A failing collective aborts with its status; nothing is modified, the set is named. */
  log.fail_with = 42;
  options.max_norm = 0.5;
  CHECK_STATUS(fsdpturbo_clip_grad_norm(&options, &grad, 1, simulate, &log, &total), 42);
  CHECK(last_error_contains("set 0"));
  CHECK(log.calls == 1 && g[0] == 3.0f && g[1] == 4.0f);
}

/* The reduction plan alone, for embedders that run their own collectives: ids are the
 * caller's (0 = dp, 1 = ep, 2 = efsdp here). */
static void test_norm_plan(void) {
  const uint32_t ep[1] = {1};
  const int32_t shard[2] = {FSDPTURBO_DIM_SHARD, FSDPTURBO_DIM_SHARD};
  const uint32_t efsdp_ep[2] = {2, 1};
  const uint32_t dp[1] = {0};
  const int32_t replicate[1] = {FSDPTURBO_DIM_REPLICATE};
  fsdpturbo_grad_t grads[4];
  grads[0] = grad_of(NULL, 0, FSDPTURBO_DTYPE_F32, efsdp_ep, shard, 2);
  grads[1] = grad_of(NULL, 0, FSDPTURBO_DTYPE_F32, NULL, NULL, 0);
  grads[2] = grad_of(NULL, 0, FSDPTURBO_DTYPE_F32, ep, shard, 1);
  grads[3] = grad_of(NULL, 0, FSDPTURBO_DTYPE_F32, dp, replicate, 1);
  size_t grad_set[4], ends[4], n_sets = 0, n_dims = 0;
  uint32_t dims[5];
  CHECK_STATUS(fsdpturbo_norm_plan(grads, 4, grad_set, ends, 4, &n_sets, dims, 5, &n_dims), FSDPTURBO_OK);
  CHECK(n_sets == 3 && n_dims == 3);
  CHECK(ends[0] == 2 && dims[0] == 1 && dims[1] == 2); /* sorted ids */
  CHECK(ends[1] == 2);                                 /* the empty set */
  CHECK(ends[2] == 3 && dims[2] == 1);
  CHECK(grad_set[0] == 0 && grad_set[1] == 1 && grad_set[2] == 2 && grad_set[3] == 1);
  CHECK_STATUS(fsdpturbo_norm_plan(grads, 4, grad_set, ends, 2, &n_sets, dims, 5, &n_dims),
               FSDPTURBO_ERR_BUFFER_TOO_SMALL);
  CHECK(n_sets == 3);
}

int main(void) {
  test_local_power_sum();
  test_clip_two_ranks();
  test_clip_nonfinite();
  test_scale_in_place();
  test_options_init();
  test_misuse();
  test_norm_plan();
  return check_summary("test_norm");
}
