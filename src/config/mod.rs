//! Strict parsing of the training configuration: a LlamaFactory-style training YAML with its
//! public topology at the top level, `dist_config` (strictly `FSDPTurboParams`) and
//! `kernel_config` (the seed's, docs/seed.md).
//!
//! Every problem is collected (not only the first) and each names its YAML path and line.
//! Values come from `serde_yaml`; as its `Value` has no spans, the line of each key comes from
//! a marked pass over the events of the same libyaml parser (`unsafe_libyaml`, the crate
//! serde_yaml itself parses with), so both passes agree on the syntax. That pass runs first
//! and refuses what would make serde_yaml slow or huge: nesting beyond its limit, recursive
//! aliases, and aliases that expand to more than 10 000 nodes.
//!
//! The seed's string coercions are kept: a `dist_config`/`kernel_config` string that starts
//! with `{` is JSON; inside those mappings (recursively into nested mappings, not lists)
//! `"true"`/`"false"` in any case become booleans, ASCII digit strings integers, and digit
//! strings with one `.` floats. Top-level fields are typed strictly.

use std::collections::HashMap;
use std::fmt;

use serde::{Serialize, Serializer};
use serde_yaml::Value;

use crate::error::must_escape;

mod lines;
mod schema;
#[cfg(test)]
mod tests;
mod text;

use lines::{Index, MAX_NESTING};
use schema::{dist_config, kernel_config, train_config};
pub(crate) use text::py_list;
use text::py_str;
pub use text::{ConfigError, ConfigErrors};

// ---------------------------------------------------------------------------------------------
// Public types
// ---------------------------------------------------------------------------------------------

/// The token dispatcher of the expert-parallel forward (`dist_config.ep_dispatcher`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Dispatcher {
    Eager,
    Fused,
    Mc2,
    Domino,
}

/// Every dispatcher.
const DISPATCHERS: [Dispatcher; 4] =
    [Dispatcher::Eager, Dispatcher::Fused, Dispatcher::Mc2, Dispatcher::Domino];

impl Dispatcher {
    /// The name used in the YAML: "eager", "fused", "mc2" or "domino".
    pub fn as_str(self) -> &'static str {
        match self {
            Dispatcher::Eager => "eager",
            Dispatcher::Fused => "fused",
            Dispatcher::Mc2 => "mc2",
            Dispatcher::Domino => "domino",
        }
    }

    /// The dispatcher of a YAML name (exact, case-sensitive, as the seed compares it).
    pub fn from_name(name: &str) -> Option<Dispatcher> {
        DISPATCHERS.into_iter().find(|d| d.as_str() == name)
    }
}

/// The EFSDP implementation (`dist_config.fsdp_implementation`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum FsdpImplementation {
    Native,
    Custom,
}

impl FsdpImplementation {
    /// The name used in the YAML: "native" or "custom".
    pub fn as_str(self) -> &'static str {
        match self {
            FsdpImplementation::Native => "native",
            FsdpImplementation::Custom => "custom",
        }
    }

    /// The implementation of a YAML name (exact, case-sensitive).
    pub fn from_name(name: &str) -> Option<FsdpImplementation> {
        match name {
            "native" => Some(FsdpImplementation::Native),
            "custom" => Some(FsdpImplementation::Custom),
            _ => None,
        }
    }
}

/// What a capacity-bounded dispatch does with rows over an expert's capacity
/// (`dist_config.capacity_overflow`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum CapacityOverflow {
    /// The rows over capacity skip the expert (their slot adds nothing); counted as dropped.
    Drop,
    /// An error on every rank of the EP group naming the layer, the expert and the counts.
    Fail,
}

impl CapacityOverflow {
    const ALL: [CapacityOverflow; 2] = [CapacityOverflow::Drop, CapacityOverflow::Fail];

    /// The name used in the YAML: "drop" or "fail".
    pub fn as_str(self) -> &'static str {
        match self {
            CapacityOverflow::Drop => "drop",
            CapacityOverflow::Fail => "fail",
        }
    }
}

/// Over which tokens the router's load-balancing (aux) loss takes its statistics
/// (`dist_config.aux_loss_scope`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AuxLossScope {
    /// The global batch: every data-parallel rank's tokens (one-process semantics).
    Global,
    /// Each rank's own tokens (plain Hugging Face under data parallelism).
    Local,
    /// Each sequence's tokens, averaged over the sequences of the global batch.
    Sequence,
}

impl AuxLossScope {
    const ALL: [AuxLossScope; 3] = [AuxLossScope::Global, AuxLossScope::Local, AuxLossScope::Sequence];

    /// The name used in the YAML: "global", "local" or "sequence".
    pub fn as_str(self) -> &'static str {
        match self {
            AuxLossScope::Global => "global",
            AuxLossScope::Local => "local",
            AuxLossScope::Sequence => "sequence",
        }
    }
}

