/* Shard-on-read loading through the header, as a C++ trainer does it: write a safetensors file
 * with per-expert weights, read its header (8 bytes, then the size the library asks for),
 * plan each rank's reads of the fused gate_up [E, 2I, H] tensor (Shard(0) over experts x
 * Shard(1) inside each expert) and of a plain tensor, read them with fread at the planned
 * offsets, and compare with the slice of the full tensor; then the errors a trainer meets. */
#include <stdint.h>
#include <stdlib.h>

#include "check.h"

#define E 3
#define I 2
#define H 5

static const fsdpturbo_placement_t SHARD0 = {FSDPTURBO_PLACEMENT_SHARD, 0, 0};
static const fsdpturbo_placement_t SHARD1 = {FSDPTURBO_PLACEMENT_SHARD, 1, 0};

/* Writes `path`: experts.{e}.gate_proj.weight and .up_proj.weight [I, H] F32 (value =
 * 1000 e + 100 part + row-major index), then w [4, 3] F32 (value = index). Returns the file size. */
static long write_file(const char *path) {
  char json[4096];
  size_t n = 0;
  uint64_t at = 0, part = (uint64_t)I * H * 4;
  n += (size_t)snprintf(json + n, sizeof json - n, "{");
  for (int e = 0; e < E; ++e) {
    const char *parts[2] = {"gate_proj", "up_proj"};
    for (int p = 0; p < 2; ++p) {
      n += (size_t)snprintf(json + n, sizeof json - n,
                            "\"experts.%d.%s.weight\":{\"dtype\":\"F32\",\"shape\":[%d,%d],\"data_offsets\":[%llu,%llu]},",
                            e, parts[p], I, H, (unsigned long long)at, (unsigned long long)(at + part));
      at += part;
    }
  }
  n += (size_t)snprintf(json + n, sizeof json - n,
                        "\"w\":{\"dtype\":\"F32\",\"shape\":[4,3],\"data_offsets\":[%llu,%llu]}}",
                        (unsigned long long)at, (unsigned long long)(at + 48));
  FILE *f = fopen(path, "wb");
  if (!f) return -1;
  uint64_t len = n;
  unsigned char le[8];
  for (int b = 0; b < 8; ++b) le[b] = (unsigned char)(len >> (8 * b));
  fwrite(le, 1, 8, f);
  fwrite(json, 1, n, f);
  for (int e = 0; e < E; ++e)
    for (int p = 0; p < 2; ++p)
      for (int k = 0; k < I * H; ++k) {
        float v = (float)(1000 * e + 100 * p + k);
        fwrite(&v, 4, 1, f);
      }
  for (int k = 0; k < 12; ++k) {
    float v = (float)k;
    fwrite(&v, 4, 1, f);
  }
  long size = ftell(f);
  fclose(f);
  return size;
}

/* Reads the header of `path` and parses it. */
static fsdpturbo_safetensors_t *open_header(const char *path, uint64_t file_size) {
  FILE *f = fopen(path, "rb");
  unsigned char prefix[8];
  CHECK(f != NULL && fread(prefix, 1, 8, f) == 8);
  uint64_t need = 0;
  CHECK_STATUS(fsdpturbo_safetensors_header_size(prefix, 8, &need), FSDPTURBO_OK);
  unsigned char *bytes = malloc(need);
  rewind(f);
  CHECK(fread(bytes, 1, need, f) == need);
  fclose(f);
  fsdpturbo_safetensors_t *h = NULL;
  CHECK_STATUS(fsdpturbo_safetensors_parse(bytes, need, file_size, &h), FSDPTURBO_OK);
  free(bytes);
  return h;
}

