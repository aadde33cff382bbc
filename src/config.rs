//! Strict parsing of the training configuration: a LlamaFactory-style training YAML with its
//! public topology at the top level, `dist_config` (strictly `FSDPTurboParams`) and
//! `kernel_config` (reference: `seed-semantics.md` §1.1, §1.2, §1.5).
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
use serde_yaml::{Mapping, Value};

use crate::error::{Error, ErrorKind};

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

/// Every dispatcher. (Module constants of the core stay private where a public one would be
/// picked up by cbindgen into the C header.)
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

/// `dist_config`: LlamaFactory's `FSDPTurboParams`, with the seed's defaults, plus our one
/// extension `efsdp_size` (DESIGN §4.6).
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
    /// `None` when the YAML has no `dist_config` (or it is null).
    pub dist: Option<DistConfig>,
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
            dist: None,
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

/// The keys of `dist_config` (the fields of `FSDPTurboParams`, plus `efsdp_size`).
const DIST_FIELDS: [&str; 11] = [
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
];
/// The public topology fields: top level of the training YAML.
const TOPOLOGY_FIELDS: [&str; 6] =
    ["dp_size", "cp_size", "cp_mode", "mp_replicate_size", "mp_shard_size", "dist_timeout"];
/// The keys of `kernel_config`.
const KERNEL_FIELDS: [&str; 3] = ["name", "include_kernels", "chunk_size"];
/// Keys that only the model spec sets.
const MODEL_SPEC_FIELDS: [&str; 2] = ["ep_modules", "ep_fsdp_modules"];

// ---------------------------------------------------------------------------------------------
// Errors
// ---------------------------------------------------------------------------------------------

/// One problem in the configuration: where (YAML path, 1-based line) and what.
#[derive(Clone, Debug, PartialEq)]
pub struct ConfigError {
    /// e.g. `dist_config.ep_size` or `dist_config.hook_modules[1]`; empty for the document.
    pub path: String,
    pub line: Option<usize>,
    pub message: String,
}

/// Text echoed from the input with its control characters escaped (`\n`, `\u{7}`), so that an
/// error stays one line and input cannot forge log lines.
struct Escaped<'a>(&'a str);

impl fmt::Display for Escaped<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for c in self.0.chars() {
            if c.is_control() {
                write!(f, "{}", c.escape_default())?;
            } else {
                write!(f, "{c}")?;
            }
        }
        Ok(())
    }
}

impl fmt::Display for ConfigError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (path, message) = (Escaped(&self.path), Escaped(&self.message));
        match (self.path.is_empty(), self.line) {
            (false, Some(line)) => write!(f, "{path} (line {line}): {message}"),
            (false, None) => write!(f, "{path}: {message}"),
            (true, Some(line)) => write!(f, "line {line}: {message}"),
            (true, None) => write!(f, "{message}"),
        }
    }
}

impl std::error::Error for ConfigError {}

/// Every problem found in one configuration, in document order.
#[derive(Clone, Debug, PartialEq)]
pub struct ConfigErrors(pub Vec<ConfigError>);

impl fmt::Display for ConfigErrors {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, err) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("\n")?;
            }
            write!(f, "{err}")?;
        }
        Ok(())
    }
}

impl std::error::Error for ConfigErrors {}

impl From<ConfigErrors> for Error {
    fn from(errors: ConfigErrors) -> Self {
        Error::new(ErrorKind::Config, errors.to_string())
    }
}

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
    let message = one_line(&e.to_string());
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
                Seg::Key(key) if key.chars().any(char::is_control) => write!(f, "[{}]", py_str(key))?,
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

// ---------------------------------------------------------------------------------------------
// The training YAML
// ---------------------------------------------------------------------------------------------

fn train_config(cx: &mut Cx, root: &Value) -> Option<TrainConfig> {
    let top = Path::default();
    let map = match root {
        Value::Mapping(map) => map,
        Value::Null => {
            cx.err(&top, "the training configuration is empty: expected a YAML mapping at the top level");
            return None;
        }
        other => {
            cx.err(&top, format!("expected a YAML mapping at the top level, got {}", describe(other)));
            return None;
        }
    };

    for key in map.keys().filter_map(Value::as_str) {
        if key != "name" && DIST_FIELDS.contains(&key) {
            cx.err(
                &top.key(key),
                format!(
                    "`{key}` is a dist_config (FSDPTurboParams) field, not a top-level training \
                     argument: move it inside dist_config"
                ),
            );
        }
    }

    let mut cfg = TrainConfig::default();
    let field = |name: &str| map.get(name).map(|v| (top.key(name), v));
    if let Some((path, v)) = field("dp_size") {
        cfg.dp_size = optional(v, |v| size(cx, &path, "dp_size", v));
    }
    if let Some((path, v)) = field("cp_size") {
        cfg.cp_size = size(cx, &path, "cp_size", v).unwrap_or(cfg.cp_size);
    }
    if let Some((path, v)) = field("cp_mode") {
        cfg.cp_mode = string(cx, &path, v).unwrap_or(cfg.cp_mode);
    }
    if let Some((path, v)) = field("mp_replicate_size") {
        cfg.mp_replicate_size = size(cx, &path, "mp_replicate_size", v).unwrap_or(cfg.mp_replicate_size);
    }
    if let Some((path, v)) = field("mp_shard_size") {
        cfg.mp_shard_size = optional(v, |v| size(cx, &path, "mp_shard_size", v));
    }
    if let Some((path, v)) = field("dist_timeout") {
        cfg.dist_timeout = size(cx, &path, "dist_timeout", v).unwrap_or(cfg.dist_timeout);
    }
    if let Some((path, v)) = field("bf16") {
        cfg.bf16 = boolean(cx, &path, v).unwrap_or(cfg.bf16);
    }
    if let Some((path, v)) = field("dist_config") {
        cfg.dist = dist_config(cx, &path, v);
    }
    if let Some((path, v)) = field("kernel_config") {
        cfg.kernel = kernel_config(cx, &path, v);
    }
    check_topology(cx, &cfg);
    Some(cfg)
}

