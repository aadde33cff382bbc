//! Plan resolution: from a model's module tree, its spec, the FSDPTurbo config and the
//! topology, decide which modules are experts (EP) and expert-FSDP units (EFSDP), which
//! parameters the outer FSDP2 ignores, which experts each rank owns, how every parameter is
//! laid out, the gradient divide factor, and the bytes each rank holds.

use std::cell::Cell;
use std::collections::{HashMap, HashSet};

use crate::config::{Dispatcher, DistConfig, FsdpImplementation, TrainConfig, py_list};
use crate::error::{Error, ErrorKind, Result};
use crate::pattern::PatternSet;
use crate::spec::{ModelSpec, ModelTree, ParamInfo};
use crate::topology::{Topology, TopologySpec};

/// The most experts one EP module may have (models have up to a few hundred); it bounds the
/// per-expert tables a plan builds.
pub const MAX_EXPERTS: u64 = 65_536;

/// Everything plan resolution reads.
pub struct PlanInput<'a> {
    pub tree: &'a ModelTree,
    pub spec: &'a ModelSpec,
    pub dist: &'a DistConfig,
    pub topology: &'a Topology,
    /// Storage dtype: bf16 (2 bytes) when set, else f32 (4 bytes).
    pub bf16: bool,
}

/// Who owns a parameter and how it is sharded.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ParamRole {
    /// An expert weight: `Shard(0)` over ep, then (efsdp > 1) `Shard(1)` (≥ 2-D) or
    /// `Shard(0)` (1-D) over efsdp; ignored by the outer FSDP2.
    Expert,
    /// Listed in `fsdp_ignored_modules`: kept whole on every rank.
    Ignored,
    /// Everything else: the outer FSDP2, `Shard(0)` over dp. This includes the non-expert
    /// parameters of EFSDP units (router, shared expert): every ep rank holds them whole, and
    /// on the dp mesh a norm that reduces by mesh counts each once.
    Dense,
}

/// An EP module and its expert counts.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct ExpertModule {
    pub name: String,
    pub num_global_experts: u64,
    pub num_local_experts: u64,
}

/// The rank-independent plan.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct Plan {
    pub ep_modules: Vec<ExpertModule>,
    pub efsdp_modules: Vec<String>,
    pub hook_modules: Vec<String>,
    /// The role of every parameter of the planned tree, in the tree's order. The plan
    /// annotates the tree rather than copying its names: a 235B model has 37k of them.
    pub roles: Vec<ParamRole>,
    /// What every gradient is divided by after its reduction: the world size, dp · cp, the
    /// ranks whose gradients are summed (docs/design.md §4.1). It holds under both loss
    /// conventions the engines serve: each rank's loss the mean over its own tokens
    /// (`shard_model`), and LlamaFactory's, where every cp rank backpropagates its sequence's
    /// whole loss scaled by dp / global tokens (docs/seed.md).
    pub gradient_divide_factor: f64,
    /// The seed's factor (ep × efsdp, applied only when efsdp > 1), for comparison.
    pub seed_gradient_divide_factor: Option<f64>,
    pub warnings: Vec<String>,
}

/// What one rank holds.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct RankPlan {
    pub rank: u64,
    /// This rank's coordinate on the ep mesh dim (0 without EP).
    pub ep_rank: u64,
    pub local_expert_indices: Vec<u64>,
    /// For each global expert, its index among its owner's local experts (`e % L`).
    pub expert_ids_per_ep_rank: Vec<u64>,
    pub memory: Memory,
}

/// Bytes held by one rank under EP × EFSDP × outer FSDP2 (storage dtype for parameters and
/// gradients; AdamW's two moments in the parameter dtype, as torch keeps them).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, serde::Serialize)]
pub struct Memory {
    pub param_elements: u64,
    pub param_bytes: u64,
    pub grad_bytes: u64,
    pub optimizer_bytes: u64,
    pub total_bytes: u64,
}

fn plan_error(message: String) -> Error {
    Error::new(ErrorKind::Plan, message)
}

fn compile(patterns: &[String], source: &str) -> Result<PatternSet> {
    PatternSet::compile(patterns).map_err(|e| plan_error(format!("{source}: {}", e.message)))
}

