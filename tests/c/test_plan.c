/* A full round trip through the header: config → topology → state → plan, plus misuse. */
#include <stdlib.h>

#include "check.h"

static const char *CONFIG_YAML =
    "bf16: true\n"
    "cp_size: 2\n"
    "dist_config:\n"
    "  name: fsdpturbo\n"
    "  ep_size: 4\n"
    "  ep_dispatcher: fused\n";

/* A tiny Qwen3-MoE (2 layers, 8 experts) as its HF config.json. */
static const char *MODEL_JSON =
    "{\"model_type\": \"qwen3_moe\", \"vocab_size\": 128, \"hidden_size\": 64,"
    " \"intermediate_size\": 96, \"moe_intermediate_size\": 24, \"num_hidden_layers\": 2,"
    " \"num_attention_heads\": 4, \"num_key_value_heads\": 2, \"head_dim\": 16,"
    " \"num_experts\": 8, \"num_experts_per_tok\": 2}";

static fsdpturbo_config_t *parse(const char *yaml) {
  fsdpturbo_config_t *config = NULL;
  CHECK_STATUS(fsdpturbo_config_parse(yaml, strlen(yaml), &config), FSDPTURBO_OK);
  return config;
}

static fsdpturbo_topology_t *topology_for(const fsdpturbo_config_t *config, uint64_t world) {
  fsdpturbo_topology_t *topology = NULL;
  CHECK_STATUS(fsdpturbo_topology_from_config(config, world, &topology), FSDPTURBO_OK);
  return topology;
}

static void test_round_trip(void) {
  fsdpturbo_config_t *config = parse(CONFIG_YAML);
  int32_t dispatcher = -1;
  CHECK_STATUS(fsdpturbo_config_dispatcher(config, &dispatcher), FSDPTURBO_OK);
  CHECK(dispatcher == FSDPTURBO_DISPATCHER_FUSED);

  /* The seed's validated layout: world 16, cp 2, ep 4 → expert mesh (1, 2, 4, 2). */
  fsdpturbo_topology_t *topology = topology_for(config, 16);
  uint64_t shape[4] = {0};
  size_t n = 0;
  CHECK_STATUS(fsdpturbo_topology_mesh_shape(topology, FSDPTURBO_MESH_EXPERT, shape, 4, &n), FSDPTURBO_OK);
  CHECK(n == 4 && shape[0] == 1 && shape[1] == 2 && shape[2] == 4 && shape[3] == 2);
  uint64_t members[16] = {0};
  CHECK_STATUS(fsdpturbo_topology_group(topology, FSDPTURBO_MESH_EXPERT, "ep", 3, members, 16, &n), FSDPTURBO_OK);
  CHECK(n == 4 && members[0] == 1 && members[1] == 3 && members[2] == 5 && members[3] == 7);
  CHECK_STATUS(fsdpturbo_topology_group(topology, FSDPTURBO_MESH_EXPERT, "efsdp", 3, members, 16, &n), FSDPTURBO_OK);
  CHECK(n == 2 && members[0] == 3 && members[1] == 11);

  /* Global state: idempotent with the same topology, the seed's error with another. */
  fsdpturbo_state_reset();
  CHECK_STATUS(fsdpturbo_state_initialize(topology), FSDPTURBO_OK);
  CHECK_STATUS(fsdpturbo_state_initialize(topology), FSDPTURBO_OK);
  fsdpturbo_config_t *other_config = parse("dist_config:\n  name: fsdpturbo\n  ep_size: 2\n");
  fsdpturbo_topology_t *other = topology_for(other_config, 16);
  CHECK_STATUS(fsdpturbo_state_initialize(other), FSDPTURBO_ERR_STATE);
  CHECK(last_error_contains("FSDPTurbo parallel state is already initialized with (8, 2, 4), got (16, 1, 2)."));
  fsdpturbo_state_reset();

  /* The plan of a built-in family from its config.json. */
  fsdpturbo_plan_t *plan = NULL;
  CHECK_STATUS(fsdpturbo_plan_resolve_hf(MODEL_JSON, config, topology, &plan), FSDPTURBO_OK);
  size_t modules = 0;
  CHECK_STATUS(fsdpturbo_plan_num_ep_modules(plan, &modules), FSDPTURBO_OK);
  CHECK(modules == 2);
  char name[128];
  size_t name_len = 0;
  uint64_t global = 0, local = 0;
  CHECK_STATUS(fsdpturbo_plan_ep_module(plan, 1, name, sizeof name, &name_len, &global, &local), FSDPTURBO_OK);
  CHECK(strcmp(name, "model.layers.1.mlp.experts") == 0 && name_len == strlen(name) + 1);
  CHECK(global == 8 && local == 2);
  uint64_t experts[8] = {0};
  CHECK_STATUS(fsdpturbo_plan_local_experts(plan, 3, experts, 8, &n), FSDPTURBO_OK);
  CHECK(n == 2 && experts[0] == 2 && experts[1] == 3); /* rank 3 is ep rank 1 */
  int32_t role = -1;
  CHECK_STATUS(fsdpturbo_plan_param_role(plan, "model.layers.0.mlp.experts.gate_up_proj", &role), FSDPTURBO_OK);
  CHECK(role == FSDPTURBO_PARAM_EXPERT);
  CHECK_STATUS(fsdpturbo_plan_param_role(plan, "model.layers.0.mlp.gate.weight", &role), FSDPTURBO_OK);
  CHECK(role == FSDPTURBO_PARAM_DENSE); /* the router belongs to the outer FSDP2 */
  CHECK_STATUS(fsdpturbo_plan_param_role(plan, "lm_head.weight", &role), FSDPTURBO_OK);
  CHECK(role == FSDPTURBO_PARAM_DENSE);
  CHECK_STATUS(fsdpturbo_plan_param_role(plan, "no.such.param", &role), FSDPTURBO_ERR_INVALID_ARGUMENT);
  double factor = 0;
  CHECK_STATUS(fsdpturbo_plan_gradient_divide_factor(plan, &factor), FSDPTURBO_OK);
  CHECK(factor == 16.0);
  fsdpturbo_memory_t memory;
  CHECK_STATUS(fsdpturbo_plan_memory(plan, 3, &memory), FSDPTURBO_OK);
  CHECK(memory.param_bytes == 2 * memory.param_elements && memory.total_bytes == 4 * memory.param_bytes);

  /* JSON: ask for the size, then fetch. */
  size_t json_len = 0;
  CHECK_STATUS(fsdpturbo_plan_to_json(plan, NULL, 0, &json_len), FSDPTURBO_ERR_BUFFER_TOO_SMALL);
  char *json = malloc(json_len);
  CHECK_STATUS(fsdpturbo_plan_to_json(plan, json, json_len, &json_len), FSDPTURBO_OK);
  CHECK(strstr(json, "\"ep_modules\"") != NULL && strlen(json) + 1 == json_len);
  free(json);

  fsdpturbo_plan_free(plan);
  fsdpturbo_topology_free(other);
  fsdpturbo_topology_free(topology);
  fsdpturbo_config_free(other_config);
  fsdpturbo_config_free(config);
}

