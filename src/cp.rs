//! Context parallelism (Ulysses) in a planned launch: which ranks form each CP group, and
//! the layouts that cannot work, each violation naming its rule.
//!
//! Ulysses hands each rank of a CP group `heads / cp` attention heads over the whole
//! sequence, so `cp` must divide the model's `num_attention_heads`; key/value heads that `cp`
//! does not divide are repeated (each still serving whole query groups), which is always
//! possible once `cp` divides the query heads. Qwen3.5's linear attention is head-parallel with
//! no repeat: `cp` must divide `linear_num_key_heads` and `linear_num_value_heads`.
//! LlamaFactory's pairwise stages (`dpo`, `rm`) take no context parallelism. LlamaFactory v1
//! names the stage by its command (`llamafactory-cli sft|dpo|rm`), not in the training YAML,
//! so the stage comes from `fsdpturbo plan --stage`.

use serde_json::Value;

use crate::topology::Topology;

/// LlamaFactory's training stages: the commands of `llamafactory-cli` that train.
pub const STAGES: [&str; 3] = ["sft", "dpo", "rm"];
/// The training stages that cannot run with context parallelism.
pub const STAGES_WITHOUT_CP: [&str; 2] = ["dpo", "rm"];

/// The ranks of every CP group (the data mesh's `cp` dim), in order.
pub fn cp_groups(topology: &Topology) -> Vec<Vec<u64>> {
    topology.data_mesh().groups(&["cp"]).expect("the data mesh has a cp dim")
}

/// The text model's section of a `config.json` (`text_config` of a multimodal one).
fn text_config(model: &Value) -> &Value {
    model.get("text_config").filter(|v| v.is_object()).unwrap_or(model)
}

/// The times each key/value head is repeated so that `cp` splits them, each still serving
/// whole query groups: the smallest divisor `r` of `heads / kv_heads` with `cp | kv_heads · r`.
pub fn key_value_repeat(heads: u64, kv_heads: u64, cp: u64) -> Option<u64> {
    if kv_heads == 0 || heads % kv_heads != 0 {
        return None;
    }
    let groups = heads / kv_heads;
    (1..=groups).find(|r| groups % r == 0 && (kv_heads * r) % cp == 0)
}

/// Every reason the layout `cp` cannot run `model` (its `config.json`) at `stage`.
pub fn cp_violations(model: &Value, cp: u64, stage: Option<&str>) -> Vec<String> {
    let mut violations = Vec::new();
    if cp <= 1 {
        return violations;
    }
    if let Some(stage) = stage.filter(|s| STAGES_WITHOUT_CP.contains(s)) {
        violations.push(format!(
            "cp_size {cp} with stage {stage}: LlamaFactory's dpo and rm trainers take no context \
             parallelism (rule: stages {STAGES_WITHOUT_CP:?} need cp_size 1); accepted: cp_size 1, or stage sft"
        ));
    }
    let text = text_config(model);
    let count = |key: &str| text.get(key).and_then(Value::as_u64);
    let section = if text == model { "" } else { "text_config." };
    if let Some(heads) = count("num_attention_heads") {
        if heads % cp != 0 {
            violations.push(format!(
                "cp_size {cp} does not divide {section}num_attention_heads ({heads}) (rule: Ulysses gives each \
                 CP rank heads / cp_size attention heads); accepted: a cp_size dividing {heads}"
            ));
        } else if let Some(kv) = count("num_key_value_heads") {
            if key_value_repeat(heads, kv, cp).is_none() {
                violations.push(format!(
                    "{section}num_key_value_heads ({kv}) does not divide num_attention_heads ({heads}) (rule: each \
                     key/value head serves whole query groups)"
                ));
            }
        }
    }
    for key in ["linear_num_key_heads", "linear_num_value_heads"] {
        if let Some(heads) = count(key).filter(|h| h % cp != 0) {
            violations.push(format!(
                "cp_size {cp} does not divide {section}{key} ({heads}) (rule: the linear attention is \
                 head-parallel over the CP group, its key and value heads split without repeats); accepted: a \
                 cp_size dividing {heads}"
            ));
        }
    }
    violations
}