/// The topology checks that need no world size: sizes implied by the explicit ones must
/// agree and divide (reference §3.1, §3.3).
fn check_topology(cx: &mut Cx, cfg: &TrainConfig) {
    // A size that was rejected holds its default here: checking it would only mislead.
    const SIZES: [&str; 6] = [
        "dp_size",
        "cp_size",
        "mp_replicate_size",
        "mp_shard_size",
        "dist_config.ep_size",
        "dist_config.efsdp_size",
    ];
    if cx.errors.iter().any(|e| SIZES.contains(&e.path.as_str())) {
        return;
    }
    let top = Path::default();
    let (cp, r) = (cfg.cp_size, cfg.mp_replicate_size);
    // The world size, when the explicit sizes imply it: mp_replicate * mp_shard = dp * cp.
    let model_world = cfg.mp_shard_size.map(|s| (s, r.checked_mul(s)));
    let data_world = cfg.dp_size.map(|d| (d, d.checked_mul(cp)));
    for (name, world) in [("mp_shard_size", model_world.map(|w| w.1)), ("dp_size", data_world.map(|w| w.1))] {
        if let Some(None) = world {
            cx.err(&top.key(name), "the world size it implies overflows a 64-bit integer");
            return;
        }
    }
    let dp = match (model_world, data_world) {
        (Some((s, Some(w_model))), Some((d, Some(w_data)))) => {
            if w_model != w_data {
                cx.err(
                    &top.key("mp_shard_size"),
                    format!(
                        "mp_replicate_size * mp_shard_size must equal dp_size * cp_size (both are the \
                         world size), got {r} * {s} != {d} * {cp}."
                    ),
                );
            }
            Some(d)
        }
        (Some((_, Some(w))), None) if w % cp != 0 => {
            cx.err(
                &top.key("cp_size"),
                format!(
                    "world_size ({w}) must be divisible by cp_size ({cp}). (The world size is \
                     mp_replicate_size * mp_shard_size.)"
                ),
            );
            None
        }
        (Some((_, Some(w))), None) => Some(w / cp),
        (_, data) => data.map(|(d, _)| d),
    };
    let (Some(dp), Some(dist)) = (dp, &cfg.dist) else { return };
    let ep = dist.ep_size;
    let dist_path = top.key("dist_config");
    if dp % ep != 0 {
        cx.err(
            &dist_path.key("ep_size"),
            format!("dp_size must be divisible by ep_size, got {dp} % {ep} != 0."),
        );
    } else if let Some(efsdp) = dist.efsdp_size {
        match ep.checked_mul(efsdp) {
            Some(product) if dp % product == 0 => {}
            _ => cx.err(
                &dist_path.key("efsdp_size"),
                format!(
                    "dp_size must be divisible by ep_size * efsdp_size, got {dp} % ({ep} * {efsdp}) != 0."
                ),
            ),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// dist_config (FSDPTurboParams)
// ---------------------------------------------------------------------------------------------

fn dist_config(cx: &mut Cx, path: &Path, value: &Value) -> Option<DistConfig> {
    let map = plugin_mapping(cx, path, value, |ty| {
        format!("DistributedPlugin config must be a mapping or FSDPTurboParams, got {ty}.")
    })?;
    unknown_keys(cx, path, &map, &DIST_FIELDS, "DistributedPlugin.FSDPTurboParams", dist_hint);

    let mut d = DistConfig::default();
    let field = |name: &str| map.get(name).map(|v| (path.key(name), v));
    match field("name") {
        None => cx.err(path, "Plugin configuration must have a 'name' field."),
        Some((p, v)) => {
            if let Some(name) = string(cx, &p, v) {
                if name == DIST_PLUGIN_NAME {
                    d.name = name;
                } else {
                    cx.err(
                        &p,
                        format!(
                            "this library implements the '{DIST_PLUGIN_NAME}' plugin, got {}",
                            py_str(&name)
                        ),
                    );
                }
            }
        }
    }
    if let Some((p, v)) = field("reshard_after_forward") {
        d.reshard_after_forward = boolean(cx, &p, v).unwrap_or(d.reshard_after_forward);
    }
    if let Some((p, v)) = field("offload_params") {
        d.offload_params = boolean(cx, &p, v).unwrap_or(d.offload_params);
    }
    if let Some((p, v)) = field("pin_memory") {
        d.pin_memory = boolean(cx, &p, v).unwrap_or(d.pin_memory);
    }
    if let Some((p, v)) = field("dcp_path") {
        d.dcp_path = optional(v, |v| match string(cx, &p, v) {
            Some(s) if s.is_empty() => {
                cx.err(&p, "dcp_path must not be empty: give a checkpoint path, or null for none");
                None
            }
            s => s,
        });
    }
    if let Some((p, v)) = field("ep_size") {
        d.ep_size = size(cx, &p, "ep_size", v).unwrap_or(d.ep_size);
    }
    if let Some((p, v)) = field("ep_dispatcher") {
        if let Some(name) = string(cx, &p, v) {
            match Dispatcher::from_name(&name) {
                Some(dispatcher) => d.ep_dispatcher = dispatcher,
                None => cx.err(
                    &p,
                    format!(
                        "Unsupported dispatcher {}. Supported: {}",
                        one_line(&name),
                        py_list(sorted(DISPATCHERS.map(Dispatcher::as_str)))
                    ),
                ),
            }
        }
    }
    if let Some((p, v)) = field("fsdp_ignored_modules") {
        d.fsdp_ignored_modules = string_list(cx, &p, v).unwrap_or_default();
    }
    if let Some((p, v)) = field("hook_modules") {
        d.hook_modules = string_list(cx, &p, v).unwrap_or_default();
    }
    if let Some((p, v)) = field("fsdp_implementation") {
        if let Some(name) = string(cx, &p, v) {
            match FsdpImplementation::from_name(&name) {
                Some(implementation) => d.fsdp_implementation = implementation,
                None => cx.err(
                    &p,
                    format!(
                        "Unknown FSDP implementation: {}. Supported: ['custom', 'native']",
                        one_line(&name)
                    ),
                ),
            }
        }
    }
    if let Some((p, v)) = field("efsdp_size") {
        d.efsdp_size = optional(v, |v| size(cx, &p, "efsdp_size", v));
    }
    Some(d)
}

fn dist_hint(key: &str) -> Option<String> {
    if TOPOLOGY_FIELDS.contains(&key) || key == "bf16" {
        Some(format!(
            "`{key}` is a public training argument: put it at the top level of the training YAML, \
             not inside dist_config."
        ))
    } else if MODEL_SPEC_FIELDS.contains(&key) {
        Some(format!(
            "`{key}` comes from the model spec (FSDPTurboEPModelSpec) of the model type and cannot \
             be set in the YAML."
        ))
    } else if KERNEL_FIELDS[1..].contains(&key) {
        Some(format!("`{key}` belongs in kernel_config."))
    } else {
        did_you_mean(key, &DIST_FIELDS)
    }
}

// ---------------------------------------------------------------------------------------------
// kernel_config
// ---------------------------------------------------------------------------------------------

fn kernel_config(cx: &mut Cx, path: &Path, value: &Value) -> Option<KernelConfig> {
    let map = plugin_mapping(cx, path, value, |ty| format!("kernel_config must be a mapping, got {ty}."))?;
    unknown_keys(cx, path, &map, &KERNEL_FIELDS, "kernel_config", |key| did_you_mean(key, &KERNEL_FIELDS));

    let mut k = KernelConfig {
        names: Vec::new(),
        include_kernels: IncludeKernels::Auto,
        chunk_size: DEFAULT_CHUNK_SIZE,
    };
    match map.get("name") {
        None => cx.err(path, "Plugin configuration must have a 'name' field."),
        Some(Value::String(names)) => {
            let p = path.key("name");
            k.names = split_names(names);
            if k.names.is_empty() {
                cx.err(&p, "kernel_config.name must contain at least one kernel name.");
            }
            for name in k.names.iter().filter(|n| !KERNEL_NAMES.contains(&n.as_str())) {
                cx.err(
                    &p,
                    format!(
                        "Plugin '{}' is not registered under KernelPlugin. Known kernels: {}",
                        one_line(name),
                        py_list(KERNEL_NAMES)
                    ),
                );
            }
        }
        Some(other) => {
            cx.err(
                &path.key("name"),
                format!("kernel_config.name must be a string. Got {}.", describe(other)),
            );
        }
    }
    if let Some(v) = map.get("include_kernels") {
        let p = path.key("include_kernels");
        match v {
            Value::Bool(true) => {}
            Value::String(s) if s == "auto" => {}
            Value::String(s) => {
                let selected = split_names(s);
                let unsupported =
                    sorted(selected.iter().map(String::as_str).filter(|n| !FLA_KERNELS.contains(n)));
                if selected.is_empty() {
                    cx.err(&p, "kernel_config.include_kernels must select at least one FLA kernel.");
                } else if !unsupported.is_empty() {
                    cx.err(
                        &p,
                        format!(
                            "Unsupported Flash Linear Attention kernels: {}. Supported: 'auto' or a \
                             comma-separated list of {}",
                            py_list(unsupported),
                            py_list(FLA_KERNELS)
                        ),
                    );
                } else {
                    k.include_kernels = IncludeKernels::List(selected);
                }
            }
            other => cx.err(
                &p,
                format!(
                    "kernel_config.include_kernels must be 'auto' or a comma-separated string. Got {}.",
                    describe(other)
                ),
            ),
        }
    }
    if let Some(v) = map.get("chunk_size") {
        match v.as_u64().and_then(|n| u32::try_from(n).ok()).filter(|n| CHUNK_SIZES.contains(n)) {
            Some(n) => k.chunk_size = n,
            None => cx.err(
                &path.key("chunk_size"),
                format!("chunk_size must be one of (16, 32, 64), got {}.", py_repr(v)),
            ),
        }
    }
    Some(k)
}

/// The seed's list syntax: split on `,`, strip, drop empty items; order kept.
fn split_names(text: &str) -> Vec<String> {
    text.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_string).collect()
}

// ---------------------------------------------------------------------------------------------
// Plugin mappings: JSON-in-a-string, string coercion, unknown keys
// ---------------------------------------------------------------------------------------------

/// The mapping of a plugin config (`dist_config`, `kernel_config`) after the seed's
/// `get_plugin_config`: a string starting with `{` is JSON, then string values are coerced.
/// `None` for null (no config) and for errors (recorded).
fn plugin_mapping(
    cx: &mut Cx,
    path: &Path,
    value: &Value,
    not_mapping: impl Fn(&str) -> String,
) -> Option<Mapping> {
    match value {
        Value::Null => None,
        Value::Mapping(map) => Some(convert_str_dict(map)),
        Value::Tagged(_) => {
            cx.err(path, format!("expected a mapping, got {}", describe(value)));
            None
        }
        Value::String(text) if text.starts_with('{') => match serde_json::from_str::<Value>(text) {
            Ok(Value::Mapping(map)) => Some(convert_str_dict(&map)),
            Ok(other) => {
                cx.err(path, not_mapping(py_type(&other)));
                None
            }
            Err(e) => {
                cx.err(path, format!("the string starts with '{{' but is not valid JSON: {e}"));
                None
            }
        },
        other => {
            cx.err(path, not_mapping(py_type(other)));
            None
        }
    }
}

/// LlamaFactory's `_convert_str_dict`: recursively into mappings (not lists), each string
/// value `"true"`/`"false"` (any case) becomes a bool, an ASCII digit string an integer, and a
/// digit string with one `.` a float. Keys are left alone.
fn convert_str_dict(map: &Mapping) -> Mapping {
    map.iter()
        .map(|(k, v)| {
            let v = match v {
                Value::String(s) => convert_str(s),
                Value::Mapping(inner) => Value::Mapping(convert_str_dict(inner)),
                other => other.clone(),
            };
            (k.clone(), v)
        })
        .collect()
}

fn convert_str(s: &str) -> Value {
    let digits = |t: &str| !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit());
    if s.eq_ignore_ascii_case("true") || s.eq_ignore_ascii_case("false") {
        Value::Bool(s.eq_ignore_ascii_case("true"))
    } else if digits(s) {
        // Python ints are unbounded; beyond u64 the value is kept as a float, which the
        // integer checks report as out of range.
        s.parse::<u64>()
            .map(Value::from)
            .unwrap_or_else(|_| Value::from(s.parse::<f64>().unwrap_or(f64::INFINITY)))
    } else if digits(&s.replacen('.', "", 1)) {
        s.parse::<f64>().map(Value::from).unwrap_or_else(|_| Value::String(s.to_string()))
    } else {
        Value::String(s.to_string())
    }
}

/// Reports the keys of `map` that are not in `known`, with the seed's text.
fn unknown_keys(
    cx: &mut Cx,
    path: &Path,
    map: &Mapping,
    known: &[&str],
    owner: &str,
    hint: impl Fn(&str) -> Option<String>,
) {
    let mut unknown: Vec<(String, Path)> = map
        .keys()
        .filter(|k| k.as_str().is_none_or(|k| !known.contains(&k)))
        .map(|k| (py_repr(k), path.key(&key_text(k))))
        .collect();
    if unknown.is_empty() {
        return;
    }
    unknown.sort_by(|a, b| a.0.cmp(&b.0));
    let mut message = format!(
        "Unknown params for {owner}: [{}]. Expected: {}",
        unknown.iter().map(|(repr, _)| repr.as_str()).collect::<Vec<_>>().join(", "),
        py_list(sorted(known.iter().copied()))
    );
    // Hints are sentences on the same line: ConfigErrors prints one error per line.
    message.push('.');
    for key in map.keys().filter_map(Value::as_str).filter(|k| !known.contains(k)) {
        if let Some(hint) = hint(key) {
            message.push(' ');
            message.push_str(&hint);
        }
    }
    // Point at the first unknown key in document order, and list where the others are.
    unknown.sort_by_key(|(_, p)| cx.lines.of(&p.0).unwrap_or(0));
    if unknown.len() > 1 {
        let at: Vec<String> = unknown
            .iter()
            .map(|(_, p)| match cx.lines.of(&p.0) {
                Some(line) => format!("{p} (line {line})"),
                None => p.to_string(),
            })
            .collect();
        message.push_str(&format!(" Unknown keys at: {}.", at.join(", ")));
    }
    cx.err(&unknown[0].1, message);
}

fn did_you_mean(key: &str, known: &[&str]) -> Option<String> {
    known
        .iter()
        .map(|k| (edit_distance(key, k), k))
        .filter(|(d, _)| *d <= 2)
        .min()
        .map(|(_, k)| format!("`{key}`: did you mean `{k}`?"))
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut row: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut diagonal = row[0];
        row[0] = i + 1;
        for (j, cb) in b.iter().enumerate() {
            let substitute = diagonal + usize::from(ca != *cb);
            diagonal = row[j + 1];
            row[j + 1] = substitute.min(row[j] + 1).min(diagonal + 1);
        }
    }
    row[b.len()]
}

