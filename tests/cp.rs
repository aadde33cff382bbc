//! Context parallelism in a planned launch (`fsdpturbo::cp`): the CP groups, and each layout
//! that cannot work refused with its rule.

use fsdpturbo::cp::{cp_groups, cp_violations, key_value_repeat};
use fsdpturbo::topology::{Topology, TopologySpec};
use serde_json::{Value, json};

fn qwen3_moe(heads: u64, kv_heads: u64) -> Value {
    json!({"model_type": "qwen3_moe", "num_attention_heads": heads, "num_key_value_heads": kv_heads})
}

fn qwen3_5(linear_k: u64, linear_v: u64) -> Value {
    json!({"model_type": "qwen3_5_moe", "text_config": {"num_attention_heads": 16, "num_key_value_heads": 2,
           "linear_num_key_heads": linear_k, "linear_num_value_heads": linear_v}})
}

#[test]
fn cp_groups_are_consecutive_ranks() {
    let topology =
        Topology::new(&TopologySpec { world_size: 8, cp_size: 2, ..TopologySpec::default() }).unwrap();
    assert_eq!(cp_groups(&topology), vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]);
}

#[test]
fn query_heads_not_divisible_by_cp_are_refused() {
    let violations = cp_violations(&qwen3_moe(6, 2), 4, None);
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert!(
        violations[0].starts_with("cp_size 4 does not divide num_attention_heads (6) (rule: Ulysses gives")
    );
    assert!(cp_violations(&qwen3_moe(8, 2), 4, None).is_empty());
}

#[test]
fn fewer_key_value_heads_than_cp_are_repeated_not_refused() {
    assert_eq!(key_value_repeat(16, 2, 4), Some(2));
    assert_eq!(key_value_repeat(2, 1, 2), Some(2));
    assert_eq!(key_value_repeat(32, 4, 2), Some(1));
    assert!(cp_violations(&qwen3_moe(16, 2), 8, Some("sft")).is_empty());
    let violations = cp_violations(&qwen3_moe(16, 3), 2, None);
    assert!(violations[0].starts_with("num_key_value_heads (3) does not divide num_attention_heads (16)"));
}

#[test]
fn linear_attention_heads_not_divisible_by_cp_are_refused() {
    let violations = cp_violations(&qwen3_5(16, 30), 4, None);
    assert_eq!(violations.len(), 1, "{violations:?}");
    assert!(violations[0].starts_with("cp_size 4 does not divide text_config.linear_num_value_heads (30) (rule: the linear attention is head-parallel"));
    let violations = cp_violations(&qwen3_5(6, 32), 4, None);
    assert!(violations[0].starts_with("cp_size 4 does not divide text_config.linear_num_key_heads (6)"));
    assert!(cp_violations(&qwen3_5(16, 32), 4, None).is_empty());
}

#[test]
fn dpo_and_rm_with_cp_are_refused() {
    for stage in ["dpo", "rm"] {
        let violations = cp_violations(&qwen3_moe(16, 4), 2, Some(stage));
        assert_eq!(violations.len(), 1, "{violations:?}");
        assert!(
            violations[0].starts_with(&format!("cp_size 2 with stage {stage}: LlamaFactory's dpo and rm"))
        );
        assert!(cp_violations(&qwen3_moe(16, 4), 1, Some(stage)).is_empty());
    }
}
