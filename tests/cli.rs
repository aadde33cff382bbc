//! The `fsdpturbo plan` CLI, run as a process.

use std::process::Output;

mod common;

/// Runs the CLI (through the target's runner when cross-compiled: `common::target_command`).
fn plan(args: &[&str]) -> Output {
    let cli = std::path::Path::new(env!("CARGO_BIN_EXE_fsdpturbo"));
    common::target_command(cli).args(args).current_dir(env!("CARGO_MANIFEST_DIR")).output().unwrap_or_else(
        |e| {
            panic!(
                "cannot run {}: {e} (a cross-compiled CLI needs its runner in {})",
                cli.display(),
                common::runner_variable()
            )
        },
    )
}

fn stdout(output: &Output) -> String {
    String::from_utf8(output.stdout.clone()).expect("UTF-8 output")
}

#[test]
fn no_arguments_plans_the_embedded_example() {
    let out = plan(&[]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}");
    assert!(text.contains("violations: none"), "{text}");
    assert!(text.contains("expert (edp=1, efsdp=4, ep=8, expert_cp=1)"), "{text}");
    assert!(text.contains("48 EP modules"), "{text}");
    assert!(text.contains("ep rank 7   experts 112-127"), "{text}");
}

/// The plan of the seed's validated CP2/EP4/EFSDP2 layout on 16 ranks, with `extra` options.
fn seed_cp2_plan(extra: &[&str]) -> Output {
    let layout = [
        "plan",
        "--config",
        "examples/configs/qwen3_5_cp2_ep4_efsdp2.yaml",
        "--model",
        "examples/models/qwen3_5_35b_a3b.json",
        "--world-size",
        "16",
    ];
    plan(&[&layout[..], extra].concat())
}

/// The seed's validated CP2/EP4/EFSDP2 layout on 16 ranks.
#[test]
fn seed_layout_world16_cp2_ep4() {
    let out = seed_cp2_plan(&["--rank", "3", "--json"]);
    assert!(out.status.success(), "{}", stdout(&out));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
    assert_eq!(report["meshes"]["expert"]["shape"], serde_json::json!([1, 2, 4, 2]));
    assert_eq!(report["groups"]["ep"], serde_json::json!([1, 3, 5, 7]));
    assert_eq!(report["groups"]["efsdp"], serde_json::json!([3, 11]));
    assert_eq!(report["groups"]["expert_cp"], serde_json::json!([2, 3]));
    assert_eq!(report["groups"]["dp"], serde_json::json!([1, 3, 5, 7, 9, 11, 13, 15]));
    assert_eq!(report["plan"]["ep_modules"].as_array().unwrap().len(), 40);
    assert_eq!(report["expert_owners"][1], serde_json::json!([64, 128]));
    assert_eq!(report["ranks"][3]["local_expert_indices"].as_array().unwrap().len(), 64);
    assert_eq!(report["valid"], true);
}

#[test]
fn every_shipped_example_is_valid() {
    for (config, world) in [
        ("examples/configs/qwen3_30b_a3b_ep8.yaml", "32"),
        ("examples/configs/qwen3_5_cp1_ep16_efsdp1.yaml", "16"),
        ("examples/configs/qwen3_5_cp2_ep4_efsdp2.yaml", "16"),
        ("examples/configs/qwen3_5_a5_cp1_ep8.yaml", "8"),
    ] {
        let model = if config.contains("qwen3_5") {
            "examples/models/qwen3_5_35b_a3b.json"
        } else {
            "examples/models/qwen3_30b_a3b.json"
        };
        let out = plan(&["plan", "--config", config, "--model", model, "--world-size", world]);
        assert!(out.status.success(), "{config}: {}", stdout(&out));
    }
    let out = plan(&[
        "plan",
        "--config",
        "examples/configs/qwen3_30b_a3b_ep8.yaml",
        "--model",
        "examples/models/qwen3_235b_a22b.json",
        "--world-size",
        "64",
    ]);
    assert!(out.status.success(), "{}", stdout(&out));
}

