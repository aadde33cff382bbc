//! `fsdpturbo plan`: a dry run of a launch. Validates config + topology + plan for a model's
//! HF config.json and prints meshes, the groups of one rank, expert ownership and a per-rank
//! memory table (or all of it as one JSON object with --json).

use std::process::ExitCode;

use fsdpturbo::config::{TrainConfig, parse_train_config_bytes};
use fsdpturbo::cp;
use fsdpturbo::plan::{self, Plan, PlanInput, RankPlan};
use fsdpturbo::spec::{ModelTree, SpecRegistry, model_tree_from_config};
use fsdpturbo::topology::{Mesh, Topology};
use serde_json::{Value, json};

const USAGE: &str = "\
usage: fsdpturbo [plan] [--config TRAIN.yaml --model CONFIG.json --world-size N] [--rank R]
                 [--device cpu|cuda|npu] [--stage sft|dpo|rm] [--expert-lora-rank R] [--json]

With no --config/--model/--world-size it plans the built-in example: Qwen3-30B-A3B on 32 ranks
with ep_size 8 (examples/configs/qwen3_30b_a3b_ep8.yaml, examples/models/qwen3_30b_a3b.json).
--device is the accelerator of the planned launch (default cuda): what it cannot run (mc2 off an
NPU) is a violation, as are valid settings that shard_model does not implement.
--stage is LlamaFactory's command of the launch (`llamafactory-cli sft|dpo|rm`; LlamaFactory v1
takes no stage key in the YAML): dpo and rm with cp_size > 1 are a violation. Without it the
stage is not checked.
--expert-lora-rank plans LoRA of that rank on the expert weights with every other parameter
frozen: the memory table counts the adapters, and gradients and AdamW moments of them only.
Exit status: 0 when the launch is valid, 1 when there are violations, 2 on a usage error.";

const EXAMPLE_CONFIG: &str = include_str!("../../examples/configs/qwen3_30b_a3b_ep8.yaml");
const EXAMPLE_MODEL: &str = include_str!("../../examples/models/qwen3_30b_a3b.json");
const EXAMPLE_WORLD: u64 = 32;

struct Args {
    config: Option<String>,
    model: Option<String>,
    world_size: Option<u64>,
    rank: u64,
    device: String,
    stage: Option<&'static str>,
    expert_lora_rank: Option<u64>,
    json: bool,
}

fn parse_args(args: impl Iterator<Item = String>) -> Result<Args, String> {
    let mut args = args.peekable();
    match args.peek().map(String::as_str) {
        Some("plan") => {
            args.next();
        }
        None => {}
        Some("-h" | "--help") => return Err(String::new()),
        Some(other) => return Err(format!("unknown command {other:?}; the only command is `plan`")),
    }
    let mut parsed = Args {
        config: None,
        model: None,
        world_size: None,
        rank: 0,
        device: "cuda".into(),
        stage: None,
        expert_lora_rank: None,
        json: false,
    };
    while let Some(flag) = args.next() {
        let mut value = |name: &str| args.next().ok_or_else(|| format!("{name} needs a value"));
        let number = |name: &str, text: String| {
            text.parse::<u64>().map_err(|_| format!("{name} must be a non-negative integer, got {text:?}"))
        };
        match flag.as_str() {
            "--config" => parsed.config = Some(value("--config")?),
            "--model" => parsed.model = Some(value("--model")?),
            "--world-size" => parsed.world_size = Some(number("--world-size", value("--world-size")?)?),
            "--rank" => parsed.rank = number("--rank", value("--rank")?)?,
            "--device" => match value("--device")?.as_str() {
                device @ ("cpu" | "cuda" | "npu") => parsed.device = device.into(),
                other => return Err(format!("--device must be cpu, cuda or npu, got {other:?}")),
            },
            "--stage" => {
                let stage = value("--stage")?;
                match cp::STAGES.iter().find(|&&s| s == stage) {
                    Some(&known) => parsed.stage = Some(known),
                    None => {
                        let accepted = cp::STAGES.join(", ");
                        return Err(format!(
                            "--stage must be one of {accepted} (the llamafactory-cli command), got {stage:?}"
                        ));
                    }
                }
            }
            "--expert-lora-rank" => match number("--expert-lora-rank", value("--expert-lora-rank")?)? {
                0 => return Err("--expert-lora-rank must be at least 1".into()),
                lora_rank => parsed.expert_lora_rank = Some(lora_rank),
            },
            "--json" => parsed.json = true,
            "-h" | "--help" => return Err(String::new()),
            other => return Err(format!("unknown option {other:?}")),
        }
    }
    let given = [parsed.config.is_some(), parsed.model.is_some(), parsed.world_size.is_some()];
    if given.iter().any(|&g| g) && !given.iter().all(|&g| g) {
        return Err("--config, --model and --world-size go together (or give none for the example)".into());
    }
    Ok(parsed)
}

