//! Model specs: which modules of a model type are experts (EP) and which are expert-FSDP
//! (EFSDP) units, and — for the built-in families — the module tree a Hugging Face
//! `config.json` describes, so plans can be made without building the model.

use std::collections::{BTreeMap, HashSet};

use serde_json::Value;

use crate::error::{Error, ErrorKind, Escaped, Result, escaped};
use crate::plan::MAX_EXPERTS;

/// The most decoder layers a config.json may give: the largest models have a few hundred, and
/// the module tree grows with them (about 4.5 KB a layer).
pub const MAX_LAYERS: u64 = 10_000;
/// The largest number a config.json may give to a size (hidden, vocab, heads, intermediate):
/// products of two or three stay within 64 bits.
pub const MAX_SIZE: u64 = 1 << 24;

/// What the seed's `FSDPTurboEPModelSpec` holds for one model type.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ModelSpec {
    pub model_type: String,
    pub ep_modules: Vec<String>,
    /// None: derived from `ep_modules` by dropping a `.experts` suffix (seed `_get_ep_fsdp_modules`).
    pub ep_fsdp_modules: Option<Vec<String>>,
}

impl ModelSpec {
    pub fn new(model_type: &str, ep_modules: &[&str], ep_fsdp_modules: Option<&[&str]>) -> ModelSpec {
        let owned = |patterns: &[&str]| patterns.iter().map(|p| p.to_string()).collect::<Vec<_>>();
        ModelSpec {
            model_type: model_type.to_string(),
            ep_modules: owned(ep_modules),
            ep_fsdp_modules: ep_fsdp_modules.map(owned),
        }
    }

    /// The EFSDP module patterns: explicit ones, else each EP pattern without `.experts`.
    pub fn efsdp_modules(&self) -> Vec<String> {
        match &self.ep_fsdp_modules {
            Some(patterns) => patterns.clone(),
            None => {
                self.ep_modules.iter().map(|p| p.strip_suffix(".experts").unwrap_or(p).to_string()).collect()
            }
        }
    }
}

/// A registry of model specs keyed by `model_type`. Plain data: the process-wide instance
/// used by the C ABI and Python lives in `state`.
#[derive(Clone, Debug)]
pub struct SpecRegistry {
    specs: BTreeMap<String, ModelSpec>,
}

impl SpecRegistry {
    /// The built-in specs: `qwen3_moe` and `qwen3_5_moe`, with the seed's patterns, and
    /// `qwen3_5_moe_text` (the text-only `Qwen3_5MoeForCausalLM`, layers under `model`).
    pub fn with_builtins() -> SpecRegistry {
        let mut registry = SpecRegistry { specs: BTreeMap::new() };
        registry.register(ModelSpec::new(
            "qwen3_moe",
            &["model.layers.{*}.mlp.experts"],
            Some(&["model.layers.{*}.mlp"]),
        ));
        registry.register(ModelSpec::new(
            "qwen3_5_moe",
            &["model.language_model.layers.{*}.mlp.experts"],
            Some(&["model.language_model.layers.{*}.mlp"]),
        ));
        registry.register(ModelSpec::new(
            "qwen3_5_moe_text",
            &["model.layers.{*}.mlp.experts"],
            Some(&["model.layers.{*}.mlp"]),
        ));
        registry
    }

    /// Adds or replaces (as the seed does, silently) the spec of `spec.model_type`; returns
    /// the spec it replaced. Patterns are checked by the pattern compiler at plan time.
    pub fn register(&mut self, spec: ModelSpec) -> Option<ModelSpec> {
        self.specs.insert(spec.model_type.clone(), spec)
    }

    /// The spec of `model_type`, or the seed's error listing the registered types.
    pub fn get(&self, model_type: &str) -> Result<&ModelSpec> {
        self.specs.get(model_type).ok_or_else(|| {
            Error::new(
                ErrorKind::Plan,
                format!(
                    "No FSDPTurbo EP spec is registered for model_type={}. Registered: [{}]",
                    Escaped(model_type),
                    self.model_types().join(", ")
                ),
            )
        })
    }