/// `dist_config`: LlamaFactory's `FSDPTurboParams`, with the seed's defaults, plus our
/// extensions: `efsdp_size` (docs/design.md §4.6), the capacity-bounded dispatch and load balancing.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct DistConfig {
    pub name: String,
    pub reshard_after_forward: bool,
    pub offload_params: bool,
    pub pin_memory: bool,
    pub dcp_path: Option<String>,
    pub ep_size: u64,
    pub ep_dispatcher: Dispatcher,
    pub fsdp_ignored_modules: Vec<String>,
    pub hook_modules: Vec<String>,
    pub fsdp_implementation: FsdpImplementation,
    /// Explicit expert-FSDP size; `None` = the seed's formula (dp / ep).
    pub efsdp_size: Option<u64>,
    /// Capacity-bounded dispatch: each expert takes at most `ceil(factor · tokens · top_k / E)`
    /// rows from each rank per forward; `None` (and no `expert_capacity`) = dropless.
    pub capacity_factor: Option<f64>,
    /// Capacity-bounded dispatch with an explicit capacity: rows per expert per source rank.
    pub expert_capacity: Option<u64>,
    /// What overflows a capacity: `Drop` unless the YAML says otherwise; `None` without one.
    pub capacity_overflow: Option<CapacityOverflow>,
    pub aux_loss_scope: AuxLossScope,
    /// Coefficient of the router z-loss (mean squared log-sum-exp of the router logits); 0 = off.
    pub router_z_loss_coef: f64,
    /// Aux-loss-free balancing (DeepSeek-V3): the per-expert routing bias moves by this much per
    /// optimizer step towards balance; `None` = off.
    pub expert_bias_update_rate: Option<f64>,
}

impl Default for DistConfig {
    fn default() -> Self {
        DistConfig {
            name: DIST_PLUGIN_NAME.to_string(),
            reshard_after_forward: true,
            offload_params: false,
            pin_memory: true,
            dcp_path: None,
            ep_size: 1,
            ep_dispatcher: Dispatcher::Eager,
            fsdp_ignored_modules: Vec::new(),
            hook_modules: Vec::new(),
            fsdp_implementation: FsdpImplementation::Native,
            efsdp_size: None,
            capacity_factor: None,
            expert_capacity: None,
            capacity_overflow: None,
            aux_loss_scope: AuxLossScope::Global,
            router_z_loss_coef: 0.0,
            expert_bias_update_rate: None,
        }
    }
}

/// `kernel_config.include_kernels`: `auto` (also `true`) or an explicit list, in the order
/// written. Serialises as `"auto"` or a list of names.
#[derive(Clone, Debug, PartialEq)]
pub enum IncludeKernels {
    Auto,
    List(Vec<String>),
}

impl Serialize for IncludeKernels {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        match self {
            IncludeKernels::Auto => serializer.serialize_str("auto"),
            IncludeKernels::List(names) => names.serialize(serializer),
        }
    }
}

/// `kernel_config`: the model kernels to apply, in the order written.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct KernelConfig {
    pub names: Vec<String>,
    pub include_kernels: IncludeKernels,
    pub chunk_size: u32,
}

/// The parts of a training YAML this library owns. Other top-level keys (model, dataset, …)
/// are left to the trainer.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct TrainConfig {
    /// `None` = world / cp.
    pub dp_size: Option<u64>,
    pub cp_size: u64,
    pub cp_mode: String,
    pub mp_replicate_size: u64,
    /// `None` = world / mp_replicate_size.
    pub mp_shard_size: Option<u64>,
    /// Seconds.
    pub dist_timeout: u64,
    pub bf16: bool,
    /// `dist_config`; every default where the YAML has none (or it is null).
    pub dist: DistConfig,
    /// `None` when the YAML has no `kernel_config` (or it is null).
    pub kernel: Option<KernelConfig>,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            dp_size: None,
            cp_size: 1,
            cp_mode: "ulysses".to_string(),
            mp_replicate_size: 1,
            mp_shard_size: None,
            dist_timeout: 18000,
            bf16: false,
            dist: DistConfig::default(),
            kernel: None,
        }
    }
}

/// The `name` of the distributed plugin this library implements.
pub const DIST_PLUGIN_NAME: &str = "fsdpturbo";
/// The kernel names `kernel_config.name` accepts.
pub const KERNEL_NAMES: [&str; 2] = ["auto", "flash-linear-attention"];
/// The Flash Linear Attention kernels `include_kernels` selects from (`auto` = both).
pub const FLA_KERNELS: [&str; 2] = ["chunk_gated_delta_rule", "fused_recurrent_gated_delta_rule"];
/// The accepted `kernel_config.chunk_size` values.
const CHUNK_SIZES: [u32; 3] = [16, 32, 64];
/// The default `kernel_config.chunk_size`.
const DEFAULT_CHUNK_SIZE: u32 = 64;