/// Everything the dry run found; violations are collected, not stopped at.
struct DryRun {
    title: String,
    world_size: u64,
    rank: u64,
    stage: Option<&'static str>,
    expert_lora_rank: Option<u64>,
    violations: Vec<String>,
    config: Option<TrainConfig>,
    topology: Option<Topology>,
    tree: Option<ModelTree>,
    plan: Option<Plan>,
    rank_plans: Vec<RankPlan>,
}

fn read(path: &str) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("{path}: cannot read: {e}"))
}

fn dry_run(args: &Args) -> DryRun {
    let (title, config_bytes, model_bytes, world_size) = match (&args.config, &args.model, args.world_size) {
        (Some(config), Some(model), Some(world)) => {
            (format!("{config} + {model}"), read(config), read(model), world)
        }
        _ => (
            "built-in example: Qwen3-30B-A3B, ep_size 8".to_string(),
            Ok(EXAMPLE_CONFIG.as_bytes().to_vec()),
            Ok(EXAMPLE_MODEL.as_bytes().to_vec()),
            EXAMPLE_WORLD,
        ),
    };
    let mut run = DryRun {
        title,
        world_size,
        rank: args.rank,
        stage: args.stage,
        expert_lora_rank: args.expert_lora_rank,
        violations: Vec::new(),
        config: None,
        topology: None,
        tree: None,
        plan: None,
        rank_plans: Vec::new(),
    };

    match config_bytes.map(|bytes| parse_train_config_bytes(&bytes)) {
        Ok(Ok(config)) => run.config = Some(config),
        Ok(Err(errors)) => run.violations.extend(errors.0.iter().map(|e| format!("config: {e}"))),
        Err(e) => run.violations.push(e),
    }
    let model = model_bytes.and_then(|bytes| {
        serde_json::from_slice::<Value>(&bytes).map_err(|e| format!("model config.json: invalid JSON: {e}"))
    });
    let model = match model {
        Ok(value) => Some(value),
        Err(e) => {
            run.violations.push(e);
            None
        }
    };
    if let Some(value) = &model {
        match model_tree_from_config(value) {
            Ok(tree) => run.tree = Some(tree),
            Err(e) => run.violations.push(e.message),
        }
    }
    if args.rank >= world_size {
        run.violations.push(format!("--rank {} is outside the world of {world_size} ranks", args.rank));
    }
    let Some(config) = &run.config else { return run };
    match Topology::new(&plan::topology_spec(config, world_size)) {
        Ok(topology) => run.topology = Some(topology),
        Err(e) => run.violations.push(format!("topology: {}", e.message)),
    }
    if let (Some(topology), Some(value)) = (&run.topology, &model) {
        run.violations.extend(
            cp::cp_violations(value, topology.cp_size, args.stage).into_iter().map(|v| format!("cp: {v}")),
        );
    }
    let (Some(topology), Some(tree)) = (&run.topology, &run.tree) else { return run };

    let registry = SpecRegistry::with_builtins();
    let spec = match registry.get(&tree.model_type) {
        Ok(spec) => spec,
        Err(e) => {
            run.violations.push(format!("plan: {}", e.message));
            return run;
        }
    };
    let dist = &config.dist;
    run.violations.extend(plan::unsupported(dist, &args.device).into_iter().map(|v| format!("config: {v}")));
    let input = PlanInput { tree, spec, dist, topology, bf16: config.bf16 };
    match plan::resolve(&input) {
        Ok(resolved) => {
            for rank in 0..world_size {
                let planned = plan::rank_plan(&resolved, tree, topology, config.bf16, rank).and_then(
                    |mut rank_plan| {
                        if let Some(lora_rank) = args.expert_lora_rank {
                            rank_plan.memory = plan::expert_lora_memory(
                                &resolved,
                                tree,
                                topology,
                                config.bf16,
                                rank,
                                lora_rank,
                            )?;
                        }
                        Ok(rank_plan)
                    },
                );
                match planned {
                    Ok(rank_plan) => run.rank_plans.push(rank_plan),
                    Err(e) => run.violations.push(format!("plan for rank {rank}: {}", e.message)),
                }
            }
            run.plan = Some(resolved);
        }
        Err(e) => run.violations.push(format!("plan: {}", e.message)),
    }
    run
}