/// Modules matched by `patterns`, pattern-major then in module order (the seed's loop),
/// without the seed's duplicates; a module matched twice is reported in `warnings`.
fn match_modules(tree: &ModelTree, patterns: &PatternSet, warnings: &mut Vec<String>) -> Vec<String> {
    let mut matched: Vec<String> = Vec::new();
    let mut seen: HashSet<&str> = HashSet::new();
    for pattern in patterns.patterns() {
        for module in tree.modules.iter().filter(|m| pattern.is_match(m)) {
            if seen.insert(module) {
                matched.push(module.clone());
            } else {
                warnings.push(format!(
                    "module {module} is matched by more than one pattern; it is processed once \
                     (the seed would process it twice)"
                ));
            }
        }
    }
    matched
}

fn within(module: &str, name: &str) -> bool {
    module.is_empty() || name.strip_prefix(module).is_some_and(|rest| rest.starts_with('.'))
}

/// The number of '.' in a dotted module or parameter name.
fn dots(name: &str) -> usize {
    name.bytes().filter(|&b| b == b'.').count()
}

/// A set of module names that answers "is one of them an ancestor of this parameter?" with a
/// lookup per distinct depth of its members, not per ancestor.
struct ModuleSet<'a> {
    names: HashSet<&'a str>,
    /// The distinct numbers of dots in the members' names.
    depths: Vec<usize>,
    has_root: bool,
    /// The member found last: parameters come grouped by module, so most lookups hit it.
    last_hit: Cell<Option<&'a str>>,
}

