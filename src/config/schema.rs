//! The schema: the walk over the parsed YAML that checks every field of the training
//! configuration, `dist_config` and `kernel_config`, recording each problem with its path.

use serde_yaml::{Mapping, Value};

use super::text::*;
use super::*;
use crate::topology::divisors_hint;

// ---------------------------------------------------------------------------------------------
// The training YAML
// ---------------------------------------------------------------------------------------------

pub(super) fn train_config(cx: &mut Cx, root: &Value) -> Option<TrainConfig> {
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
        if key == "stage" {
            // Once documented here for the plan's CP rule; LlamaFactory v1's parser refuses it.
            cx.err(
                &top.key(key),
                "`stage` is not a LlamaFactory v1 training argument (the stage is the command, \
                 `llamafactory-cli sft|dpo|rm`): remove it, and give it to `fsdpturbo plan --stage`",
            );
        } else if key != "name" && DIST_FIELDS.contains(&key) {
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
        cfg.dp_size = optional_size(cx, &path, "dp_size", v);
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
        cfg.mp_shard_size = optional_size(cx, &path, "mp_shard_size", v);
    }
    if let Some((path, v)) = field("dist_timeout") {
        cfg.dist_timeout = size(cx, &path, "dist_timeout", v).unwrap_or(cfg.dist_timeout);
    }
    if let Some((path, v)) = field("bf16") {
        cfg.bf16 = boolean(cx, &path, v).unwrap_or(cfg.bf16);
    }
    if let Some(dist) = field("dist_config").and_then(|(path, v)| dist_config(cx, &path, v)) {
        cfg.dist = dist;
    }
    if let Some((path, v)) = field("kernel_config") {
        cfg.kernel = kernel_config(cx, &path, v);
    }
    check_topology(cx, &cfg);
    Some(cfg)
}

/// The topology checks that need no world size: sizes implied by the explicit ones must
/// agree and divide.
pub(super) fn check_topology(cx: &mut Cx, cfg: &TrainConfig) {
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
    for (name, product, world) in [
        ("mp_shard_size", "mp_replicate_size * mp_shard_size", model_world.map(|w| w.1)),
        ("dp_size", "dp_size * cp_size", data_world.map(|w| w.1)),
    ] {
        if let Some(None) = world {
            cx.err(
                &top.key(name),
                format!(
                    "{product} (the world size it implies) overflows a 64-bit integer. Accepted: sizes \
                     whose product is below 2^64."
                ),
            );
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
                         world size), got {r} * {s} != {d} * {cp}. {}",
                        if w_data % r == 0 {
                            format!("Accepted mp_shard_size: {} (or leave it unset).", w_data / r)
                        } else {
                            format!(
                                "Accepted: an mp_replicate_size that divides dp_size * cp_size ({w_data}), \
                                 with mp_shard_size = dp_size * cp_size / mp_replicate_size."
                            )
                        }
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
                     mp_replicate_size * mp_shard_size.){}",
                    divisors_hint("cp_size", "world_size", w)
                ),
            );
            None
        }
        (Some((_, Some(w))), None) => Some(w / cp),
        (_, data) => data.map(|(d, _)| d),
    };
    let Some(dp) = dp else { return };
    let dist = &cfg.dist;
    let ep = dist.ep_size;
    let dist_path = top.key("dist_config");
    if dp % ep != 0 {
        cx.err(
            &dist_path.key("ep_size"),
            format!(
                "dp_size must be divisible by ep_size, got {dp} % {ep} != 0.{}",
                divisors_hint("ep_size", "dp_size", dp)
            ),
        );
    } else if let Some(efsdp) = dist.efsdp_size {
        match ep.checked_mul(efsdp) {
            Some(product) if dp % product == 0 => {}
            _ => cx.err(
                &dist_path.key("efsdp_size"),
                format!(
                    "dp_size must be divisible by ep_size * efsdp_size, got {dp} % ({ep} * {efsdp}) != 0.{}",
                    divisors_hint("efsdp_size", "dp_size / ep_size", dp / ep)
                ),
            ),
        }
    }
}