// ---------------------------------------------------------------------------------------------
// Typed field readers (each records its error and returns None)
// ---------------------------------------------------------------------------------------------

/// null → None, else `read(value)`.
fn optional<T>(value: &Value, read: impl FnOnce(&Value) -> Option<T>) -> Option<T> {
    if value.is_null() { None } else { read(value) }
}

fn boolean(cx: &mut Cx, path: &Path, value: &Value) -> Option<bool> {
    match value {
        Value::Bool(b) => Some(*b),
        other => {
            cx.err(path, format!("expected a boolean (true or false), got {}", describe(other)));
            None
        }
    }
}

fn string(cx: &mut Cx, path: &Path, value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        other => {
            cx.err(path, format!("expected a string, got {}", describe(other)));
            None
        }
    }
}

fn string_list(cx: &mut Cx, path: &Path, value: &Value) -> Option<Vec<String>> {
    let Value::Sequence(items) = value else {
        let example = match value {
            Value::String(s) => format!(", e.g. [{}]", py_str(s)),
            _ => String::new(),
        };
        cx.err(path, format!("expected a list of strings{example}, got {}", describe(value)));
        return None;
    };
    // Every bad item is reported, not only the first.
    let out: Vec<Option<String>> =
        items.iter().enumerate().map(|(i, item)| string(cx, &path.index(i), item)).collect();
    out.into_iter().collect()
}

