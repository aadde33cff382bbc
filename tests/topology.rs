//! Topology: sizes and errors (docs/design.md §4.6), the mesh layout (torch's
//! `init_device_mesh`: a rank's coordinate is its mixed-radix digits, last dim fastest) and
//! groups (the ranks that share every other coordinate) checked against an independent
//! `arange(world).reshape(shape)` model, and the C ABI of `ffi/topology.rs`.

use std::collections::{BTreeMap, BTreeSet};
use std::ffi::CString;
use std::ptr;

use fsdpturbo::error::ErrorKind;
use fsdpturbo::ffi::config::{fsdpturbo_config_free, fsdpturbo_config_parse, fsdpturbo_config_t};
use fsdpturbo::ffi::error::fsdpturbo_last_error;
use fsdpturbo::ffi::status::*;
use fsdpturbo::ffi::topology::*;
use fsdpturbo::topology::{MAX_MATERIALIZED_RANKS, Mesh, Topology, TopologySpec};

mod common;
use common::{last_error, topology_options};

fn spec(world: u64, cp: u64, ep: u64) -> TopologySpec {
    TopologySpec { world_size: world, cp_size: cp, ep_size: ep, ..TopologySpec::default() }
}

fn topo(s: &TopologySpec) -> Topology {
    Topology::new(s).unwrap_or_else(|e| panic!("{s:?} should be valid: {e}"))
}

fn topo_err(s: &TopologySpec) -> String {
    let err = Topology::new(s).expect_err(&format!("{s:?} should be rejected"));
    assert_eq!(err.kind, ErrorKind::Topology, "{s:?}: {err}");
    err.message
}

fn range(a: u64, b: u64) -> Vec<u64> {
    (a..b).collect()
}

// ---------------------------------------------------------------------------------------------
// Sizes and errors

#[test]
fn default_spec_is_a_single_undistributed_rank() {
    let s = TopologySpec::default();
    assert_eq!(
        s,
        TopologySpec {
            world_size: 1,
            dp_size: None,
            cp_size: 1,
            mp_replicate_size: 1,
            mp_shard_size: None,
            ep_size: 1,
            efsdp_size: None
        }
    );
    let t = topo(&s);
    assert_eq!(
        t,
        Topology {
            world_size: 1,
            dp_size: 1,
            cp_size: 1,
            mp_replicate_size: 1,
            mp_shard_size: 1,
            ep_size: 1,
            efsdp_size: 1,
            edp_size: 1
        }
    );
    assert_eq!(t.data_mesh(), Mesh { dim_names: vec!["dp".into(), "cp".into()], shape: vec![1, 1] });
    assert_eq!(
        t.model_mesh(),
        Mesh { dim_names: vec!["mp_replicate".into(), "mp_shard".into()], shape: vec![1, 1] }
    );
    assert_eq!(t.expert_mesh(), None);
    assert_eq!(t.key(), (1, 1, 1));
}

#[test]
fn default_formulas_of_the_base_meshes() {
    // mp_shard defaults to world / mp_replicate, dp to world / cp.
    let t =
        topo(&TopologySpec { world_size: 16, mp_replicate_size: 2, cp_size: 4, ..TopologySpec::default() });
    assert_eq!((t.mp_replicate_size, t.mp_shard_size, t.dp_size, t.cp_size), (2, 8, 4, 4));
    assert_eq!(t.model_mesh().shape, vec![2, 8]);
    assert_eq!(t.data_mesh().shape, vec![4, 4]);
    // Explicit sizes equal to the defaults give the same topology.
    let explicit = topo(&TopologySpec {
        world_size: 16,
        mp_replicate_size: 2,
        mp_shard_size: Some(8),
        cp_size: 4,
        dp_size: Some(4),
        ..TopologySpec::default()
    });
    assert_eq!(explicit, t);
}

#[test]
fn seed_error_texts_of_the_base_meshes() {
    let m = topo_err(&TopologySpec { world_size: 16, mp_replicate_size: 3, ..TopologySpec::default() });
    assert_eq!(
        m,
        "world_size (16) must be divisible by mp_replicate_size (3). \
         Accepted mp_replicate_size values (divisors of world_size 16): 1, 2, 4, 8, 16."
    );
    let m = topo_err(&TopologySpec {
        world_size: 16,
        mp_replicate_size: 2,
        mp_shard_size: Some(4),
        ..TopologySpec::default()
    });
    assert_eq!(
        m,
        "mp_replicate_size * mp_shard_size must equal to world_size, got 2 * 4 != 16. \
         Accepted mp_shard_size: 8 (or leave it unset)."
    );
    let m = topo_err(&TopologySpec { world_size: 12, cp_size: 5, ..TopologySpec::default() });
    assert_eq!(
        m,
        "world_size (12) must be divisible by cp_size (5). \
         Accepted cp_size values (divisors of world_size 12): 1, 2, 3, 4, 6, 12."
    );
    let m =
        topo_err(&TopologySpec { world_size: 16, cp_size: 2, dp_size: Some(4), ..TopologySpec::default() });
    assert_eq!(
        m,
        "dp_size * cp_size must equal to world_size, got 4 * 2 != 16. Accepted dp_size: 8 (or leave it unset)."
    );
}

#[test]
fn seed_error_texts_of_the_expert_sizes() {
    assert_eq!(topo_err(&spec(16, 1, 0)), "ep_size must be positive, got 0.");
    let m = topo_err(&spec(24, 1, 5));
    assert!(m.starts_with("dp_size must be divisible by ep_size, got 24 % 5 != 0."), "{m}");
    assert!(m.contains("1, 2, 3, 4, 6, 8, 12, 24"), "{m}");
    // dp counts, not world: world 16 with cp 2 has dp 8.
    assert!(topo_err(&spec(16, 2, 16)).starts_with("dp_size must be divisible by ep_size, got 8 % 16 != 0."));
    // Not distributed: dp = 1, so any ep > 1 fails here (as in the seed).
    assert!(topo_err(&spec(1, 1, 2)).starts_with("dp_size must be divisible by ep_size, got 1 % 2 != 0."));
}

#[test]
fn zero_sizes_are_rejected_with_their_name() {
    let d = TopologySpec { world_size: 8, ..TopologySpec::default() };
    assert_eq!(topo_err(&TopologySpec { world_size: 0, ..d.clone() }), "world_size must be positive, got 0.");
    assert_eq!(topo_err(&TopologySpec { cp_size: 0, ..d.clone() }), "cp_size must be positive, got 0.");
    assert_eq!(
        topo_err(&TopologySpec { mp_replicate_size: 0, ..d.clone() }),
        "mp_replicate_size must be positive, got 0."
    );
    assert_eq!(
        topo_err(&TopologySpec { dp_size: Some(0), ..d.clone() }),
        "dp_size must be positive when given, got 0. Leave it unset for the default (world_size / cp_size)."
    );
    assert_eq!(
        topo_err(&TopologySpec { mp_shard_size: Some(0), ..d.clone() }),
        "mp_shard_size must be positive when given, got 0. \
         Leave it unset for the default (world_size / mp_replicate_size)."
    );
    assert_eq!(
        topo_err(&TopologySpec { ep_size: 2, efsdp_size: Some(0), ..d.clone() }),
        "efsdp_size must be positive when given, got 0. Leave it unset for the default (dp_size / ep_size)."
    );
}

