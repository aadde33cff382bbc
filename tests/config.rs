//! The strict training-configuration parser: every field, default, coercion and error text of
//! the seed's configuration and LlamaFactory's config tests, with paths and lines; the
//! malformed-YAML corpus under tests/data/config; and the C ABI called from Rust.

use std::ffi::c_char;
use std::path::Path;
use std::ptr;

use fsdpturbo::config::{
    AuxLossScope, CapacityOverflow, ConfigError, ConfigErrors, Dispatcher, DistConfig, FsdpImplementation,
    IncludeKernels, KernelConfig, TrainConfig, parse_dist_config, parse_kernel_config, parse_train_config,
    parse_train_config_bytes,
};
use fsdpturbo::error::{Error, ErrorKind};

mod common;

fn ok(yaml: &str) -> TrainConfig {
    parse_train_config(yaml).unwrap_or_else(|e| panic!("expected {yaml:?} to parse, got:\n{e}"))
}

fn errors(yaml: &str) -> Vec<ConfigError> {
    match parse_train_config(yaml) {
        Ok(cfg) => panic!("expected {yaml:?} to fail, got {cfg:?}"),
        Err(ConfigErrors(errors)) => errors,
    }
}

/// The single error of `yaml`.
fn error(yaml: &str) -> ConfigError {
    let mut errors = errors(yaml);
    assert_eq!(errors.len(), 1, "expected one error, got {errors:#?}");
    errors.remove(0)
}

#[track_caller]
fn assert_error(err: &ConfigError, path: &str, line: usize, message: &str) {
    assert_eq!((err.path.as_str(), err.line), (path, Some(line)), "{err}");
    assert!(err.message.contains(message), "expected {message:?} in:\n{err}");
}

fn dist(body: &str) -> DistConfig {
    ok(&format!("dist_config:\n{body}")).dist
}

fn kernel(body: &str) -> KernelConfig {
    ok(&format!("kernel_config:\n{body}")).kernel.expect("kernel_config present")
}

const EXPECTED: &str = "Expected: ['aux_loss_scope', 'capacity_factor', 'capacity_overflow', 'dcp_path', \
                        'efsdp_size', 'ep_dispatcher', 'ep_size', 'expert_bias_update_rate', 'expert_capacity', \
                        'fsdp_ignored_modules', 'fsdp_implementation', 'hook_modules', 'name', 'offload_params', \
                        'pin_memory', 'reshard_after_forward', 'router_z_loss_coef']";

// ---- defaults and fields ---------------------------------------------------------------------

#[test]
fn defaults_are_the_seeds() {
    let t = TrainConfig::default();
    assert_eq!(t.dp_size, None);
    assert_eq!(t.cp_size, 1);
    assert_eq!(t.cp_mode, "ulysses");
    assert_eq!(t.mp_replicate_size, 1);
    assert_eq!(t.mp_shard_size, None);
    assert_eq!(t.dist_timeout, 18000);
    assert!(!t.bf16);
    assert_eq!((t.dist, t.kernel), (DistConfig::default(), None));

    let d = DistConfig::default();
    assert_eq!(d.name, "fsdpturbo");
    assert!(d.reshard_after_forward);
    assert!(!d.offload_params);
    assert!(d.pin_memory);
    assert_eq!(d.dcp_path, None);
    assert_eq!(d.ep_size, 1);
    assert_eq!(d.ep_dispatcher, Dispatcher::Eager);
    assert!(d.fsdp_ignored_modules.is_empty());
    assert!(d.hook_modules.is_empty());
    assert_eq!(d.fsdp_implementation, FsdpImplementation::Native);
    assert_eq!(d.efsdp_size, None);
}

#[test]
fn a_yaml_without_our_keys_gives_the_defaults_and_leaves_the_trainers_keys_alone() {
    let yaml = "model: Qwen/Qwen3.5-35B-A3B\ndataset: [a, b]\nlearning_rate: 1.0e-5\nname: anything\n\
                template: {x: 1}\n";
    assert_eq!(ok(yaml), TrainConfig::default());
}

#[test]
fn every_top_level_field() {
    let t = ok("dp_size: 8\ncp_size: 2\ncp_mode: ring\nmp_replicate_size: 2\nmp_shard_size: 8\n\
                dist_timeout: 600\nbf16: true\n");
    assert_eq!(t.dp_size, Some(8));
    assert_eq!(t.cp_size, 2);
    assert_eq!(t.cp_mode, "ring");
    assert_eq!(t.mp_replicate_size, 2);
    assert_eq!(t.mp_shard_size, Some(8));
    assert_eq!(t.dist_timeout, 600);
    assert!(t.bf16);
    assert_eq!(ok("dp_size: null\nmp_shard_size: ~\n"), TrainConfig::default());
}

#[test]
fn every_dist_config_field() {
    let d = dist(
        "  name: fsdpturbo\n  reshard_after_forward: false\n  offload_params: true\n  pin_memory: false\n\
         \x20 dcp_path: /ckpt/run1\n  ep_size: 8\n  ep_dispatcher: domino\n\
         \x20 fsdp_ignored_modules: [model.visual, lm_head]\n  hook_modules:\n    - model.layers.{*}.mlp\n\
         \x20 fsdp_implementation: custom\n  efsdp_size: 2\n",
    );
    assert_eq!(
        d,
        DistConfig {
            name: "fsdpturbo".into(),
            reshard_after_forward: false,
            offload_params: true,
            pin_memory: false,
            dcp_path: Some("/ckpt/run1".into()),
            ep_size: 8,
            ep_dispatcher: Dispatcher::Domino,
            fsdp_ignored_modules: vec!["model.visual".into(), "lm_head".into()],
            hook_modules: vec!["model.layers.{*}.mlp".into()],
            fsdp_implementation: FsdpImplementation::Custom,
            efsdp_size: Some(2),
            ..DistConfig::default()
        }
    );
}

#[test]
fn capacity_and_balancing_fields() {
    let d = dist(
        "  name: fsdpturbo\n  ep_dispatcher: fused\n  capacity_factor: 1.25\n  capacity_overflow: fail\n\
         \x20 aux_loss_scope: sequence\n  router_z_loss_coef: 0.001\n  expert_bias_update_rate: 1.0e-3\n",
    );
    assert_eq!(d.capacity_factor, Some(1.25));
    assert_eq!(d.expert_capacity, None);
    assert_eq!(d.capacity_overflow, Some(CapacityOverflow::Fail));
    assert_eq!(d.aux_loss_scope, AuxLossScope::Sequence);
    assert_eq!(d.router_z_loss_coef, 0.001);
    assert_eq!(d.expert_bias_update_rate, Some(1.0e-3));
    let d = dist("  name: fsdpturbo\n  expert_capacity: 64\n");
    assert_eq!((d.expert_capacity, d.capacity_overflow), (Some(64), Some(CapacityOverflow::Drop)));
    assert_eq!(DistConfig::default().capacity_overflow, None);
    assert_eq!(DistConfig::default().aux_loss_scope, AuxLossScope::Global);
}

#[test]
fn capacity_and_balancing_errors_name_the_field_and_what_is_accepted() {
    let cases = [
        ("capacity_factor: 0", "dist_config.capacity_factor", "expected a finite number > 0, got 0.0"),
        ("capacity_factor: .inf", "dist_config.capacity_factor", "expected a finite number > 0, got inf"),
        (
            "capacity_factor: high",
            "dist_config.capacity_factor",
            "expected a finite number > 0, got string 'high'",
        ),
        ("expert_capacity: 0", "dist_config.expert_capacity", "expert_capacity must be positive, got 0."),
        ("capacity_factor: 1.0\n  expert_capacity: 8", "dist_config.expert_capacity", "not both"),
        ("capacity_overflow: fail", "dist_config.capacity_overflow", "needs a capacity"),
        (
            "capacity_factor: 2\n  capacity_overflow: spill",
            "dist_config.capacity_overflow",
            "expected one of ['drop', 'fail'], got 'spill'",
        ),
        ("capacity_factor: 2\n  ep_dispatcher: mc2", "dist_config.capacity_factor", "got 'mc2'"),
        ("expert_capacity: 4\n  ep_dispatcher: domino", "dist_config.expert_capacity", "got 'domino'"),
        (
            "aux_loss_scope: batch",
            "dist_config.aux_loss_scope",
            "expected one of ['global', 'local', 'sequence'], got 'batch'",
        ),
        (
            "router_z_loss_coef: -1",
            "dist_config.router_z_loss_coef",
            "expected a finite number ≥ 0, got -1.0",
        ),
        ("expert_bias_update_rate: 0", "dist_config.expert_bias_update_rate", "expected a finite number > 0"),
    ];
    for (body, path, message) in cases {
        let err = error(&format!("dist_config:\n  name: fsdpturbo\n  {body}\n"));
        assert_eq!(err.path, path, "{body}");
        assert!(err.message.contains(message), "{body}: {}", err.message);
    }
}