    pub fn model_types(&self) -> Vec<&str> {
        self.specs.keys().map(String::as_str).collect()
    }
}

/// One parameter: its full name (as `named_parameters()` gives it) and shape.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ParamInfo {
    pub name: String,
    pub shape: Vec<u64>,
}

impl ParamInfo {
    pub fn numel(&self) -> u64 {
        self.shape.iter().product()
    }
}

/// A model's modules (in `named_modules()` order, root "" first) and parameters (in
/// `named_parameters()` order), plus notes on what the tree leaves out.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct ModelTree {
    pub model_type: String,
    pub modules: Vec<String>,
    pub params: Vec<ParamInfo>,
    pub notes: Vec<String>,
}

impl ModelTree {
    /// An empty tree of `model_type` with room for `layers` decoder layers, reserved fallibly: a
    /// tree too large for memory is an error, not an abort.
    fn with_layers(model_type: &str, layers: u64) -> Result<ModelTree> {
        const ENTRIES_PER_LAYER: u64 = 32; // modules or parameters of one decoder layer, at most
        let too_large = || {
            Error::new(
                ErrorKind::Plan,
                format!("config.json: a module tree of {layers} layers does not fit in memory"),
            )
        };
        let entries = layers.checked_mul(ENTRIES_PER_LAYER).and_then(|n| usize::try_from(n + 16).ok());
        let entries = entries.ok_or_else(too_large)?;
        let mut tree = ModelTree { model_type: model_type.into(), ..ModelTree::default() };
        tree.modules.try_reserve(entries).map_err(|_| too_large())?;
        tree.params.try_reserve(entries).map_err(|_| too_large())?;
        Ok(tree)
    }
    fn module(&mut self, name: String) {
        self.modules.push(name);
    }
    fn param(&mut self, name: String, shape: &[u64]) {
        self.params.push(ParamInfo { name, shape: shape.to_vec() });
    }
    /// A module holding one `weight` (and a `bias` when `bias` is set).
    fn linear(&mut self, name: String, out_features: u64, in_features: u64, bias: bool) {
        self.param(format!("{name}.weight"), &[out_features, in_features]);
        if bias {
            self.param(format!("{name}.bias"), &[out_features]);
        }
        self.module(name);
    }
    fn norm(&mut self, name: String, size: u64) {
        self.param(format!("{name}.weight"), &[size]);
        self.module(name);
    }
}

/// Builds the module tree of a built-in model family from its HF `config.json` values.
pub fn model_tree_from_config(config: &Value) -> Result<ModelTree> {
    let model_type = config
        .get("model_type")
        .and_then(Value::as_str)
        .ok_or_else(|| Error::new(ErrorKind::Plan, "config.json: `model_type` is missing or not a string"))?;
    match model_type {
        "qwen3_moe" => qwen3_moe_tree(config),
        "qwen3_5_moe" | "qwen3_5_moe_text" => qwen3_5_moe_tree(config),
        other => Err(Error::new(
            ErrorKind::Plan,
            format!(
                "config.json: no module-tree builder for model_type={}; \
                 the built-in families are qwen3_moe and qwen3_5_moe",
                Escaped(other)
            ),
        )),
    }
}

/// Reads the config values a tree builder needs, naming the key and file in every error.
struct ConfigValues<'a> {
    values: &'a Value,
    section: &'static str,
}

