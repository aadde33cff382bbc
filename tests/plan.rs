//! Model specs, module trees (checked against Hugging Face's own named_modules/named_parameters)
//! and plan resolution.

use fsdpturbo::config::DistConfig;
use fsdpturbo::error::ErrorKind;
use fsdpturbo::plan::{self, MAX_EXPERTS, ParamRole, PlanInput};
use fsdpturbo::spec::{MAX_LAYERS, MAX_SIZE, ModelSpec, ModelTree, SpecRegistry, model_tree_from_config};
use fsdpturbo::topology::{Topology, TopologySpec};
use serde_json::{Value, json};

fn hf_fixture(name: &str) -> Value {
    let path = format!("{}/tests/data/hf_trees/{name}.json", env!("CARGO_MANIFEST_DIR"));
    serde_json::from_str(&std::fs::read_to_string(path).expect("fixture exists")).expect("fixture is JSON")
}

fn tree_of(name: &str) -> ModelTree {
    model_tree_from_config(&hf_fixture(name)["config"]).expect("tree builds")
}

#[test]
fn builtin_specs_match_the_seed() {
    let registry = SpecRegistry::with_builtins();
    let qwen35 = registry.get("qwen3_5_moe").unwrap();
    assert_eq!(qwen35.ep_modules, ["model.language_model.layers.{*}.mlp.experts"]);
    assert_eq!(qwen35.efsdp_modules(), ["model.language_model.layers.{*}.mlp"]);
    let qwen3 = registry.get("qwen3_moe").unwrap();
    assert_eq!(qwen3.ep_modules, ["model.layers.{*}.mlp.experts"]);
    assert_eq!(qwen3.efsdp_modules(), ["model.layers.{*}.mlp"]);
    assert_eq!(registry.model_types(), ["qwen3_5_moe", "qwen3_5_moe_text", "qwen3_moe"]);
}

#[test]
fn unregistered_model_type_names_the_registered_ones() {
    let err = SpecRegistry::with_builtins().get("llama").unwrap_err();
    assert_eq!(err.kind, ErrorKind::Plan);
    assert_eq!(
        err.message,
        "No FSDPTurbo EP spec is registered for model_type=llama. Registered: [qwen3_5_moe, qwen3_5_moe_text, qwen3_moe]"
    );
}

#[test]
fn user_specs_register_and_replace() {
    let mut registry = SpecRegistry::with_builtins();
    assert!(registry.register(ModelSpec::new("my_moe", &["blocks.{*}.moe.experts"], None)).is_none());
    assert_eq!(registry.get("my_moe").unwrap().efsdp_modules(), ["blocks.{*}.moe"]);
    let previous = registry.register(ModelSpec::new("my_moe", &["blocks.{*}.ffn"], None)).unwrap();
    assert_eq!(previous.ep_modules, ["blocks.{*}.moe.experts"]);
    // Without a `.experts` suffix the EFSDP pattern is the EP pattern itself (seed).
    assert_eq!(registry.get("my_moe").unwrap().efsdp_modules(), ["blocks.{*}.ffn"]);
}

/// The module tree built from config values equals the one transformers builds
/// (tests/data/hf_trees/generate.py), module for module and shape for shape.
#[test]
fn module_trees_equal_hugging_face() {
    for name in ["qwen3_moe", "qwen3_5_moe"] {
        let fixture = hf_fixture(name);
        let tree = tree_of(name);
        let modules: Vec<&str> =
            fixture["modules"].as_array().unwrap().iter().map(|m| m.as_str().unwrap()).collect();
        assert_eq!(tree.modules, modules, "{name}: modules");
        let params: Vec<(String, Vec<u64>)> = fixture["params"]
            .as_array()
            .unwrap()
            .iter()
            .map(|p| (p[0].as_str().unwrap().to_string(), serde_json::from_value(p[1].clone()).unwrap()))
            .collect();
        let ours: Vec<(String, Vec<u64>)> =
            tree.params.iter().map(|p| (p.name.clone(), p.shape.clone())).collect();
        assert_eq!(ours, params, "{name}: parameters");
    }
}

