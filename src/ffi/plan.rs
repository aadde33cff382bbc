//! C ABI of plan resolution: a plan from module and parameter names (or from a Hugging Face
//! config.json of a built-in family), a training config and a topology.

use std::ffi::c_char;

use super::config::fsdpturbo_config_t;
use super::error::FfiError;
use super::handle::{
    arg_mut, arg_ref, arg_slice, arg_str, arg_strs, check_struct_size, free_handle, into_handle, invalid,
    struct_size_of, write_out, write_slice, write_string,
};
use super::panic::boundary;
use super::topology::fsdpturbo_topology_t;
use crate::config::TrainConfig;
use crate::error::{Error, ErrorKind};
use crate::plan::{self, ParamRole, Plan, PlanInput, RankPlan};
use crate::spec::{ModelTree, ParamInfo, model_tree_from_config};
use crate::state;
use crate::topology::Topology;

/// A resolved plan together with the model tree, topology and storage dtype it was made for.
pub struct fsdpturbo_plan_t {
    plan: Plan,
    tree: ModelTree,
    topology: Topology,
    bf16: bool,
}

impl fsdpturbo_plan_t {
    fn rank_plan(&self, rank: u64) -> Result<RankPlan, FfiError> {
        Ok(plan::rank_plan(&self.plan, &self.tree, &self.topology, self.bf16, rank)?)
    }
}

/// The most experts one EP module may have: a larger count is a plan error, and the
/// checkpoint converter refuses per-expert keys numbered beyond it.
pub const FSDPTURBO_MAX_EXPERTS: u64 = 65_536;
const _: () = assert!(FSDPTURBO_MAX_EXPERTS == plan::MAX_EXPERTS);

/// Parameter roles (fsdpturbo_plan_param_role).
pub const FSDPTURBO_PARAM_EXPERT: i32 = 0;
// 1 was FSDPTURBO_PARAM_EXPERT_FSDP: routers and shared experts are now DENSE (the outer FSDP2).
/// Listed in fsdp_ignored_modules: kept whole on every rank.
pub const FSDPTURBO_PARAM_IGNORED: i32 = 2;
/// Managed by the outer FSDP2 over dp.
pub const FSDPTURBO_PARAM_DENSE: i32 = 3;

/// A model described by its module names (named_modules() order) and parameters.
/// `param_shapes` holds the dims of every parameter back to back; `param_ndims[i]` says how
/// many belong to parameter i. Initialise with FSDPTURBO_MODEL_DESC_INIT: `struct_size` is read
/// first and alone, and one below this version's size is FSDPTURBO_ERR_STRUCT_SIZE.
#[repr(C)]
pub struct fsdpturbo_model_desc_t {
    pub struct_size: usize,
    pub model_type: *const c_char,
    pub module_names: *const *const c_char,
    pub n_modules: usize,
    pub param_names: *const *const c_char,
    pub param_ndims: *const usize,
    pub param_shapes: *const u64,
    pub n_params: usize,
}

const MODEL_DESC_V1_SIZE: usize = std::mem::size_of::<fsdpturbo_model_desc_t>();

fn model_tree(desc: *const fsdpturbo_model_desc_t) -> Result<ModelTree, FfiError> {
    check_struct_size(
        struct_size_of(desc, "desc")?,
        MODEL_DESC_V1_SIZE,
        "desc",
        "fsdpturbo_model_desc_t",
        Some("FSDPTURBO_MODEL_DESC_INIT"),
    )?;
    let desc = arg_ref(desc, "desc")?;
    let model_type = arg_str(desc.model_type, "desc.model_type")?;
    let modules = arg_strs(desc.module_names, desc.n_modules, "desc.module_names")?;
    let names = arg_strs(desc.param_names, desc.n_params, "desc.param_names")?;
    let ndims = arg_slice(desc.param_ndims, desc.n_params, "desc.param_ndims")?;
    let total = ndims
        .iter()
        .try_fold(0usize, |acc, &n| acc.checked_add(n))
        .ok_or_else(|| invalid("desc.param_ndims sum overflows".into()))?;
    let dims = arg_slice(desc.param_shapes, total, "desc.param_shapes")?;
    let mut params = Vec::with_capacity(names.len());
    let mut offset = 0;
    for (name, &n) in names.iter().zip(ndims) {
        params.push(ParamInfo { name: name.to_string(), shape: dims[offset..offset + n].to_vec() });
        offset += n;
    }
    Ok(ModelTree {
        model_type: model_type.to_string(),
        modules: modules.into_iter().map(str::to_string).collect(),
        params,
        notes: Vec::new(),
    })
}