impl ConfigValues<'_> {
    fn error(&self, key: &str, what: &str) -> Error {
        Error::new(ErrorKind::Plan, format!("config.json: `{}{key}` {what}", self.section))
    }
    /// The non-negative integer at `key`, at most `limit` (the message says "{limit} {what}").
    fn bounded(&self, key: &str, limit: u64, what: &str) -> Result<u64> {
        match self.values.get(key) {
            Some(v) => match v.as_u64() {
                Some(n) if n > limit => {
                    Err(self.error(key, &format!("is {n}, more than the limit of {limit} {what}")))
                }
                Some(n) => Ok(n),
                None => Err(self.error(key, &format!("must be a non-negative integer, got {}", escaped(v)))),
            },
            None => Err(self.error(key, "is missing (needed to build the module tree)")),
        }
    }
    fn uint(&self, key: &str) -> Result<u64> {
        self.bounded(key, MAX_SIZE, "for a size")
    }
    fn at_least_one(&self, key: &str, n: u64) -> Result<u64> {
        match n {
            0 => Err(self.error(key, "must be at least 1, got 0")),
            n => Ok(n),
        }
    }
    fn positive(&self, key: &str) -> Result<u64> {
        self.at_least_one(key, self.uint(key)?)
    }
    fn uint_or(&self, key: &str, default: u64) -> Result<u64> {
        if self.values.get(key).is_none_or(Value::is_null) { Ok(default) } else { self.uint(key) }
    }
    fn positive_or(&self, key: &str, default: u64) -> Result<u64> {
        if self.values.get(key).is_none_or(Value::is_null) { Ok(default) } else { self.positive(key) }
    }
    fn bool_or(&self, key: &str, default: bool) -> Result<bool> {
        match self.values.get(key) {
            None | Some(Value::Null) => Ok(default),
            Some(v) => v
                .as_bool()
                .ok_or_else(|| self.error(key, &format!("must be true or false, got {}", escaped(v)))),
        }
    }
    fn uint_set_or_empty(&self, key: &str) -> Result<HashSet<u64>> {
        match self.values.get(key) {
            None | Some(Value::Null) => Ok(HashSet::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .ok_or_else(|| self.error(key, &format!("must hold integers, got {}", escaped(v))))
                })
                .collect(),
            Some(v) => Err(self.error(key, &format!("must be a list of integers, got {}", escaped(v)))),
        }
    }
}

/// The shapes shared by both families' sparse MoE blocks and decoders.
struct MoeDims {
    hidden: u64,
    vocab: u64,
    layers: u64,
    heads: u64,
    kv_heads: u64,
    head_dim: u64,
    experts: u64,
    moe_intermediate: u64,
    tie_word_embeddings: bool,
}

impl MoeDims {
    fn read(v: &ConfigValues) -> Result<MoeDims> {
        let hidden = v.positive("hidden_size")?;
        let heads = v.positive("num_attention_heads")?;
        Ok(MoeDims {
            hidden,
            vocab: v.positive("vocab_size")?,
            layers: v.bounded("num_hidden_layers", MAX_LAYERS, "layers")?,
            heads,
            kv_heads: v.positive("num_key_value_heads")?,
            head_dim: v.uint_or("head_dim", hidden / heads)?,
            experts: v.at_least_one("num_experts", v.bounded("num_experts", MAX_EXPERTS, "experts")?)?,
            moe_intermediate: v.positive("moe_intermediate_size")?,
            tie_word_embeddings: v.bool_or("tie_word_embeddings", false)?,
        })
    }

    /// `mlp.gate` (router) and `mlp.experts` (fused [E, 2I, H] / [E, H, I]); the two
    /// families register them in opposite orders.
    fn sparse_block(&self, tree: &mut ModelTree, mlp: &str, router_first: bool) {
        let router = |tree: &mut ModelTree| {
            tree.param(format!("{mlp}.gate.weight"), &[self.experts, self.hidden]);
            tree.module(format!("{mlp}.gate"));
        };
        let experts = |tree: &mut ModelTree| {
            tree.param(
                format!("{mlp}.experts.gate_up_proj"),
                &[self.experts, 2 * self.moe_intermediate, self.hidden],
            );
            tree.param(
                format!("{mlp}.experts.down_proj"),
                &[self.experts, self.hidden, self.moe_intermediate],
            );
            tree.module(format!("{mlp}.experts"));
            tree.module(format!("{mlp}.experts.act_fn"));
        };
        if router_first {
            router(tree);
            experts(tree);
        } else {
            experts(tree);
            router(tree);
        }
    }

