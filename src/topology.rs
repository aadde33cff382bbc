//! The parallel topology: the sizes of every parallel dimension, and the device meshes built
//! from them (data, model and expert), with rank coordinates and communication groups.
//!
//! Pure: no globals, no I/O. Semantics follow the seed (LlamaFactory's base meshes and
//! `FSDPTurboParallelState`), with one deliberate extension (docs/design.md §4.6): an
//! explicit `efsdp_size` may leave `edp = dp / (ep * efsdp)` above 1, so experts are replicated.
//!
//! Every mesh follows torch `init_device_mesh`: the mesh tensor is `arange(world).reshape(shape)`,
//! so a rank's coordinate is its mixed-radix digits, last dim fastest.

use serde::Serialize;

use crate::error::{Error, ErrorKind, Escaped, Result};

/// The most ranks a single `Mesh::group` or `Mesh::groups` call materialises. Far above any
/// real cluster; it only keeps absurd (but valid) sizes such as `world_size = u64::MAX` from
/// exhausting memory. Coordinates and ranks work at any size.
pub const MAX_MATERIALIZED_RANKS: u64 = 1 << 24;

/// The sizes a caller asks for. `None` means "the default formula".
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TopologySpec {
    /// Number of ranks; 1 means "not distributed".
    pub world_size: u64,
    /// Data-parallel size; default `world_size / cp_size`.
    pub dp_size: Option<u64>,
    /// Context-parallel size.
    pub cp_size: u64,
    /// Replicate dim of the model mesh.
    pub mp_replicate_size: u64,
    /// Shard dim of the model mesh; default `world_size / mp_replicate_size`.
    pub mp_shard_size: Option<u64>,
    /// Expert-parallel size; 1 means no expert parallelism (and no expert mesh).
    pub ep_size: u64,
    /// Expert-FSDP size (only with `ep_size > 1`); default `dp_size / ep_size` (so edp = 1).
    pub efsdp_size: Option<u64>,
}

impl Default for TopologySpec {
    fn default() -> Self {
        TopologySpec {
            world_size: 1,
            dp_size: None,
            cp_size: 1,
            mp_replicate_size: 1,
            mp_shard_size: None,
            ep_size: 1,
            efsdp_size: None,
        }
    }
}

/// A named device mesh: `arange(size).reshape(shape)` with one name per dim.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Mesh {
    pub dim_names: Vec<String>,
    pub shape: Vec<u64>,
}

fn mesh_error(message: String) -> Error {
    Error::new(ErrorKind::InvalidArgument, message)
}

impl Mesh {
    /// A checked mesh: one distinct, non-empty name per dim, every dim at least 1, and a total
    /// size that fits in `u64`.
    pub fn new(dim_names: Vec<String>, shape: Vec<u64>) -> Result<Mesh> {
        let mesh = Mesh { dim_names, shape };
        mesh.strides()?;
        Ok(mesh)
    }

    /// The number of ranks (the product of the shape). Saturates at `u64::MAX` for a
    /// hand-built mesh whose product overflows; such a mesh is rejected by every other method.
    pub fn size(&self) -> u64 {
        self.shape.iter().try_fold(1u64, |acc, &d| acc.checked_mul(d)).unwrap_or(u64::MAX)
    }

    /// `(dp=8, cp=2)`, for messages.
    fn describe(&self) -> String {
        let dims: Vec<String> =
            self.dim_names.iter().zip(&self.shape).map(|(name, size)| format!("{name}={size}")).collect();
        format!("({})", dims.join(", "))
    }

    fn names_list(&self) -> String {
        let names: Vec<String> = self.dim_names.iter().map(|n| format!("\"{n}\"")).collect();
        names.join(", ")
    }

    /// Validates the mesh and returns its row-major strides.
    fn strides(&self) -> Result<Vec<u64>> {
        if self.dim_names.len() != self.shape.len() {
            return Err(mesh_error(format!(
                "mesh has {} dim names ({}) but {} sizes {:?}; every dim needs exactly one name",
                self.dim_names.len(),
                self.names_list(),
                self.shape.len(),
                self.shape
            )));
        }
        for (i, name) in self.dim_names.iter().enumerate() {
            if name.is_empty() {
                return Err(mesh_error(format!(
                    "mesh dim {i} has an empty name; dim names must be non-empty"
                )));
            }
            if self.dim_names[..i].contains(name) {
                return Err(mesh_error(format!(
                    "mesh dim name \"{name}\" appears more than once in ({}); dim names must be distinct",
                    self.names_list()
                )));
            }
            if self.shape[i] == 0 {
                return Err(mesh_error(format!(
                    "mesh dim \"{name}\" has size 0 in {}; every dim must have size at least 1",
                    self.describe()
                )));
            }
        }
        let mut strides = vec![1u64; self.shape.len()];
        let mut acc = 1u64;
        for i in (0..self.shape.len()).rev() {
            strides[i] = acc;
            acc = acc.checked_mul(self.shape[i]).ok_or_else(|| {
                mesh_error(format!(
                    "mesh {} has more than {} ranks; its size must fit in 64 bits",
                    self.describe(),
                    u64::MAX
                ))
            })?;
        }
        Ok(strides)
    }