#[test]
fn tree_errors_name_the_missing_or_bad_key() {
    let err = model_tree_from_config(&json!({"model_type": "qwen3_moe", "hidden_size": 8})).unwrap_err();
    assert!(err.message.contains("`num_attention_heads` is missing"), "{}", err.message);
    let err = model_tree_from_config(&json!({"model_type": "qwen3_moe", "hidden_size": "big"})).unwrap_err();
    assert!(err.message.contains("`hidden_size` must be a non-negative integer"), "{}", err.message);
    let err = model_tree_from_config(&json!({"model_type": "gpt2"})).unwrap_err();
    assert!(err.message.contains("no module-tree builder for model_type=gpt2"), "{}", err.message);
    let err = model_tree_from_config(&json!({"hidden_size": 8})).unwrap_err();
    assert!(err.message.contains("`model_type` is missing"), "{}", err.message);
    let mut values = hf_fixture("qwen3_5_moe")["config"].clone();
    values["text_config"]["layer_types"] = json!(["linear_attention"]);
    let err = model_tree_from_config(&values).unwrap_err();
    assert!(
        err.message.contains("`text_config.layer_types` has 1 entries but num_hidden_layers is 2"),
        "{}",
        err.message
    );
}

/// A small config.json cannot make the tree builder allocate without bound: layers, experts
/// and sizes are capped, each an error naming the limit (10^8 layers once aborted the process).
#[test]
fn tree_inputs_beyond_the_limits_are_errors() {
    let base = hf_fixture("qwen3_moe")["config"].clone();
    for (key, value, limit) in [
        ("num_hidden_layers", 100_000_000u64, format!("more than the limit of {MAX_LAYERS} layers")),
        ("num_experts", 1_000_000_000, format!("more than the limit of {MAX_EXPERTS} experts")),
        ("hidden_size", 1 << 40, format!("more than the limit of {MAX_SIZE} for a size")),
        ("vocab_size", u64::MAX, format!("more than the limit of {MAX_SIZE} for a size")),
    ] {
        let mut config = base.clone();
        config[key] = json!(value);
        let started = std::time::Instant::now();
        let err = model_tree_from_config(&config).unwrap_err();
        assert_eq!(err.message, format!("config.json: `{key}` is {value}, {limit}"));
        assert!(started.elapsed().as_secs_f64() < 1.0, "{key}: refused only after {:?}", started.elapsed());
    }
    let mut config = base.clone();
    config["num_hidden_layers"] = json!(MAX_LAYERS);
    config["mlp_only_layers"] = json!((0..MAX_LAYERS).step_by(2).collect::<Vec<_>>());
    assert_eq!(
        model_tree_from_config(&config).unwrap().modules.iter().filter(|m| m.ends_with(".mlp")).count(),
        MAX_LAYERS as usize
    );
}

#[test]
fn more_experts_than_the_limit_is_a_plan_error() {
    let mut tree = tree_of("qwen3_moe");
    for param in tree.params.iter_mut().filter(|p| p.name.contains(".experts.")) {
        param.shape[0] = MAX_EXPERTS + 1;
    }
    let err = resolve(&tree, &DistConfig { ep_size: 4, ..DistConfig::default() }, &topology(16, 2, 4, None))
        .unwrap_err();
    assert!(
        err.message
            .contains(&format!("has {} experts, more than the limit of {MAX_EXPERTS}", MAX_EXPERTS + 1)),
        "{}",
        err.message
    );
}

fn topology(world: u64, cp: u64, ep: u64, efsdp: Option<u64>) -> Topology {
    Topology::new(&TopologySpec {
        world_size: world,
        cp_size: cp,
        ep_size: ep,
        efsdp_size: efsdp,
        ..TopologySpec::default()
    })
    .expect("valid topology")
}

fn resolve(tree: &ModelTree, dist: &DistConfig, topology: &Topology) -> fsdpturbo::error::Result<plan::Plan> {
    let registry = SpecRegistry::with_builtins();
    let spec = registry.get(&tree.model_type)?;
    plan::resolve(&PlanInput { tree, spec, dist, topology, bf16: true })
}