    fn attention(&self, tree: &mut ModelTree, attn: &str, q_multiplier: u64, bias: bool) {
        tree.module(attn.to_string());
        let q_out = self.heads * self.head_dim;
        let kv_out = self.kv_heads * self.head_dim;
        tree.linear(format!("{attn}.q_proj"), q_multiplier * q_out, self.hidden, bias);
        tree.linear(format!("{attn}.k_proj"), kv_out, self.hidden, bias);
        tree.linear(format!("{attn}.v_proj"), kv_out, self.hidden, bias);
        tree.linear(format!("{attn}.o_proj"), self.hidden, q_out, bias);
        tree.norm(format!("{attn}.q_norm"), self.head_dim);
        tree.norm(format!("{attn}.k_norm"), self.head_dim);
    }

    fn embeddings(&self, tree: &mut ModelTree, base: &str) {
        tree.param(format!("{base}.embed_tokens.weight"), &[self.vocab, self.hidden]);
        tree.module(format!("{base}.embed_tokens"));
        tree.module(format!("{base}.layers"));
    }

    fn final_norm_and_head(&self, tree: &mut ModelTree, base: &str) {
        tree.norm(format!("{base}.norm"), self.hidden);
        tree.module(format!("{base}.rotary_emb"));
        if self.tie_word_embeddings {
            tree.module("lm_head".to_string());
        } else {
            tree.linear("lm_head".to_string(), self.vocab, self.hidden, false);
        }
    }
}

/// `Qwen3MoeForCausalLM` (transformers 5.x): fused experts, MoE on every
/// `decoder_sparse_step`-th layer not listed in `mlp_only_layers`, dense MLP elsewhere.
fn qwen3_moe_tree(config: &Value) -> Result<ModelTree> {
    let v = ConfigValues { values: config, section: "" };
    let dims = MoeDims::read(&v)?;
    let sparse_step = v.positive_or("decoder_sparse_step", 1)?;
    let mlp_only = v.uint_set_or_empty("mlp_only_layers")?;
    let dense_intermediate = v.uint_or("intermediate_size", 0)?;
    let bias = v.bool_or("attention_bias", false)?;

    let mut tree = ModelTree::with_layers("qwen3_moe", dims.layers)?;
    tree.module(String::new());
    tree.module("model".into());
    dims.embeddings(&mut tree, "model");
    for layer in 0..dims.layers {
        let base = format!("model.layers.{layer}");
        tree.module(base.clone());
        dims.attention(&mut tree, &format!("{base}.self_attn"), 1, bias);
        let mlp = format!("{base}.mlp");
        tree.module(mlp.clone());
        let sparse = !mlp_only.contains(&layer) && (layer + 1) % sparse_step == 0;
        if sparse {
            dims.sparse_block(&mut tree, &mlp, false);
        } else {
            if dense_intermediate == 0 {
                return Err(v.error("intermediate_size", "is missing or 0 but a dense MLP layer needs it"));
            }
            dense_mlp(&mut tree, &mlp, dims.hidden, dense_intermediate);
        }
        tree.norm(format!("{base}.input_layernorm"), dims.hidden);
        tree.norm(format!("{base}.post_attention_layernorm"), dims.hidden);
    }
    dims.final_norm_and_head(&mut tree, "model");
    Ok(tree)
}

fn dense_mlp(tree: &mut ModelTree, name: &str, hidden: u64, intermediate: u64) {
    tree.linear(format!("{name}.gate_proj"), intermediate, hidden, false);
    tree.linear(format!("{name}.up_proj"), intermediate, hidden, false);
    tree.linear(format!("{name}.down_proj"), hidden, intermediate, false);
    tree.module(format!("{name}.act_fn"));
}