/* Runs a plan: reads every range of `path` into a buffer of the plan's local bytes. */
static float *read_local(const char *path, const fsdpturbo_read_plan_t *plan, uint64_t *out_numel) {
  size_t n = 0;
  CHECK_STATUS(fsdpturbo_read_plan_ranges(plan, NULL, 0, &n), n ? FSDPTURBO_ERR_BUFFER_TOO_SMALL : FSDPTURBO_OK);
  fsdpturbo_byte_range_t *ranges = calloc(n ? n : 1, sizeof *ranges);
  CHECK_STATUS(fsdpturbo_read_plan_ranges(plan, ranges, n, &n), FSDPTURBO_OK);
  uint64_t bytes = 0;
  CHECK_STATUS(fsdpturbo_read_plan_local_bytes(plan, &bytes), FSDPTURBO_OK);
  unsigned char *local = calloc(bytes ? bytes : 1, 1);
  FILE *f = fopen(path, "rb");
  uint64_t filled = 0;
  for (size_t r = 0; r < n; ++r) {
    CHECK(ranges[r].file == 0 && ranges[r].dst_offset == filled);
    CHECK(fseek(f, (long)ranges[r].offset, SEEK_SET) == 0);
    CHECK(fread(local + ranges[r].dst_offset, 1, ranges[r].length, f) == ranges[r].length);
    filled += ranges[r].length;
  }
  CHECK(filled == bytes);
  fclose(f);
  free(ranges);
  *out_numel = bytes / 4;
  return (float *)local;
}

static void test_per_expert_slices(const char *path, fsdpturbo_safetensors_t *h) {
  char name_buf[E * 2][64];
  const char *names[E * 2];
  for (int e = 0; e < E; ++e) {
    snprintf(name_buf[2 * e], 64, "experts.%d.gate_proj.weight", e);
    snprintf(name_buf[2 * e + 1], 64, "experts.%d.up_proj.weight", e);
    names[2 * e] = name_buf[2 * e];
    names[2 * e + 1] = name_buf[2 * e + 1];
  }
  const fsdpturbo_safetensors_t *files[1] = {h};
  uint64_t shape[3] = {E, 2 * I, H}, mesh[2] = {2, 2};
  fsdpturbo_placement_t placements[2] = {SHARD0, SHARD1};
  for (uint64_t rank = 0; rank < 4; ++rank) {
    fsdpturbo_read_plan_t *plan = NULL;
    CHECK_STATUS(fsdpturbo_safetensors_read_plan_new(files, 1, names, E * 2, 2, shape, 3, mesh, 2, placements, rank,
                                                     &plan),
                 FSDPTURBO_OK);
    /* The oracle: the same slice by the element copy plan of the full tensor. */
    uint64_t coord[2] = {rank / 2, rank % 2};
    uint64_t local_shape[3] = {0}, offset[3] = {0};
    CHECK_STATUS(fsdpturbo_local_shape_and_offset(shape, 3, mesh, coord, 2, placements, local_shape, offset),
                 FSDPTURBO_OK);
    uint64_t got_shape[3] = {0};
    size_t ndim = 0;
    CHECK_STATUS(fsdpturbo_read_plan_local_shape(plan, got_shape, 3, &ndim), FSDPTURBO_OK);
    CHECK(ndim == 3 && memcmp(got_shape, local_shape, sizeof got_shape) == 0);
    uint64_t numel = 0;
    float *local = read_local(path, plan, &numel);
    CHECK(numel == local_shape[0] * local_shape[1] * local_shape[2]);
    uint64_t k = 0;
    for (uint64_t e = 0; e < local_shape[0]; ++e)
      for (uint64_t r = 0; r < local_shape[1]; ++r)
        for (uint64_t c = 0; c < H; ++c, ++k) {
          uint64_t ge = offset[0] + e, gr = offset[1] + r;
          float want = (float)(1000 * ge + 100 * (gr / I) + (gr % I) * H + c);
          CHECK(local[k] == want);
        }
    free(local);
    fsdpturbo_read_plan_free(plan);
  }
}