#[test]
fn dist_config_with_only_a_name_has_every_default() {
    assert_eq!(dist("  name: fsdpturbo\n"), DistConfig::default());
    assert_eq!(dist("  {name: fsdpturbo, dcp_path: null, efsdp_size: null}"), DistConfig::default());
    assert_eq!(ok("dist_config:\n").dist, DistConfig::default());
    assert_eq!(ok("dist_config: null\n").dist, DistConfig::default());
}

#[test]
fn each_dispatcher_and_implementation() {
    for dispatcher in [Dispatcher::Eager, Dispatcher::Fused, Dispatcher::Mc2, Dispatcher::Domino] {
        let d = dist(&format!("  {{name: fsdpturbo, ep_dispatcher: {}}}", dispatcher.as_str()));
        assert_eq!(d.ep_dispatcher, dispatcher);
        assert_eq!(Dispatcher::from_name(dispatcher.as_str()), Some(dispatcher));
    }
    assert_eq!(
        dist("  {name: fsdpturbo, fsdp_implementation: native}").fsdp_implementation,
        FsdpImplementation::Native
    );
    assert_eq!(FsdpImplementation::Custom.as_str(), "custom");
}

#[test]
fn seed_parse_params_ep_size_4() {
    // test_fsdpturbo_uses_class_plugin_and_strict_backend_params: {"name":"fsdpturbo","ep_size":4}
    let d = parse_dist_config(r#"{"name":"fsdpturbo","ep_size":4}"#).unwrap();
    assert_eq!(d.ep_size, 4);
    assert_eq!(DistConfig { ep_size: 4, ..DistConfig::default() }, d);
}

#[test]
fn the_seed_design_minimal_example() {
    let t = ok("cp_size: 1\n\ndist_config:\n  name: fsdpturbo\n  ep_size: 16\n  ep_dispatcher: eager\n");
    let d = t.dist;
    assert_eq!((t.cp_size, d.ep_size, d.ep_dispatcher), (1, 16, Dispatcher::Eager));
}

#[test]
fn example_config_file_parses() {
    let t =
        parse_train_config_bytes(&std::fs::read(corpus_dir().join("ok_qwen3_moe_ep.yaml")).unwrap()).unwrap();
    assert_eq!(t.cp_size, 2);
    assert!(t.bf16);
    let d = t.dist;
    assert_eq!((d.ep_size, d.ep_dispatcher, d.efsdp_size), (4, Dispatcher::Fused, None));
    let k = t.kernel.unwrap();
    assert_eq!(k.names, ["auto", "flash-linear-attention"]);
}

// ---- kernel_config: the cases of the seed's argument-parser tests ----------------------------

#[test]
fn kernel_config_of_test_args_parser_is_kept_verbatim() {
    let k = kernel(
        "  name: auto, flash-linear-attention\n\
         \x20 include_kernels: chunk_gated_delta_rule, fused_recurrent_gated_delta_rule\n  chunk_size: 32\n",
    );
    assert_eq!(k.names, ["auto", "flash-linear-attention"]);
    assert_eq!(
        k.include_kernels,
        IncludeKernels::List(vec![
            "chunk_gated_delta_rule".into(),
            "fused_recurrent_gated_delta_rule".into()
        ])
    );
    assert_eq!(k.chunk_size, 32);
}

#[test]
fn kernel_config_of_test_kernel_plugin_keeps_the_users_order() {
    let k = parse_kernel_config(
        r#"{"name":"auto, flash-linear-attention","include_kernels":"fused_recurrent_gated_delta_rule, chunk_gated_delta_rule","chunk_size":32}"#,
    )
    .unwrap();
    assert_eq!(
        k.include_kernels,
        IncludeKernels::List(vec![
            "fused_recurrent_gated_delta_rule".into(),
            "chunk_gated_delta_rule".into()
        ])
    );
    assert_eq!(k.chunk_size, 32);
}

#[test]
fn chunk_size_48_and_an_unknown_fla_kernel() {
    let e = error("kernel_config:\n  name: flash-linear-attention\n  chunk_size: 48\n");
    assert_error(&e, "kernel_config.chunk_size", 3, "chunk_size must be one of (16, 32, 64), got 48.");
    let e = error("kernel_config:\n  name: flash-linear-attention\n  include_kernels: not_a_kernel\n");
    assert_error(
        &e,
        "kernel_config.include_kernels",
        3,
        "Unsupported Flash Linear Attention kernels: ['not_a_kernel']",
    );
}

#[test]
fn kernel_config_defaults_and_auto_forms() {
    let k = kernel("  name: auto\n");
    assert_eq!(
        (k.names.as_slice(), &k.include_kernels, k.chunk_size),
        (&["auto".to_string()][..], &IncludeKernels::Auto, 64)
    );
    for include in ["auto", "true", "True", "'TRUE'", "'true'"] {
        let k = kernel(&format!("  name: flash-linear-attention\n  include_kernels: {include}\n"));
        assert_eq!(k.include_kernels, IncludeKernels::Auto, "{include}");
    }
    for size in [16, 32, 64] {
        assert_eq!(kernel(&format!("  {{name: auto, chunk_size: {size}}}")).chunk_size, size);
    }
    // The seed's split: strip, drop empty items.
    let k = kernel(
        "  name: ' auto ,, flash-linear-attention , '\n  include_kernels: ' chunk_gated_delta_rule ,'\n",
    );
    assert_eq!(k.names, ["auto", "flash-linear-attention"]);
    assert_eq!(k.include_kernels, IncludeKernels::List(vec!["chunk_gated_delta_rule".into()]));
}

#[test]
fn kernel_config_seed_errors() {
    let cases = [
        ("name: 3", "kernel_config.name", "kernel_config.name must be a string."),
        ("name: [auto]", "kernel_config.name", "kernel_config.name must be a string."),
        ("name: ' , ,'", "kernel_config.name", "kernel_config.name must contain at least one kernel name."),
        ("name: ''", "kernel_config.name", "kernel_config.name must contain at least one kernel name."),
        ("name: auto, liger", "kernel_config.name", "Plugin 'liger' is not registered under KernelPlugin."),
        (
            "{name: auto, include_kernels: ' ,'}",
            "kernel_config.include_kernels",
            "kernel_config.include_kernels must select at least one FLA kernel.",
        ),
        (
            "{name: auto, include_kernels: false}",
            "kernel_config.include_kernels",
            "kernel_config.include_kernels must be 'auto' or a comma-separated string.",
        ),
        (
            "{name: auto, include_kernels: [chunk_gated_delta_rule]}",
            "kernel_config.include_kernels",
            "kernel_config.include_kernels must be 'auto' or a comma-separated string.",
        ),
        (
            "{name: auto, include_kernels: 'zz, Auto, chunk_gated_delta_rule, aa, zz'}",
            "kernel_config.include_kernels",
            "Unsupported Flash Linear Attention kernels: ['Auto', 'aa', 'zz']",
        ),
        (
            "{name: auto, chunk_size: true}",
            "kernel_config.chunk_size",
            "chunk_size must be one of (16, 32, 64), got True.",
        ),
        (
            "{name: auto, chunk_size: 32.0}",
            "kernel_config.chunk_size",
            "chunk_size must be one of (16, 32, 64), got 32.0.",
        ),
        (
            "{name: auto, chunk_size: abc}",
            "kernel_config.chunk_size",
            "chunk_size must be one of (16, 32, 64), got 'abc'.",
        ),
        (
            "{name: auto, chunk_size: null}",
            "kernel_config.chunk_size",
            "chunk_size must be one of (16, 32, 64), got None.",
        ),
        ("{name: auto, chunk_size: 4294967328}", "kernel_config.chunk_size", "got 4294967328."),
        ("{name: auto, chunk_size: -32}", "kernel_config.chunk_size", "got -32."),
    ];
    for (body, path, message) in cases {
        assert_error(&error(&format!("kernel_config:\n  {body}\n")), path, 2, message);
    }
    let e = error("model: m\nkernel_config:\n  include_kernels: auto\n");
    assert_error(&e, "kernel_config", 2, "Plugin configuration must have a 'name' field.");
}

#[test]
fn kernel_config_unknown_keys_and_shape() {
    let e = error("kernel_config:\n  name: auto\n  chunk_sise: 32\n");
    assert_error(
        &e,
        "kernel_config.chunk_sise",
        3,
        "Unknown params for kernel_config: ['chunk_sise']. Expected: ['chunk_size', 'include_kernels', 'name']. `chunk_sise`: did you mean `chunk_size`?",
    );
    assert_error(
        &error("kernel_config: auto\n"),
        "kernel_config",
        1,
        "kernel_config must be a mapping, got str.",
    );
    assert_error(
        &error("kernel_config: [auto]\n"),
        "kernel_config",
        1,
        "kernel_config must be a mapping, got list.",
    );
}

// ---- string coercions (the seed's `convert_str_dict`) ----------------------------------------

#[test]
fn dist_config_strings_are_coerced_like_convert_str_dict() {
    let d = dist(
        "  name: fsdpturbo\n  reshard_after_forward: 'FALSE'\n  offload_params: 'tRuE'\n  pin_memory: \"false\"\n\
         \x20 ep_size: '0008'\n  efsdp_size: \"2\"\n  hook_modules: ['1', 'true', '2.5']\n",
    );
    assert!(!d.reshard_after_forward);
    assert!(d.offload_params);
    assert!(!d.pin_memory);
    assert_eq!((d.ep_size, d.efsdp_size), (8, Some(2)));
    // Not into lists.
    assert_eq!(d.hook_modules, ["1", "true", "2.5"]);
}

#[test]
fn coercion_float_rule_and_what_stays_a_string() {
    // One '.' with digits around it is a float, which is not an integer.
    assert_error(
        &error("dist_config: {name: fsdpturbo, ep_size: '2.0'}"),
        "dist_config.ep_size",
        1,
        "expected a positive integer, got float 2.0",
    );
    assert_error(
        &error("dist_config: {name: fsdpturbo, ep_size: '.5'}"),
        "dist_config.ep_size",
        1,
        "expected a positive integer, got float 0.5",
    );
    // "-1", "1.2.3", "1e3" are not isdigit(): they stay strings.
    assert_error(
        &error("dist_config: {name: fsdpturbo, ep_size: '-1'}"),
        "dist_config.ep_size",
        1,
        "expected a positive integer, got string '-1'",
    );
    assert_error(
        &error("dist_config: {name: fsdpturbo, ep_size: '1.2.3'}"),
        "dist_config.ep_size",
        1,
        "got string '1.2.3'",
    );
    // A digit string becomes an integer, even where a string is expected.
    assert_error(
        &error("dist_config: {name: fsdpturbo, dcp_path: '2024'}"),
        "dist_config.dcp_path",
        1,
        "expected a string, got integer 2024",
    );
    assert_error(
        &error("dist_config: {name: 'True'}"),
        "dist_config.name",
        1,
        "expected a string, got boolean true",
    );
}

#[test]
fn coercion_recurses_into_nested_mappings_but_not_lists() {
    // Seen through the seed's repr in the chunk_size message.
    assert_error(
        &error("kernel_config: {name: auto, chunk_size: {a: '1', b: {c: 'true'}, d: ['1']}}"),
        "kernel_config.chunk_size",
        1,
        "chunk_size must be one of (16, 32, 64), got {'a': 1, 'b': {'c': True}, 'd': ['1']}.",
    );
    assert_error(
        &error("kernel_config: {name: auto, chunk_size: ['32']}"),
        "kernel_config.chunk_size",
        1,
        "got ['32'].",
    );
    // "32" becomes 32 and is accepted; "48" becomes 48 and is reported as the int.
    assert_eq!(kernel("  {name: auto, chunk_size: '32'}").chunk_size, 32);
    assert_error(
        &error("kernel_config: {name: auto, chunk_size: '48'}"),
        "kernel_config.chunk_size",
        1,
        "got 48.",
    );
}

#[test]
fn json_in_a_string() {
    let t = ok("dist_config: '{\"name\": \"fsdpturbo\", \"ep_size\": \"4\", \"offload_params\": \"TRUE\", \
                \"hook_modules\": [\"a\"]}'\nkernel_config: '{\"name\": \"auto\", \"chunk_size\": 16}'\n");
    let d = t.dist;
    assert_eq!((d.ep_size, d.offload_params, d.hook_modules), (4, true, vec!["a".to_string()]));
    assert_eq!(t.kernel.unwrap().chunk_size, 16);
    // Errors inside the JSON point at the dist_config line.
    let e = error("model: x\ndist_config: >-\n  {\"name\": \"fsdpturbo\",\n   \"ep_size\": 0}\n");
    assert_error(&e, "dist_config.ep_size", 2, "ep_size must be positive, got 0.");
    let e = error("dist_config: '{\"name\": \"fsdpturbo\", \"name\": \"x\"}'\n");
    assert_error(&e, "dist_config", 1, "duplicate entry with key \"name\"");
    let e = error("dist_config: '{\"name\": \"fsdpturbo\", \"ep_size\": 99999999999999999999999}'\n");
    assert_error(&e, "dist_config.ep_size", 1, "integer 1e+23 is out of range");
}

#[test]
fn json_in_a_string_that_is_not_json() {
    let e = error("cp_size: 1\ndist_config: '{name: fsdpturbo}'\n");
    assert_error(
        &e,
        "dist_config",
        2,
        "the string starts with '{' but is not valid JSON: key must be a string at line 1 column 2",
    );
    // A string that does not start with '{' is not parsed (and is not a mapping).
    let e = error("dist_config: ' {\"name\": \"fsdpturbo\"}'\n");
    assert_error(
        &e,
        "dist_config",
        1,
        "DistributedPlugin config must be a mapping or FSDPTurboParams, got str.",
    );
    assert_error(&error("dist_config: fsdpturbo\n"), "dist_config", 1, "got str.");
    assert_error(&error("dist_config: 3\n"), "dist_config", 1, "got int.");
    assert_error(&error("dist_config: [name]\n"), "dist_config", 1, "got list.");
    assert_error(&error("dist_config: true\n"), "dist_config", 1, "got bool.");
    assert_error(
        &error("dist_config: !plugin {name: fsdpturbo}\n"),
        "dist_config",
        1,
        "expected a mapping, got a value with the unsupported YAML tag !plugin",
    );
}

#[test]
fn top_level_fields_are_not_coerced() {
    assert_error(&error("cp_size: '2'\n"), "cp_size", 1, "expected a positive integer, got string '2'");
    assert_error(
        &error("bf16: 'true'\n"),
        "bf16",
        1,
        "expected a boolean (true or false), got string 'true'",
    );
    assert_error(&error("bf16: yes\n"), "bf16", 1, "got string 'yes'");
}

// ---- strict dist_config: an unknown key is an error with the seed's text ---------------------

#[test]
fn unknown_params_has_the_seeds_exact_text() {
    let e = error("dist_config:\n  name: fsdpturbo\n  foo: 1\n");
    assert_eq!(
        e.to_string(),
        format!(
            "dist_config.foo (line 3): Unknown params for DistributedPlugin.FSDPTurboParams: ['foo']. {EXPECTED}."
        )
    );
}

#[test]
fn several_unknown_keys_are_one_error_sorted_like_python() {
    let e = error("dist_config:\n  name: fsdpturbo\n  zeta: 1\n  alpha: 2\n  Beta: 3\n");
    assert_error(
        &e,
        "dist_config.zeta",
        3,
        &format!(
            "Unknown params for DistributedPlugin.FSDPTurboParams: ['Beta', 'alpha', 'zeta']. {EXPECTED}. \
             Unknown keys at: dist_config.zeta (line 3), dist_config.alpha (line 4), dist_config.Beta (line 5)."
        ),
    );
    // Keys that are not strings are shown as Python shows them.
    let e = error("dist_config: {name: fsdpturbo, 1: a, true: b, null: c}\n");
    assert!(
        e.message.starts_with("Unknown params for DistributedPlugin.FSDPTurboParams: [1, None, True]."),
        "{e}"
    );
}

#[test]
fn topology_fields_inside_dist_config_are_unknown_with_a_hint() {
    for (line, field) in
        ["dp_size", "cp_size", "cp_mode", "mp_replicate_size", "mp_shard_size", "dist_timeout", "bf16"]
            .into_iter()
            .enumerate()
    {
        let e = error(&format!(
            "model: m\n\ndist_config:\n{}  name: fsdpturbo\n  {field}: 2\n",
            "  # c\n".repeat(line)
        ));
        assert_error(
            &e,
            &format!("dist_config.{field}"),
            5 + line,
            &format!("Unknown params for DistributedPlugin.FSDPTurboParams: ['{field}']. {EXPECTED}."),
        );
        assert!(
            e.message.contains(&format!("`{field}` is a public training argument: put it at the top level")),
            "{e}"
        );
    }
}

#[test]
fn model_spec_fields_inside_dist_config_are_unknown_with_a_hint() {
    for field in ["ep_modules", "ep_fsdp_modules"] {
        let e = error(&format!(
            "dist_config:\n  name: fsdpturbo\n  {field}: ['model.layers.{{*}}.mlp.experts']\n"
        ));
        assert_error(
            &e,
            &format!("dist_config.{field}"),
            3,
            &format!("Unknown params for DistributedPlugin.FSDPTurboParams: ['{field}']"),
        );
        assert!(e.message.contains("comes from the model spec (FSDPTurboEPModelSpec)"), "{e}");
    }
    let e = error("dist_config: {name: fsdpturbo, chunk_size: 32}\n");
    assert!(e.message.contains("`chunk_size` belongs in kernel_config."), "{e}");
}

#[test]
fn missing_and_wrong_name() {
    let e = error("model: m\ndist_config:\n  ep_size: 2\n");
    assert_error(&e, "dist_config", 2, "Plugin configuration must have a 'name' field.");
    assert_error(
        &error("dist_config: {}\n"),
        "dist_config",
        1,
        "Plugin configuration must have a 'name' field.",
    );
    let e = error("dist_config:\n  name: fsdp2\n");
    assert_error(&e, "dist_config.name", 2, "this library implements the 'fsdpturbo' plugin, got 'fsdp2'");
}

#[test]
fn value_errors_with_the_seeds_texts() {
    let cases = [
        ("ep_size: 0", "dist_config.ep_size", "ep_size must be positive, got 0."),
        ("ep_size: -4", "dist_config.ep_size", "ep_size must be positive, got -4."),
        (
            "ep_dispatcher: moonep",
            "dist_config.ep_dispatcher",
            "Unsupported dispatcher moonep. Supported: ['domino', 'eager', 'fused', 'mc2']",
        ),
        ("ep_dispatcher: Eager", "dist_config.ep_dispatcher", "Unsupported dispatcher Eager."),
        (
            "fsdp_implementation: fsdp1",
            "dist_config.fsdp_implementation",
            "Unknown FSDP implementation: fsdp1. Supported: ['custom', 'native']",
        ),
        ("efsdp_size: 0", "dist_config.efsdp_size", "efsdp_size must be positive, got 0."),
        ("dcp_path: ''", "dist_config.dcp_path", "dcp_path must not be empty"),
    ];
    for (field, path, message) in cases {
        assert_error(&error(&format!("dist_config:\n  name: fsdpturbo\n  {field}\n")), path, 3, message);
    }
}

#[test]
fn type_errors_name_the_type() {
    let cases = [
        ("ep_size: 2.5", "dist_config.ep_size", "expected a positive integer, got float 2.5"),
        ("ep_size: true", "dist_config.ep_size", "expected a positive integer, got boolean true"),
        ("ep_size: [2]", "dist_config.ep_size", "expected a positive integer, got a list"),
        ("ep_size: null", "dist_config.ep_size", "expected a positive integer, got null"),
        (
            "efsdp_size: 1e3",
            "dist_config.efsdp_size",
            "expected a positive integer or null (unset), got float 1000.0",
        ),
        (
            "reshard_after_forward: 1",
            "dist_config.reshard_after_forward",
            "expected a boolean (true or false), got integer 1",
        ),
        (
            "offload_params: yes",
            "dist_config.offload_params",
            "expected a boolean (true or false), got string 'yes'",
        ),
        ("pin_memory: {a: 1}", "dist_config.pin_memory", "expected a boolean (true or false), got a mapping"),
        ("dcp_path: [a]", "dist_config.dcp_path", "expected a string, got a list"),
        ("ep_dispatcher: 1", "dist_config.ep_dispatcher", "expected a string, got integer 1"),
        (
            "hook_modules: model.layers.0",
            "dist_config.hook_modules",
            "expected a list of strings, e.g. ['model.layers.0'], got string 'model.layers.0'",
        ),
        (
            "fsdp_ignored_modules: {a: b}",
            "dist_config.fsdp_ignored_modules",
            "expected a list of strings, got a mapping",
        ),
        (
            "fsdp_ignored_modules: null",
            "dist_config.fsdp_ignored_modules",
            "expected a list of strings, got null",
        ),
        (
            "fsdp_implementation: !custom x",
            "dist_config.fsdp_implementation",
            "expected a string, got a value with the unsupported YAML tag !custom",
        ),
    ];
    for (field, path, message) in cases {
        assert_error(&error(&format!("dist_config:\n  name: fsdpturbo\n  {field}\n")), path, 3, message);
    }
}

#[test]
fn every_bad_list_item_is_reported() {
    let errors = errors(
        "dist_config:\n  name: fsdpturbo\n  hook_modules:\n    - 1\n    - ok\n    - [x]\n    - null\n",
    );
    let got: Vec<(&str, Option<usize>)> = errors.iter().map(|e| (e.path.as_str(), e.line)).collect();
    assert_eq!(
        got,
        [
            ("dist_config.hook_modules[0]", Some(4)),
            ("dist_config.hook_modules[2]", Some(6)),
            ("dist_config.hook_modules[3]", Some(7))
        ]
    );
}

#[test]
fn list_items_are_checked_with_their_own_line() {
    let e = error("dist_config:\n  name: fsdpturbo\n  hook_modules:\n    - a\n    - 7\n");
    assert_error(&e, "dist_config.hook_modules[1]", 5, "expected a string, got integer 7");
    let e = error("dist_config:\n  name: fsdpturbo\n  fsdp_ignored_modules: [a,\n    b, [c]]\n");
    assert_error(&e, "dist_config.fsdp_ignored_modules[2]", 4, "expected a string, got a list");
}

#[test]
fn top_level_sizes_and_types() {
    let cases = [
        ("cp_size: 0", "cp_size", "cp_size must be positive, got 0."),
        ("dp_size: -2", "dp_size", "dp_size must be positive, got -2."),
        ("mp_replicate_size: 0", "mp_replicate_size", "mp_replicate_size must be positive, got 0."),
        ("mp_shard_size: 0", "mp_shard_size", "mp_shard_size must be positive, got 0."),
        ("dist_timeout: 0", "dist_timeout", "dist_timeout must be positive, got 0."),
        ("dist_timeout: 1.5", "dist_timeout", "expected a positive integer, got float 1.5"),
        ("cp_size: true", "cp_size", "expected a positive integer, got boolean true"),
        ("dp_size: [8]", "dp_size", "expected a positive integer or null (unset), got a list"),
        ("cp_mode: 3", "cp_mode", "expected a string, got integer 3"),
        ("cp_mode: null", "cp_mode", "expected a string, got null"),
        ("bf16: 1", "bf16", "expected a boolean (true or false), got integer 1"),
        ("cp_size: 99999999999999999999", "cp_size", "integer 99999999999999999999 is out of range"),
        ("cp_size: -99999999999999999999", "cp_size", "integer -99999999999999999999 is out of range"),
    ];
    for (field, path, message) in cases {
        assert_error(&error(&format!("model: m\n{field}\n")), path, 2, message);
    }
}

#[test]
fn topology_products_that_need_no_world_size() {
    let e = error("dp_size: 6\ndist_config:\n  name: fsdpturbo\n  ep_size: 4\n");
    assert_error(&e, "dist_config.ep_size", 4, "dp_size must be divisible by ep_size, got 6 % 4 != 0.");
    let e = error("dp_size: 8\ndist_config:\n  name: fsdpturbo\n  ep_size: 2\n  efsdp_size: 3\n");
    assert_error(
        &e,
        "dist_config.efsdp_size",
        5,
        "dp_size must be divisible by ep_size * efsdp_size, got 8 % (2 * 3) != 0.",
    );
    let e = error("dp_size: 8\ncp_size: 2\nmp_shard_size: 8\n");
    assert_error(
        &e,
        "mp_shard_size",
        3,
        "mp_replicate_size * mp_shard_size must equal dp_size * cp_size (both are the world size), got 1 * 8 != 8 * 2.",
    );
    let e = error("mp_replicate_size: 1\nmp_shard_size: 9\ncp_size: 2\n");
    assert_error(&e, "cp_size", 3, "world_size (9) must be divisible by cp_size (2).");
    // The world size implied by mp sizes gives dp = 16 / 2 = 8, which ep 3 does not divide.
    let e = error(
        "mp_replicate_size: 2\nmp_shard_size: 8\ncp_size: 2\ndist_config: {name: fsdpturbo, ep_size: 3}\n",
    );
    assert_error(&e, "dist_config.ep_size", 4, "got 8 % 3 != 0.");
    let e = error("dp_size: 18446744073709551615\ncp_size: 2\n");
    assert_error(
        &e,
        "dp_size",
        1,
        "dp_size * cp_size (the world size it implies) overflows a 64-bit integer. Accepted: sizes whose \
         product is below 2^64.",
    );
    let e =
        error("dp_size: 8\ndist_config: {name: fsdpturbo, ep_size: 4, efsdp_size: 9223372036854775808}\n");
    assert_error(&e, "dist_config.efsdp_size", 2, "dp_size must be divisible by ep_size * efsdp_size");
    // Consistent ones pass: 16 = 2 * 8 = 8 * 2; ep 4 * efsdp 2 divides dp 8.
    let t = ok("dp_size: 8\ncp_size: 2\nmp_replicate_size: 2\nmp_shard_size: 8\n\
                dist_config: {name: fsdpturbo, ep_size: 4, efsdp_size: 2}\n");
    assert_eq!(t.dist.efsdp_size, Some(2));
    // Without dp_size or mp_shard_size nothing is known about the world: any ep is fine.
    assert_eq!(ok("dist_config: {name: fsdpturbo, ep_size: 7}\n").dist.ep_size, 7);
}

/// Each schema error names the field (its path and line) and ends with what is accepted; the
/// seed's text, where the seed has one, stays its start.
#[test]
fn every_schema_error_says_what_is_accepted() {
    const KERNELS: &str = "a comma-separated string of kernel names from ['auto', 'flash-linear-attention']";
    const FLA: &str =
        "'auto' or a comma-separated list of ['chunk_gated_delta_rule', 'fused_recurrent_gated_delta_rule']";
    let cases: [(&str, &str, usize, String); 19] = [
        (
            "dist_config: {name: fsdpturbo, ep_size: 0}",
            "dist_config.ep_size",
            1,
            "ep_size must be positive, got 0. Accepted: a positive integer.".into(),
        ),
        ("cp_size: x", "cp_size", 1, "expected a positive integer, got string 'x'".into()),
        (
            "dist_config: {name: fsdpturbo, efsdp_size: 0}",
            "dist_config.efsdp_size",
            1,
            "efsdp_size must be positive, got 0. Accepted: a positive integer or null (unset).".into(),
        ),
        (
            "dist_config: {name: fsdpturbo, expert_capacity: -3}",
            "dist_config.expert_capacity",
            1,
            "expert_capacity must be positive, got -3. Accepted: a positive integer or null (unset).".into(),
        ),
        (
            "dist_config: '{\"name\": \"fsdpturbo\", \"ep_size\": 99999999999999999999999}'",
            "dist_config.ep_size",
            1,
            "integer 1e+23 is out of range: integers must lie in [-2^63, 2^64). Accepted: a positive integer."
                .into(),
        ),
        (
            "dist_config: {name: fsdpturbo, router_z_loss_coef: []}",
            "dist_config.router_z_loss_coef",
            1,
            "expected a finite number ≥ 0, got a list".into(),
        ),
        (
            "dist_config: {ep_size: 2}",
            "dist_config",
            1,
            "Plugin configuration must have a 'name' field. Accepted: name: fsdpturbo.".into(),
        ),
        (
            "dist_config: {name: fsdp2}",
            "dist_config.name",
            1,
            "this library implements the 'fsdpturbo' plugin, got 'fsdp2'. Accepted: 'fsdpturbo'.".into(),
        ),
        (
            "dist_config: '{name: x}'",
            "dist_config",
            1,
            "the string starts with '{' but is not valid JSON: key must be a string at line 1 column 2. \
             Accepted: a mapping, or a string holding a JSON object."
                .into(),
        ),
        (
            "kernel_config: {chunk_size: 16}",
            "kernel_config",
            1,
            format!("Plugin configuration must have a 'name' field. Accepted: name: {KERNELS}."),
        ),
        (
            "kernel_config: {name: ' ,'}",
            "kernel_config.name",
            1,
            format!("kernel_config.name must contain at least one kernel name. Accepted: {KERNELS}."),
        ),
        (
            "kernel_config: {name: [auto]}",
            "kernel_config.name",
            1,
            format!("kernel_config.name must be a string. Got a list. Accepted: {KERNELS}."),
        ),
        (
            "kernel_config: {name: auto, include_kernels: ','}",
            "kernel_config.include_kernels",
            1,
            format!("kernel_config.include_kernels must select at least one FLA kernel. Supported: {FLA}"),
        ),
        (
            "kernel_config: {name: auto, include_kernels: 3}",
            "kernel_config.include_kernels",
            1,
            format!(
                "kernel_config.include_kernels must be 'auto' or a comma-separated string. Got integer 3. \
                 Supported: {FLA}"
            ),
        ),
        (
            "dp_size: 6\ndist_config: {name: fsdpturbo, ep_size: 4}",
            "dist_config.ep_size",
            2,
            "dp_size must be divisible by ep_size, got 6 % 4 != 0. Accepted ep_size values (divisors of dp_size \
             6): 1, 2, 3, 6."
                .into(),
        ),
        (
            "dp_size: 8\ndist_config: {name: fsdpturbo, ep_size: 2, efsdp_size: 3}",
            "dist_config.efsdp_size",
            2,
            "dp_size must be divisible by ep_size * efsdp_size, got 8 % (2 * 3) != 0. Accepted efsdp_size \
             values (divisors of dp_size / ep_size 4): 1, 2, 4."
                .into(),
        ),
        (
            "mp_shard_size: 9\ncp_size: 2",
            "cp_size",
            2,
            "world_size (9) must be divisible by cp_size (2). (The world size is mp_replicate_size * \
             mp_shard_size.) Accepted cp_size values (divisors of world_size 9): 1, 3, 9."
                .into(),
        ),
        (
            "dp_size: 8\ncp_size: 2\nmp_shard_size: 8",
            "mp_shard_size",
            3,
            "mp_replicate_size * mp_shard_size must equal dp_size * cp_size (both are the world size), got \
             1 * 8 != 8 * 2. Accepted mp_shard_size: 16 (or leave it unset)."
                .into(),
        ),
        (
            "dp_size: 4\nmp_replicate_size: 3\nmp_shard_size: 4",
            "mp_shard_size",
            3,
            "mp_replicate_size * mp_shard_size must equal dp_size * cp_size (both are the world size), got \
             3 * 4 != 4 * 1. Accepted: an mp_replicate_size that divides dp_size * cp_size (4), with \
             mp_shard_size = dp_size * cp_size / mp_replicate_size."
                .into(),
        ),
    ];
    for (yaml, path, line, message) in cases {
        let e = error(&format!("{yaml}\n"));
        assert_eq!(
            (e.path.as_str(), e.line, e.message.as_str()),
            (path, Some(line), message.as_str()),
            "{yaml}"
        );
    }
    let e = error("mp_replicate_size: 4294967296\nmp_shard_size: 4294967296\n");
    assert_eq!(
        e.to_string(),
        "mp_shard_size (line 2): mp_replicate_size * mp_shard_size (the world size it implies) overflows a \
         64-bit integer. Accepted: sizes whose product is below 2^64."
    );
}

#[test]
fn a_rejected_size_does_not_cause_topology_noise() {
    // cp_size 0 is reported once, and not again as a world-size mismatch.
    let e = error("dp_size: 8\ncp_size: 0\nmp_shard_size: 8\n");
    assert_error(&e, "cp_size", 2, "cp_size must be positive, got 0.");
}

// ---- lines, collection, document-level errors ------------------------------------------------

#[test]
fn errors_carry_the_line_in_block_and_flow_style() {
    let yaml = "# training\nmodel: m\n\ndist_config:\n  name: fsdpturbo\n\n  ep_size: 0\nkernel_config: {name: auto,\n  chunk_size: 7}\n";
    let errors = errors(yaml);
    assert_eq!(errors.len(), 2, "{errors:?}");
    assert_error(&errors[0], "dist_config.ep_size", 7, "ep_size must be positive, got 0.");
    assert_error(&errors[1], "kernel_config.chunk_size", 9, "got 7.");
    assert_eq!(
        errors[0].to_string(),
        "dist_config.ep_size (line 7): ep_size must be positive, got 0. Accepted: a positive integer."
    );
}

#[test]
fn every_error_is_collected_in_document_order() {
    let yaml = "cp_size: 0\nep_size: 2\ndist_config:\n  name: fsdpturbo\n  ep_size: x\n  ep_dispatcher: slow\n  \
                foo: 1\n  hook_modules: a\nkernel_config:\n  name: nope\n  chunk_size: 48\nbf16: maybe\n";
    let errors = errors(yaml);
    let got: Vec<(&str, Option<usize>)> = errors.iter().map(|e| (e.path.as_str(), e.line)).collect();
    assert_eq!(
        got,
        [
            ("cp_size", Some(1)),
            ("ep_size", Some(2)),
            ("dist_config.ep_size", Some(5)),
            ("dist_config.ep_dispatcher", Some(6)),
            ("dist_config.foo", Some(7)),
            ("dist_config.hook_modules", Some(8)),
            ("kernel_config.name", Some(10)),
            ("kernel_config.chunk_size", Some(11)),
            ("bf16", Some(12)),
        ]
    );
    // Display: one error per line; into the crate error as a Config error.
    let text = ConfigErrors(errors.clone()).to_string();
    assert_eq!(text.lines().count(), errors.len());
    assert_eq!(
        text.lines().next(),
        Some("cp_size (line 1): cp_size must be positive, got 0. Accepted: a positive integer.")
    );
    let err = Error::from(ConfigErrors(errors));
    assert_eq!((err.kind, err.message), (ErrorKind::Config, text));
}

#[test]
fn anchors_aliases_and_merge_keys_are_followed() {
    let yaml =
        "base: &base\n  name: fsdpturbo\n  ep_size: 4\ndist_config:\n  <<: *base\n  ep_dispatcher: fused\n";
    let d = ok(yaml).dist;
    assert_eq!((d.ep_size, d.ep_dispatcher), (4, Dispatcher::Fused));
    let d = ok("defaults: &d {name: fsdpturbo, ep_size: 2}\ndist_config: *d\n").dist;
    assert_eq!(d.ep_size, 2);
    // An error reached through an alias points at the key that uses it.
    let e = error("defaults: &d {name: fsdpturbo, ep_size: 0}\nmodel: m\ndist_config: *d\n");
    assert_error(&e, "dist_config.ep_size", 3, "ep_size must be positive, got 0.");
}

#[test]
fn alias_bombs_are_refused_before_expansion() {
    // An anchor of n items used n times: n² values for serde_yaml (4 million here, and out of
    // memory at 10 times the size) if it were let through.
    let n = 2000;
    let yaml = format!("model: m\na: &a [{}]\nb: [{}]\n", vec!["x"; n].join(", "), vec!["*a"; n].join(", "));
    let start = std::time::Instant::now();
    let e = error(&yaml);
    assert_eq!((e.line, e.message.as_str()), (Some(3), "the YAML's aliases expand to more than 10000 nodes"));
    assert!(start.elapsed() < std::time::Duration::from_secs(5), "{:?}", start.elapsed());
    // Ordinary reuse is fine: 50 uses of a 100-node anchor.
    let yaml = format!("a: &a [{}]\nb: [{}]\n", vec!["x"; 99].join(", "), vec!["*a"; 50].join(", "));
    assert_eq!(ok(&yaml), TrainConfig::default());
}

#[test]
fn document_level_errors() {
    let e = error("- a\n- b\n");
    assert_eq!((e.path.as_str(), e.line), ("", None));
    assert!(e.message.contains("expected a YAML mapping at the top level, got a list"), "{e}");
    assert!(error("just a string").message.contains("got string 'just a string'"));
    assert!(error("").message.contains("the training configuration is empty"));
    assert!(error("# only a comment\n").message.contains("the training configuration is empty"));
    let e = error("a: 1\n---\nb: 2\n");
    assert!(e.message.contains("more than one document"), "{e}");
}

#[test]
fn syntax_errors_have_serde_yamls_line_and_column() {
    let e = error("model: m\ndist_config: {name: fsdpturbo\n");
    assert_eq!(e.line, Some(3));
    assert!(
        e.message.starts_with("invalid YAML: did not find expected ',' or '}' at line 3 column 1"),
        "{e}"
    );
    let e = error("model: m\ndist_config:\n\tname: fsdpturbo\n");
    assert_eq!(e.line, Some(3));
    assert!(e.message.contains("found character that cannot start any token at line 3 column 1"), "{e}");
    assert_eq!(error("a: *nope\n").message, "invalid YAML: unknown anchor at line 1 column 4");
}

#[test]
fn duplicate_keys_point_at_the_repeat() {
    let e = error("model: m\ndist_config:\n  name: fsdpturbo\n  ep_size: 2\n  ep_size: 4\n");
    assert_error(&e, "dist_config.ep_size", 5, "duplicate key (first written at line 4)");
    let e = error("cp_size: 1\nmodel: m\ncp_size: 2\n");
    assert_error(&e, "cp_size", 3, "duplicate key (first written at line 1)");
}

#[test]
fn deep_nesting_is_an_error_not_a_crash() {
    for junk in [
        format!("a: {}{}", "[".repeat(10_000), "]".repeat(10_000)),
        format!("a: {}", "[".repeat(10_000)),
        "{a: ".repeat(5_000),
        (0..300).map(|i| format!("{}k{i}:\n", " ".repeat(i))).collect(),
    ] {
        let e = error(&junk);
        assert_eq!(e.message, "the YAML nests deeper than 128 levels", "{e}");
    }
    assert!(error("a: [[\n").message.starts_with("invalid YAML"));
}

#[test]
fn the_nesting_limit_is_serde_yamls_and_costs_linear_time() {
    // The top-level mapping and 127 lists: the most serde_yaml reads.
    assert_eq!(ok(&format!("a: {}{}", "[".repeat(127), "]".repeat(127))), TrainConfig::default());
    let e = error(&format!("\na:\n  {}{}", "[".repeat(128), "]".repeat(128)));
    assert_eq!((e.line, e.message.as_str()), (Some(3), "the YAML nests deeper than 128 levels"));
    // Past the limit the parse stops: libyaml's cost per token grows with the flow depth, so
    // 300 KB of `[` took minutes when serde_yaml met them first.
    let start = std::time::Instant::now();
    error(&format!("a: {}", "[".repeat(300_000)));
    assert!(start.elapsed() < std::time::Duration::from_secs(20), "{:?}", start.elapsed());
}

#[test]
fn non_utf8_bytes_are_reported_with_their_offset() {
    let e = parse_train_config_bytes(b"model: m\ncp_size: \xff2\n").unwrap_err().0;
    assert_eq!(e.len(), 1);
    assert_eq!(e[0].line, Some(2));
    assert_eq!(
        e[0].message,
        "the configuration is not valid UTF-8: invalid byte 0xFF at byte offset 18 (line 2, column 10)"
    );
    let e = parse_train_config_bytes(b"model: \xe2\x82").unwrap_err().0;
    assert!(e[0].message.contains("incomplete UTF-8 sequence at the end at byte offset 7"), "{}", e[0]);
    assert_eq!(parse_train_config_bytes(b"cp_size: 2\n").unwrap().cp_size, 2);
}

// ---- parse_dist_config / parse_kernel_config -------------------------------------------------

#[test]
fn dist_config_text_as_yaml_or_json() {
    let d = parse_dist_config("name: fsdpturbo\nep_size: 8\nep_dispatcher: mc2\n").unwrap();
    assert_eq!((d.ep_size, d.ep_dispatcher), (8, Dispatcher::Mc2));
    let e = parse_dist_config("name: fsdpturbo\n\nep_size: 0\n").unwrap_err().0;
    assert_error(&e[0], "dist_config.ep_size", 3, "ep_size must be positive, got 0.");
    // JSON as Python's json.dumps writes it, including what YAML does not read (a key longer
    // than YAML's 1024-character limit for implicit keys): no lines then.
    let long = "k".repeat(1500);
    let e = parse_dist_config(&format!("{{\"name\": \"fsdpturbo\", \"{long}\": 1}}")).unwrap_err().0;
    assert_eq!(e[0].line, None);
    assert!(
        e[0].message
            .starts_with(&format!("Unknown params for DistributedPlugin.FSDPTurboParams: ['{long}']"))
    );
    let e = parse_dist_config("{\"name\": \"fsdpturbo\",").unwrap_err().0;
    assert!(e.iter().any(|e| e.message.starts_with("invalid YAML")), "{e:?}");
    assert!(e.iter().any(|e| e.message.starts_with("the text is not valid JSON either")), "{e:?}");
    assert!(parse_dist_config("").unwrap_err().0[0].message.contains("dist_config is empty"));
    assert!(
        parse_dist_config("[1]").unwrap_err().0[0]
            .message
            .contains("must be a mapping or FSDPTurboParams, got list.")
    );
    let e = parse_dist_config("ep_size: 2\n").unwrap_err().0;
    assert_error(&e[0], "dist_config", 1, "Plugin configuration must have a 'name' field.");
}

#[test]
fn kernel_config_text() {
    let k = parse_kernel_config("name: flash-linear-attention\nchunk_size: 16\n").unwrap();
    assert_eq!((k.names, k.chunk_size), (vec!["flash-linear-attention".to_string()], 16));
    let e = parse_kernel_config("name: auto\nchunk_size: 8\n").unwrap_err().0;
    assert_error(&e[0], "kernel_config.chunk_size", 2, "chunk_size must be one of (16, 32, 64), got 8.");
}

// ---- the malformed corpus --------------------------------------------------------------------

fn corpus_dir() -> std::path::PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/config")
}