/// A size: an integer ≥ 1 (`{field} must be positive, got N.`, the seed's ep_size text).
fn size(cx: &mut Cx, path: &Path, field: &str, value: &Value) -> Option<u64> {
    let Value::Number(n) = value else {
        cx.err(path, format!("expected an integer, got {}", describe(value)));
        return None;
    };
    if let Some(u) = n.as_u64() {
        if u >= 1 {
            return Some(u);
        }
    }
    match (n.as_i64(), n.as_f64()) {
        (Some(i), _) => cx.err(path, format!("{field} must be positive, got {i}.")),
        (None, Some(f)) if f.is_finite() && f.fract() == 0.0 && f.abs() >= 9.2e18 => cx.err(
            path,
            format!("integer {} is out of range: integers must lie in [-2^63, 2^64)", py_float(f)),
        ),
        _ => cx.err(path, format!("expected an integer, got {}", describe(value))),
    }
    None
}

// ---------------------------------------------------------------------------------------------
// Describing values (messages use Python's spelling where they quote the seed)
// ---------------------------------------------------------------------------------------------

/// "integer 3", "string 'abc'", "a list", …
fn describe(value: &Value) -> String {
    match value {
        Value::Null => "null".to_string(),
        Value::Bool(b) => format!("boolean {b}"),
        Value::Number(n) if n.is_f64() => format!("float {}", py_repr(value)),
        Value::Number(n) => format!("integer {n}"),
        Value::String(s) => format!("string {}", py_str(s)),
        Value::Sequence(_) => "a list".to_string(),
        Value::Mapping(_) => "a mapping".to_string(),
        Value::Tagged(t) => format!("a value with the unsupported YAML tag {}", t.tag),
    }
}