fn resolve(tree: ModelTree, config: &TrainConfig, topology: &Topology) -> Result<fsdpturbo_plan_t, FfiError> {
    let spec = state::spec(&tree.model_type)?;
    let input = PlanInput { tree: &tree, spec: &spec, dist: &config.dist, topology, bf16: config.bf16 };
    let plan = plan::resolve(&input)?;
    Ok(fsdpturbo_plan_t { plan, tree, topology: topology.clone(), bf16: config.bf16 })
}

/// Resolves the plan of the model described by `desc` under `config` and `topology`, using the
/// process-wide spec registry (built-ins plus fsdpturbo_spec_register). A `desc.struct_size`
/// below the size of fsdpturbo_model_desc_t is FSDPTURBO_ERR_STRUCT_SIZE (nothing else of `desc`
/// is read); on any failure `*out` is left as it was.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_plan_resolve(
    desc: *const fsdpturbo_model_desc_t,
    config: *const fsdpturbo_config_t,
    topology: *const fsdpturbo_topology_t,
    out: *mut *mut fsdpturbo_plan_t,
) -> i32 {
    boundary(|| {
        let (config, topology) = (arg_ref(config, "config")?, arg_ref(topology, "topology")?);
        let out = arg_mut(out, "out")?;
        let tree = model_tree(desc)?;
        *out = into_handle(resolve(tree, config.config(), &topology.topology)?);
        Ok(())
    })
}

/// Like fsdpturbo_plan_resolve, for a built-in family (qwen3_moe, qwen3_5_moe) described by
/// the text of its Hugging Face config.json.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_plan_resolve_hf(
    config_json: *const c_char,
    config: *const fsdpturbo_config_t,
    topology: *const fsdpturbo_topology_t,
    out: *mut *mut fsdpturbo_plan_t,
) -> i32 {
    boundary(|| {
        let text = arg_str(config_json, "config_json")?;
        let (config, topology) = (arg_ref(config, "config")?, arg_ref(topology, "topology")?);
        let out = arg_mut(out, "out")?;
        let value: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::new(ErrorKind::Plan, format!("config_json: invalid JSON: {e}")))?;
        let tree = model_tree_from_config(&value)?;
        *out = into_handle(resolve(tree, config.config(), &topology.topology)?);
        Ok(())
    })
}

/// Frees a plan; NULL is a no-op.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_plan_free(plan: *mut fsdpturbo_plan_t) {
    free_handle(plan)
}

/// The number of EP modules in the plan (0 without expert parallelism).
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_plan_num_ep_modules(plan: *const fsdpturbo_plan_t, out: *mut usize) -> i32 {
    boundary(|| write_out(out, "out", arg_ref(plan, "plan")?.plan.ep_modules.len()))
}

/// EP module `index`: its name (into `name`, with NUL; `*name_len` gets the bytes needed), its
/// global and local expert counts.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_plan_ep_module(
    plan: *const fsdpturbo_plan_t,
    index: usize,
    name: *mut c_char,
    name_cap: usize,
    name_len: *mut usize,
    num_global_experts: *mut u64,
    num_local_experts: *mut u64,
) -> i32 {
    boundary(|| {
        let modules = &arg_ref(plan, "plan")?.plan.ep_modules;
        let module = modules.get(index).ok_or_else(|| {
            Error::invalid(format!(
                "index {index} is out of range: the plan has {} EP modules",
                modules.len()
            ))
        })?;
        write_out(num_global_experts, "num_global_experts", module.num_global_experts)?;
        write_out(num_local_experts, "num_local_experts", module.num_local_experts)?;
        write_string(name, name_cap, name_len, &module.name, "name")
    })
}