    /// The position of the dim called `name`.
    pub fn dim_index(&self, name: &str) -> Result<usize> {
        self.dim_names.iter().position(|n| n == name).ok_or_else(|| {
            mesh_error(format!(
                "mesh {} has no dim named \"{}\"; its dims are {}",
                self.describe(),
                Escaped(name),
                self.names_list()
            ))
        })
    }

    fn check_rank(&self, rank: u64) -> Result<()> {
        let size = self.size();
        if rank >= size {
            return Err(mesh_error(format!(
                "rank {rank} is outside mesh {}, which has {size} ranks (0..={})",
                self.describe(),
                size - 1
            )));
        }
        Ok(())
    }

    /// The coordinate of `rank`: its mixed-radix digits, last dim fastest.
    pub fn coordinate(&self, rank: u64) -> Result<Vec<u64>> {
        self.strides()?;
        self.check_rank(rank)?;
        let mut coordinate = vec![0u64; self.shape.len()];
        let mut rest = rank;
        for i in (0..self.shape.len()).rev() {
            coordinate[i] = rest % self.shape[i];
            rest /= self.shape[i];
        }
        Ok(coordinate)
    }

    /// The rank at `coordinate` (the inverse of `coordinate`).
    pub fn rank_of(&self, coordinate: &[u64]) -> Result<u64> {
        let strides = self.strides()?;
        if coordinate.len() != self.shape.len() {
            return Err(mesh_error(format!(
                "coordinate {coordinate:?} has {} entries but mesh {} has {} dims",
                coordinate.len(),
                self.describe(),
                self.shape.len()
            )));
        }
        let mut rank = 0u64;
        for (i, &c) in coordinate.iter().enumerate() {
            if c >= self.shape[i] {
                return Err(mesh_error(format!(
                    "coordinate {coordinate:?} is outside mesh {}: \"{}\" must be below {}, got {c}",
                    self.describe(),
                    self.dim_names[i],
                    self.shape[i]
                )));
            }
            // Cannot overflow: the sum is below the mesh size, which fits (checked by strides()).
            rank += c * strides[i];
        }
        Ok(rank)
    }

    /// Resolves group dims to indices: at least one, known, no repeats.
    fn resolve_dims(&self, dims: &[&str]) -> Result<Vec<usize>> {
        if dims.is_empty() {
            return Err(mesh_error(format!(
                "a group needs at least one mesh dim; mesh {} has dims {}",
                self.describe(),
                self.names_list()
            )));
        }
        let mut indices = Vec::with_capacity(dims.len());
        for &name in dims {
            let index = self.dim_index(name)?;
            if indices.contains(&index) {
                return Err(mesh_error(format!(
                    "group dims {dims:?} name \"{name}\" more than once; each dim may appear once"
                )));
            }
            indices.push(index);
        }
        Ok(indices)
    }

    fn check_materializable(&self, count: u64, what: &str) -> Result<()> {
        if count > MAX_MATERIALIZED_RANKS {
            return Err(mesh_error(format!(
                "{what} of mesh {} has {count} ranks, more than the {MAX_MATERIALIZED_RANKS} this library \
                 lists at once; use coordinate/rank_of to walk it",
                self.describe()
            )));
        }
        Ok(())
    }