/// Python's `type(v).__name__` of the value LlamaFactory would hold.
fn py_type(value: &Value) -> &'static str {
    match value {
        Value::Null => "NoneType",
        Value::Bool(_) => "bool",
        Value::Number(n) if n.is_f64() => "float",
        Value::Number(_) => "int",
        Value::String(_) => "str",
        Value::Sequence(_) => "list",
        Value::Mapping(_) => "dict",
        Value::Tagged(t) => py_type(&t.value),
    }
}

/// Python's `repr(v)`.
fn py_repr(value: &Value) -> String {
    match value {
        Value::Null => "None".to_string(),
        Value::Bool(true) => "True".to_string(),
        Value::Bool(false) => "False".to_string(),
        Value::Number(n) => match (n.as_u64(), n.as_i64(), n.as_f64()) {
            (Some(u), _, _) => u.to_string(),
            (None, Some(i), _) => i.to_string(),
            (_, _, f) => py_float(f.unwrap_or(f64::NAN)),
        },
        Value::String(s) => py_str(s),
        Value::Sequence(items) => format!("[{}]", items.iter().map(py_repr).collect::<Vec<_>>().join(", ")),
        Value::Mapping(map) => format!(
            "{{{}}}",
            map.iter().map(|(k, v)| format!("{}: {}", py_repr(k), py_repr(v))).collect::<Vec<_>>().join(", ")
        ),
        Value::Tagged(t) => py_repr(&t.value),
    }
}

/// Python's `repr(float)`: shortest round-trip digits, exponent form below 1e-4 and from 1e16.
fn py_float(f: f64) -> String {
    if f.is_nan() {
        return "nan".to_string();
    }
    if f.is_infinite() {
        return if f > 0.0 { "inf" } else { "-inf" }.to_string();
    }
    let sci = format!("{f:e}"); // "-1.5e-7", "4.8e1"
    let (mantissa, exp) = sci.split_once('e').unwrap_or((&sci, "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    if (-4..16).contains(&exp) {
        let plain = format!("{f}");
        if plain.contains('.') { plain } else { format!("{plain}.0") }
    } else {
        let sign = if exp < 0 { '-' } else { '+' };
        format!("{mantissa}e{sign}{:02}", exp.abs())
    }
}

/// Python's `repr(str)`.
fn py_str(s: &str) -> String {
    let quote = if s.contains('\'') && !s.contains('"') { '"' } else { '\'' };
    let mut out = String::with_capacity(s.len() + 2);
    out.push(quote);
    for c in s.chars() {
        match c {
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if c == quote => {
                out.push('\\');
                out.push(c);
            }
            c if (c as u32) < 0x100 && c.is_control() => out.push_str(&format!("\\x{:02x}", c as u32)),
            c if c.is_control() => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push(quote);
    out
}

/// Text the seed prints raw (user names, serde_yaml's messages, which may quote keys raw) with
/// its control characters escaped: a line break would split the one-error-per-line output.
fn one_line(s: &str) -> String {
    s.chars()
        .flat_map(|c| if c.is_control() { c.escape_default().collect::<Vec<_>>() } else { vec![c] })
        .collect()
}

/// Python's `repr(list_of_str)`.
fn py_list<'a>(items: impl IntoIterator<Item = &'a str>) -> String {
    format!("[{}]", items.into_iter().map(py_str).collect::<Vec<_>>().join(", "))
}

/// Python's `sorted(set(...))` of strings (code-point order = UTF-8 byte order).
fn sorted<'a>(items: impl IntoIterator<Item = &'a str>) -> Vec<&'a str> {
    let mut items: Vec<&str> = items.into_iter().collect();
    items.sort_unstable();
    items.dedup();
    items
}

/// The text a key has in a path.
fn key_text(key: &Value) -> String {
    match key {
        Value::String(s) => s.clone(),
        Value::Number(n) => n.to_string(),
        Value::Bool(b) => b.to_string(),
        Value::Null => "null".to_string(),
        other => py_repr(other),
    }
}

// ---------------------------------------------------------------------------------------------
// The line index: a marked pass over libyaml's events
// ---------------------------------------------------------------------------------------------

/// Deeper keys are not indexed: only the first levels are ever reported, and this bounds the
/// work of cloning paths.
const MAX_INDEXED_DEPTH: usize = 16;
/// serde_yaml's nesting limit (its `recursion limit exceeded`).
const MAX_NESTING: usize = 128;
/// The most nodes that aliases may add by expansion (a real configuration reuses a few small
/// anchors). serde_yaml bounds the number of alias jumps, not what they copy, so an anchor of n
/// items used n times cost n² values (14 KB of YAML: 4 million values, 1.3 s; 140 KB: out of
/// memory), and 70 000 values before its own limit took 35 ms.
const MAX_ALIAS_NODES: u64 = 10_000;