impl<'a> ModuleSet<'a> {
    fn new(names: impl Iterator<Item = &'a String>) -> ModuleSet<'a> {
        let names: HashSet<&str> = names.map(String::as_str).collect();
        let has_root = names.contains("");
        let mut depths: Vec<usize> = names.iter().filter(|n| !n.is_empty()).map(|n| dots(n)).collect();
        depths.sort_unstable();
        depths.dedup();
        ModuleSet { names, depths, has_root, last_hit: Cell::new(None) }
    }

    fn contains_ancestor_of(&self, name: &str) -> bool {
        if self.has_root || self.last_hit.get().is_some_and(|hit| within(hit, name)) {
            return true;
        }
        if self.depths.is_empty() {
            return false;
        }
        // A member with d dots is an ancestor iff it equals the prefix before dot number d.
        let mut dot_positions =
            name.bytes().enumerate().filter(|&(_, b)| b == b'.').map(|(i, _)| i).enumerate();
        let found = self.depths.iter().find_map(|&d| {
            let (_, end) = dot_positions.find(|&(n, _)| n == d)?;
            self.names.get(&name[..end]).copied()
        });
        if found.is_some() {
            self.last_hit.set(found);
        }
        found.is_some()
    }
}

/// The number of experts of each EP module: the leading dim of its fused expert weights
/// (`num_experts`), or, for the legacy ModuleList form, its number of numbered children.
/// One pass over the parameters and one over the modules.
fn count_experts(tree: &ModelTree, names: &[String]) -> Result<Vec<u64>> {
    let index: HashMap<&str, usize> = names.iter().enumerate().map(|(i, n)| (n.as_str(), i)).collect();
    // Only names one level below an EP module can belong to it: compare dot counts before hashing.
    let child_depths: HashSet<usize> = names.iter().map(|n| dots(n) + 1).collect();
    let child_of = |name: &str| -> Option<usize> {
        if !child_depths.contains(&dots(name)) {
            return None;
        }
        index.get(&name[..name.rfind('.')?]).copied()
    };
    let mut fused: Vec<Option<(u64, &str)>> = vec![None; names.len()];
    for param in &tree.params {
        let Some(i) = child_of(&param.name) else { continue };
        let owner = &names[i];
        let Some(&rows) = param.shape.first() else {
            return Err(plan_error(format!(
                "[Expert Parallel] expert parameter {} is a scalar; expert parameters are [E, ...]",
                param.name
            )));
        };
        match fused[i] {
            Some((e, other)) if e != rows => {
                return Err(plan_error(format!(
                    "[Expert Parallel] the parameters of {owner} disagree on the number of experts: \
                     {other} has {e} rows, {} has {rows}",
                    param.name
                )));
            }
            _ => fused[i] = Some((rows, &param.name)),
        }
    }
    let mut numbered_children = vec![0u64; names.len()];
    for module in &tree.modules {
        if module.as_bytes().last().is_some_and(u8::is_ascii_digit)
            && let Some((_, leaf)) = module.rsplit_once('.')
            && leaf.bytes().all(|b| b.is_ascii_digit())
            && let Some(i) = child_of(module)
        {
            numbered_children[i] += 1;
        }
    }
    names
        .iter()
        .enumerate()
        .map(|(i, name)| match (fused[i], numbered_children[i]) {
            (Some((rows, _)), _) => Ok(rows),
            (None, n) if n > 0 => Ok(n),
            _ => Err(plan_error(format!(
                "[Expert Parallel] module {name} matches an EP pattern but holds no experts: expected \
                 fused [E, ...] weights (gate_up_proj, down_proj) or a ModuleList of experts"
            ))),
        })
        .collect()
}

fn expert_modules(tree: &ModelTree, names: &[String], ep: u64) -> Result<Vec<ExpertModule>> {
    let counts = count_experts(tree, names)?;
    names
        .iter()
        .zip(counts)
        .map(|(name, num_global_experts)| {
            if num_global_experts > MAX_EXPERTS {
                return Err(plan_error(format!(
                    "[Expert Parallel] {name} has {num_global_experts} experts, more than the limit of {MAX_EXPERTS}"
                )));
            }
            if num_global_experts % ep != 0 {
                return Err(plan_error(format!(
                    "Number of experts({num_global_experts}) is not divisible by ep size({ep})."
                )));
            }
            Ok(ExpertModule {
                name: name.clone(),
                num_global_experts,
                num_local_experts: num_global_experts / ep,
            })
        })
        .collect()
}

/// Module names in post-order (children before parents, root last), as the seed's hook search.
fn post_order(modules: &[String]) -> Vec<String> {
    let mut out = Vec::with_capacity(modules.len());
    let mut open: Vec<&String> = Vec::new();
    for module in modules {
        while let Some(top) = open.last() {
            if within(top, module) {
                break;
            }
            out.push(open.pop().expect("non-empty").clone());
        }
        open.push(module);
    }
    out.extend(open.into_iter().rev().cloned());
    out
}

/// Resolves the plan. Errors carry the seed's texts where it has them.
pub fn resolve(input: &PlanInput) -> Result<Plan> {
    let PlanInput { tree, spec, dist, topology, .. } = *input;
    let ep = topology.ep_size;
    let efsdp = topology.efsdp_size;
    let mut warnings = Vec::new();

    let mut ep_modules = Vec::new();
    let mut efsdp_modules = Vec::new();
    let mut hook_modules = Vec::new();
    if ep > 1 {
        let ep_patterns = compile(&spec.ep_modules, &format!("model spec {}.ep_modules", spec.model_type))?;
        let names = match_modules(tree, &ep_patterns, &mut warnings);
        if names.is_empty() {
            return Err(plan_error(format!(
                "[Expert Parallel] No module named {} or not be ModuleList (model type {})",
                py_list(&spec.ep_modules),
                spec.model_type
            )));
        }
        ep_modules = expert_modules(tree, &names, ep)?;

        if efsdp > 1 {
            let efsdp_patterns = spec.efsdp_modules();
            let compiled =
                compile(&efsdp_patterns, &format!("model spec {}.ep_fsdp_modules", spec.model_type))?;
            let matched = match_modules(tree, &compiled, &mut warnings);
            if matched.is_empty() {
                return Err(plan_error(format!(
                    "[Expert Fully Shard] No module named {} or not be ModuleList (model type {})",
                    py_list(&efsdp_patterns),
                    spec.model_type
                )));
            }
            // A unit without experts (e.g. a dense MLP layer in `mlp_only_layers`, which the
            // seed's `...mlp` pattern also matches) would be sharded over efsdp alone while
            // replicated over ep; it stays with the outer FSDP2 instead.
            let (with_experts, without): (Vec<String>, Vec<String>) =
                matched.into_iter().partition(|unit| ep_modules.iter().any(|m| within(unit, &m.name)));
            for unit in without {
                warnings.push(format!(
                    "{unit} matches the EFSDP pattern but holds no EP module; it stays with the outer FSDP2"
                ));
            }
            efsdp_modules = with_experts;
            if !dist.hook_modules.is_empty() {
                let hooks = compile(&dist.hook_modules, "dist_config.hook_modules")?;
                hook_modules = post_order(&tree.modules).into_iter().filter(|m| hooks.is_match(m)).collect();
                if hook_modules.is_empty() {
                    return Err(plan_error(format!(
                        "[FSDP2] No module named {}.",
                        py_list(&dist.hook_modules)
                    )));
                }
            }
        }
    }

    let user_ignored = compile(&dist.fsdp_ignored_modules, "dist_config.fsdp_ignored_modules")?;
    for pattern in user_ignored.patterns() {
        if !tree.modules.iter().any(|m| pattern.is_match(m)) {
            warnings.push(format!(
                "dist_config.fsdp_ignored_modules pattern {:?} matches no module",
                pattern.as_str()
            ));
        }
    }
    let ignored_modules = ModuleSet::new(tree.modules.iter().filter(|m| user_ignored.is_match(m)));
    let expert_modules = ModuleSet::new(ep_modules.iter().map(|m| &m.name));

    let roles = tree
        .params
        .iter()
        .map(|param| {
            if expert_modules.contains_ancestor_of(&param.name) {
                ParamRole::Expert
            } else if ignored_modules.contains_ancestor_of(&param.name) {
                ParamRole::Ignored
            } else {
                ParamRole::Dense
            }
        })
        .collect();

    Ok(Plan {
        ep_modules,
        efsdp_modules,
        hook_modules,
        roles,
        gradient_divide_factor: topology.world_size as f64,
        seed_gradient_divide_factor: (ep > 1 && efsdp > 1).then(|| (ep * efsdp) as f64),
        warnings,
    })
}

/// What `shard_model` refuses in a valid configuration, for a launch on `device` ("cpu",
/// "cuda" or "npu"): settings of the seed's schema that are not built here, and a dispatcher
/// the device cannot run. `fsdpturbo plan` reports each as a violation.
pub fn unsupported(dist: &DistConfig, device: &str) -> Vec<String> {
    let mut refused = Vec::new();
    if dist.fsdp_implementation == FsdpImplementation::Custom {
        refused.push(
            "dist_config.fsdp_implementation 'custom' (FSDPTurbo's fine-grained fully_shard) is not \
             implemented; use 'native'"
                .to_string(),
        );
    }
    if dist.ep_dispatcher == Dispatcher::Mc2 && device != "npu" {
        refused.push(format!(
            "dist_config.ep_dispatcher 'mc2' runs only on Ascend NPUs, not on {device}; use 'eager', \
             'fused' or 'domino' (or plan with --device npu)"
        ));
    }
    refused
}

/// Length of chunk `index` when `n` rows are split into `parts` like `torch.chunk` and
/// DTensor (ceil-sized chunks; trailing chunks may be short or empty).
pub(crate) fn chunk_len(n: u64, parts: u64, index: u64) -> u64 {
    let size = n.div_ceil(parts.max(1));
    n.saturating_sub(size * index).min(size)
}

/// The local shape of a parameter on the rank at `coord` (mesh coordinates by dim name).
fn local_shape(param: &ParamInfo, role: ParamRole, topology: &Topology, coord: &Coordinates) -> Vec<u64> {
    let mut shape = param.shape.clone();
    if shape.is_empty() {
        return shape;
    }
    let fsdp_dim = if shape.len() >= 2 { 1 } else { 0 };
    match role {
        ParamRole::Expert => {
            shape[0] = chunk_len(shape[0], topology.ep_size, coord.ep);
            if topology.efsdp_size > 1 {
                shape[fsdp_dim] = chunk_len(shape[fsdp_dim], topology.efsdp_size, coord.efsdp);
            }
        }
        ParamRole::Ignored => {}
        ParamRole::Dense => shape[0] = chunk_len(shape[0], topology.dp_size, coord.dp),
    }
    shape
}

struct Coordinates {
    dp: u64,
    ep: u64,
    efsdp: u64,
}

fn coordinates(topology: &Topology, rank: u64) -> Result<Coordinates> {
    let data = topology.data_mesh().coordinate(rank)?;
    let (ep, efsdp) = match topology.expert_mesh() {
        Some(mesh) => {
            let c = mesh.coordinate(rank)?;
            (c[mesh.dim_index("ep")?], c[mesh.dim_index("efsdp")?])
        }
        None => (0, 0),
    };
    Ok(Coordinates { dp: data[0], ep, efsdp })
}

impl Plan {
    /// Parameters the outer FSDP2 must not manage: EP parameters and fsdp_ignored_modules.
    pub fn ignored_params<'t>(&self, tree: &'t ModelTree) -> Vec<&'t str> {
        tree.params
            .iter()
            .zip(&self.roles)
            .filter(|(_, role)| matches!(role, ParamRole::Expert | ParamRole::Ignored))
            .map(|(p, _)| p.name.as_str())
            .collect()
    }

    /// The role of parameter `name` of `tree`.
    pub fn role(&self, tree: &ModelTree, name: &str) -> Option<ParamRole> {
        tree.params.iter().position(|p| p.name == name).map(|i| self.roles[i])
    }

    /// The plan with every parameter's name, shape and role, as one JSON value.
    pub fn to_json(&self, tree: &ModelTree) -> serde_json::Value {
        let mut value = serde_json::to_value(self).expect("plain data serialises");
        let params: Vec<serde_json::Value> = tree
            .params
            .iter()
            .zip(&self.roles)
            .map(|(p, role)| serde_json::json!({ "name": p.name, "shape": p.shape, "role": role }))
            .collect();
        value["roles"] = serde_json::Value::Null;
        value["params"] = serde_json::Value::Array(params);
        value["ignored_params"] = serde_json::json!(self.ignored_params(tree));
        value
    }
}