#[test]
fn violations_are_all_reported_with_a_nonzero_exit() {
    let dir = std::env::temp_dir().join(format!("fsdpturbo-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("bad.yaml");
    std::fs::write(&config, "dist_config:\n  name: fsdpturbo\n  ep_size: 3\n  cp_size: 2\n").unwrap();
    let model = dir.join("bad.json");
    std::fs::write(&model, "{\"model_type\": \"qwen3_moe\", \"hidden_size\": 64}").unwrap();
    let out = plan(&[
        "plan",
        "--config",
        config.to_str().unwrap(),
        "--model",
        model.to_str().unwrap(),
        "--world-size",
        "8",
        "--rank",
        "9",
    ]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("Unknown params for DistributedPlugin.FSDPTurboParams: ['cp_size']"), "{text}");
    assert!(text.contains("line 4"), "{text}");
    assert!(text.contains("`num_attention_heads` is missing"), "{text}");
    assert!(text.contains("--rank 9 is outside the world of 8 ranks"), "{text}");
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn topology_violations_use_the_seed_text() {
    let out = plan(&[
        "plan",
        "--config",
        "examples/configs/qwen3_30b_a3b_ep8.yaml",
        "--model",
        "examples/models/qwen3_30b_a3b.json",
        "--world-size",
        "12",
    ]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(text.contains("dp_size must be divisible by ep_size, got 12 % 8 != 0."), "{text}");
}

#[test]
fn usage_errors_exit_2() {
    let out = plan(&["plan", "--config", "x.yaml"]);
    assert_eq!(out.status.code(), Some(2));
    let out = plan(&["plan", "--world-size", "many", "--config", "a", "--model", "b"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--world-size must be a non-negative integer"));
    let out = plan(&["reshard"]);
    assert_eq!(out.status.code(), Some(2));
    let out =
        plan(&["plan", "--config", "/nonexistent.yaml", "--model", "/nonexistent.json", "--world-size", "4"]);
    assert_eq!(out.status.code(), Some(1));
    assert!(stdout(&out).contains("/nonexistent.yaml: cannot read"));
}

/// The CP groups are shown, and a CP layout that cannot work is refused naming its rule: the
/// seed's CP2 layout as DPO (`--stage dpo`: LlamaFactory v1 names the stage by its command,
/// not in the YAML), and with a model whose linear-attention value heads cp 2 does not split.
#[test]
fn cp_groups_are_shown_and_unworkable_cp_layouts_refused() {
    let out = seed_cp2_plan(&[]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}");
    assert!(
        text.contains("cp groups (Ulysses, cp_size 2): [0, 1], [2, 3], [4, 5], [6, 7], [8, 9]"),
        "{text}"
    );

    let dir = std::env::temp_dir().join(format!("fsdpturbo-cli-cp-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut model: serde_json::Value =
        serde_json::from_slice(&std::fs::read("examples/models/qwen3_5_35b_a3b.json").unwrap()).unwrap();
    model["text_config"]["linear_num_value_heads"] = serde_json::json!(33);
    let model_path = dir.join("odd_heads.json");
    std::fs::write(&model_path, model.to_string()).unwrap();
    let out = plan(&[
        "plan",
        "--config",
        "examples/configs/qwen3_5_cp2_ep4_efsdp2.yaml",
        "--model",
        model_path.to_str().unwrap(),
        "--world-size",
        "16",
        "--stage",
        "dpo",
    ]);
    let text = stdout(&out);
    assert_eq!(out.status.code(), Some(1), "{text}");
    assert!(
        text.contains("cp: cp_size 2 with stage dpo: LlamaFactory's dpo and rm trainers take no context"),
        "{text}"
    );
    assert!(text.contains("cp: cp_size 2 does not divide text_config.linear_num_value_heads (33)"), "{text}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// `--stage` feeds the rule that LlamaFactory's pairwise trainers take no CP: dpo and rm at
/// the seed's cp 2 are refused naming the rule, sft is accepted, and an unknown stage is a
/// usage error naming the accepted ones.
#[test]
fn stage_option_feeds_the_cp_rule() {
    for stage in ["dpo", "rm"] {
        let out = seed_cp2_plan(&["--stage", stage, "--json"]);
        assert_eq!(out.status.code(), Some(1), "{}", stdout(&out));
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        assert_eq!(report["stage"], stage);
        let violations = report["violations"].as_array().unwrap();
        assert_eq!(violations.len(), 1, "{violations:?}");
        let rule = format!(
            "cp: cp_size 2 with stage {stage}: LlamaFactory's dpo and rm trainers take no context parallelism \
             (rule: stages [\"dpo\", \"rm\"] need cp_size 1); accepted: cp_size 1, or stage sft"
        );
        assert_eq!(violations[0], rule.as_str());
    }
    let out = seed_cp2_plan(&["--stage", "sft"]);
    let text = stdout(&out);
    assert!(out.status.success(), "{text}");
    assert!(text.contains(", stage sft\nviolations: none"), "{text}");

    for bad in ["ppo", "DPO", ""] {
        let out = seed_cp2_plan(&["--stage", bad]);
        assert_eq!(out.status.code(), Some(2));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(&format!(
                "--stage must be one of sft, dpo, rm (the llamafactory-cli command), got {bad:?}"
            )),
            "{err}"
        );
    }
    let out = seed_cp2_plan(&["--stage"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("--stage needs a value"));
}

/// Expert LoRA on the example (Qwen3-30B-A3B, 48 layers of 128 experts, hidden 2048, expert
/// width 768; ep 8 × efsdp 4 on 32 ranks), computed by hand: rank r adds r·(2048 + 1536) +
/// r·(768 + 2048) elements per expert and layer, 1/32 of them on each rank; the gradients and
/// both AdamW moments are the adapters' only.
#[test]
fn expert_lora_memory_counts_the_adapters_and_only_their_gradients_and_moments() {
    let memory = |extra: &[&str]| {
        let out = plan(&[&["plan", "--json"], extra].concat());
        assert!(out.status.success(), "{}", stdout(&out));
        let report: serde_json::Value = serde_json::from_slice(&out.stdout).expect("JSON");
        report["ranks"][5]["memory"].clone()
    };
    let (full, lora) = (memory(&[]), memory(&["--expert-lora-rank", "16"]));
    let adapters: u64 = 48 * 128 * 16 * (2048 + 1536 + 768 + 2048) / 32;
    assert_eq!(adapters, 19_660_800);
    assert_eq!(lora["param_elements"].as_u64().unwrap(), full["param_elements"].as_u64().unwrap() + adapters);
    assert_eq!(lora["grad_bytes"].as_u64().unwrap(), 2 * adapters); // bf16
    assert_eq!(lora["optimizer_bytes"].as_u64().unwrap(), 4 * adapters);
    assert_eq!(lora["total_bytes"].as_u64().unwrap(), lora["param_bytes"].as_u64().unwrap() + 6 * adapters);
    assert_eq!(plan(&["plan", "--expert-lora-rank", "0"]).status.code(), Some(2));
}