/// What the marked pass finds.
struct Index {
    lines: Lines,
    /// Each key written twice in one mapping: (path, first line, repeated line), in order.
    duplicates: Vec<(Vec<Seg>, usize, usize)>,
    /// Why the YAML is refused before serde_yaml reads it, and where (the pass stops there).
    refused: Option<(usize, String)>,
}

impl Lines {
    /// The 1-based line of every mapping key (scalar keys) and sequence item down to
    /// [`MAX_INDEXED_DEPTH`], paths prefixed with `base`; repeated keys; and a refusal at the
    /// first nesting beyond [`MAX_NESTING`] or alias expansion beyond [`MAX_ALIAS_NODES`].
    /// Stops quietly at a syntax error (the caller has the error from serde_yaml).
    fn index(text: &str, base: Vec<Seg>) -> Index {
        use events::Event;

        enum State {
            Key,
            Value(Option<String>),
            Item(usize),
        }
        struct Frame {
            state: State,
            pushed: bool,
            recording: bool,
            /// Nodes in this collection with aliases expanded, itself included.
            nodes: u64,
            /// The anchor on this collection and the number of its definition.
            anchor: Option<(Vec<u8>, usize)>,
        }
        /// A node of `nodes` (expanded) nodes ends: its parent moves on and counts it.
        fn close(frames: &mut [Frame], key: Option<String>, nodes: u64) {
            if let Some(frame) = frames.last_mut() {
                frame.nodes = frame.nodes.saturating_add(nodes);
                frame.state = match frame.state {
                    State::Key => State::Value(key),
                    State::Value(_) => State::Key,
                    State::Item(i) => State::Item(i + 1),
                };
            }
        }

        let mut index = Index { lines: Lines::default(), duplicates: Vec::new(), refused: None };
        let Some(events) = events::Events::new(text) else { return index };
        let mut path = base;
        let mut frames: Vec<Frame> = Vec::new();
        // Each anchor's latest definition (defined where its node starts, as serde_yaml's loader
        // does): its number and its expanded size, None while its node is still open.
        let mut anchors: HashMap<Vec<u8>, (usize, Option<u64>)> = HashMap::new();
        let mut definitions = 0usize;
        let mut alias_nodes = 0u64;
        for (event, line) in events {
            let (Event::Scalar(..) | Event::Alias(_) | Event::SequenceStart(_) | Event::MappingStart(_)) =
                event
            else {
                if let Event::SequenceEnd | Event::MappingEnd = event {
                    if let Some(frame) = frames.pop() {
                        if frame.pushed {
                            path.pop();
                        }
                        if let Some((name, number)) = frame.anchor {
                            // Unless an inner node took the name over meanwhile.
                            if let Some((latest, size)) = anchors.get_mut(&name) {
                                if *latest == number {
                                    *size = Some(frame.nodes);
                                }
                            }
                        }
                        close(&mut frames, None, frame.nodes);
                    }
                }
                continue;
            };

            // Where the node sits in its parent, and its line if it is a key or a list item.
            let recording = frames.last().is_none_or(|f| f.recording) && path.len() < MAX_INDEXED_DEPTH;
            let (is_key, seg) = match frames.last().map(|f| &f.state) {
                None => (false, None),
                Some(State::Key) => (true, None),
                Some(State::Value(key)) => (false, key.clone().map(Seg::Key)),
                Some(State::Item(i)) => (false, Some(Seg::Index(*i))),
            };
            let at = match (&event, &seg) {
                (Event::Scalar(key, _), _) if recording && is_key => {
                    Some(path.iter().cloned().chain([Seg::Key(key.clone())]).collect())
                }
                (_, Some(Seg::Index(_))) if recording => {
                    Some(path.iter().cloned().chain(seg.clone()).collect())
                }
                (_, None) if recording && frames.is_empty() && !path.is_empty() => Some(path.clone()),
                _ => None,
            };
            if let Some(at) = at {
                match index.lines.0.get(&at) {
                    Some(&first) => index.duplicates.push((at, first, line)),
                    None => {
                        index.lines.0.insert(at, line);
                    }
                }
            }

            let is_mapping_start = matches!(event, Event::MappingStart(_));
            match event {
                Event::SequenceStart(anchor) | Event::MappingStart(anchor) => {
                    let root = frames.is_empty();
                    let pushed = seg.is_some();
                    path.extend(seg);
                    let state = if is_mapping_start { State::Key } else { State::Item(0) };
                    let anchor = anchor.map(|name| {
                        definitions += 1;
                        anchors.insert(name.clone(), (definitions, None));
                        (name, definitions)
                    });
                    frames.push(Frame {
                        state,
                        pushed,
                        recording: recording && (pushed || root),
                        nodes: 1,
                        anchor,
                    });
                    if frames.len() > MAX_NESTING {
                        index.refused =
                            Some((line, format!("the YAML nests deeper than {MAX_NESTING} levels")));
                        break;
                    }
                }
                Event::Scalar(text, anchor) => {
                    if let Some(name) = anchor {
                        anchors.insert(name, (0, Some(1)));
                    }
                    close(&mut frames, Some(text).filter(|_| is_key), 1);
                }
                Event::Alias(anchor) => {
                    // An unknown anchor is serde_yaml's error to report. An alias inside the
                    // node it names would expand forever: serde_yaml expands it until its
                    // nesting limit, copying everything else in the node at every level.
                    let nodes = match anchors.get(&anchor) {
                        Some((_, Some(nodes))) => *nodes,
                        Some((_, None)) => {
                            let name = String::from_utf8_lossy(&anchor);
                            index.refused =
                                Some((line, format!("the alias *{name} is inside the node it names")));
                            break;
                        }
                        None => 1,
                    };
                    alias_nodes = alias_nodes.saturating_add(nodes);
                    if alias_nodes > MAX_ALIAS_NODES {
                        let message =
                            format!("the YAML's aliases expand to more than {MAX_ALIAS_NODES} nodes");
                        index.refused = Some((line, message));
                        break;
                    }
                    close(&mut frames, None, nodes);
                }
                _ => {}
            }
        }
        index
    }
}