/// The keys of `dist_config` (the fields of `FSDPTurboParams`, plus our extensions).
const DIST_FIELDS: [&str; 17] = [
    "name",
    "reshard_after_forward",
    "offload_params",
    "pin_memory",
    "dcp_path",
    "ep_size",
    "ep_dispatcher",
    "fsdp_ignored_modules",
    "hook_modules",
    "fsdp_implementation",
    "efsdp_size",
    "capacity_factor",
    "expert_capacity",
    "capacity_overflow",
    "aux_loss_scope",
    "router_z_loss_coef",
    "expert_bias_update_rate",
];
/// The public topology fields: top level of the training YAML.
const TOPOLOGY_FIELDS: [&str; 6] =
    ["dp_size", "cp_size", "cp_mode", "mp_replicate_size", "mp_shard_size", "dist_timeout"];
/// The keys of `kernel_config`.
const KERNEL_FIELDS: [&str; 3] = ["name", "include_kernels", "chunk_size"];
/// Keys that only the model spec sets.
const MODEL_SPEC_FIELDS: [&str; 2] = ["ep_modules", "ep_fsdp_modules"];

// ---------------------------------------------------------------------------------------------
// Entry points
// ---------------------------------------------------------------------------------------------

/// Parses and validates a training YAML.
pub fn parse_train_config(yaml: &str) -> Result<TrainConfig, ConfigErrors> {
    let (root, lines) = load_yaml(yaml, Vec::new())?;
    let mut cx = Cx::new(lines);
    let config = train_config(&mut cx, &root);
    cx.finish(config)
}

/// As [`parse_train_config`], for bytes that may not be UTF-8 (reported with the byte offset).
pub fn parse_train_config_bytes(bytes: &[u8]) -> Result<TrainConfig, ConfigErrors> {
    parse_train_config(utf8(bytes)?)
}

/// Parses a `dist_config` mapping given as YAML or JSON text (what the Python layer hands
/// over for a dict); paths are named `dist_config.*` and lines are those of `text`.
pub fn parse_dist_config(text: &str) -> Result<DistConfig, ConfigErrors> {
    parse_fragment(text, "dist_config", dist_config)
}

/// Parses a `kernel_config` mapping given as YAML or JSON text.
pub fn parse_kernel_config(text: &str) -> Result<KernelConfig, ConfigErrors> {
    parse_fragment(text, "kernel_config", kernel_config)
}

fn parse_fragment<T>(
    text: &str,
    name: &str,
    parse: fn(&mut Cx, &Path, &Value) -> Option<T>,
) -> Result<T, ConfigErrors> {
    let base = vec![Seg::Key(name.to_string())];
    let (root, lines) = match load_yaml(text, base.clone()) {
        Ok(loaded) => loaded,
        // JSON that YAML does not read (e.g. a `\/` escape) is still JSON.
        Err(mut errors) if text.trim_start().starts_with('{') => match serde_json::from_str::<Value>(text) {
            Ok(value) => (value, Lines::default()),
            Err(json) => {
                errors
                    .0
                    .push(doc_error(Some(json.line()), format!("the text is not valid JSON either: {json}")));
                return Err(errors);
            }
        },
        Err(errors) => return Err(errors),
    };
    let mut cx = Cx::new(lines);
    let path = Path(base);
    if root.is_null() {
        cx.err(&path, format!("{name} is empty: expected a mapping"));
    }
    let parsed = parse(&mut cx, &path, &root);
    cx.finish(parsed)
}

fn utf8(bytes: &[u8]) -> Result<&str, ConfigErrors> {
    std::str::from_utf8(bytes).map_err(|e| {
        let at = e.valid_up_to();
        let before = &bytes[..at];
        let line = before.iter().filter(|&&b| b == b'\n').count() + 1;
        let column = at - before.iter().rposition(|&b| b == b'\n').map_or(0, |p| p + 1) + 1;
        let what = match e.error_len() {
            Some(_) => format!("invalid byte 0x{:02X}", bytes[at]),
            None => "incomplete UTF-8 sequence at the end".to_string(),
        };
        ConfigErrors(vec![doc_error(
            Some(line),
            format!("the configuration is not valid UTF-8: {what} at byte offset {at} (line {line}, column {column})"),
        )])
    })
}

fn doc_error(line: Option<usize>, message: String) -> ConfigError {
    ConfigError { path: String::new(), line, message }
}