#[test]
fn not_distributed_rejects_sizes_it_cannot_honour() {
    // The seed silently overwrites dp/mp_shard with 1 when not distributed; we reject
    // sizes that do not fit one rank instead of ignoring them.
    assert!(
        topo_err(&TopologySpec { cp_size: 2, ..TopologySpec::default() })
            .starts_with("world_size (1) must be divisible by cp_size (2).")
    );
    assert!(
        topo_err(&TopologySpec { dp_size: Some(2), ..TopologySpec::default() })
            .starts_with("dp_size * cp_size must equal to world_size, got 2 * 1 != 1.")
    );
    assert!(
        topo_err(&TopologySpec { mp_shard_size: Some(2), ..TopologySpec::default() })
            .starts_with("mp_replicate_size * mp_shard_size must equal to world_size, got 1 * 2 != 1.")
    );
}

#[test]
fn seed_expert_sizes_have_edp_one() {
    for (world, cp, ep, efsdp) in [(16, 1, 8, 2), (16, 2, 4, 2), (16, 1, 16, 1), (8, 2, 2, 2), (32, 4, 2, 4)]
    {
        let t = topo(&spec(world, cp, ep));
        assert_eq!((t.efsdp_size, t.edp_size), (efsdp, 1), "{t:?}");
        assert_eq!(t.expert_mesh().unwrap().shape, vec![1, efsdp, ep, cp]);
        assert_eq!(t.key(), (world / cp, cp, ep));
    }
    // ep == 1: efsdp = edp = 1 and no expert mesh, whatever dp is.
    let t = topo(&spec(16, 2, 1));
    assert_eq!((t.ep_size, t.efsdp_size, t.edp_size), (1, 1, 1));
    assert_eq!(t.expert_mesh(), None);
}

#[test]
fn explicit_efsdp_replicates_experts() {
    let t = topo(&TopologySpec { world_size: 8, ep_size: 2, efsdp_size: Some(2), ..TopologySpec::default() });
    assert_eq!((t.dp_size, t.ep_size, t.efsdp_size, t.edp_size), (8, 2, 2, 2));
    let m = t.expert_mesh().unwrap();
    assert_eq!(m.shape, vec![2, 2, 2, 1]);
    assert_eq!(m.dim_names, vec!["edp", "efsdp", "ep", "expert_cp"]);
    // r = 4*edp_i + 2*efsdp_i + ep_i
    for r in 0..8 {
        assert_eq!(m.coordinate(r).unwrap(), vec![r / 4, (r / 2) % 2, r % 2, 0]);
    }
    assert_eq!(m.groups(&["ep"]).unwrap(), vec![vec![0, 1], vec![2, 3], vec![4, 5], vec![6, 7]]);
    assert_eq!(m.groups(&["efsdp"]).unwrap(), vec![vec![0, 2], vec![1, 3], vec![4, 6], vec![5, 7]]);
    assert_eq!(m.groups(&["edp"]).unwrap(), vec![vec![0, 4], vec![1, 5], vec![2, 6], vec![3, 7]]);
    assert_eq!(m.group(5, &["efsdp", "ep"]).unwrap(), vec![4, 5, 6, 7]);

    // efsdp = dp/ep explicitly is the seed's layout; efsdp 1 makes every ep group a replica.
    let same =
        topo(&TopologySpec { world_size: 8, ep_size: 2, efsdp_size: Some(4), ..TopologySpec::default() });
    assert_eq!(same, topo(&spec(8, 1, 2)));
    let one =
        topo(&TopologySpec { world_size: 8, ep_size: 2, efsdp_size: Some(1), ..TopologySpec::default() });
    assert_eq!(one.expert_mesh().unwrap().shape, vec![4, 1, 2, 1]);

    let m =
        topo_err(&TopologySpec { world_size: 8, ep_size: 2, efsdp_size: Some(3), ..TopologySpec::default() });
    assert_eq!(
        m,
        "efsdp_size must divide dp_size / ep_size, got 8 / 2 = 4 and 4 % 3 != 0. \
         Accepted efsdp_size values (divisors of dp_size / ep_size 4): 1, 2, 4. Leave it unset for 4 (edp_size 1)."
    );
    let m =
        topo_err(&TopologySpec { world_size: 8, ep_size: 2, efsdp_size: Some(8), ..TopologySpec::default() });
    assert!(m.starts_with("efsdp_size must divide dp_size / ep_size, got 8 / 2 = 4 and 4 % 8 != 0."), "{m}");
}

#[test]
fn explicit_efsdp_without_expert_parallelism() {
    let m = topo_err(&TopologySpec { world_size: 8, efsdp_size: Some(2), ..TopologySpec::default() });
    assert!(m.starts_with("efsdp_size (2) needs expert parallelism, but ep_size is 1"), "{m}");
    assert!(m.contains("Set ep_size > 1, or leave efsdp_size unset (or 1)."), "{m}");
    let t = topo(&TopologySpec { world_size: 8, efsdp_size: Some(1), ..TopologySpec::default() });
    assert_eq!(t, topo(&spec(8, 1, 1)));
}

#[test]
fn huge_sizes_neither_panic_nor_overflow() {
    let max = u64::MAX; // = 3 * 5 * 17 * 257 * 641 * 65537 * 6700417
    let t = topo(&spec(max, 1, 1));
    assert_eq!((t.dp_size, t.mp_shard_size), (max, max));
    let data = t.data_mesh();
    assert_eq!(data.size(), max);
    assert_eq!(data.coordinate(max - 1).unwrap(), vec![max - 1, 0]);
    assert_eq!(data.rank_of(&[max - 1, 0]).unwrap(), max - 1);
    assert!(
        data.coordinate(max).unwrap_err().message.contains("outside mesh (dp=18446744073709551615, cp=1)")
    );
    assert_eq!(data.group(max - 1, &["cp"]).unwrap(), vec![max - 1]);
    let err = data.group(0, &["dp"]).unwrap_err();
    assert_eq!(err.kind, ErrorKind::InvalidArgument);
    assert!(err.message.contains(&format!("more than the {MAX_MATERIALIZED_RANKS}")), "{}", err.message);
    assert!(data.groups(&["cp"]).is_err());

    // world = dp * cp with cp = 3, 5, 17; the other way round overflows and is rejected.
    let t = topo(&spec(max, 3, 5));
    assert_eq!((t.dp_size, t.efsdp_size), (max / 3, max / 15));
    let e = t.expert_mesh().unwrap();
    assert_eq!(e.size(), max);
    assert_eq!(e.coordinate(max - 1).unwrap(), vec![0, max / 15 - 1, 4, 2]);
    assert_eq!(e.group(max - 1, &["ep", "expert_cp"]).unwrap(), range(max - 15, max));
    assert_eq!(
        topo_err(&TopologySpec {
            world_size: max,
            cp_size: 3,
            dp_size: Some(max),
            ..TopologySpec::default()
        }),
        format!(
            "dp_size * cp_size must equal to world_size, got {max} * 3 != {max}. Accepted dp_size: {} \
             (or leave it unset).",
            max / 3
        )
    );
    assert!(
        topo_err(&TopologySpec {
            world_size: max,
            mp_replicate_size: 5,
            mp_shard_size: Some(max),
            ..TopologySpec::default()
        })
        .starts_with(&format!(
            "mp_replicate_size * mp_shard_size must equal to world_size, got 5 * {max} != {max}."
        ))
    );
    assert!(
        topo_err(&spec(max, 1, 2))
            .starts_with(&format!("dp_size must be divisible by ep_size, got {max} % 2"))
    );
    assert_eq!(topo(&spec(max, 1, max)).expert_mesh().unwrap().shape, vec![1, 1, max, 1]);
    assert_eq!(topo(&spec(max, max, 1)).data_mesh().shape, vec![1, max]);
    assert!(
        topo_err(&TopologySpec {
            world_size: max,
            ep_size: 3,
            efsdp_size: Some(max),
            ..TopologySpec::default()
        })
        .starts_with("efsdp_size must divide dp_size / ep_size")
    );
    assert!(topo_err(&spec(max - 1, 1, max)).starts_with("dp_size must be divisible by ep_size"));
    // Large non-divisor worlds get a hint without listing divisors.
    assert!(
        topo_err(&TopologySpec { world_size: max, mp_replicate_size: 2, ..TopologySpec::default() })
            .ends_with(&format!("Accepted mp_replicate_size values are the divisors of world_size ({max})."))
    );

    // A hand-built topology whose meshes overflow: every mesh method errs instead of panicking.
    let bad = Topology {
        world_size: max,
        dp_size: max,
        cp_size: max,
        mp_replicate_size: max,
        mp_shard_size: max,
        ep_size: max,
        efsdp_size: max,
        edp_size: max,
    };
    assert!(bad.validate().is_err());
    let mesh = bad.expert_mesh().unwrap();
    assert_eq!(mesh.size(), max); // saturates
    for err in [
        mesh.coordinate(0).unwrap_err(),
        mesh.rank_of(&[0, 0, 0, 0]).unwrap_err(),
        mesh.group(0, &["ep"]).unwrap_err(),
        mesh.groups(&["ep"]).unwrap_err(),
    ] {
        assert_eq!(err.kind, ErrorKind::InvalidArgument);
        assert!(err.message.contains("must fit in 64 bits"), "{}", err.message);
    }
}