    /// The members of `rank`'s sub-mesh over `dims`: the ranks that share every other coordinate
    /// with `rank`, in row-major order over `dims` as given (the first dim slowest). With one dim
    /// the position of a member is its coordinate along that dim, i.e. its group-local rank; with
    /// several it is the flattened sub-mesh order of torch `mesh[dims]`.
    pub fn group(&self, rank: u64, dims: &[&str]) -> Result<Vec<u64>> {
        let strides = self.strides()?;
        let indices = self.resolve_dims(dims)?;
        self.check_rank(rank)?;
        let count: u64 = indices.iter().map(|&i| self.shape[i]).product();
        self.check_materializable(count, &format!("the group over {dims:?}"))?;
        let coordinate = self.coordinate(rank)?;
        let base = rank - indices.iter().map(|&i| coordinate[i] * strides[i]).sum::<u64>();
        let mut members = vec![base];
        members.reserve_exact(count as usize);
        for &i in &indices {
            let (stride, len) = (strides[i], self.shape[i]);
            members = members.iter().flat_map(|&m| (0..len).map(move |k| m + k * stride)).collect();
        }
        Ok(members)
    }

    /// Every distinct group over `dims`, ordered by first member (which is also the smallest).
    pub fn groups(&self, dims: &[&str]) -> Result<Vec<Vec<u64>>> {
        let strides = self.strides()?;
        let indices = self.resolve_dims(dims)?;
        let size = self.size();
        self.check_materializable(size, &format!("the groups over {dims:?}"))?;
        let mut groups = Vec::new();
        for rank in 0..size {
            // The group's first member is the rank whose coordinate along every dim of `dims` is 0.
            if indices.iter().all(|&i| (rank / strides[i]) % self.shape[i] == 0) {
                groups.push(self.group(rank, dims)?);
            }
        }
        Ok(groups)
    }
}

/// A resolved topology: every size known and consistent.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Topology {
    pub world_size: u64,
    pub dp_size: u64,
    pub cp_size: u64,
    pub mp_replicate_size: u64,
    pub mp_shard_size: u64,
    pub ep_size: u64,
    pub efsdp_size: u64,
    pub edp_size: u64,
}

fn topology_error(message: String) -> Error {
    Error::new(ErrorKind::Topology, message)
}

/// " Accepted {name} values (divisors of {of} 16): 1, 2, 4, 8, 16." for small `n`; for large
/// ones " Accepted {name} values are the divisors of {of} ({n})." (the configuration schema's
/// divisibility errors end the same way).
pub(crate) fn divisors_hint(name: &str, of: &str, n: u64) -> String {
    if n == 0 || n > 4096 {
        return format!(" Accepted {name} values are the divisors of {of} ({n}).");
    }
    let divisors: Vec<String> = (1..=n).filter(|d| n % d == 0).map(|d| d.to_string()).collect();
    format!(" Accepted {name} values (divisors of {of} {n}): {}.", divisors.join(", "))
}

fn positive(name: &str, value: u64) -> Result<()> {
    if value == 0 {
        return Err(topology_error(format!("{name} must be positive, got 0.")));
    }
    Ok(())
}

fn positive_if_given(name: &str, value: Option<u64>, default: &str) -> Result<()> {
    if value == Some(0) {
        return Err(topology_error(format!(
            "{name} must be positive when given, got 0. Leave it unset for the default ({default})."
        )));
    }
    Ok(())
}