/// Parses YAML text into a value (merge keys applied) and the line of each key.
fn load_yaml(text: &str, base: Vec<Seg>) -> Result<(Value, Lines), ConfigErrors> {
    // The marked pass runs first because it stops one level beyond serde_yaml's nesting limit:
    // libyaml's work per token grows with the flow depth, so deep junk would cost quadratic
    // time in serde_yaml before it reached its own limit (100 KB of `[` took 20 s).
    // It also refuses alias bombs, which serde_yaml would expand.
    let index = Lines::index(text, base);
    if let Some((line, message)) = index.refused {
        return Err(ConfigErrors(vec![doc_error(Some(line), message)]));
    }
    match serde_yaml::from_str::<Value>(text) {
        Ok(mut value) => {
            if let Err(e) = value.apply_merge() {
                return Err(ConfigErrors(vec![doc_error(None, format!("invalid YAML merge key (<<): {e}"))]));
            }
            Ok((value, index.lines))
        }
        Err(e) => Err(ConfigErrors(vec![yaml_error(index, &e)])),
    }
}

fn yaml_error(index: Index, e: &serde_yaml::Error) -> ConfigError {
    let message = e.to_string();
    if message.contains("duplicate entry") {
        // serde_yaml points at the mapping; find the repeated key itself.
        if let Some((path, first, line)) = index.duplicates.into_iter().next() {
            return ConfigError {
                path: Path(path).to_string(),
                line: Some(line),
                message: format!("duplicate key (first written at line {first})"),
            };
        }
    }
    let line = e.location().map(|l| l.line());
    // serde_yaml cannot hold integers beyond 64 bits: "<path>: invalid type: integer `<n>` as
    // u128, expected any YAML value at line L column C".
    if let Some((path, rest)) = message.split_once(": invalid type: integer `") {
        if let Some((digits, rest)) = rest.split_once("` as ") {
            if rest.starts_with("u128") || rest.starts_with("i128") {
                return ConfigError {
                    path: path.trim_start_matches('.').to_string(),
                    line,
                    message: format!("integer {digits} is out of range: integers must lie in [-2^63, 2^64)"),
                };
            }
        }
    }
    let message = if message.starts_with("recursion limit exceeded") {
        // Reached through aliases (the marked pass does not follow them).
        format!("the YAML nests deeper than {MAX_NESTING} levels ({message})")
    } else {
        format!("invalid YAML: {message}")
    };
    doc_error(line, message)
}

// ---------------------------------------------------------------------------------------------
// Paths, lines and the error collector
// ---------------------------------------------------------------------------------------------

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
enum Seg {
    Key(String),
    Index(usize),
}

/// A YAML path: `dist_config.hook_modules[1]`.
#[derive(Clone, Debug, Default)]
struct Path(Vec<Seg>);

impl Path {
    fn key(&self, key: &str) -> Path {
        let mut segs = self.0.clone();
        segs.push(Seg::Key(key.to_string()));
        Path(segs)
    }

    fn index(&self, index: usize) -> Path {
        let mut segs = self.0.clone();
        segs.push(Seg::Index(index));
        Path(segs)
    }
}

impl fmt::Display for Path {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, seg) in self.0.iter().enumerate() {
            match seg {
                // A key with a line break would split the one-error-per-line output.
                Seg::Key(key) if key.chars().any(must_escape) => write!(f, "[{}]", py_str(key))?,
                Seg::Key(key) if i == 0 => f.write_str(key)?,
                Seg::Key(key) => write!(f, ".{key}")?,
                Seg::Index(index) => write!(f, "[{index}]")?,
            }
        }
        Ok(())
    }
}

/// The 1-based line of each mapping key and sequence item, by path.
#[derive(Debug, Default)]
struct Lines(HashMap<Vec<Seg>, usize>);

impl Lines {
    /// The line of `path`, or of its nearest ancestor that has one (values that came from a
    /// JSON string, an alias or a merge key have no line of their own).
    fn of(&self, path: &[Seg]) -> Option<usize> {
        (0..=path.len()).rev().find_map(|n| self.0.get(&path[..n]).copied())
    }
}

/// Collects the errors of one parse.
struct Cx {
    lines: Lines,
    errors: Vec<ConfigError>,
}

impl Cx {
    fn new(lines: Lines) -> Self {
        Cx { lines, errors: Vec::new() }
    }

    fn err(&mut self, path: &Path, message: impl Into<String>) {
        self.errors.push(ConfigError {
            path: path.to_string(),
            line: self.lines.of(&path.0),
            message: message.into(),
        });
    }

    fn finish<T>(mut self, value: Option<T>) -> Result<T, ConfigErrors> {
        match value {
            Some(value) if self.errors.is_empty() => Ok(value),
            _ => {
                // Document order; errors of the whole document (no line) first.
                self.errors.sort_by_key(|e| e.line.unwrap_or(0));
                Err(ConfigErrors(self.errors))
            }
        }
    }
}