/// The role of parameter `name` (FSDPTURBO_PARAM_*); an unknown name is an error.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_plan_param_role(
    plan: *const fsdpturbo_plan_t,
    name: *const c_char,
    out: *mut i32,
) -> i32 {
    boundary(|| {
        let handle = arg_ref(plan, "plan")?;
        let name = arg_str(name, "name")?;
        let role = handle
            .plan
            .role(&handle.tree, name)
            .ok_or_else(|| Error::invalid(format!("parameter {name:?} is not part of the planned model")))?;
        let role = match role {
            ParamRole::Expert => FSDPTURBO_PARAM_EXPERT,
            ParamRole::Ignored => FSDPTURBO_PARAM_IGNORED,
            ParamRole::Dense => FSDPTURBO_PARAM_DENSE,
        };
        write_out(out, "out", role)
    })
}

/// What every gradient is divided by after its reduction (docs/design.md §4.1).
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_plan_gradient_divide_factor(plan: *const fsdpturbo_plan_t, out: *mut f64) -> i32 {
    boundary(|| write_out(out, "out", arg_ref(plan, "plan")?.plan.gradient_divide_factor))
}

/// The global expert indices `rank` holds (`local_expert_indices`).
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_plan_local_experts(
    plan: *const fsdpturbo_plan_t,
    rank: u64,
    experts: *mut u64,
    cap: usize,
    out_len: *mut usize,
) -> i32 {
    boundary(|| {
        let rank_plan = arg_ref(plan, "plan")?.rank_plan(rank)?;
        write_slice(experts, cap, out_len, &rank_plan.local_expert_indices, "experts")
    })
}

/// For each global expert, its index among its owner's local experts (`expert_ids_per_ep_rank`).
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_plan_expert_ids_per_ep_rank(
    plan: *const fsdpturbo_plan_t,
    ids: *mut u64,
    cap: usize,
    out_len: *mut usize,
) -> i32 {
    boundary(|| {
        let rank_plan = arg_ref(plan, "plan")?.rank_plan(0)?;
        write_slice(ids, cap, out_len, &rank_plan.expert_ids_per_ep_rank, "ids")
    })
}

/// Bytes one rank holds (fsdpturbo_memory_t), under EP × EFSDP × outer FSDP2.
#[repr(C)]
#[derive(Clone, Copy)]
pub struct fsdpturbo_memory_t {
    pub param_elements: u64,
    pub param_bytes: u64,
    pub grad_bytes: u64,
    pub optimizer_bytes: u64,
    pub total_bytes: u64,
}

/// The memory `rank` holds under the plan.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_plan_memory(
    plan: *const fsdpturbo_plan_t,
    rank: u64,
    out: *mut fsdpturbo_memory_t,
) -> i32 {
    boundary(|| {
        let m = arg_ref(plan, "plan")?.rank_plan(rank)?.memory;
        write_out(
            out,
            "out",
            fsdpturbo_memory_t {
                param_elements: m.param_elements,
                param_bytes: m.param_bytes,
                grad_bytes: m.grad_bytes,
                optimizer_bytes: m.optimizer_bytes,
                total_bytes: m.total_bytes,
            },
        )
    })
}

/// The whole plan as JSON, copied into `buf` with its NUL; `*out_len` gets the bytes needed.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_plan_to_json(
    plan: *const fsdpturbo_plan_t,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> i32 {
    boundary(|| {
        let handle = arg_ref(plan, "plan")?;
        let text = handle.plan.to_json(&handle.tree).to_string();
        write_string(buf, cap, out_len, &text, "buf")
    })
}