#[test]
fn qwen3_moe_plan_under_ep_and_efsdp() {
    let tree = tree_of("qwen3_moe"); // 3 layers, layer 1 dense, 8 experts
    let dist = DistConfig { ep_size: 4, ..DistConfig::default() };
    let topo = topology(16, 2, 4, None); // dp 8, expert mesh (1, 2, 4, 2)
    let plan = resolve(&tree, &dist, &topo).unwrap();

    let names: Vec<&str> = plan.ep_modules.iter().map(|m| m.name.as_str()).collect();
    assert_eq!(names, ["model.layers.0.mlp.experts", "model.layers.2.mlp.experts"]);
    assert!(plan.ep_modules.iter().all(|m| m.num_global_experts == 8 && m.num_local_experts == 2));
    assert_eq!(plan.efsdp_modules, ["model.layers.0.mlp", "model.layers.2.mlp"]);
    assert_eq!(
        plan.ignored_params(&tree),
        [
            "model.layers.0.mlp.experts.gate_up_proj",
            "model.layers.0.mlp.experts.down_proj",
            "model.layers.2.mlp.experts.gate_up_proj",
            "model.layers.2.mlp.experts.down_proj"
        ]
    );
    let role = |name: &str| plan.role(&tree, name).unwrap();
    assert_eq!(role("model.layers.0.mlp.gate.weight"), ParamRole::Dense);
    assert_eq!(role("model.layers.1.mlp.gate_proj.weight"), ParamRole::Dense);
    assert_eq!(role("model.layers.0.self_attn.q_proj.weight"), ParamRole::Dense);
    assert_eq!(role("lm_head.weight"), ParamRole::Dense);
    assert_eq!(plan.gradient_divide_factor, 16.0);
    assert_eq!(plan.seed_gradient_divide_factor, Some(8.0));
    assert_eq!(
        plan.warnings,
        [
            "model.layers.1.mlp matches the EFSDP pattern but holds no EP module; it stays with the outer FSDP2"
        ]
    );

    // Rank 10 = 8·efsdp_i + 2·ep_i + cp_i → efsdp 1, ep 1, cp 0: experts 2 and 3.
    let rank = plan::rank_plan(&plan, &tree, &topo, true, 10).unwrap();
    assert_eq!(rank.ep_rank, 1);
    assert_eq!(rank.local_expert_indices, [2, 3]);
    assert_eq!(rank.expert_ids_per_ep_rank, [0, 1, 0, 1, 0, 1, 0, 1]);
    assert_eq!(plan::expert_owners(&plan, &topo), [(0, 2), (2, 4), (4, 6), (6, 8)]);
}

/// Memory of one rank, computed by hand from the torch.chunk rule for the tiny model.
#[test]
fn memory_follows_the_layouts() {
    let tree = tree_of("qwen3_moe");
    let dist = DistConfig { ep_size: 2, ..DistConfig::default() };
    let topo = topology(4, 1, 2, None); // dp 4, ep 2, efsdp 2
    let plan = resolve(&tree, &dist, &topo).unwrap();
    let rank = plan::rank_plan(&plan, &tree, &topo, true, 3).unwrap(); // dp 3, ep 1, efsdp 1
    let mut expected = 0u64;
    let chunk = |n: u64, parts: u64, i: u64| {
        let size = n.div_ceil(parts);
        n.saturating_sub(size * i).min(size)
    };
    for p in &tree.params {
        let s = &p.shape;
        let rest: u64 = s.iter().skip(1).product();
        expected += if p.name.contains(".mlp.experts.") {
            // Shard(0) over ep (8 → 4 experts), then Shard(1) over efsdp.
            let (e, d1) = (chunk(s[0], 2, 1), chunk(s[1], 2, 1));
            e * d1 * s[2]
        } else {
            chunk(s[0], 4, 3) * rest // outer FSDP2 (the router too): Shard(0) over dp
        };
    }
    assert_eq!(rank.memory.param_elements, expected);
    assert_eq!(rank.memory.param_bytes, 2 * expected);
    assert_eq!(rank.memory.total_bytes, 8 * expected);
}

#[test]
fn experts_equal_to_ep_get_ids_too() {
    let tree = tree_of("qwen3_moe");
    let dist = DistConfig { ep_size: 8, ..DistConfig::default() };
    let topo = topology(8, 1, 8, None);
    let plan = resolve(&tree, &dist, &topo).unwrap();
    let rank = plan::rank_plan(&plan, &tree, &topo, true, 5).unwrap();
    assert_eq!(rank.local_expert_indices, [5]);
    assert_eq!(rank.expert_ids_per_ep_rank, [0; 8]);
    assert!(plan.efsdp_modules.is_empty(), "efsdp = 1: no EFSDP units");
    assert_eq!(plan.seed_gradient_divide_factor, None);
}