/// A safe iterator over the events of libyaml (`unsafe_libyaml`, the parser serde_yaml uses),
/// with the 1-based line where each starts.
mod events {
    use std::ffi::CStr;
    use std::marker::PhantomData;
    use std::mem::MaybeUninit;

    use unsafe_libyaml as unsafe_yaml;

    /// An event; anchors are the names after `&` (on a node) or `*` (an alias).
    pub(super) enum Event {
        Scalar(String, Option<Vec<u8>>),
        Alias(Vec<u8>),
        SequenceStart(Option<Vec<u8>>),
        SequenceEnd,
        MappingStart(Option<Vec<u8>>),
        MappingEnd,
        Other,
    }

    pub(super) struct Events<'a> {
        // Boxed so that the parser never moves once initialised.
        parser: Box<MaybeUninit<unsafe_yaml::yaml_parser_t>>,
        done: bool,
        _input: PhantomData<&'a str>,
    }

    impl<'a> Events<'a> {
        pub(super) fn new(text: &'a str) -> Option<Events<'a>> {
            let mut parser = Box::new(MaybeUninit::<unsafe_yaml::yaml_parser_t>::uninit());
            // SAFETY: `parser` is valid for writes; initialisation zeroes it first. The input
            // outlives the parser (`'a`), which only reads it.
            unsafe {
                if unsafe_yaml::yaml_parser_initialize(parser.as_mut_ptr()).fail {
                    return None;
                }
                unsafe_yaml::yaml_parser_set_encoding(parser.as_mut_ptr(), unsafe_yaml::YAML_UTF8_ENCODING);
                unsafe_yaml::yaml_parser_set_input_string(
                    parser.as_mut_ptr(),
                    text.as_ptr(),
                    text.len() as u64,
                );
            }
            Some(Events { parser, done: false, _input: PhantomData })
        }
    }

    /// A NUL-terminated anchor name owned by an event, or NULL.
    ///
    /// SAFETY: `ptr` is NULL or points to a NUL-terminated string alive for the call.
    unsafe fn anchor(ptr: *const u8) -> Option<Vec<u8>> {
        // SAFETY: as documented by the caller's contract.
        (!ptr.is_null()).then(|| unsafe { CStr::from_ptr(ptr.cast()) }.to_bytes().to_vec())
    }

    impl Iterator for Events<'_> {
        type Item = (Event, usize);

        /// The next event and its line; None at the end of the stream or at a syntax error.
        fn next(&mut self) -> Option<(Event, usize)> {
            if self.done {
                return None;
            }
            let mut raw = MaybeUninit::<unsafe_yaml::yaml_event_t>::uninit();
            // SAFETY: the parser was initialised in `new`; on success `raw` holds an event that
            // we read according to its type (libyaml's strings are NUL-terminated, the scalar
            // value has its length) and then delete exactly once.
            unsafe {
                if unsafe_yaml::yaml_parser_parse(self.parser.as_mut_ptr(), raw.as_mut_ptr()).fail {
                    self.done = true;
                    return None;
                }
                let raw = raw.as_mut_ptr();
                let line = usize::try_from((*raw).start_mark.line).unwrap_or(usize::MAX).saturating_add(1);
                let data = &(*raw).data;
                let event = match (*raw).type_ {
                    unsafe_yaml::YAML_SCALAR_EVENT => {
                        let scalar = data.scalar;
                        let bytes = if scalar.value.is_null() || scalar.length == 0 {
                            &[][..]
                        } else {
                            std::slice::from_raw_parts(scalar.value, scalar.length as usize)
                        };
                        Event::Scalar(String::from_utf8_lossy(bytes).into_owned(), anchor(scalar.anchor))
                    }
                    unsafe_yaml::YAML_ALIAS_EVENT => {
                        Event::Alias(anchor(data.alias.anchor).unwrap_or_default())
                    }
                    unsafe_yaml::YAML_SEQUENCE_START_EVENT => {
                        Event::SequenceStart(anchor(data.sequence_start.anchor))
                    }
                    unsafe_yaml::YAML_SEQUENCE_END_EVENT => Event::SequenceEnd,
                    unsafe_yaml::YAML_MAPPING_START_EVENT => {
                        Event::MappingStart(anchor(data.mapping_start.anchor))
                    }
                    unsafe_yaml::YAML_MAPPING_END_EVENT => Event::MappingEnd,
                    unsafe_yaml::YAML_STREAM_END_EVENT | unsafe_yaml::YAML_NO_EVENT => {
                        self.done = true;
                        Event::Other
                    }
                    _ => Event::Other,
                };
                unsafe_yaml::yaml_event_delete(raw);
                Some((event, line))
            }
        }
    }

    impl Drop for Events<'_> {
        fn drop(&mut self) {
            // SAFETY: initialised in `new` (a failed initialisation returns no `Events`).
            unsafe { unsafe_yaml::yaml_parser_delete(self.parser.as_mut_ptr()) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(text: &str) -> HashMap<String, usize> {
        Lines::index(text, Vec::new()).lines.0.into_iter().map(|(k, v)| (Path(k).to_string(), v)).collect()
    }

    #[test]
    fn line_index_block_and_flow() {
        let l = lines("a: 1\nb:\n  c: [x,\n    y]\n  d: {e: 1,\n   f: 2}\ng:\n  - h\n  - i: 3\n");
        assert_eq!(l["a"], 1);
        assert_eq!(l["b"], 2);
        assert_eq!(l["b.c"], 3);
        assert_eq!(l["b.c[0]"], 3);
        assert_eq!(l["b.c[1]"], 4);
        assert_eq!(l["b.d.e"], 5);
        assert_eq!(l["b.d.f"], 6);
        assert_eq!(l["g[0]"], 8);
        assert_eq!(l["g[1]"], 9);
        assert_eq!(l["g[1].i"], 9);
    }

    #[test]
    fn line_index_skips_complex_keys_and_keeps_counting() {
        let l = lines("? [k, l]\n: {m: 1}\nn: 2\n");
        assert_eq!(l.get("m"), None);
        assert_eq!(l["n"], 3);
        assert_eq!(l.len(), 1);
    }

    #[test]
    fn line_index_reports_repeated_keys() {
        let index = Lines::index("a: 1\nb: {c: 1}\nb: 2\n", Vec::new());
        assert_eq!(index.duplicates, vec![(vec![Seg::Key("b".into())], 2, 3)]);
    }

    #[test]
    fn fragment_root_gets_the_base_path() {
        let l = Lines::index("\n{ep_size: 2}", vec![Seg::Key("dist_config".into())]).lines;
        assert_eq!(l.of(&[Seg::Key("dist_config".into())]), Some(2));
        assert_eq!(l.of(&[Seg::Key("dist_config".into()), Seg::Key("ep_size".into())]), Some(2));
        assert_eq!(l.of(&[Seg::Key("dist_config".into()), Seg::Key("nope".into())]), Some(2));
    }

    #[test]
    fn nesting_beyond_the_limit_stops_the_pass() {
        let ok = format!("{}{}", "[".repeat(MAX_NESTING), "]".repeat(MAX_NESTING));
        assert_eq!(Lines::index(&ok, Vec::new()).refused, None);
        let deep = format!("a:\n {}{}", "[".repeat(MAX_NESTING), "]".repeat(MAX_NESTING));
        let refused = Lines::index(&deep, Vec::new()).refused;
        assert_eq!(refused, Some((2, "the YAML nests deeper than 128 levels".to_string())));
    }

    #[test]
    fn alias_expansion_is_counted_through_nested_anchors() {
        // &a is 4 nodes (the list and 3 items); &b holds two aliases of it: 1 + 8 = 9 nodes.
        let text = "a: &a [x, y, z]\nb: &b [*a, *a]\nc: *b\n";
        assert_eq!(Lines::index(text, Vec::new()).refused, None);
        let uses =
            |n: usize| format!("a: &a [{}]\nb: [{}]\n", vec!["x"; 99].join(", "), vec!["*a"; n].join(", "));
        assert_eq!(Lines::index(&uses(100), Vec::new()).refused, None); // 100 * 100 nodes
        let refused = Lines::index(&uses(101), Vec::new()).refused;
        assert_eq!(refused, Some((2, "the YAML's aliases expand to more than 10000 nodes".to_string())));
    }

    #[test]
    fn recursive_aliases_are_refused_and_redefinitions_followed() {
        let refused = |text: &str| Lines::index(text, Vec::new()).refused.map(|r| r.1);
        assert_eq!(refused("a: &a [x, *a]\n").as_deref(), Some("the alias *a is inside the node it names"));
        assert_eq!(
            refused("a: &a {b: {c: *a}}\n").as_deref(),
            Some("the alias *a is inside the node it names")
        );
        // The inner node took the name over before the alias: not recursive.
        assert_eq!(refused("a: &a [&a x, *a]\n"), None);
        assert_eq!(
            refused("a: &a [x]\nb: &a [*a]\n").as_deref(),
            Some("the alias *a is inside the node it names")
        );
        assert_eq!(refused("a: &a [x]\nb: [*a, *a]\nc: &a y\nd: *a\n"), None);
    }

    #[test]
    fn python_reprs() {
        assert_eq!(py_float(48.0), "48.0");
        assert_eq!(py_float(2.5), "2.5");
        assert_eq!(py_float(1e16), "1e+16");
        assert_eq!(py_float(1.2345678901234568e29), "1.2345678901234568e+29");
        assert_eq!(py_float(0.0001), "0.0001");
        assert_eq!(py_float(0.00001), "1e-05");
        assert_eq!(py_float(-0.0), "-0.0");
        assert_eq!(py_str("it's"), "\"it's\"");
        assert_eq!(py_str("a'b\"c"), "'a\\'b\"c'");
        assert_eq!(py_str("tab\there\u{1}"), "'tab\\there\\x01'");
        assert_eq!(
            py_repr(&serde_yaml::from_str("[1, x, null, true, 2.0]").unwrap()),
            "[1, 'x', None, True, 2.0]"
        );
    }

    #[test]
    fn string_coercion_follows_convert_str_dict() {
        assert_eq!(convert_str("TrUe"), Value::Bool(true));
        assert_eq!(convert_str("FALSE"), Value::Bool(false));
        assert_eq!(convert_str("0042"), Value::from(42u64));
        assert_eq!(convert_str("1.5"), Value::from(1.5));
        assert_eq!(convert_str(".5"), Value::from(0.5));
        assert_eq!(convert_str("5."), Value::from(5.0));
        assert_eq!(convert_str("1.2.3"), Value::from("1.2.3"));
        assert_eq!(convert_str("-1"), Value::from("-1"));
        assert_eq!(convert_str("."), Value::from("."));
        assert_eq!(convert_str(""), Value::from(""));
        assert_eq!(convert_str("１２"), Value::from("１２"));
        assert!(matches!(convert_str("99999999999999999999999"), Value::Number(n) if n.is_f64()));
    }

    #[test]
    fn edit_distance_counts_edits() {
        assert_eq!(edit_distance("ep_sise", "ep_size"), 1);
        assert_eq!(edit_distance("", "abc"), 3);
        assert_eq!(
            did_you_mean("hook_module", &DIST_FIELDS).as_deref(),
            Some("`hook_module`: did you mean `hook_modules`?")
        );
        assert_eq!(did_you_mean("zzz", &DIST_FIELDS), None);
    }
}