/// What `rank` holds under `plan`.
pub fn rank_plan(
    plan: &Plan,
    tree: &ModelTree,
    topology: &Topology,
    bf16: bool,
    rank: u64,
) -> Result<RankPlan> {
    let coord = coordinates(topology, rank)?;
    let (local_expert_indices, expert_ids_per_ep_rank) = match plan.ep_modules.first() {
        Some(m) => {
            let local = m.num_local_experts;
            (
                (coord.ep * local..(coord.ep + 1) * local).collect(),
                (0..m.num_global_experts).map(|e| e % local).collect(),
            )
        }
        None => (Vec::new(), Vec::new()),
    };
    let element_bytes = if bf16 { 2 } else { 4 };
    let param_elements: u64 = tree
        .params
        .iter()
        .zip(&plan.roles)
        .map(|(p, &role)| local_shape(p, role, topology, &coord).iter().product::<u64>())
        .sum();
    let param_bytes = param_elements * element_bytes;
    let memory = Memory {
        param_elements,
        param_bytes,
        grad_bytes: param_bytes,
        optimizer_bytes: 2 * param_bytes,
        total_bytes: 4 * param_bytes,
    };
    Ok(RankPlan { rank, ep_rank: coord.ep, local_expert_indices, expert_ids_per_ep_rank, memory })
}