/* `desc.struct_size` is read first and alone, like every versioned struct's: below the size of
 * fsdpturbo_model_desc_t (this header's version is its first) it is FSDPTURBO_ERR_STRUCT_SIZE
 * naming the argument, the struct and the sizes accepted, and nothing else is read; a newer
 * header's larger struct is accepted and its tail ignored. `desc` describes a valid model. */
static void test_model_desc_struct_size(const fsdpturbo_model_desc_t *desc, const fsdpturbo_config_t *config,
                                        const fsdpturbo_topology_t *topology) {
  const size_t full = sizeof(fsdpturbo_model_desc_t);
  const size_t short_sizes[] = {0, sizeof(size_t), full - sizeof(void *), full - 1};
  char expected[256];
  for (size_t i = 0; i < sizeof short_sizes / sizeof short_sizes[0]; ++i) {
    fsdpturbo_model_desc_t small = *desc;
    small.struct_size = short_sizes[i];
    fsdpturbo_plan_t *plan = (fsdpturbo_plan_t *)&small; /* must be left alone on failure */
    CHECK_STATUS(fsdpturbo_plan_resolve(&small, config, topology, &plan), FSDPTURBO_ERR_STRUCT_SIZE);
    CHECK(plan == (fsdpturbo_plan_t *)&small);
    snprintf(expected, sizeof expected,
             "argument `desc` (fsdpturbo_model_desc_t) has struct_size %zu; this library accepts %zu (the "
             "first version's size) or more (a newer header's): initialise it with FSDPTURBO_MODEL_DESC_INIT",
             short_sizes[i], full);
    CHECK(last_error_contains(expected));
  }

  /* A caller whose struct holds nothing but struct_size: only those bytes exist, and only they
   * are read (a read past them shows under ASan or valgrind). */
  size_t *only_size = malloc(sizeof *only_size);
  CHECK(only_size != NULL);
  if (only_size != NULL) {
    *only_size = sizeof *only_size;
    fsdpturbo_plan_t *plan = NULL;
    CHECK_STATUS(fsdpturbo_plan_resolve((const fsdpturbo_model_desc_t *)(void *)only_size, config, topology, &plan),
                 FSDPTURBO_ERR_STRUCT_SIZE);
    CHECK(plan == NULL);
    snprintf(expected, sizeof expected, "has struct_size %zu;", sizeof *only_size);
    CHECK(last_error_contains(expected));
    free(only_size);
  }

  /* A newer header's struct: larger, with fields this library does not know. */
  struct {
    fsdpturbo_model_desc_t v1;
    uint64_t future[3];
  } newer;
  newer.v1 = *desc;
  newer.v1.struct_size = sizeof newer;
  newer.future[0] = newer.future[1] = newer.future[2] = UINT64_MAX;
  fsdpturbo_plan_t *plan = NULL;
  CHECK_STATUS(fsdpturbo_plan_resolve(&newer.v1, config, topology, &plan), FSDPTURBO_OK);
  size_t modules = 0;
  CHECK_STATUS(fsdpturbo_plan_num_ep_modules(plan, &modules), FSDPTURBO_OK);
  CHECK(modules == 1);
  fsdpturbo_plan_free(plan);
}