/// `Qwen3_5MoeForConditionalGeneration` (a config with `text_config`, layers under
/// `model.language_model`) or the text-only `Qwen3_5MoeForCausalLM` (layers under `model`).
/// Every layer is sparse with one shared expert; `layer_types` picks gated-delta-net linear
/// attention or gated full attention per layer.
fn qwen3_5_moe_tree(config: &Value) -> Result<ModelTree> {
    let (text, base, section) = match config.get("text_config") {
        Some(text) => (text, "model.language_model", "text_config."),
        None => (config, "model", ""),
    };
    let v = ConfigValues { values: text, section };
    let dims = MoeDims::read(&v)?;
    let shared_intermediate = v.positive("shared_expert_intermediate_size")?;
    let layer_types = layer_types(&v, dims.layers)?;
    let key_heads = v.positive("linear_num_key_heads")?;
    let value_heads = v.positive("linear_num_value_heads")?;
    let key_dim = key_heads * v.positive("linear_key_head_dim")?;
    let value_head_dim = v.positive("linear_value_head_dim")?;
    let value_dim = value_heads * value_head_dim;
    let conv_kernel = v.positive("linear_conv_kernel_dim")?;
    let conv_dim = 2 * key_dim + value_dim;

    let mut tree = ModelTree::with_layers("qwen3_5_moe", dims.layers)?;
    tree.module(String::new());
    tree.module("model".into());
    if base != "model" {
        tree.module(base.into());
    }
    dims.embeddings(&mut tree, base);
    for (layer, kind) in layer_types.iter().enumerate() {
        let layer_base = format!("{base}.layers.{layer}");
        tree.module(layer_base.clone());
        if kind == "linear_attention" {
            let la = format!("{layer_base}.linear_attn");
            tree.module(la.clone());
            tree.param(format!("{la}.dt_bias"), &[value_heads]);
            tree.param(format!("{la}.A_log"), &[value_heads]);
            tree.param(format!("{la}.conv1d.weight"), &[conv_dim, 1, conv_kernel]);
            tree.module(format!("{la}.conv1d"));
            tree.norm(format!("{la}.norm"), value_head_dim);
            tree.linear(format!("{la}.out_proj"), dims.hidden, value_dim, false);
            tree.linear(format!("{la}.in_proj_qkv"), conv_dim, dims.hidden, false);
            tree.linear(format!("{la}.in_proj_z"), value_dim, dims.hidden, false);
            tree.linear(format!("{la}.in_proj_b"), value_heads, dims.hidden, false);
            tree.linear(format!("{la}.in_proj_a"), value_heads, dims.hidden, false);
        } else {
            // Gated attention: q_proj emits the query and its output gate.
            dims.attention(&mut tree, &format!("{layer_base}.self_attn"), 2, false);
        }
        let mlp = format!("{layer_base}.mlp");
        tree.module(mlp.clone());
        dims.sparse_block(&mut tree, &mlp, true);
        let shared = format!("{mlp}.shared_expert");
        tree.module(shared.clone());
        dense_mlp(&mut tree, &shared, dims.hidden, shared_intermediate);
        tree.linear(format!("{mlp}.shared_expert_gate"), 1, dims.hidden, false);
        tree.norm(format!("{layer_base}.input_layernorm"), dims.hidden);
        tree.norm(format!("{layer_base}.post_attention_layernorm"), dims.hidden);
    }
    dims.final_norm_and_head(&mut tree, base);
    if base != "model" {
        tree.notes.push(
            "the vision tower (model.visual.*) is not modelled: its parameters are left out of \
             the memory table and stay with the outer FSDP2"
                .into(),
        );
    }
    Ok(tree)
}

fn layer_types(v: &ConfigValues, layers: u64) -> Result<Vec<String>> {
    match v.values.get("layer_types") {
        Some(Value::Array(items)) => {
            if items.len() as u64 != layers {
                return Err(v.error(
                    "layer_types",
                    &format!("has {} entries but num_hidden_layers is {layers}", items.len()),
                ));
            }
            items
                .iter()
                .map(|item| match item.as_str() {
                    Some(kind @ ("linear_attention" | "full_attention")) => Ok(kind.to_string()),
                    _ => Err(v.error(
                        "layer_types",
                        &format!(
                            "entries must be \"linear_attention\" or \"full_attention\", got {}",
                            escaped(item)
                        ),
                    )),
                })
                .collect()
        }
        None | Some(Value::Null) => {
            let interval = v.positive_or("full_attention_interval", 4)?;
            Ok((0..layers)
                .map(|i| {
                    if (i + 1) % interval == 0 { "full_attention" } else { "linear_attention" }.to_string()
                })
                .collect())
        }
        Some(other) => Err(v.error("layer_types", &format!("must be a list, got {}", escaped(other)))),
    }
}