// ---------------------------------------------------------------------------------------------
// dist_config (FSDPTurboParams)
// ---------------------------------------------------------------------------------------------

pub(super) fn dist_config(cx: &mut Cx, path: &Path, value: &Value) -> Option<DistConfig> {
    let map = plugin_mapping(cx, path, value, |ty| {
        format!("DistributedPlugin config must be a mapping or FSDPTurboParams, got {ty}.")
    })?;
    unknown_keys(cx, path, &map, &DIST_FIELDS, "DistributedPlugin.FSDPTurboParams", dist_hint);

    let mut d = DistConfig::default();
    let field = |name: &str| map.get(name).map(|v| (path.key(name), v));
    match field("name") {
        None => cx.err(
            path,
            format!("Plugin configuration must have a 'name' field. Accepted: name: {DIST_PLUGIN_NAME}."),
        ),
        Some((p, v)) => {
            if let Some(name) = string(cx, &p, v) {
                if name == DIST_PLUGIN_NAME {
                    d.name = name;
                } else {
                    cx.err(
                        &p,
                        format!(
                            "this library implements the '{DIST_PLUGIN_NAME}' plugin, got {}. Accepted: \
                             '{DIST_PLUGIN_NAME}'.",
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
                        "Unsupported dispatcher {name}. Supported: {}",
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
                None => cx
                    .err(&p, format!("Unknown FSDP implementation: {name}. Supported: ['custom', 'native']")),
            }
        }
    }
    if let Some((p, v)) = field("efsdp_size") {
        d.efsdp_size = optional_size(cx, &p, "efsdp_size", v);
    }
    capacity(cx, path, &map, &mut d);
    if let Some((p, v)) = field("aux_loss_scope") {
        if let Some(scope) = choice(cx, &p, v, &AuxLossScope::ALL, AuxLossScope::as_str) {
            d.aux_loss_scope = scope;
        }
    }
    if let Some((p, v)) = field("router_z_loss_coef") {
        d.router_z_loss_coef = number(cx, &p, v, Bound::AtLeastZero).unwrap_or(0.0);
    }
    if let Some((p, v)) = field("expert_bias_update_rate") {
        d.expert_bias_update_rate = optional(v, |v| number(cx, &p, v, Bound::Positive));
    }
    Some(d)
}

/// `capacity_factor`, `expert_capacity` (at most one) and `capacity_overflow` (only with one).
fn capacity(cx: &mut Cx, path: &Path, map: &Mapping, d: &mut DistConfig) {
    let field = |name: &str| map.get(name).filter(|v| !v.is_null()).map(|v| (path.key(name), v));
    let factor = field("capacity_factor");
    let tokens = field("expert_capacity");
    if let Some((p, v)) = &factor {
        d.capacity_factor = number(cx, p, v, Bound::Positive);
    }
    if let Some((p, v)) = &tokens {
        d.expert_capacity = size_accepting(cx, p, "expert_capacity", v, SIZE_OR_NULL);
    }
    if let (Some(_), Some((p, _))) = (&factor, &tokens) {
        cx.err(
            p,
            "give either capacity_factor (capacity from the token count) or expert_capacity (rows \
             per expert per rank), not both",
        );
    }
    if let (Some((p, _)), Dispatcher::Mc2 | Dispatcher::Domino) =
        (factor.as_ref().or(tokens.as_ref()), d.ep_dispatcher)
    {
        cx.err(
            p,
            format!(
                "the capacity-bounded dispatch runs with ep_dispatcher 'eager' or 'fused', got {}",
                py_str(d.ep_dispatcher.as_str())
            ),
        );
    }
    if let Some((p, v)) = field("capacity_overflow") {
        d.capacity_overflow = choice(cx, &p, v, &CapacityOverflow::ALL, CapacityOverflow::as_str);
        if factor.is_none() && tokens.is_none() {
            cx.err(
                &p,
                "capacity_overflow needs a capacity: set capacity_factor or expert_capacity (without \
                 one the dispatch is dropless and nothing overflows)",
            );
        }
    }
    if factor.is_some() || tokens.is_some() {
        d.capacity_overflow.get_or_insert(CapacityOverflow::Drop);
    }
}

pub(super) fn dist_hint(key: &str) -> Option<String> {
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

pub(super) fn kernel_config(cx: &mut Cx, path: &Path, value: &Value) -> Option<KernelConfig> {
    let map = plugin_mapping(cx, path, value, |ty| format!("kernel_config must be a mapping, got {ty}."))?;
    unknown_keys(cx, path, &map, &KERNEL_FIELDS, "kernel_config", |key| did_you_mean(key, &KERNEL_FIELDS));

    let kernel_names = format!("a comma-separated string of kernel names from {}", py_list(KERNEL_NAMES));
    let fla_kernels = format!("'auto' or a comma-separated list of {}", py_list(FLA_KERNELS));
    let mut k = KernelConfig {
        names: Vec::new(),
        include_kernels: IncludeKernels::Auto,
        chunk_size: DEFAULT_CHUNK_SIZE,
    };
    match map.get("name") {
        None => cx.err(
            path,
            format!("Plugin configuration must have a 'name' field. Accepted: name: {}.", kernel_names),
        ),
        Some(Value::String(names)) => {
            let p = path.key("name");
            k.names = split_names(names);
            if k.names.is_empty() {
                cx.err(
                    &p,
                    format!(
                        "kernel_config.name must contain at least one kernel name. Accepted: {kernel_names}."
                    ),
                );
            }
            for name in k.names.iter().filter(|n| !KERNEL_NAMES.contains(&n.as_str())) {
                cx.err(
                    &p,
                    format!(
                        "Plugin '{name}' is not registered under KernelPlugin. Known kernels: {}",
                        py_list(KERNEL_NAMES)
                    ),
                );
            }
        }
        Some(other) => {
            cx.err(
                &path.key("name"),
                format!(
                    "kernel_config.name must be a string. Got {}. Accepted: {kernel_names}.",
                    describe(other)
                ),
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
                    cx.err(
                        &p,
                        format!(
                            "kernel_config.include_kernels must select at least one FLA kernel. Supported: \
                             {fla_kernels}"
                        ),
                    );
                } else if !unsupported.is_empty() {
                    cx.err(
                        &p,
                        format!(
                            "Unsupported Flash Linear Attention kernels: {}. Supported: {fla_kernels}",
                            py_list(unsupported),
                        ),
                    );
                } else {
                    k.include_kernels = IncludeKernels::List(selected);
                }
            }
            other => cx.err(
                &p,
                format!(
                    "kernel_config.include_kernels must be 'auto' or a comma-separated string. Got {}. \
                     Supported: {fla_kernels}",
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
pub(super) fn split_names(text: &str) -> Vec<String> {
    text.split(',').map(str::trim).filter(|s| !s.is_empty()).map(str::to_string).collect()
}

// ---------------------------------------------------------------------------------------------
// Plugin mappings: JSON-in-a-string, string coercion, unknown keys
// ---------------------------------------------------------------------------------------------

/// The mapping of a plugin config (`dist_config`, `kernel_config`) after the seed's
/// `get_plugin_config`: a string starting with `{` is JSON, then string values are coerced.
/// `None` for null (no config) and for errors (recorded).
pub(super) fn plugin_mapping(
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
                cx.err(
                    path,
                    format!(
                        "the string starts with '{{' but is not valid JSON: {e}. Accepted: a mapping, or a \
                         string holding a JSON object."
                    ),
                );
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
pub(super) fn convert_str_dict(map: &Mapping) -> Mapping {
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

pub(super) fn convert_str(s: &str) -> Value {
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
pub(super) fn unknown_keys(
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

pub(super) fn did_you_mean(key: &str, known: &[&str]) -> Option<String> {
    known
        .iter()
        .map(|k| (edit_distance(key, k), k))
        .filter(|(d, _)| *d <= 2)
        .min()
        .map(|(_, k)| format!("`{key}`: did you mean `{k}`?"))
}

pub(super) fn edit_distance(a: &str, b: &str) -> usize {
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
pub(super) fn optional<T>(value: &Value, read: impl FnOnce(&Value) -> Option<T>) -> Option<T> {
    if value.is_null() { None } else { read(value) }
}

pub(super) fn boolean(cx: &mut Cx, path: &Path, value: &Value) -> Option<bool> {
    match value {
        Value::Bool(b) => Some(*b),
        other => {
            cx.err(path, format!("expected a boolean (true or false), got {}", describe(other)));
            None
        }
    }
}

pub(super) fn string(cx: &mut Cx, path: &Path, value: &Value) -> Option<String> {
    match value {
        Value::String(s) => Some(s.clone()),
        other => {
            cx.err(path, format!("expected a string, got {}", describe(other)));
            None
        }
    }
}

pub(super) fn string_list(cx: &mut Cx, path: &Path, value: &Value) -> Option<Vec<String>> {
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

/// One of `options`, by its YAML name (exact, case-sensitive).
pub(super) fn choice<T: Copy>(
    cx: &mut Cx,
    path: &Path,
    value: &Value,
    options: &[T],
    name: fn(T) -> &'static str,
) -> Option<T> {
    let given = string(cx, path, value)?;
    let found = options.iter().copied().find(|o| name(*o) == given);
    if found.is_none() {
        let accepted = py_list(options.iter().map(|o| name(*o).to_string()).collect::<Vec<_>>());
        cx.err(path, format!("expected one of {accepted}, got {}", py_str(&given)));
    }
    found
}

/// What a real number must be.
#[derive(Clone, Copy)]
pub(super) enum Bound {
    Positive,
    AtLeastZero,
}

/// A finite real number (an integer is accepted) within `bound`.
pub(super) fn number(cx: &mut Cx, path: &Path, value: &Value, bound: Bound) -> Option<f64> {
    let accepted = match bound {
        Bound::Positive => "a finite number > 0",
        Bound::AtLeastZero => "a finite number ≥ 0",
    };
    let Some(x) = value.as_f64() else {
        cx.err(path, format!("expected {accepted}, got {}", describe(value)));
        return None;
    };
    let ok = match bound {
        Bound::Positive => x > 0.0,
        Bound::AtLeastZero => x >= 0.0,
    };
    if ok && x.is_finite() {
        return Some(x);
    }
    cx.err(path, format!("expected {accepted}, got {}", py_float(x)));
    None
}

/// What a size accepts.
const SIZE: &str = "a positive integer";
/// What a size that may be left unset accepts.
const SIZE_OR_NULL: &str = "a positive integer or null (unset)";

/// A size: an integer ≥ 1 (`{field} must be positive, got N.`, the seed's ep_size text, then
/// what is accepted).
pub(super) fn size(cx: &mut Cx, path: &Path, field: &str, value: &Value) -> Option<u64> {
    size_accepting(cx, path, field, value, SIZE)
}

/// A size that may be null (unset): None for null.
pub(super) fn optional_size(cx: &mut Cx, path: &Path, field: &str, value: &Value) -> Option<u64> {
    optional(value, |v| size_accepting(cx, path, field, v, SIZE_OR_NULL))
}

fn size_accepting(cx: &mut Cx, path: &Path, field: &str, value: &Value, accepted: &str) -> Option<u64> {
    let Value::Number(n) = value else {
        cx.err(path, format!("expected {accepted}, got {}", describe(value)));
        return None;
    };
    if let Some(u) = n.as_u64() {
        if u >= 1 {
            return Some(u);
        }
    }
    match (n.as_i64(), n.as_f64()) {
        (Some(i), _) => cx.err(path, format!("{field} must be positive, got {i}. Accepted: {accepted}.")),
        (None, Some(f)) if f.is_finite() && f.fract() == 0.0 && f.abs() >= 9.2e18 => cx.err(
            path,
            format!(
                "integer {} is out of range: integers must lie in [-2^63, 2^64). Accepted: {accepted}.",
                py_float(f)
            ),
        ),
        _ => cx.err(path, format!("expected {accepted}, got {}", describe(value))),
    }
    None
}