/// What `rank` holds with LoRA of rank `lora_rank` on every 3-D expert weight of the EP modules
/// (fsdpturbo.moe.expert_lora) and every other parameter frozen: the frozen parameters as in
/// `rank_plan`, plus the adapters (`{weight}_lora_down` [E, r, in] and `{weight}_lora_up`
/// [E, out, r], sharded like the expert weight: dim 0 over ep, dim 1 over efsdp), whose
/// gradients and AdamW moments are the only ones.
pub fn expert_lora_memory(
    plan: &Plan,
    tree: &ModelTree,
    topology: &Topology,
    bf16: bool,
    rank: u64,
    lora_rank: u64,
) -> Result<Memory> {
    let coord = coordinates(topology, rank)?;
    let base = rank_plan(plan, tree, topology, bf16, rank)?.memory;
    let ep_modules: HashSet<&str> = plan.ep_modules.iter().map(|m| m.name.as_str()).collect();
    let adapter_elements: u64 = tree
        .params
        .iter()
        .filter(|p| {
            p.shape.len() == 3 && p.name.rsplit_once('.').is_some_and(|(owner, _)| ep_modules.contains(owner))
        })
        .flat_map(|p| {
            let (experts, out, input) = (p.shape[0], p.shape[1], p.shape[2]);
            [vec![experts, lora_rank, input], vec![experts, out, lora_rank]]
        })
        .map(|shape| {
            let factor = ParamInfo { name: String::new(), shape };
            local_shape(&factor, ParamRole::Expert, topology, &coord).iter().product::<u64>()
        })
        .sum();
    let adapter_bytes = adapter_elements * if bf16 { 2 } else { 4 };
    Ok(Memory {
        param_elements: base.param_elements + adapter_elements,
        param_bytes: base.param_bytes + adapter_bytes,
        grad_bytes: adapter_bytes,
        optimizer_bytes: 2 * adapter_bytes,
        total_bytes: base.param_bytes + 4 * adapter_bytes,
    })
}

/// Each EP rank's expert range `[start, end)` for the first EP module (all EP modules of the
/// built-in families have the same count).
pub fn expert_owners(plan: &Plan, topology: &Topology) -> Vec<(u64, u64)> {
    match plan.ep_modules.first() {
        Some(m) => {
            (0..topology.ep_size).map(|j| (j * m.num_local_experts, (j + 1) * m.num_local_experts)).collect()
        }
        None => Vec::new(),
    }
}

/// The topology a training config asks for on `world_size` ranks: its sizes, with `None` for
/// those it leaves to their formulas.
pub fn topology_spec(config: &TrainConfig, world_size: u64) -> TopologySpec {
    TopologySpec {
        world_size,
        dp_size: config.dp_size,
        cp_size: config.cp_size,
        mp_replicate_size: config.mp_replicate_size,
        mp_shard_size: config.mp_shard_size,
        ep_size: config.dist.ep_size,
        efsdp_size: config.dist.efsdp_size,
    }
}