/// The groups of `rank` in every mesh, by dim name (and the 2-D (efsdp, ep) expert group).
fn groups_of(topology: &Topology, rank: u64) -> Vec<(String, Vec<u64>)> {
    let mut groups = Vec::new();
    let mut add = |mesh: &Mesh, dims: &[&str]| {
        if let Ok(members) = mesh.group(rank, dims) {
            groups.push((dims.join("×"), members));
        }
    };
    let data = topology.data_mesh();
    add(&data, &["dp"]);
    add(&data, &["cp"]);
    let model = topology.model_mesh();
    add(&model, &["mp_replicate"]);
    add(&model, &["mp_shard"]);
    if let Some(expert) = topology.expert_mesh() {
        for dim in ["edp", "efsdp", "ep", "expert_cp"] {
            add(&expert, &[dim]);
        }
        add(&expert, &["efsdp", "ep"]);
    }
    groups
}

fn list(members: &[u64]) -> String {
    if members.len() > 16 {
        let head: Vec<String> = members[..4].iter().map(u64::to_string).collect();
        format!("[{}, …, {}] ({} ranks)", head.join(", "), members[members.len() - 1], members.len())
    } else {
        format!("{members:?}")
    }
}

fn mesh_text(mesh: &Mesh) -> String {
    let dims: Vec<String> = mesh.dim_names.iter().zip(&mesh.shape).map(|(n, s)| format!("{n}={s}")).collect();
    format!("({})", dims.join(", "))
}

fn gib(bytes: u64) -> String {
    format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
}

/// Consecutive ranks with identical memory, as (first, last, memory).
fn memory_rows(rank_plans: &[RankPlan]) -> Vec<(u64, u64, plan::Memory)> {
    let mut rows: Vec<(u64, u64, plan::Memory)> = Vec::new();
    for rp in rank_plans {
        match rows.last_mut() {
            Some(row) if row.2 == rp.memory && row.1 + 1 == rp.rank => row.1 = rp.rank,
            _ => rows.push((rp.rank, rp.rank, rp.memory)),
        }
    }
    rows
}