#[test]
fn validate_rejects_hand_built_inconsistencies() {
    let good = topo(&spec(16, 2, 4));
    good.validate().unwrap();
    let with_edp = Topology { efsdp_size: 1, edp_size: 2, ..good.clone() };
    with_edp.validate().unwrap(); // an explicit efsdp of 1 is a valid layout
    let cases = [
        Topology { edp_size: 2, ..good.clone() },      // 1*2*4*2 != 16
        Topology { dp_size: 4, ..good.clone() },       // 4*2 != 16
        Topology { mp_shard_size: 4, ..good.clone() }, // 1*4 != 16
        Topology { ep_size: 1, ..good.clone() },       // ep 1 with efsdp 2
        Topology { world_size: 0, ..good.clone() },    // zero
        Topology { ep_size: 1, efsdp_size: 1, edp_size: 8, ..good.clone() }, // ep 1 needs edp 1
    ];
    for t in cases {
        let err = t.validate().expect_err(&format!("{t:?}"));
        assert_eq!(err.kind, ErrorKind::Topology, "{t:?}");
    }
    let err = Topology { ep_size: 1, efsdp_size: 1, edp_size: 8, ..good }.validate().unwrap_err();
    assert!(err.message.starts_with("inconsistent topology"), "{}", err.message);
}

#[test]
fn topology_and_mesh_serialize_with_their_field_names() {
    let t = topo(&spec(16, 2, 4));
    let v = serde_json::to_value(&t).unwrap();
    assert_eq!(
        v,
        serde_json::json!({"world_size": 16, "dp_size": 8, "cp_size": 2, "mp_replicate_size": 1,
            "mp_shard_size": 16, "ep_size": 4, "efsdp_size": 2, "edp_size": 1})
    );
    let m = serde_json::to_value(t.expert_mesh().unwrap()).unwrap();
    assert_eq!(
        m,
        serde_json::json!({"dim_names": ["edp", "efsdp", "ep", "expert_cp"], "shape": [1, 2, 4, 2]})
    );
}

// ---------------------------------------------------------------------------------------------
// Worked examples (the seed's)

#[test]
fn worked_example_world16_cp1_ep8() {
    let t = topo(&spec(16, 1, 8));
    let m = t.expert_mesh().unwrap();
    assert_eq!(m.shape, vec![1, 2, 8, 1]);
    assert_eq!(m.dim_names, vec!["edp", "efsdp", "ep", "expert_cp"]);
    assert_eq!(m.groups(&["ep"]).unwrap(), vec![range(0, 8), range(8, 16)]);
    let efsdp: Vec<Vec<u64>> = (0..8).map(|i| vec![i, i + 8]).collect();
    assert_eq!(m.groups(&["efsdp"]).unwrap(), efsdp);
    assert_eq!(m.groups(&["edp"]).unwrap(), (0..16).map(|r| vec![r]).collect::<Vec<_>>());
    assert_eq!(m.groups(&["expert_cp"]).unwrap(), (0..16).map(|r| vec![r]).collect::<Vec<_>>());
    for r in 0..16 {
        assert_eq!(m.group(r, &["ep"]).unwrap(), range(r / 8 * 8, r / 8 * 8 + 8));
        assert_eq!(m.group(r, &["efsdp"]).unwrap(), vec![r % 8, r % 8 + 8]);
        // Group-local rank = coordinate.
        let c = m.coordinate(r).unwrap();
        assert_eq!(m.group(r, &["ep"]).unwrap()[c[2] as usize], r);
        assert_eq!(m.group(r, &["efsdp"]).unwrap()[c[1] as usize], r);
    }
}

#[test]
fn worked_example_world16_cp2_ep4() {
    let t = topo(&spec(16, 2, 4));
    assert_eq!((t.dp_size, t.efsdp_size, t.edp_size), (8, 2, 1));
    let m = t.expert_mesh().unwrap();
    assert_eq!(m.shape, vec![1, 2, 4, 2]);
    let data = t.data_mesh();
    for r in 0..16 {
        let (efsdp_i, ep_i, cp_i) = (r / 8, (r / 2) % 4, r % 2);
        assert_eq!(r, 8 * efsdp_i + 2 * ep_i + cp_i);
        assert_eq!(m.coordinate(r).unwrap(), vec![0, efsdp_i, ep_i, cp_i]);
        assert_eq!(m.rank_of(&[0, efsdp_i, ep_i, cp_i]).unwrap(), r);
        // dp_i = efsdp_i * ep + ep_i, and expert_cp is the base CP group.
        assert_eq!(data.coordinate(r).unwrap(), vec![efsdp_i * 4 + ep_i, cp_i]);
        assert_eq!(m.group(r, &["expert_cp"]).unwrap(), data.group(r, &["cp"]).unwrap());
        assert_eq!(m.group(r, &["edp"]).unwrap(), vec![r]);
        // The group formulas: ep group = {efsdp_i·ep·cp + j·cp + cp_i}, efsdp group =
        // {k·ep·cp + ep_i·cp + cp_i}.
        let ep: Vec<u64> = (0..4).map(|j| efsdp_i * 4 * 2 + j * 2 + cp_i).collect();
        assert_eq!(m.group(r, &["ep"]).unwrap(), ep);
        let efsdp: Vec<u64> = (0..2).map(|k| k * 4 * 2 + ep_i * 2 + cp_i).collect();
        assert_eq!(m.group(r, &["efsdp"]).unwrap(), efsdp);
    }
    assert_eq!(
        m.groups(&["ep"]).unwrap(),
        vec![vec![0, 2, 4, 6], vec![1, 3, 5, 7], vec![8, 10, 12, 14], vec![9, 11, 13, 15]]
    );
    assert_eq!(m.groups(&["efsdp"]).unwrap(), (0..8).map(|i| vec![i, i + 8]).collect::<Vec<_>>());
    assert_eq!(m.groups(&["expert_cp"]).unwrap(), (0..8).map(|i| vec![2 * i, 2 * i + 1]).collect::<Vec<_>>());
    assert_eq!(
        data.groups(&["dp"]).unwrap(),
        vec![vec![0, 2, 4, 6, 8, 10, 12, 14], vec![1, 3, 5, 7, 9, 11, 13, 15]]
    );
    // Several dims: row-major in the order given, like mesh["efsdp", "ep"].
    assert_eq!(m.group(0, &["efsdp", "ep"]).unwrap(), vec![0, 2, 4, 6, 8, 10, 12, 14]);
    assert_eq!(m.group(0, &["ep", "efsdp"]).unwrap(), vec![0, 8, 2, 10, 4, 12, 6, 14]);
    assert_eq!(m.group(3, &["efsdp", "expert_cp"]).unwrap(), vec![2, 3, 10, 11]);
    assert_eq!(m.group(3, &["edp", "efsdp", "ep"]).unwrap(), data.group(3, &["dp"]).unwrap());
    assert_eq!(m.group(3, &["edp", "efsdp", "ep", "expert_cp"]).unwrap(), range(0, 16));
    // Local experts of rank r: [ep_i*L, (ep_i+1)*L) with L = E/ep; E = 128 → L = 32.
    assert_eq!(m.coordinate(13).unwrap()[2] * 32, 64);
}