impl Topology {
    /// Resolves and checks `spec` (docs/design.md §4.6). Errors are
    /// `ErrorKind::Topology` and start with the seed's exact text where the seed has one.
    pub fn new(spec: &TopologySpec) -> Result<Topology> {
        let world = spec.world_size;
        positive("world_size", world)?;

        // Model mesh (mp_replicate, mp_shard).
        let r = spec.mp_replicate_size;
        positive("mp_replicate_size", r)?;
        positive_if_given("mp_shard_size", spec.mp_shard_size, "world_size / mp_replicate_size")?;
        if world % r != 0 {
            return Err(topology_error(format!(
                "world_size ({world}) must be divisible by mp_replicate_size ({r}).{}",
                divisors_hint("mp_replicate_size", "world_size", world)
            )));
        }
        let mp_shard = spec.mp_shard_size.unwrap_or(world / r);
        if r.checked_mul(mp_shard) != Some(world) {
            return Err(topology_error(format!(
                "mp_replicate_size * mp_shard_size must equal to world_size, got {r} * {mp_shard} != {world}. \
                 Accepted mp_shard_size: {} (or leave it unset).",
                world / r
            )));
        }

        // Data mesh (dp, cp).
        let cp = spec.cp_size;
        positive("cp_size", cp)?;
        positive_if_given("dp_size", spec.dp_size, "world_size / cp_size")?;
        if world % cp != 0 {
            return Err(topology_error(format!(
                "world_size ({world}) must be divisible by cp_size ({cp}).{}",
                divisors_hint("cp_size", "world_size", world)
            )));
        }
        let dp = spec.dp_size.unwrap_or(world / cp);
        if dp.checked_mul(cp) != Some(world) {
            return Err(topology_error(format!(
                "dp_size * cp_size must equal to world_size, got {dp} * {cp} != {world}. \
                 Accepted dp_size: {} (or leave it unset).",
                world / cp
            )));
        }

        // Expert mesh (edp, efsdp, ep, expert_cp).
        let ep = spec.ep_size;
        positive("ep_size", ep)?;
        positive_if_given("efsdp_size", spec.efsdp_size, "dp_size / ep_size")?;
        if dp % ep != 0 {
            return Err(topology_error(format!(
                "dp_size must be divisible by ep_size, got {dp} % {ep} != 0.{}",
                divisors_hint("ep_size", "dp_size", dp)
            )));
        }
        let (efsdp, edp) = if ep == 1 {
            match spec.efsdp_size {
                None | Some(1) => (1, 1),
                Some(efsdp) => {
                    return Err(topology_error(format!(
                        "efsdp_size ({efsdp}) needs expert parallelism, but ep_size is 1: with ep_size 1 \
                         there is no expert mesh and efsdp_size is 1. Set ep_size > 1, or leave \
                         efsdp_size unset (or 1)."
                    )));
                }
            }
        } else {
            let per_ep = dp / ep;
            match spec.efsdp_size {
                None => (per_ep, 1),
                Some(efsdp) if per_ep % efsdp == 0 => (efsdp, per_ep / efsdp),
                Some(efsdp) => {
                    return Err(topology_error(format!(
                        "efsdp_size must divide dp_size / ep_size, got {dp} / {ep} = {per_ep} and \
                         {per_ep} % {efsdp} != 0.{} Leave it unset for {per_ep} (edp_size 1).",
                        divisors_hint("efsdp_size", "dp_size / ep_size", per_ep)
                    )));
                }
            }
        };

        Ok(Topology {
            world_size: world,
            dp_size: dp,
            cp_size: cp,
            mp_replicate_size: r,
            mp_shard_size: mp_shard,
            ep_size: ep,
            efsdp_size: efsdp,
            edp_size: edp,
        })
    }

    /// Checks a `Topology` that was built field by field: it must be exactly what `new` makes
    /// of its own sizes (edp, efsdp and the products included).
    pub fn validate(&self) -> Result<()> {
        let spec = TopologySpec {
            world_size: self.world_size,
            dp_size: Some(self.dp_size),
            cp_size: self.cp_size,
            mp_replicate_size: self.mp_replicate_size,
            mp_shard_size: Some(self.mp_shard_size),
            ep_size: self.ep_size,
            efsdp_size: Some(self.efsdp_size),
        };
        let rebuilt = Topology::new(&spec)?;
        if rebuilt != *self {
            return Err(topology_error(format!(
                "inconsistent topology {self:?}: its sizes resolve to {rebuilt:?} \
                 (edp_size must be dp_size / (ep_size * efsdp_size), and 1 when ep_size is 1)"
            )));
        }
        Ok(())
    }

    /// The data mesh `(dp, cp)`, dims `("dp", "cp")`.
    pub fn data_mesh(&self) -> Mesh {
        Mesh { dim_names: vec!["dp".into(), "cp".into()], shape: vec![self.dp_size, self.cp_size] }
    }

    /// The model mesh `(mp_replicate, mp_shard)`, dims `("mp_replicate", "mp_shard")`.
    pub fn model_mesh(&self) -> Mesh {
        Mesh {
            dim_names: vec!["mp_replicate".into(), "mp_shard".into()],
            shape: vec![self.mp_replicate_size, self.mp_shard_size],
        }
    }

    /// The expert mesh `(edp, efsdp, ep, expert_cp)`; `None` when `ep_size == 1` (the seed
    /// builds no expert mesh then).
    pub fn expert_mesh(&self) -> Option<Mesh> {
        (self.ep_size > 1).then(|| Mesh {
            dim_names: vec!["edp".into(), "efsdp".into(), "ep".into(), "expert_cp".into()],
            shape: vec![self.edp_size, self.efsdp_size, self.ep_size, self.cp_size],
        })
    }

    /// `(dp, cp, ep)`: the tuple the seed compares on re-initialisation and prints in its error.
    pub fn key(&self) -> (u64, u64, u64) {
        (self.dp_size, self.cp_size, self.ep_size)
    }
}