/* A user model registered from C, described by its module and parameter names. */
static void test_user_spec(void) {
  const char *ep[] = {"blocks.{*}.moe.experts"};
  CHECK_STATUS(fsdpturbo_spec_register("tiny_moe", ep, 1, NULL, 0), FSDPTURBO_OK);
  const char *bad[] = {"blocks.{1,2}.moe"};
  CHECK_STATUS(fsdpturbo_spec_register("bad_moe", bad, 1, NULL, 0), FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK(last_error_contains("Unrecognized brace pattern: 1,2"));

  const char *modules[] = {"", "blocks", "blocks.0", "blocks.0.attn", "blocks.0.moe", "blocks.0.moe.gate",
                           "blocks.0.moe.experts"};
  const char *params[] = {"blocks.0.attn.weight", "blocks.0.moe.gate.weight", "blocks.0.moe.experts.w_in",
                          "blocks.0.moe.experts.w_out"};
  size_t ndims[] = {2, 2, 3, 3};
  uint64_t shapes[] = {16, 16, 4, 16, 4, 32, 16, 4, 16, 32};
  fsdpturbo_model_desc_t desc = FSDPTURBO_MODEL_DESC_INIT;
  desc.model_type = "tiny_moe";
  desc.module_names = modules;
  desc.n_modules = 7;
  desc.param_names = params;
  desc.param_ndims = ndims;
  desc.param_shapes = shapes;
  desc.n_params = 4;

  fsdpturbo_config_t *config = parse("dist_config:\n  name: fsdpturbo\n  ep_size: 2\n");
  fsdpturbo_topology_t *topology = topology_for(config, 4);
  fsdpturbo_plan_t *plan = NULL;
  CHECK_STATUS(fsdpturbo_plan_resolve(&desc, config, topology, &plan), FSDPTURBO_OK);
  uint64_t ids[4] = {9, 9, 9, 9};
  size_t n = 0;
  CHECK_STATUS(fsdpturbo_plan_expert_ids_per_ep_rank(plan, ids, 4, &n), FSDPTURBO_OK);
  CHECK(n == 4 && ids[0] == 0 && ids[1] == 1 && ids[2] == 0 && ids[3] == 1);
  int32_t role = -1;
  CHECK_STATUS(fsdpturbo_plan_param_role(plan, "blocks.0.moe.experts.w_out", &role), FSDPTURBO_OK);
  CHECK(role == FSDPTURBO_PARAM_EXPERT);
  fsdpturbo_plan_free(plan);

  test_model_desc_struct_size(&desc, config, topology);

  /* 4 experts over ep 8: the seed's divisibility error. */
  fsdpturbo_config_t *wide = parse("dist_config:\n  name: fsdpturbo\n  ep_size: 8\n");
  fsdpturbo_topology_t *wide_topology = topology_for(wide, 8);
  plan = (fsdpturbo_plan_t *)&n; /* must be left alone on failure */
  CHECK_STATUS(fsdpturbo_plan_resolve(&desc, wide, wide_topology, &plan), FSDPTURBO_ERR_PLAN);
  CHECK(last_error_contains("Number of experts(4) is not divisible by ep size(8)."));

  desc.model_type = "unknown_moe";
  CHECK_STATUS(fsdpturbo_plan_resolve(&desc, config, topology, &plan), FSDPTURBO_ERR_PLAN);
  CHECK(last_error_contains("No FSDPTurbo EP spec is registered for model_type=unknown_moe."));

  fsdpturbo_topology_free(wide_topology);
  fsdpturbo_config_free(wide);
  fsdpturbo_topology_free(topology);
  fsdpturbo_config_free(config);
}

static void test_misuse(void) {
  fsdpturbo_config_t *config = NULL;
  CHECK_STATUS(fsdpturbo_config_parse(NULL, 3, &config), FSDPTURBO_ERR_NULL_ARGUMENT);
  CHECK(last_error_contains("yaml"));
  CHECK_STATUS(fsdpturbo_config_parse("a: 1", 4, NULL), FSDPTURBO_ERR_NULL_ARGUMENT);
  const char bad_utf8[] = "bf16: \xff\xfe\n";
  CHECK(fsdpturbo_config_parse(bad_utf8, sizeof bad_utf8 - 1, &config) != FSDPTURBO_OK);
  CHECK(last_error_contains("UTF-8"));
  CHECK_STATUS(fsdpturbo_config_parse("dist_config: [1\n", 16, &config), FSDPTURBO_ERR_CONFIG);

  /* A configuration whose sizes do not fit the world: the topology error, *out reset. */
  config = parse("dp_size: 4\ndist_config:\n  name: fsdpturbo\n  ep_size: 4\n");
  fsdpturbo_topology_t *from_config = (fsdpturbo_topology_t *)config;
  CHECK_STATUS(fsdpturbo_topology_from_config(config, 8, &from_config), FSDPTURBO_ERR_TOPOLOGY);
  CHECK(from_config == NULL);
  CHECK(last_error_contains("dp_size"));
  CHECK_STATUS(fsdpturbo_topology_from_config(NULL, 4, &from_config), FSDPTURBO_ERR_NULL_ARGUMENT);
  CHECK_STATUS(fsdpturbo_topology_from_config(config, 4, NULL), FSDPTURBO_ERR_NULL_ARGUMENT);
  CHECK_STATUS(fsdpturbo_topology_from_config(config, 4, &from_config), FSDPTURBO_OK);
  uint64_t dp = 0;
  CHECK_STATUS(fsdpturbo_topology_size(from_config, "dp", &dp), FSDPTURBO_OK);
  CHECK(dp == 4);
  fsdpturbo_topology_free(from_config);
  fsdpturbo_config_free(config);

  fsdpturbo_topology_options_t options = FSDPTURBO_TOPOLOGY_OPTIONS_INIT;
  fsdpturbo_topology_t *topology = NULL;
  options.struct_size = 8;
  CHECK_STATUS(fsdpturbo_topology_new(&options, &topology), FSDPTURBO_ERR_STRUCT_SIZE);
  CHECK(last_error_contains("struct_size"));
  options.struct_size = sizeof options;
  options.world_size = 12;
  options.ep_size = 8;
  CHECK_STATUS(fsdpturbo_topology_new(&options, &topology), FSDPTURBO_ERR_TOPOLOGY);
  CHECK(last_error_contains("dp_size must be divisible by ep_size, got 12 % 8 != 0."));
  options.ep_size = 4;
  CHECK_STATUS(fsdpturbo_topology_new(&options, &topology), FSDPTURBO_OK);
  uint64_t shape[4];
  size_t n = 0;
  CHECK_STATUS(fsdpturbo_topology_mesh_shape(topology, 7, shape, 4, &n), FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(fsdpturbo_topology_mesh_shape(topology, -1, shape, 4, &n), FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(fsdpturbo_topology_mesh_shape(topology, FSDPTURBO_MESH_EXPERT, shape, 2, &n),
               FSDPTURBO_ERR_BUFFER_TOO_SMALL);
  CHECK(n == 4);
  CHECK_STATUS(fsdpturbo_topology_group(topology, FSDPTURBO_MESH_EXPERT, "tp", 0, shape, 4, &n),
               FSDPTURBO_ERR_INVALID_ARGUMENT);
  CHECK_STATUS(fsdpturbo_plan_resolve_hf("{not json", NULL, topology, NULL), FSDPTURBO_ERR_NULL_ARGUMENT);
  fsdpturbo_topology_free(topology);

  /* Every free accepts NULL; the panic status still works afterwards. */
  fsdpturbo_config_free(NULL);
  fsdpturbo_topology_free(NULL);
  fsdpturbo_plan_free(NULL);
  fsdpturbo_pattern_free(NULL);
  fsdpturbo_copy_plan_free(NULL);
  CHECK_STATUS(fsdpturbo_debug_panic(), FSDPTURBO_ERR_PANIC);
}

int main(void) {
  test_round_trip();
  test_user_spec();
  test_misuse();
  return check_summary("test_plan");
}