#[test]
fn data_mesh_formulas() {
    for (world, cp) in [(16, 1), (16, 2), (16, 4), (12, 3), (8, 8), (6, 1)] {
        let t = topo(&spec(world, cp, 1));
        let data = t.data_mesh();
        assert_eq!(data.shape, vec![world / cp, cp]);
        for r in 0..world {
            let (dp_i, cp_i) = (r / cp, r % cp);
            assert_eq!(data.coordinate(r).unwrap(), vec![dp_i, cp_i]);
            let dp_group: Vec<u64> = (0..world / cp).map(|k| cp_i + k * cp).collect();
            assert_eq!(data.group(r, &["dp"]).unwrap(), dp_group);
            let cp_group: Vec<u64> = (0..cp).map(|c| dp_i * cp + c).collect();
            assert_eq!(data.group(r, &["cp"]).unwrap(), cp_group);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// Mesh errors

#[test]
fn mesh_argument_errors_name_what_is_accepted() {
    let m = topo(&spec(16, 2, 4)).expert_mesh().unwrap();
    let e = m.dim_index("dp").unwrap_err();
    assert_eq!(e.kind, ErrorKind::InvalidArgument);
    assert_eq!(
        e.message,
        "mesh (edp=1, efsdp=2, ep=4, expert_cp=2) has no dim named \"dp\"; \
         its dims are \"edp\", \"efsdp\", \"ep\", \"expert_cp\""
    );
    assert_eq!(m.dim_index("expert_cp").unwrap(), 3);
    assert_eq!(
        m.coordinate(16).unwrap_err().message,
        "rank 16 is outside mesh (edp=1, efsdp=2, ep=4, expert_cp=2), which has 16 ranks (0..=15)"
    );
    assert!(m.group(16, &["ep"]).unwrap_err().message.starts_with("rank 16 is outside mesh"));
    assert!(m.rank_of(&[0, 0, 0]).unwrap_err().message.contains("has 3 entries but mesh"));
    assert_eq!(
        m.rank_of(&[0, 0, 4, 0]).unwrap_err().message,
        "coordinate [0, 0, 4, 0] is outside mesh (edp=1, efsdp=2, ep=4, expert_cp=2): \"ep\" must be below 4, got 4"
    );
    assert!(m.group(0, &[]).unwrap_err().message.starts_with("a group needs at least one mesh dim"));
    assert!(m.groups(&[]).is_err());
    assert!(m.group(0, &["ep", "ep"]).unwrap_err().message.contains("more than once"));
    assert!(m.group(0, &["ep", "cp"]).unwrap_err().message.contains("no dim named \"cp\""));
    assert!(m.groups(&["nope"]).is_err());
}

#[test]
fn hand_built_meshes_are_checked() {
    let bad = |names: &[&str], shape: &[u64]| {
        let mesh = Mesh { dim_names: names.iter().map(|s| s.to_string()).collect(), shape: shape.to_vec() };
        let err = mesh.coordinate(0).unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidArgument);
        let again = Mesh::new(mesh.dim_names.clone(), mesh.shape.clone()).unwrap_err();
        assert_eq!(again, err);
        assert!(mesh.group(0, &[names[0]]).is_err());
        assert!(mesh.rank_of(&vec![0; shape.len()]).is_err());
        err.message
    };
    assert!(bad(&["a", "b"], &[2]).contains("2 dim names"));
    assert!(bad(&["a", "a"], &[2, 2]).contains("appears more than once"));
    assert!(bad(&["a", ""], &[2, 2]).contains("empty name"));
    assert!(bad(&["a", "b"], &[2, 0]).contains("has size 0"));
    assert!(bad(&["a", "b"], &[u64::MAX, 2]).contains("must fit in 64 bits"));

    let ok = Mesh::new(vec!["x".into(), "y".into(), "z".into()], vec![2, 3, 4]).unwrap();
    assert_eq!(ok.size(), 24);
    assert_eq!(ok.coordinate(23).unwrap(), vec![1, 2, 3]);
    assert_eq!(ok.group(23, &["z", "x"]).unwrap(), vec![8, 20, 9, 21, 10, 22, 11, 23]);
}

// ---------------------------------------------------------------------------------------------
// Brute force against an independent model of `arange(world).reshape(shape)`

/// The coordinate of every rank: multi-indices enumerated in row-major order by an odometer
/// (the last index turns fastest), so position in this list = value in arange().reshape().
fn reference_coordinates(shape: &[u64]) -> Vec<Vec<u64>> {
    let total: u64 = shape.iter().product();
    let mut index = vec![0u64; shape.len()];
    let mut all = Vec::new();
    for _ in 0..total {
        all.push(index.clone());
        for d in (0..shape.len()).rev() {
            index[d] += 1;
            if index[d] < shape[d] {
                break;
            }
            index[d] = 0;
        }
    }
    all
}

/// The groups over `dims` (indices): ranks that agree on every other dim, each group ordered by
/// its members' coordinates along `dims` taken in the given order. Keyed by rank.
fn reference_groups(coords: &[Vec<u64>], dims: &[usize]) -> Vec<Vec<u64>> {
    let ndim = coords.first().map_or(0, Vec::len);
    let mut buckets: BTreeMap<Vec<u64>, Vec<(Vec<u64>, u64)>> = BTreeMap::new();
    for (rank, c) in coords.iter().enumerate() {
        let rest: Vec<u64> = (0..ndim).filter(|d| !dims.contains(d)).map(|d| c[d]).collect();
        let along: Vec<u64> = dims.iter().map(|&d| c[d]).collect();
        buckets.entry(rest).or_default().push((along, rank as u64));
    }
    let mut of_rank = vec![Vec::new(); coords.len()];
    for (_, mut members) in buckets {
        members.sort();
        let group: Vec<u64> = members.iter().map(|(_, r)| *r).collect();
        for &r in &group {
            of_rank[r as usize] = group.clone();
        }
    }
    of_rank
}

/// Every ordered selection of distinct dims (non-empty).
fn dim_orders(n: usize) -> Vec<Vec<usize>> {
    let mut out = Vec::new();
    let mut stack: Vec<Vec<usize>> = (0..n).map(|d| vec![d]).collect();
    while let Some(order) = stack.pop() {
        for d in 0..n {
            if !order.contains(&d) {
                let mut longer = order.clone();
                longer.push(d);
                stack.push(longer);
            }
        }
        out.push(order);
    }
    out
}

fn check_mesh_against_reference(mesh: &Mesh, world: u64) -> usize {
    assert_eq!(mesh.size(), world, "{mesh:?}");
    let coords = reference_coordinates(&mesh.shape);
    assert_eq!(coords.len() as u64, world);
    for (rank, c) in coords.iter().enumerate() {
        assert_eq!(&mesh.coordinate(rank as u64).unwrap(), c, "{mesh:?} rank {rank}");
        assert_eq!(mesh.rank_of(c).unwrap(), rank as u64, "{mesh:?} {c:?}");
    }
    assert!(mesh.coordinate(world).is_err());
    let mut checked = 0;
    for order in dim_orders(mesh.shape.len()) {
        let names: Vec<&str> = order.iter().map(|&d| mesh.dim_names[d].as_str()).collect();
        let expected = reference_groups(&coords, &order);
        for rank in 0..world {
            let group = mesh.group(rank, &names).unwrap();
            assert_eq!(group, expected[rank as usize], "{mesh:?} rank {rank} dims {names:?}");
            if order.len() == 1 {
                // Group-local rank = coordinate along the dim.
                assert_eq!(group[coords[rank as usize][order[0]] as usize], rank);
            }
            checked += 1;
        }
        // Every distinct group once, ordered by first member; every rank in exactly one.
        let groups = mesh.groups(&names).unwrap();
        let mut distinct: Vec<Vec<u64>> =
            expected.iter().cloned().collect::<BTreeSet<_>>().into_iter().collect();
        distinct.sort_by_key(|g| g[0]);
        assert_eq!(groups, distinct, "{mesh:?} dims {names:?}");
        let mut seen = vec![0u32; world as usize];
        for g in &groups {
            assert_eq!(g.len() as u64, order.iter().map(|&d| mesh.shape[d]).product::<u64>());
            for &r in g {
                seen[r as usize] += 1;
            }
        }
        assert!(seen.iter().all(|&n| n == 1), "{mesh:?} dims {names:?}: {seen:?}");
    }
    checked
}

fn divisors(n: u64) -> Vec<u64> {
    (1..=n).filter(|d| n % d == 0).collect()
}

#[test]
fn brute_force_every_small_topology() {
    let (mut topologies, mut group_checks) = (0usize, 0usize);
    for world in 1..=32u64 {
        for r in divisors(world) {
            // The model mesh depends on world and mp_replicate only.
            let model =
                topo(&TopologySpec { world_size: world, mp_replicate_size: r, ..TopologySpec::default() });
            assert_eq!(model.model_mesh().shape, vec![r, world / r]);
            group_checks += check_mesh_against_reference(&model.model_mesh(), world);
        }
        for cp in divisors(world) {
            let dp = world / cp;
            // The data mesh depends on world and cp only.
            let data_mesh = topo(&spec(world, cp, 1)).data_mesh();
            assert_eq!(data_mesh.shape, vec![dp, cp]);
            group_checks += check_mesh_against_reference(&data_mesh, world);
            for ep in divisors(dp) {
                let mut efsdps: Vec<Option<u64>> = vec![None];
                efsdps.extend(if ep == 1 { vec![1] } else { divisors(dp / ep) }.into_iter().map(Some));
                for efsdp in efsdps {
                    let base = TopologySpec {
                        world_size: world,
                        cp_size: cp,
                        ep_size: ep,
                        efsdp_size: efsdp,
                        ..TopologySpec::default()
                    };
                    let t = topo(&base);
                    t.validate().unwrap();
                    let (want_efsdp, want_edp) = match (ep, efsdp) {
                        (1, _) => (1, 1),
                        (_, None) => (dp / ep, 1),
                        (_, Some(e)) => (e, dp / ep / e),
                    };
                    assert_eq!((t.dp_size, t.cp_size, t.ep_size), (dp, cp, ep));
                    assert_eq!((t.efsdp_size, t.edp_size), (want_efsdp, want_edp), "{base:?}");
                    assert_eq!(t.key(), (dp, cp, ep));
                    // Every mp_replicate and explicit-default form resolves consistently.
                    for r in divisors(world) {
                        for mp_shard in [None, Some(world / r)] {
                            for dp_size in [None, Some(dp)] {
                                let full = TopologySpec {
                                    mp_replicate_size: r,
                                    mp_shard_size: mp_shard,
                                    dp_size,
                                    ..base.clone()
                                };
                                let u = topo(&full);
                                assert_eq!(
                                    u,
                                    Topology { mp_replicate_size: r, mp_shard_size: world / r, ..t.clone() }
                                );
                                topologies += 1;
                            }
                        }
                    }
                    let data = t.data_mesh();
                    assert_eq!(data, data_mesh);
                    let Some(expert) = t.expert_mesh() else {
                        assert_eq!(ep, 1);
                        continue;
                    };
                    assert_eq!(expert.shape, vec![want_edp, want_efsdp, ep, cp]);
                    group_checks += check_mesh_against_reference(&expert, world);
                    // The expert mesh refines the data mesh: (edp, efsdp, ep) flattens to dp.
                    for rank in 0..world {
                        assert_eq!(
                            expert.group(rank, &["edp", "efsdp", "ep"]).unwrap(),
                            data.group(rank, &["dp"]).unwrap()
                        );
                        assert_eq!(
                            expert.group(rank, &["expert_cp"]).unwrap(),
                            data.group(rank, &["cp"]).unwrap()
                        );
                    }
                }
            }
        }
    }
    assert!(topologies > 5000, "{topologies}");
    assert!(group_checks > 50_000, "{group_checks}");
}

#[test]
fn brute_force_acceptance_matches_divisibility() {
    for world in 1..=24u64 {
        for r in 1..=world + 1 {
            for cp in 1..=world + 1 {
                for ep in 1..=world + 1 {
                    for efsdp in 0..=4u64 {
                        let s = TopologySpec {
                            world_size: world,
                            mp_replicate_size: r,
                            cp_size: cp,
                            ep_size: ep,
                            efsdp_size: (efsdp > 0).then_some(efsdp),
                            ..TopologySpec::default()
                        };
                        let dp = world / cp;
                        let valid = world % r == 0
                            && world % cp == 0
                            && dp % ep == 0
                            && match efsdp {
                                0 => true,
                                e if ep == 1 => e == 1,
                                e => (dp / ep) % e == 0,
                            };
                        match Topology::new(&s) {
                            Ok(t) => {
                                assert!(valid, "{s:?} accepted as {t:?}");
                                assert_eq!(t.dp_size * t.cp_size, world);
                                if t.ep_size > 1 {
                                    assert_eq!(t.edp_size * t.efsdp_size * t.ep_size, t.dp_size);
                                } else {
                                    assert_eq!((t.efsdp_size, t.edp_size), (1, 1));
                                }
                                assert_eq!(t.mp_replicate_size * t.mp_shard_size, world);
                            }
                            Err(e) => {
                                assert!(!valid, "{s:?} rejected: {e}");
                                assert_eq!(e.kind, ErrorKind::Topology);
                            }
                        }
                    }
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// C ABI

struct Handle(*mut fsdpturbo_topology_t);

impl Drop for Handle {
    fn drop(&mut self) {
        fsdpturbo_topology_free(self.0);
    }
}

fn new_handle(opts: &fsdpturbo_topology_options_t) -> Handle {
    let mut out = ptr::null_mut();
    assert_eq!(fsdpturbo_topology_new(opts, &mut out), FSDPTURBO_OK, "{}", last_error());
    assert!(!out.is_null());
    Handle(out)
}

fn size(h: &Handle, dim: &str) -> u64 {
    let dim = CString::new(dim).unwrap();
    let mut out = 0u64;
    assert_eq!(fsdpturbo_topology_size(h.0, dim.as_ptr(), &mut out), FSDPTURBO_OK, "{}", last_error());
    out
}

fn group(h: &Handle, mesh: i32, dims: &str, rank: u64) -> Result<Vec<u64>, (i32, String, usize)> {
    let dims = CString::new(dims).unwrap();
    let mut buf = [u64::MAX; 32];
    let mut len = usize::MAX;
    let rc = fsdpturbo_topology_group(h.0, mesh, dims.as_ptr(), rank, buf.as_mut_ptr(), buf.len(), &mut len);
    if rc == FSDPTURBO_OK { Ok(buf[..len].to_vec()) } else { Err((rc, last_error(), len)) }
}

#[test]
fn ffi_new_and_sizes() {
    let h = new_handle(&topology_options(16, 2, 4));
    let sizes: Vec<u64> =
        ["world", "dp", "cp", "mp_replicate", "mp_shard", "ep", "efsdp", "edp", "expert_cp"]
            .iter()
            .map(|d| size(&h, d))
            .collect();
    assert_eq!(sizes, vec![16, 8, 2, 1, 16, 4, 2, 1, 2]);
    assert_eq!(fsdpturbo_last_error(ptr::null_mut(), 0), 0, "success clears the last error");

    // Zeros select the default formulas; explicit sizes are honoured.
    let h = new_handle(&fsdpturbo_topology_options_t {
        dp_size: 8,
        mp_replicate_size: 2,
        mp_shard_size: 4,
        efsdp_size: 1,
        ep_size: 2,
        ..topology_options(8, 1, 1)
    });
    let sizes: Vec<u64> =
        ["dp", "mp_replicate", "mp_shard", "ep", "efsdp", "edp"].iter().map(|d| size(&h, d)).collect();
    assert_eq!(sizes, vec![8, 2, 4, 2, 1, 4]);

    let h = new_handle(&topology_options(1, 1, 1));
    assert_eq!((size(&h, "efsdp"), size(&h, "edp"), size(&h, "expert_cp")), (1, 1, 1));
}

#[test]
fn ffi_new_errors() {
    let mut out = ptr::dangling_mut::<fsdpturbo_topology_t>(); // must be reset to NULL
    assert_eq!(fsdpturbo_topology_new(ptr::null(), &mut out), FSDPTURBO_ERR_NULL_ARGUMENT);
    assert_eq!(last_error(), "argument `options` must not be NULL");
    assert_eq!(
        fsdpturbo_topology_new(&topology_options(8, 1, 1), ptr::null_mut()),
        FSDPTURBO_ERR_NULL_ARGUMENT
    );
    assert_eq!(last_error(), "argument `out` must not be NULL");

    let mut out = ptr::dangling_mut::<fsdpturbo_topology_t>();
    assert_eq!(fsdpturbo_topology_new(&topology_options(16, 1, 3), &mut out), FSDPTURBO_ERR_TOPOLOGY);
    assert!(out.is_null());
    assert!(last_error().starts_with("dp_size must be divisible by ep_size, got 16 % 3 != 0."));

    // cp, mp_replicate, ep and world have no "default" zero.
    for opts in [
        topology_options(0, 1, 1),
        topology_options(8, 0, 1),
        topology_options(8, 1, 0),
        fsdpturbo_topology_options_t { mp_replicate_size: 0, ..topology_options(8, 1, 1) },
    ] {
        assert_eq!(fsdpturbo_topology_new(&opts, &mut out), FSDPTURBO_ERR_TOPOLOGY);
        assert!(last_error().ends_with("must be positive, got 0."), "{}", last_error());
    }
    assert_eq!(
        fsdpturbo_topology_new(
            &fsdpturbo_topology_options_t { efsdp_size: 2, ..topology_options(8, 1, 1) },
            &mut out
        ),
        FSDPTURBO_ERR_TOPOLOGY
    );
    assert!(last_error().contains("needs expert parallelism, but ep_size is 1"));
}

/// A parsed training configuration, freed on drop.
struct Config(*mut fsdpturbo_config_t);

impl Drop for Config {
    fn drop(&mut self) {
        fsdpturbo_config_free(self.0);
    }
}

fn config(yaml: &str) -> Config {
    let mut out = ptr::null_mut();
    assert_eq!(
        fsdpturbo_config_parse(yaml.as_ptr().cast(), yaml.len(), &mut out),
        FSDPTURBO_OK,
        "{}",
        last_error()
    );
    Config(out)
}

fn from_config(config: &Config, world: u64) -> Result<Handle, (i32, String)> {
    let mut out = ptr::dangling_mut::<fsdpturbo_topology_t>(); // must be overwritten
    let rc = fsdpturbo_topology_from_config(config.0, world, &mut out);
    if rc != FSDPTURBO_OK {
        assert!(out.is_null(), "a failure leaves *out NULL");
        return Err((rc, last_error()));
    }
    Ok(Handle(out))
}

const SIZE_DIMS: [&str; 9] =
    ["world", "dp", "cp", "mp_replicate", "mp_shard", "ep", "efsdp", "edp", "expert_cp"];

#[test]
fn ffi_from_config_takes_every_size_of_the_config() {
    // (YAML, world, the same sizes as options for fsdpturbo_topology_new)
    let cases = [
        ("model: m\n", 8, topology_options(8, 1, 1)),
        ("cp_size: 2\ndist_config: {name: fsdpturbo, ep_size: 4}\n", 16, topology_options(16, 2, 4)),
        (
            "dp_size: 8\ncp_size: 2\nmp_replicate_size: 2\nmp_shard_size: 8\n\
             dist_config: {name: fsdpturbo, ep_size: 2, efsdp_size: 2}\n",
            16,
            fsdpturbo_topology_options_t {
                dp_size: 8,
                mp_replicate_size: 2,
                mp_shard_size: 8,
                efsdp_size: 2,
                ..topology_options(16, 2, 2)
            },
        ),
        (
            "mp_replicate_size: 4\ndist_config: {name: fsdpturbo, ep_size: 2, efsdp_size: 1}\n",
            8,
            fsdpturbo_topology_options_t { mp_replicate_size: 4, efsdp_size: 1, ..topology_options(8, 1, 2) },
        ),
    ];
    for (yaml, world, opts) in cases {
        let ours = from_config(&config(yaml), world).unwrap_or_else(|e| panic!("{yaml}: {e:?}"));
        let by_sizes = new_handle(&opts);
        let sizes = |h: &Handle| SIZE_DIMS.iter().map(|d| size(h, d)).collect::<Vec<_>>();
        assert_eq!(sizes(&ours), sizes(&by_sizes), "{yaml}");
        for mesh in [FSDPTURBO_MESH_DATA, FSDPTURBO_MESH_MODEL, FSDPTURBO_MESH_EXPERT] {
            let shape = |h: &Handle| {
                let mut buf = [0u64; 4];
                let mut len = 0usize;
                let rc = fsdpturbo_topology_mesh_shape(h.0, mesh, buf.as_mut_ptr(), buf.len(), &mut len);
                (rc, buf[..if rc == FSDPTURBO_OK { len } else { 0 }].to_vec())
            };
            assert_eq!(shape(&ours), shape(&by_sizes), "{yaml}, mesh {mesh}");
        }
    }
}

#[test]
fn ffi_from_config_errors() {
    let cfg = config("dist_config: {name: fsdpturbo, ep_size: 3}\n");
    for (world, expected) in
        [(16, "dp_size must be divisible by ep_size, got 16 % 3 != 0."), (0, "world_size")]
    {
        let (rc, message) = from_config(&cfg, world).err().expect("refused");
        assert_eq!(rc, FSDPTURBO_ERR_TOPOLOGY);
        assert!(message.contains(expected), "{message}");
    }

    let mut out = ptr::dangling_mut::<fsdpturbo_topology_t>();
    assert_eq!(fsdpturbo_topology_from_config(ptr::null(), 8, &mut out), FSDPTURBO_ERR_NULL_ARGUMENT);
    assert!(out.is_null());
    assert_eq!(last_error(), "argument `config` must not be NULL");
    assert_eq!(fsdpturbo_topology_from_config(cfg.0, 9, ptr::null_mut()), FSDPTURBO_ERR_NULL_ARGUMENT);
    assert_eq!(last_error(), "argument `out` must not be NULL");
}

#[test]
fn ffi_struct_size() {
    let full = std::mem::size_of::<fsdpturbo_topology_options_t>();
    assert_eq!(full, 64);
    let mut out = ptr::null_mut();
    for small in [0, 8, full - 8, full - 1] {
        let opts = fsdpturbo_topology_options_t { struct_size: small, ..topology_options(8, 1, 2) };
        assert_eq!(fsdpturbo_topology_new(&opts, &mut out), FSDPTURBO_ERR_STRUCT_SIZE);
        assert!(out.is_null());
        assert_eq!(
            last_error(),
            format!(
                "argument `options` (fsdpturbo_topology_options_t) has struct_size {small}; this library \
                 accepts {full} (the first version's size) or more (a newer header's): initialise it with \
                 FSDPTURBO_TOPOLOGY_OPTIONS_INIT"
            )
        );
    }
    // A newer, larger struct is accepted and its tail ignored.
    #[repr(C)]
    struct Newer {
        v1: fsdpturbo_topology_options_t,
        future: [u64; 3],
    }
    let mut newer = Newer { v1: topology_options(8, 1, 2), future: [7; 3] };
    newer.v1.struct_size = std::mem::size_of::<Newer>();
    let mut out = ptr::null_mut();
    assert_eq!(fsdpturbo_topology_new(&newer.v1, &mut out), FSDPTURBO_OK);
    let h = Handle(out);
    assert_eq!(size(&h, "efsdp"), 4);
}

#[test]
fn ffi_size_errors() {
    let h = new_handle(&topology_options(8, 1, 2));
    let mut out = 0u64;
    let bad = CString::new("dp_size").unwrap();
    assert_eq!(fsdpturbo_topology_size(h.0, bad.as_ptr(), &mut out), FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert_eq!(
        last_error(),
        "argument `dim` is \"dp_size\", which is not a topology size; \
         accepted: world, dp, cp, mp_replicate, mp_shard, ep, efsdp, edp, expert_cp"
    );
    let dp = CString::new("dp").unwrap();
    assert_eq!(fsdpturbo_topology_size(ptr::null(), dp.as_ptr(), &mut out), FSDPTURBO_ERR_NULL_ARGUMENT);
    assert_eq!(last_error(), "argument `topology` must not be NULL");
    assert_eq!(fsdpturbo_topology_size(h.0, ptr::null(), &mut out), FSDPTURBO_ERR_NULL_ARGUMENT);
    assert_eq!(last_error(), "argument `dim` must not be NULL");
    assert_eq!(fsdpturbo_topology_size(h.0, dp.as_ptr(), ptr::null_mut()), FSDPTURBO_ERR_NULL_ARGUMENT);
    assert_eq!(last_error(), "argument `out` must not be NULL");
    let not_utf8 = [0xffu8, 0];
    assert_eq!(fsdpturbo_topology_size(h.0, not_utf8.as_ptr().cast(), &mut out), FSDPTURBO_ERR_UTF8);
    assert!(last_error().starts_with("argument `dim` is not valid UTF-8"));
}

#[test]
fn ffi_mesh_shape_and_selectors() {
    assert_eq!((FSDPTURBO_MESH_DATA, FSDPTURBO_MESH_MODEL, FSDPTURBO_MESH_EXPERT), (0, 1, 2));
    let h = new_handle(&fsdpturbo_topology_options_t { mp_replicate_size: 4, ..topology_options(16, 2, 4) });
    let shape_of = |mesh: i32| {
        let mut buf = [0u64; 4];
        let mut len = 0usize;
        let rc = fsdpturbo_topology_mesh_shape(h.0, mesh, buf.as_mut_ptr(), buf.len(), &mut len);
        (rc == FSDPTURBO_OK).then(|| buf[..len].to_vec())
    };
    assert_eq!(shape_of(FSDPTURBO_MESH_DATA), Some(vec![8, 2]));
    assert_eq!(shape_of(FSDPTURBO_MESH_MODEL), Some(vec![4, 4]));
    assert_eq!(shape_of(FSDPTURBO_MESH_EXPERT), Some(vec![1, 2, 4, 2]));
    for mesh in [-1, 3, i32::MIN, i32::MAX] {
        assert_eq!(shape_of(mesh), None);
        assert_eq!(
            last_error(),
            format!(
                "argument `mesh` is {mesh}; accepted: FSDPTURBO_MESH_DATA (0), FSDPTURBO_MESH_MODEL (1), \
                 FSDPTURBO_MESH_EXPERT (2)"
            )
        );
    }

    // Size query with NULL / capacity 0, then a short buffer: BUFFER_TOO_SMALL with the length.
    let mut len = 0usize;
    let rc = fsdpturbo_topology_mesh_shape(h.0, FSDPTURBO_MESH_EXPERT, ptr::null_mut(), 0, &mut len);
    assert_eq!((rc, len), (FSDPTURBO_ERR_BUFFER_TOO_SMALL as i32, 4));
    let mut small = [99u64; 3];
    let rc = fsdpturbo_topology_mesh_shape(h.0, FSDPTURBO_MESH_EXPERT, small.as_mut_ptr(), 3, &mut len);
    assert_eq!((rc, len, small), (FSDPTURBO_ERR_BUFFER_TOO_SMALL as i32, 4, [99; 3]));
    assert_eq!(last_error(), "buffer `shape` holds 3 elements, 4 are needed");
    let rc = fsdpturbo_topology_mesh_shape(h.0, FSDPTURBO_MESH_DATA, small.as_mut_ptr(), 3, ptr::null_mut());
    assert_eq!(rc, FSDPTURBO_ERR_NULL_ARGUMENT);
    assert_eq!(last_error(), "argument `out_len` must not be NULL");
    let rc = fsdpturbo_topology_mesh_shape(h.0, FSDPTURBO_MESH_DATA, ptr::null_mut(), 3, &mut len);
    assert_eq!(rc, FSDPTURBO_ERR_NULL_ARGUMENT);
    assert_eq!(last_error(), "argument `shape` must not be NULL");
    let rc = fsdpturbo_topology_mesh_shape(ptr::null(), FSDPTURBO_MESH_DATA, small.as_mut_ptr(), 3, &mut len);
    assert_eq!(rc, FSDPTURBO_ERR_NULL_ARGUMENT);

    // No expert mesh with ep 1.
    let h1 = new_handle(&topology_options(16, 2, 1));
    let rc = fsdpturbo_topology_mesh_shape(h1.0, FSDPTURBO_MESH_EXPERT, small.as_mut_ptr(), 3, &mut len);
    assert_eq!(rc, FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert_eq!(
        last_error(),
        "argument `mesh` is FSDPTURBO_MESH_EXPERT (2), but this topology has no expert mesh: ep_size is 1. \
         Build the topology with ep_size > 1 to get one."
    );
    assert_eq!(group(&h1, FSDPTURBO_MESH_EXPERT, "ep", 0).unwrap_err().0, FSDPTURBO_ERR_INVALID_ARGUMENT);
}

#[test]
fn ffi_coordinates() {
    let h = new_handle(&topology_options(16, 2, 4));
    let coordinate = |mesh: i32, rank: u64| {
        let mut buf = [0u64; 4];
        let mut len = 0usize;
        let rc = fsdpturbo_topology_coordinate(h.0, mesh, rank, buf.as_mut_ptr(), buf.len(), &mut len);
        if rc == FSDPTURBO_OK { Ok(buf[..len].to_vec()) } else { Err((rc, last_error())) }
    };
    assert_eq!(coordinate(FSDPTURBO_MESH_EXPERT, 13).unwrap(), vec![0, 1, 2, 1]);
    assert_eq!(coordinate(FSDPTURBO_MESH_DATA, 13).unwrap(), vec![6, 1]);
    assert_eq!(coordinate(FSDPTURBO_MESH_MODEL, 13).unwrap(), vec![0, 13]);
    assert_eq!(
        coordinate(FSDPTURBO_MESH_DATA, 16).unwrap_err(),
        (
            FSDPTURBO_ERR_INVALID_ARGUMENT as i32,
            "rank 16 is outside mesh (dp=8, cp=2), which has 16 ranks (0..=15)".into()
        )
    );
    assert_eq!(coordinate(7, 0).unwrap_err().0, FSDPTURBO_ERR_INVALID_ARGUMENT);
    let mut one = [0u64; 1];
    let mut len = 0usize;
    let rc = fsdpturbo_topology_coordinate(h.0, FSDPTURBO_MESH_DATA, 3, one.as_mut_ptr(), 1, &mut len);
    assert_eq!((rc, len), (FSDPTURBO_ERR_BUFFER_TOO_SMALL as i32, 2));
    assert_eq!(last_error(), "buffer `coordinate` holds 1 elements, 2 are needed");
}

#[test]
fn ffi_groups() {
    let h = new_handle(&topology_options(16, 2, 4));
    assert_eq!(group(&h, FSDPTURBO_MESH_EXPERT, "ep", 9).unwrap(), vec![9, 11, 13, 15]);
    assert_eq!(group(&h, FSDPTURBO_MESH_EXPERT, "efsdp", 9).unwrap(), vec![1, 9]);
    assert_eq!(group(&h, FSDPTURBO_MESH_EXPERT, "expert_cp", 9).unwrap(), vec![8, 9]);
    assert_eq!(group(&h, FSDPTURBO_MESH_EXPERT, "efsdp,ep", 0).unwrap(), vec![0, 2, 4, 6, 8, 10, 12, 14]);
    assert_eq!(group(&h, FSDPTURBO_MESH_EXPERT, " ep , efsdp ", 0).unwrap(), vec![0, 8, 2, 10, 4, 12, 6, 14]);
    assert_eq!(group(&h, FSDPTURBO_MESH_DATA, "dp", 1).unwrap(), vec![1, 3, 5, 7, 9, 11, 13, 15]);
    assert_eq!(group(&h, FSDPTURBO_MESH_MODEL, "mp_shard", 1).unwrap(), range(0, 16));

    for bad in ["", ",", "ep,", "ep,,efsdp", " "] {
        let (rc, msg, _) = group(&h, FSDPTURBO_MESH_EXPERT, bad, 0).unwrap_err();
        assert_eq!(rc, FSDPTURBO_ERR_INVALID_ARGUMENT);
        assert_eq!(
            msg,
            format!(
                "argument `dims` is \"{bad}\"; it must be one or more mesh dim names separated by commas, \
                 e.g. \"ep\" or \"efsdp,ep\", with no empty names"
            )
        );
    }
    let (rc, msg, _) = group(&h, FSDPTURBO_MESH_EXPERT, "dp", 0).unwrap_err();
    assert_eq!(rc, FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert!(msg.ends_with("its dims are \"edp\", \"efsdp\", \"ep\", \"expert_cp\""), "{msg}");
    let (rc, msg, _) = group(&h, FSDPTURBO_MESH_EXPERT, "ep,ep", 0).unwrap_err();
    assert_eq!(rc, FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert!(msg.contains("more than once"), "{msg}");
    let (rc, msg, _) = group(&h, FSDPTURBO_MESH_EXPERT, "ep", 16).unwrap_err();
    assert_eq!(rc, FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert!(msg.starts_with("rank 16 is outside mesh"), "{msg}");
    assert_eq!(group(&h, -3, "ep", 0).unwrap_err().0, FSDPTURBO_ERR_INVALID_ARGUMENT);

    // Too small: the needed length comes back and the buffer is untouched.
    let dims = CString::new("efsdp,ep").unwrap();
    let mut buf = [42u64; 7];
    let mut len = 0usize;
    let rc =
        fsdpturbo_topology_group(h.0, FSDPTURBO_MESH_EXPERT, dims.as_ptr(), 0, buf.as_mut_ptr(), 7, &mut len);
    assert_eq!((rc, len, buf), (FSDPTURBO_ERR_BUFFER_TOO_SMALL as i32, 8, [42; 7]));
    assert_eq!(last_error(), "buffer `members` holds 7 elements, 8 are needed");
    let rc =
        fsdpturbo_topology_group(h.0, FSDPTURBO_MESH_EXPERT, ptr::null(), 0, buf.as_mut_ptr(), 7, &mut len);
    assert_eq!(rc, FSDPTURBO_ERR_NULL_ARGUMENT);
    assert_eq!(last_error(), "argument `dims` must not be NULL");
}

#[test]
fn ffi_free_accepts_null_and_keeps_the_last_error() {
    let live = new_handle(&topology_options(8, 1, 1)); // success clears the last error
    assert_eq!(fsdpturbo_last_error(ptr::null_mut(), 0), 0);
    let mut out = ptr::null_mut();
    assert_eq!(fsdpturbo_topology_new(&topology_options(16, 1, 3), &mut out), FSDPTURBO_ERR_TOPOLOGY);
    let before = last_error();
    assert!(before.starts_with("dp_size must be divisible by ep_size"), "{before}");
    // Cleaning up after a failure must not erase its message.
    fsdpturbo_topology_free(ptr::null_mut());
    drop(live);
    assert_eq!(last_error(), before);
}