fn print_text(run: &DryRun) {
    let stage = run.stage.map_or(String::new(), |s| format!(", stage {s}"));
    println!("fsdpturbo plan: {} — world {}, rank {}{stage}", run.title, run.world_size, run.rank);
    if run.violations.is_empty() {
        println!("violations: none");
    } else {
        println!("violations ({}):", run.violations.len());
        for v in &run.violations {
            for (i, line) in v.lines().enumerate() {
                println!("  {} {line}", if i == 0 { "-" } else { " " });
            }
        }
    }
    if let Some(topology) = &run.topology {
        println!("meshes:");
        println!("  data   {}", mesh_text(&topology.data_mesh()));
        println!("  model  {}", mesh_text(&topology.model_mesh()));
        match topology.expert_mesh() {
            Some(mesh) => println!("  expert {}", mesh_text(&mesh)),
            None => println!("  expert none (ep_size 1)"),
        }
        let groups: Vec<String> = cp::cp_groups(topology).iter().map(|g| list(g)).collect();
        let shown = if groups.len() > 8 {
            format!("{}, … ({} groups)", groups[..4].join(", "), groups.len())
        } else {
            groups.join(", ")
        };
        println!("cp groups (Ulysses, cp_size {}): {shown}", topology.cp_size);
        if run.rank < run.world_size {
            println!("groups of rank {}:", run.rank);
            for (dims, members) in groups_of(topology, run.rank) {
                println!("  {dims:<12} {}", list(&members));
            }
        }
    }
    let (Some(plan), Some(topology), Some(config)) = (&run.plan, &run.topology, &run.config) else { return };
    match plan.ep_modules.first() {
        Some(first) => {
            println!(
                "experts: {} EP modules (e.g. {}), {} experts each, {} per EP rank",
                plan.ep_modules.len(),
                first.name,
                first.num_global_experts,
                first.num_local_experts
            );
            for (j, (start, end)) in plan::expert_owners(plan, topology).into_iter().enumerate() {
                let holders: Vec<u64> =
                    run.rank_plans.iter().filter(|rp| rp.ep_rank == j as u64).map(|rp| rp.rank).collect();
                println!("  ep rank {j:<3} experts {start}-{} on ranks {}", end - 1, list(&holders));
            }
        }
        None => println!("experts: no expert parallelism (ep_size 1)"),
    }
    if !plan.efsdp_modules.is_empty() {
        println!("efsdp units: {} (e.g. {})", plan.efsdp_modules.len(), plan.efsdp_modules[0]);
    }
    println!(
        "outer FSDP2 ignores {} parameters; gradient divide factor {} (seed: {})",
        plan.ignored_params(run.tree.as_ref().expect("planned trees exist")).len(),
        plan.gradient_divide_factor,
        plan.seed_gradient_divide_factor.map_or("none".to_string(), |f| f.to_string())
    );
    let trained = match run.expert_lora_rank {
        Some(r) => {
            format!("expert LoRA rank {r}, all else frozen; grads and AdamW moments of the adapters only")
        }
        None => "grads in the same dtype; AdamW moments 2× parameters".to_string(),
    };
    println!("memory per rank ({} storage; {trained}):", if config.bf16 { "bf16" } else { "f32" });
    println!(
        "  {:<12} {:>14} {:>12} {:>12} {:>12} {:>12}",
        "ranks", "param elems", "params", "grads", "adam", "total"
    );
    for (first, last, m) in memory_rows(&run.rank_plans) {
        let ranks = if first == last { first.to_string() } else { format!("{first}-{last}") };
        println!(
            "  {ranks:<12} {:>14} {:>12} {:>12} {:>12} {:>12}",
            m.param_elements,
            gib(m.param_bytes),
            gib(m.grad_bytes),
            gib(m.optimizer_bytes),
            gib(m.total_bytes)
        );
    }
    for w in &plan.warnings {
        println!("warning: {w}");
    }
    if let Some(tree) = &run.tree {
        for note in &tree.notes {
            println!("note: {note}");
        }
    }
}

fn to_json(run: &DryRun) -> Value {
    let meshes = run
        .topology
        .as_ref()
        .map(|t| json!({ "data": t.data_mesh(), "model": t.model_mesh(), "expert": t.expert_mesh() }));
    let groups = run.topology.as_ref().filter(|_| run.rank < run.world_size).map(|t| {
        groups_of(t, run.rank)
            .into_iter()
            .map(|(dims, members)| (dims, json!(members)))
            .collect::<serde_json::Map<_, _>>()
    });
    let owners = match (&run.plan, &run.topology) {
        (Some(p), Some(t)) => json!(plan::expert_owners(p, t)),
        _ => Value::Null,
    };
    json!({
        "title": run.title,
        "world_size": run.world_size,
        "rank": run.rank,
        "stage": run.stage,
        "expert_lora_rank": run.expert_lora_rank,
        "valid": run.violations.is_empty(),
        "violations": run.violations,
        "config": run.config,
        "topology": run.topology,
        "meshes": meshes,
        "groups": groups,
        "cp_groups": run.topology.as_ref().map(cp::cp_groups),
        "plan": match (&run.plan, &run.tree) {
            (Some(p), Some(t)) => p.to_json(t),
            _ => Value::Null,
        },
        "expert_owners": owners,
        "ranks": run.rank_plans,
        "notes": run.tree.as_ref().map(|t| t.notes.clone()).unwrap_or_default(),
    })
}

fn main() -> ExitCode {
    let args = match parse_args(std::env::args().skip(1)) {
        Ok(args) => args,
        Err(message) => {
            if !message.is_empty() {
                eprintln!("fsdpturbo: {message}");
            }
            eprintln!("{USAGE}");
            return ExitCode::from(if message.is_empty() { 0 } else { 2 });
        }
    };
    let run = dry_run(&args);
    if args.json {
        println!("{}", serde_json::to_string_pretty(&to_json(&run)).expect("plain data serialises"));
    } else {
        print_text(&run);
    }
    if run.violations.is_empty() { ExitCode::SUCCESS } else { ExitCode::from(1) }
}