/// Each `*.yaml` under tests/data/config starts with comment lines `# expect: <phrase>` (each
/// phrase must be in the error text) and optionally `# expect-line: <n>` (a reported line);
/// files named `ok_*.yaml` must parse. None may panic.
#[test]
fn corpus_files_fail_with_the_expected_phrases_and_never_panic() {
    let mut files: Vec<_> = std::fs::read_dir(corpus_dir()).unwrap().map(|e| e.unwrap().path()).collect();
    files.retain(|p| p.extension().is_some_and(|e| e == "yaml"));
    files.sort();
    assert!(files.len() >= 30, "the corpus has only {} files", files.len());
    let mut failures = Vec::new();
    for file in files {
        let bytes = std::fs::read(&file).unwrap();
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        let header = String::from_utf8_lossy(&bytes);
        let mut phrases = Vec::new();
        let mut lines = Vec::new();
        for line in header.lines().take_while(|l| l.starts_with('#')) {
            if let Some(phrase) = line.strip_prefix("# expect: ") {
                phrases.push(phrase.to_string());
            } else if let Some(n) = line.strip_prefix("# expect-line: ") {
                lines.push(n.trim().parse::<usize>().unwrap());
            }
        }
        let Ok(result) = std::panic::catch_unwind(|| parse_train_config_bytes(&bytes)) else {
            failures.push(format!("{name}: the parser panicked"));
            continue;
        };
        match result {
            Ok(_) if name.starts_with("ok_") => {}
            Err(e) if name.starts_with("ok_") => failures.push(format!("{name}: {e}")),
            Ok(cfg) => failures.push(format!("{name}: parsed: {cfg:?}")),
            Err(_) if phrases.is_empty() => failures.push(format!("{name}: no `# expect:` line")),
            Err(errors) => {
                let text = errors.to_string();
                for phrase in &phrases {
                    if !text.contains(phrase.as_str()) {
                        failures.push(format!("{name}: expected {phrase:?} in:\n{text}"));
                    }
                }
                for line in &lines {
                    if !errors.0.iter().any(|e| e.line == Some(*line)) {
                        failures.push(format!("{name}: no error at line {line}:\n{text}"));
                    }
                }
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n\n"));
}

// ---- the C ABI, called from Rust ---------------------------------------------------------------

mod c_abi {
    use super::*;
    use crate::common::last_error;
    use fsdpturbo::ffi::config::*;
    use fsdpturbo::ffi::error::fsdpturbo_last_error;
    use fsdpturbo::ffi::status::*;

    fn parse(yaml: &[u8]) -> (i32, *mut fsdpturbo_config_t) {
        let mut out = ptr::null_mut();
        let status = fsdpturbo_config_parse(yaml.as_ptr().cast::<c_char>(), yaml.len(), &mut out);
        (status, out)
    }

    fn json(cfg: *const fsdpturbo_config_t) -> serde_json::Value {
        let mut needed = 0usize;
        assert_eq!(
            fsdpturbo_config_to_json(cfg, ptr::null_mut(), 0, &mut needed),
            FSDPTURBO_ERR_BUFFER_TOO_SMALL
        );
        let mut buf = vec![0u8; needed];
        let mut len = 0usize;
        assert_eq!(fsdpturbo_config_to_json(cfg, buf.as_mut_ptr().cast(), buf.len(), &mut len), FSDPTURBO_OK);
        assert_eq!((len, buf[len - 1]), (needed, 0));
        serde_json::from_slice(&buf[..len - 1]).unwrap()
    }

    #[test]
    fn parse_get_and_free() {
        let yaml = b"dp_size: 8\ncp_size: 2\ndist_config:\n  name: fsdpturbo\n  ep_size: 4\n  \
                     ep_dispatcher: mc2\n  efsdp_size: 2\n";
        let (status, cfg) = parse(yaml);
        assert_eq!(status, FSDPTURBO_OK, "{}", last_error());
        assert!(!cfg.is_null());
        assert_eq!(fsdpturbo_last_error(ptr::null_mut(), 0), 0);
        let mut n = 0u64;
        assert_eq!(fsdpturbo_config_ep_size(cfg, &mut n), FSDPTURBO_OK);
        assert_eq!(n, 4);
        assert_eq!(fsdpturbo_config_cp_size(cfg, &mut n), FSDPTURBO_OK);
        assert_eq!(n, 2);
        assert_eq!(fsdpturbo_config_dp_size(cfg, &mut n), FSDPTURBO_OK);
        assert_eq!(n, 8);
        assert_eq!(fsdpturbo_config_efsdp_size(cfg, &mut n), FSDPTURBO_OK);
        assert_eq!(n, 2);
        let mut d = -1i32;
        assert_eq!(fsdpturbo_config_dispatcher(cfg, &mut d), FSDPTURBO_OK);
        assert_eq!(d, FSDPTURBO_DISPATCHER_MC2);
        // SAFETY: `cfg` came from fsdpturbo_config_parse and is alive.
        assert_eq!(unsafe { &*cfg }.config().dist.ep_size, 4);
        fsdpturbo_config_free(cfg);
        fsdpturbo_config_free(ptr::null_mut());
    }

    #[test]
    fn getters_give_the_defaults_without_dist_config() {
        let (status, cfg) = parse(b"model: m\n");
        assert_eq!(status, FSDPTURBO_OK);
        let (mut ep, mut dp, mut efsdp, mut cp, mut d) = (0u64, 9u64, 9u64, 0u64, -1i32);
        assert_eq!(fsdpturbo_config_ep_size(cfg, &mut ep), FSDPTURBO_OK);
        assert_eq!(fsdpturbo_config_dp_size(cfg, &mut dp), FSDPTURBO_OK);
        assert_eq!(fsdpturbo_config_efsdp_size(cfg, &mut efsdp), FSDPTURBO_OK);
        assert_eq!(fsdpturbo_config_cp_size(cfg, &mut cp), FSDPTURBO_OK);
        assert_eq!(fsdpturbo_config_dispatcher(cfg, &mut d), FSDPTURBO_OK);
        assert_eq!((ep, dp, efsdp, cp, d), (1, 0, 0, 1, FSDPTURBO_DISPATCHER_EAGER));
        fsdpturbo_config_free(cfg);
    }

    #[test]
    fn dispatcher_constants() {
        for (name, code) in [
            ("eager", FSDPTURBO_DISPATCHER_EAGER),
            ("fused", FSDPTURBO_DISPATCHER_FUSED),
            ("mc2", FSDPTURBO_DISPATCHER_MC2),
            ("domino", FSDPTURBO_DISPATCHER_DOMINO),
        ] {
            let (status, cfg) =
                parse(format!("dist_config: {{name: fsdpturbo, ep_dispatcher: {name}}}").as_bytes());
            assert_eq!(status, FSDPTURBO_OK);
            let mut d = -1;
            assert_eq!(fsdpturbo_config_dispatcher(cfg, &mut d), FSDPTURBO_OK);
            assert_eq!(d, code, "{name}");
            fsdpturbo_config_free(cfg);
        }
        assert_eq!(
            [
                FSDPTURBO_DISPATCHER_EAGER,
                FSDPTURBO_DISPATCHER_FUSED,
                FSDPTURBO_DISPATCHER_MC2,
                FSDPTURBO_DISPATCHER_DOMINO
            ],
            [0, 1, 2, 3]
        );
    }

    #[test]
    fn errors_come_back_as_config_status_with_every_message() {
        let (status, cfg) = parse(b"model: m\ndist_config:\n  name: fsdpturbo\n  ep_size: 0\n  cp_size: 2\n");
        assert_eq!(status, FSDPTURBO_ERR_CONFIG);
        assert!(cfg.is_null());
        let text = last_error();
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 2, "{text}");
        assert_eq!(
            lines[0],
            "dist_config.ep_size (line 4): ep_size must be positive, got 0. Accepted: a positive integer."
        );
        assert!(lines[1].starts_with(
            "dist_config.cp_size (line 5): Unknown params for DistributedPlugin.FSDPTurboParams: ['cp_size']"
        ));
        // A failed parse sets *out to NULL even if it held something.
        let mut out = ptr::dangling_mut::<fsdpturbo_config_t>();
        let yaml = b"- x";
        assert_eq!(fsdpturbo_config_parse(yaml.as_ptr().cast(), yaml.len(), &mut out), FSDPTURBO_ERR_CONFIG);
        assert!(out.is_null());
    }

    #[test]
    fn bytes_with_a_length_so_no_nul_and_no_utf8_are_needed() {
        // Not NUL-terminated: only `len` bytes are read.
        let yaml = b"cp_size: 4\nGARBAGE: [";
        let mut out = ptr::null_mut();
        assert_eq!(fsdpturbo_config_parse(yaml.as_ptr().cast(), 11, &mut out), FSDPTURBO_OK);
        let mut cp = 0;
        assert_eq!(fsdpturbo_config_cp_size(out, &mut cp), FSDPTURBO_OK);
        assert_eq!(cp, 4);
        fsdpturbo_config_free(out);
        let (status, _) = parse(b"cp_size: 4\xc3\x28\n");
        assert_eq!(status, FSDPTURBO_ERR_CONFIG);
        assert!(
            last_error().contains("not valid UTF-8: invalid byte 0xC3 at byte offset 10"),
            "{}",
            last_error()
        );
    }

    #[test]
    fn null_arguments() {
        let mut out = ptr::null_mut();
        let yaml = b"a: 1";
        assert_eq!(fsdpturbo_config_parse(ptr::null(), 4, &mut out), FSDPTURBO_ERR_NULL_ARGUMENT);
        assert!(last_error().contains("`yaml` must not be NULL"), "{}", last_error());
        assert_eq!(
            fsdpturbo_config_parse(yaml.as_ptr().cast(), yaml.len(), ptr::null_mut()),
            FSDPTURBO_ERR_NULL_ARGUMENT
        );
        assert!(last_error().contains("`out`"), "{}", last_error());
        // NULL with length 0 is an empty document: a configuration error, not a crash.
        assert_eq!(fsdpturbo_config_parse(ptr::null(), 0, &mut out), FSDPTURBO_ERR_CONFIG);
        assert!(last_error().contains("empty"));

        let (status, cfg) = parse(b"cp_size: 2");
        assert_eq!(status, FSDPTURBO_OK);
        let mut n = 0u64;
        let mut d = 0i32;
        let mut len = 0usize;
        assert_eq!(fsdpturbo_config_ep_size(ptr::null(), &mut n), FSDPTURBO_ERR_NULL_ARGUMENT);
        assert!(last_error().contains("`config` must not be NULL"));
        assert_eq!(fsdpturbo_config_ep_size(cfg, ptr::null_mut()), FSDPTURBO_ERR_NULL_ARGUMENT);
        assert_eq!(fsdpturbo_config_cp_size(cfg, ptr::null_mut()), FSDPTURBO_ERR_NULL_ARGUMENT);
        assert_eq!(fsdpturbo_config_dp_size(ptr::null(), &mut n), FSDPTURBO_ERR_NULL_ARGUMENT);
        assert_eq!(fsdpturbo_config_efsdp_size(cfg, ptr::null_mut()), FSDPTURBO_ERR_NULL_ARGUMENT);
        assert_eq!(fsdpturbo_config_dispatcher(ptr::null(), &mut d), FSDPTURBO_ERR_NULL_ARGUMENT);
        assert_eq!(
            fsdpturbo_config_to_json(ptr::null(), ptr::null_mut(), 0, &mut len),
            FSDPTURBO_ERR_NULL_ARGUMENT
        );
        assert_eq!(
            fsdpturbo_config_to_json(cfg, ptr::null_mut(), 0, ptr::null_mut()),
            FSDPTURBO_ERR_NULL_ARGUMENT
        );
        fsdpturbo_config_free(cfg);
    }

    #[test]
    fn json_output() {
        let (status, cfg) = parse(
            b"cp_size: 2\nbf16: true\ndist_config:\n  name: fsdpturbo\n  ep_size: 4\n  ep_dispatcher: fused\n  \
              hook_modules: [a]\nkernel_config:\n  name: auto, flash-linear-attention\n  chunk_size: 32\n",
        );
        assert_eq!(status, FSDPTURBO_OK, "{}", last_error());
        let j = json(cfg);
        assert_eq!(
            j,
            serde_json::json!({
                "dp_size": null, "cp_size": 2, "cp_mode": "ulysses", "mp_replicate_size": 1,
                "mp_shard_size": null, "dist_timeout": 18000, "bf16": true,
                "dist": {
                    "name": "fsdpturbo", "reshard_after_forward": true, "offload_params": false,
                    "pin_memory": true, "dcp_path": null, "ep_size": 4, "ep_dispatcher": "fused",
                    "fsdp_ignored_modules": [], "hook_modules": ["a"], "fsdp_implementation": "native",
                    "efsdp_size": null, "capacity_factor": null, "expert_capacity": null,
                    "capacity_overflow": null, "aux_loss_scope": "global", "router_z_loss_coef": 0.0,
                    "expert_bias_update_rate": null
                },
                "kernel": {"names": ["auto", "flash-linear-attention"], "include_kernels": "auto", "chunk_size": 32}
            })
        );
        fsdpturbo_config_free(cfg);
        let (_, cfg) =
            parse(b"kernel_config: {name: flash-linear-attention, include_kernels: chunk_gated_delta_rule}");
        assert_eq!(json(cfg)["kernel"]["include_kernels"], serde_json::json!(["chunk_gated_delta_rule"]));
        // Without a dist_config, `dist` is what a dist_config with only its name gives.
        let (_, named) = parse(b"dist_config: {name: fsdpturbo}");
        assert_eq!(json(cfg)["dist"], json(named)["dist"]);
        assert_eq!(json(cfg)["dist"], serde_json::to_value(DistConfig::default()).unwrap());
        fsdpturbo_config_free(named);
        fsdpturbo_config_free(cfg);
    }
}

#[test]
fn each_error_stays_on_one_line_whatever_the_input() {
    // Control characters in what the seed prints raw are escaped.
    let yaml = "dist_config:\n  name: fsdpturbo\n  ep_dispatcher: \"a\\nb\"\n  fsdp_implementation: \"x\\ry\"\n  \
                \"odd\\nkey\": 1\nkernel_config:\n  name: \"auto, li\\nger\"\n";
    let errors = errors(yaml);
    assert_eq!(errors.len(), 4, "{errors:#?}");
    let text = ConfigErrors(errors).to_string();
    assert_eq!(text.lines().count(), 4, "{text}");
    assert!(text.contains("Unsupported dispatcher a\\nb."), "{text}");
    assert!(text.contains("Unknown FSDP implementation: x\\ry."), "{text}");
    assert!(text.contains("Plugin 'li\\nger' is not registered"), "{text}");
    assert!(text.contains("dist_config['odd\\nkey'] (line 5): Unknown params for DistributedPlugin.FSDPTurboParams: ['odd\\nkey']"), "{text}");
}

/// Found by the `config_yaml` fuzz target: the tag `!%0A0b02u` decodes to a newline, which once
/// landed raw in the message and broke "one line per error". Echoed input is escaped.
#[test]
fn echoed_control_characters_are_escaped() {
    for input in ["!%0A0b02u", "dist_config:\n  ep_dispatcher: \"ea\\u0007ger\\r\\nINFO forged\"\n"] {
        let errors = parse_train_config_bytes(input.as_bytes()).unwrap_err();
        let lines: Vec<String> = errors.0.iter().map(ToString::to_string).collect();
        for line in &lines {
            assert!(!line.chars().any(char::is_control), "raw control characters in {line:?}");
        }
        assert!(
            lines.iter().any(|l| l.contains("\\n") || l.contains("\\u{7}")),
            "escapes missing in {lines:?}"
        );
        assert_eq!(errors.to_string().lines().count(), lines.len(), "one line per error");
    }
}

/// LlamaFactory v1 has no `stage` key (the stage is its command, and its parser refuses the
/// key): a YAML that holds one is refused, pointing at `fsdpturbo plan --stage`.
#[test]
fn stage_key_is_refused() {
    for yaml in ["stage: dpo\n", "cp_size: 2\nstage: sft\n"] {
        let line = yaml.lines().count();
        assert_error(&error(yaml), "stage", line, "`stage` is not a LlamaFactory v1 training argument");
        assert_error(&error(yaml), "stage", line, "give it to `fsdpturbo plan --stage`");
    }
}