#[test]
fn plan_errors_carry_the_seed_texts() {
    let tree = tree_of("qwen3_moe");
    let dist = DistConfig { ep_size: 16, ..DistConfig::default() };
    let err = resolve(&tree, &dist, &topology(16, 1, 16, None)).unwrap_err();
    assert_eq!(err.message, "Number of experts(8) is not divisible by ep size(16).");

    let other = ModelTree { model_type: "qwen3_moe".into(), ..tree_of("qwen3_5_moe") };
    let dist = DistConfig { ep_size: 2, ..DistConfig::default() };
    let err = resolve(&other, &dist, &topology(4, 1, 2, None)).unwrap_err();
    assert!(
        err.message.starts_with("[Expert Parallel] No module named ['model.layers.{*}.mlp.experts']"),
        "{}",
        err.message
    );

    let dist = DistConfig { ep_size: 2, hook_modules: vec!["nothing.here".into()], ..DistConfig::default() };
    let err = resolve(&tree, &dist, &topology(4, 1, 2, None)).unwrap_err();
    assert_eq!(err.message, "[FSDP2] No module named ['nothing.here'].");
    // Names print as Python's repr of the list: quotes and control characters escaped.
    let dist =
        DistConfig { ep_size: 2, hook_modules: vec!["it's".into(), "a\nb".into()], ..DistConfig::default() };
    let err = resolve(&tree, &dist, &topology(4, 1, 2, None)).unwrap_err();
    assert_eq!(err.message, r#"[FSDP2] No module named ["it's", 'a\nb']."#);

    let dist = DistConfig { ep_size: 2, fsdp_ignored_modules: vec!["{1,2}".into()], ..DistConfig::default() };
    let err = resolve(&tree, &dist, &topology(4, 1, 2, None)).unwrap_err();
    assert!(err.message.starts_with("dist_config.fsdp_ignored_modules"), "{}", err.message);
    assert!(err.message.contains("Unrecognized brace pattern: 1,2"), "{}", err.message);
}

#[test]
fn hook_modules_are_found_in_post_order() {
    let tree = tree_of("qwen3_moe");
    let dist = DistConfig {
        ep_size: 2,
        hook_modules: vec!["model.layers.{*}".into(), "model".into()],
        ..DistConfig::default()
    };
    let plan = resolve(&tree, &dist, &topology(4, 1, 2, None)).unwrap();
    assert_eq!(plan.hook_modules, ["model.layers.0", "model.layers.1", "model.layers.2", "model"]);
}

#[test]
fn ignored_modules_and_unmatched_patterns() {
    let tree = tree_of("qwen3_moe");
    let dist = DistConfig {
        ep_size: 2,
        fsdp_ignored_modules: vec!["lm_head".into(), "model.vision.*".into()],
        ..DistConfig::default()
    };
    let plan = resolve(&tree, &dist, &topology(4, 1, 2, None)).unwrap();
    assert!(plan.ignored_params(&tree).contains(&"lm_head.weight"));
    assert_eq!(plan.role(&tree, "lm_head.weight"), Some(ParamRole::Ignored));
    assert!(plan.warnings.contains(
        &"dist_config.fsdp_ignored_modules pattern \"model.vision.*\" matches no module".to_string()
    ));
}

#[test]
fn without_ep_everything_is_dense() {
    let tree = tree_of("qwen3_moe");
    let plan = resolve(&tree, &DistConfig::default(), &topology(4, 1, 1, None)).unwrap();
    assert!(plan.ep_modules.is_empty() && plan.ignored_params(&tree).is_empty());
    assert!(plan.roles.iter().all(|&role| role == ParamRole::Dense));
}

#[test]
fn module_list_experts_are_counted_by_children() {
    let mut tree = ModelTree { model_type: "qwen3_moe".into(), ..ModelTree::default() };
    tree.modules = vec!["".into(), "model".into(), "model.layers".into(), "model.layers.0".into()];
    tree.modules.push("model.layers.0.mlp".into());
    tree.modules.push("model.layers.0.mlp.experts".into());
    for e in 0..6 {
        tree.modules.push(format!("model.layers.0.mlp.experts.{e}"));
        tree.modules.push(format!("model.layers.0.mlp.experts.{e}.w1"));
        tree.params.push(fsdpturbo::spec::ParamInfo {
            name: format!("model.layers.0.mlp.experts.{e}.w1.weight"),
            shape: vec![4, 2],
        });
    }
    let dist = DistConfig { ep_size: 3, ..DistConfig::default() };
    let plan = resolve(&tree, &dist, &topology(3, 1, 3, None)).unwrap();
    assert_eq!(plan.ep_modules[0].num_global_experts, 6);
    assert_eq!(plan.ep_modules[0].num_local_experts, 2);
}