static void test_plain_tensor_and_errors(const char *path, fsdpturbo_safetensors_t *h) {
  const fsdpturbo_safetensors_t *files[1] = {h};
  const char *w[1] = {"w"};
  uint64_t shape[2] = {4, 3}, mesh[1] = {3};
  fsdpturbo_read_plan_t *plan = NULL;
  /* 4 rows over 3 ranks: 2, 2, 0 (torch.chunk); rank 2's shard is empty, with no reads. */
  for (uint64_t rank = 0; rank < 3; ++rank) {
    CHECK_STATUS(fsdpturbo_safetensors_read_plan_new(files, 1, w, 1, 0, shape, 2, mesh, 1, &SHARD0, rank, &plan),
                 FSDPTURBO_OK);
    uint64_t numel = 0;
    float *local = read_local(path, plan, &numel);
    CHECK(numel == (rank < 2 ? 6u : 0u));
    for (uint64_t k = 0; k < numel; ++k) CHECK(local[k] == (float)(6 * rank + k));
    free(local);
    char dtype[8];
    size_t len = 0;
    CHECK_STATUS(fsdpturbo_read_plan_dtype(plan, dtype, sizeof dtype, &len), FSDPTURBO_OK);
    CHECK(strcmp(dtype, "F32") == 0 && len == 4);
    fsdpturbo_read_plan_free(plan);
  }
  /* A wrong shape, a missing name, a rank outside the mesh: clear errors naming the tensor. */
  uint64_t wrong[2] = {3, 4};
  plan = NULL;
  CHECK_STATUS(fsdpturbo_safetensors_read_plan_new(files, 1, w, 1, 0, wrong, 2, mesh, 1, &SHARD0, 0, &plan),
               FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(plan == NULL && last_error_contains("tensor `w`: its shape is [4, 3]"));
  const char *missing[1] = {"experts.9.gate_proj.weight"};
  CHECK_STATUS(fsdpturbo_safetensors_read_plan_new(files, 1, missing, 1, 0, shape, 2, mesh, 1, &SHARD0, 0, &plan),
               FSDPTURBO_ERR_NOT_FOUND);
  CHECK(last_error_contains("experts.9.gate_proj.weight"));
  CHECK_STATUS(fsdpturbo_safetensors_read_plan_new(files, 1, w, 1, 0, shape, 2, mesh, 1, &SHARD0, 3, &plan),
               FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("`rank` is 3"));
  CHECK_STATUS(fsdpturbo_safetensors_read_plan_new(NULL, 1, w, 1, 0, shape, 2, mesh, 1, &SHARD0, 0, &plan),
               FSDPTURBO_ERR_NULL_ARGUMENT);
}

static void test_truncated(const char *path, long size) {
  /* The same header with a file one byte short: the last tensor runs past the end. */
  FILE *f = fopen(path, "rb");
  unsigned char *bytes = malloc((size_t)size);
  CHECK(fread(bytes, 1, (size_t)size, f) == (size_t)size);
  fclose(f);
  fsdpturbo_safetensors_t *h = NULL;
  CHECK_STATUS(fsdpturbo_safetensors_parse(bytes, (size_t)size, (uint64_t)size - 1, &h), FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(h == NULL && last_error_contains("tensor `w`") && last_error_contains("truncated"));
  bytes[8] = '[';
  CHECK_STATUS(fsdpturbo_safetensors_parse(bytes, (size_t)size, 0, &h), FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("not a valid JSON object"));
  free(bytes);
}

int main(int argc, char **argv) {
  /* One file per executable (the shared and static builds may run at once). */
  const char *exe = argc > 0 ? strrchr(argv[0], '/') : NULL;
  exe = exe ? exe + 1 : (argc > 0 ? argv[0] : "test");
  char path[512];
  const char *tmp = getenv("TMPDIR");
  snprintf(path, sizeof path, "%s/fsdpturbo_%s.safetensors", tmp ? tmp : "/tmp", exe);
  long size = write_file(path);
  CHECK(size > 0);
  fsdpturbo_safetensors_t *h = open_header(path, (uint64_t)size);
  test_per_expert_slices(path, h);
  test_plain_tensor_and_errors(path, h);
  test_truncated(path, size);
  fsdpturbo_safetensors_free(h);
  fsdpturbo_safetensors_free(NULL);
  remove(path);
  return check_summary("test_safetensors");
}
