//! Plan resolution for Qwen3-235B-A22B (94 layers × 128 experts) against the seed's Python
//! matcher on the same names, measured in one run, plus pattern-match throughput.
//! Run: `cargo bench --bench plan` (needs python3 for the seed side).

use std::hint::black_box;
use std::time::Instant;

use fsdpturbo::config::DistConfig;
use fsdpturbo::pattern::Pattern;
use fsdpturbo::plan::{PlanInput, resolve};
use fsdpturbo::spec::{ModelTree, SpecRegistry, model_tree_from_config};
use fsdpturbo::topology::{Topology, TopologySpec};

const MODEL: &str = include_str!("../examples/models/qwen3_235b_a22b.json");

/// Median seconds of `f` over `repeats` runs.
fn median_seconds(repeats: usize, mut f: impl FnMut()) -> f64 {
    let mut times: Vec<f64> = (0..repeats)
        .map(|_| {
            let start = Instant::now();
            f();
            start.elapsed().as_secs_f64()
        })
        .collect();
    times.sort_by(f64::total_cmp);
    times[repeats / 2]
}

/// The transformers-4 layout of the same model: experts as a ModuleList of 128 MLPs, so
/// every expert weight has its own name (94 × 128 × 3 expert parameters).
fn module_list_layout(fused: &ModelTree) -> ModelTree {
    let mut tree = ModelTree { model_type: fused.model_type.clone(), ..ModelTree::default() };
    for module in &fused.modules {
        if module.ends_with(".experts.act_fn") {
            continue;
        }
        tree.modules.push(module.clone());
        if module.ends_with(".experts") {
            for e in 0..128 {
                tree.modules.push(format!("{module}.{e}"));
                for proj in ["gate_proj", "up_proj", "down_proj"] {
                    tree.modules.push(format!("{module}.{e}.{proj}"));
                }
                tree.modules.push(format!("{module}.{e}.act_fn"));
            }
        }
    }
    for param in &fused.params {
        if let Some(experts) = param.name.strip_suffix(".gate_up_proj") {
            let (h, i) = (param.shape[2], param.shape[1] / 2);
            for e in 0..128 {
                for (proj, shape) in [("gate_proj", [i, h]), ("up_proj", [i, h]), ("down_proj", [h, i])] {
                    tree.params.push(fsdpturbo::spec::ParamInfo {
                        name: format!("{experts}.{e}.{proj}.weight"),
                        shape: shape.to_vec(),
                    });
                }
            }
        } else if !param.name.ends_with(".experts.down_proj") {
            tree.params.push(param.clone());
        }
    }
    tree
}

fn seed_python_seconds(tree: &ModelTree, ep: &[String], efsdp: &[String]) -> Option<f64> {
    let names = serde_json::json!({
        "modules": tree.modules,
        "params": tree.params.iter().map(|p| &p.name).collect::<Vec<_>>(),
        "ep": ep,
        "efsdp": efsdp,
    });
    let path = std::env::temp_dir().join(format!("fsdpturbo-plan-bench-{}.json", std::process::id()));
    std::fs::write(&path, names.to_string()).ok()?;
    let script = concat!(env!("CARGO_MANIFEST_DIR"), "/benches/seed_plan.py");
    let output = std::process::Command::new("python3").arg(script).arg(&path).arg("3").output().ok()?;
    let _ = std::fs::remove_file(&path);
    if !output.status.success() {
        eprintln!("seed_plan.py failed: {}", String::from_utf8_lossy(&output.stderr));
        return None;
    }
    let result: serde_json::Value = serde_json::from_slice(&output.stdout).ok()?;
    println!("  seed (Python): {result}");
    result["seconds"].as_f64()
}

fn main() {
    let fused = model_tree_from_config(&serde_json::from_str(MODEL).expect("example JSON")).expect("tree");
    let registry = SpecRegistry::with_builtins();
    let spec = registry.get("qwen3_moe").expect("built-in spec");
    let dist = DistConfig { ep_size: 8, ..DistConfig::default() };
    let topology = Topology::new(&TopologySpec { world_size: 64, ep_size: 8, ..TopologySpec::default() })
        .expect("topology");

    println!("plan resolution, Qwen3-235B-A22B, world 64, ep 8, efsdp 8 (median of runs):");
    println!(
        "{:<34} {:>9} {:>9} {:>12} {:>12} {:>8}",
        "layout", "modules", "params", "ours", "seed", "ratio"
    );
    for (label, tree) in [
        ("fused experts (transformers 5)", fused.clone()),
        ("ModuleList experts (every name)", module_list_layout(&fused)),
    ] {
        let input = PlanInput { tree: &tree, spec, dist: &dist, topology: &topology, bf16: true };
        let plan = resolve(&input).expect("plan resolves");
        let ours = median_seconds(21, || {
            black_box(resolve(black_box(&input)).expect("plan"));
        });
        println!(
            "  ours: {} EP modules, {} ignored params",
            plan.ep_modules.len(),
            plan.ignored_params(&tree).len()
        );
        let seed = seed_python_seconds(&tree, &spec.ep_modules, &spec.efsdp_modules());
        let (seed_text, ratio) = match seed {
            Some(s) => (format!("{:.2} ms", s * 1e3), format!("{:.0}×", s / ours)),
            None => ("n/a".into(), "n/a".into()),
        };
        println!(
            "{label:<34} {:>9} {:>9} {:>9.3} ms {:>12} {:>8}",
            tree.modules.len(),
            tree.params.len(),
            ours * 1e3,
            seed_text,
            ratio
        );
    }

    let tree = module_list_layout(&fused);
    let pattern = Pattern::compile("model.layers.{*}.mlp.experts").expect("pattern");
    let seconds = median_seconds(11, || {
        black_box(tree.modules.iter().filter(|m| pattern.is_match(black_box(m))).count());
    });
    println!(
        "pattern match throughput: {:.1} M names/s ({} names, `model.layers.{{*}}.mlp.experts`)",
        tree.modules.len() as f64 / seconds / 1e6,
        tree.modules.len()
    );
}
