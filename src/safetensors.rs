//! safetensors files: the header, validated strictly, and the byte ranges of one rank's local
//! slice of a tensor (shard-on-read loading). Pure: the caller reads the bytes and hands them in.
//!
//! A safetensors file is an 8-byte little-endian header length `N`, `N` bytes of JSON
//! (`{"name": {"dtype", "shape", "data_offsets": [begin, end]}, …, "__metadata__": {…}}`,
//! possibly padded with trailing spaces), then the data section; offsets are relative to the
//! start of the data section (byte `8 + N` of the file). [`parse_header`] accepts exactly what
//! the format allows: offsets that tile the data section from 0 without holes or overlaps,
//! each tensor's byte count equal to its shape times its dtype's size, no duplicate keys, no
//! unknown fields, and, when the file size is known, a data section that ends where the file
//! ends (a shorter file is reported as truncated, naming the first tensor that runs past it).
//!
//! [`read_plan`] turns the placement plan of [`crate::placement::copy_plan`] (torch DTensor's
//! local slice, uneven/empty shards and `_StridedShard` included) into `(file, offset, length,
//! destination offset)` byte ranges, merged where contiguous. A tensor is either one checkpoint
//! tensor of the same shape ([`Layout::Direct`]) or a stack of rows ([`Layout::Stacked`]): row
//! `e` of the global tensor `[E, R, …]` is the concatenation on dim 0 of `parts_per_row`
//! checkpoint tensors (Hugging Face's per-expert layout: `experts.{e}.gate_proj.weight` and
//! `.up_proj.weight` make row `e` of the fused `gate_up_proj`). Row-major, a stack is exactly the
//! concatenation of its sources' bytes in order, so a local slice's element runs map to byte
//! ranges by cutting them at the source boundaries.

use std::collections::{BTreeMap, HashMap};
use std::fmt;

use serde::Serialize;
use serde::de::{Deserialize, Deserializer, IgnoredAny, MapAccess, Visitor};
use serde_json::Value;
use serde_json::value::RawValue;

use crate::error::{Error, ErrorKind, Escaped, Result, escaped};
use crate::placement::{self, Placement};

/// The largest header the format allows (the `safetensors` crate's limit).
pub const MAX_HEADER_BYTES: u64 = 100_000_000;
/// The most tensors one file's header may hold: far above any real file (a shard of a few GB
/// holds thousands), low enough that a header's parsed form stays within a few hundred MB.
pub const MAX_TENSORS: usize = 1 << 18;
/// The most dims a tensor may have (torch's limit).
pub const MAX_DIMS: usize = 64;
/// The most JSON bytes of one tensor entry: one of at most 64 dims needs about 1.4 KB, so the
/// entry parsed alone costs little.
pub const MAX_ENTRY_BYTES: usize = 1 << 16;
/// The most JSON bytes of `__metadata__`.
pub const MAX_METADATA_BYTES: usize = 16 << 20;

/// The element types of the format: `(name, bits per element)`.
const DTYPES: &[(&str, u64)] = &[
    ("BOOL", 8),
    ("F4", 4),
    ("F6_E2M3", 6),
    ("F6_E3M2", 6),
    ("U8", 8),
    ("I8", 8),
    ("F8_E5M2", 8),
    ("F8_E4M3", 8),
    ("F8_E8M0", 8),
    ("I16", 16),
    ("U16", 16),
    ("F16", 16),
    ("BF16", 16),
    ("I32", 32),
    ("U32", 32),
    ("F32", 32),
    ("C64", 64),
    ("F64", 64),
    ("I64", 64),
    ("U64", 64),
];

/// A safetensors element type (one of the format's dtype names).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
#[serde(transparent)]
pub struct Dtype(&'static str);

impl Dtype {
    /// The dtype of a header's `dtype` string, or an error listing the accepted names.
    pub fn parse(name: &str) -> Result<Dtype> {
        DTYPES.iter().find(|(n, _)| *n == name).map(|(n, _)| Dtype(n)).ok_or_else(|| {
            let names: Vec<&str> = DTYPES.iter().map(|(n, _)| *n).collect();
            Error::invalid(format!(
                "dtype {name:?} is not a safetensors dtype; accepted: {}",
                names.join(", ")
            ))
        })
    }

    /// The format's name (`"BF16"`).
    pub fn name(self) -> &'static str {
        self.0
    }

    /// Bits per element (4 and 6 for the sub-byte float types).
    pub fn bits(self) -> u64 {
        DTYPES.iter().find(|(n, _)| *n == self.0).map_or(0, |(_, b)| *b)
    }
}

impl fmt::Display for Dtype {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.0)
    }
}

/// One tensor of a header. `data_offsets` are relative to the data section.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<u64>,
    pub data_offsets: (u64, u64),
}

impl TensorInfo {
    /// The tensor's bytes.
    pub fn nbytes(&self) -> u64 {
        self.data_offsets.1 - self.data_offsets.0
    }
}

/// A validated safetensors header.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct Header {
    /// Bytes before the data section: 8 + the JSON length.
    pub data_start: u64,
    /// Bytes of the data section (the end of the last tensor).
    pub data_bytes: u64,
    /// The tensors in file order (ascending offsets).
    pub tensors: Vec<TensorInfo>,
    /// The `__metadata__` strings (empty when absent).
    pub metadata: BTreeMap<String, String>,
    #[serde(skip)]
    index: HashMap<String, usize>,
}

impl Header {
    /// The tensor called `name`.
    pub fn get(&self, name: &str) -> Option<&TensorInfo> {
        self.index.get(name).map(|&i| &self.tensors[i])
    }

    /// The size of the file this header describes.
    pub fn file_size(&self) -> u64 {
        self.data_start + self.data_bytes
    }

    /// The header as JSON: `{"data_start", "data_bytes", "tensors": [{"name", "dtype", "shape",
    /// "data_offsets"}] (file order), "metadata"}`.
    pub fn to_json(&self) -> Value {
        serde_json::to_value(self).unwrap_or(Value::Null)
    }
}

/// The bytes before the data section (8 + the JSON length) from the first 8 bytes of a file:
/// how much to read before calling [`parse_header`].
pub fn header_size(prefix: &[u8]) -> Result<u64> {
    let Some(len) = prefix.get(..8) else {
        return Err(Error::invalid(format!(
            "a safetensors file starts with an 8-byte header length, but only {} bytes were given \
             (is the file empty or truncated?)",
            prefix.len()
        )));
    };
    let n = u64::from_le_bytes(len.try_into().expect("8 bytes"));
    if n > MAX_HEADER_BYTES {
        return Err(Error::invalid(format!(
            "the header length is {n} bytes, more than the format's limit of {MAX_HEADER_BYTES} \
             (not a safetensors file, or a corrupt one)"
        )));
    }
    if n < 2 {
        return Err(Error::invalid(format!(
            "the header length is {n} bytes; a header is a JSON object of at least 2 bytes (`{{}}`)"
        )));
    }
    Ok(8 + n)
}

/// The JSON object's entries in file order, duplicates kept (serde_json's maps drop them), each
/// value as its raw JSON text (parsed one at a time once its size is checked). Past
/// `MAX_TENSORS + 1` entries (the tensors and `__metadata__`) the rest are only counted.
struct Entries<'a> {
    kept: Vec<(String, &'a RawValue)>,
    count: usize,
}

impl<'de> Deserialize<'de> for Entries<'de> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> std::result::Result<Self, D::Error> {
        struct V;
        impl<'de> Visitor<'de> for V {
            type Value = Entries<'de>;
            fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
                f.write_str("a JSON object of tensor entries")
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> std::result::Result<Entries<'de>, A::Error> {
                let mut entries = Entries { kept: Vec::new(), count: 0 };
                while entries.kept.len() <= MAX_TENSORS {
                    let Some(entry) = map.next_entry::<String, &RawValue>()? else { return Ok(entries) };
                    entries.kept.push(entry);
                    entries.count += 1;
                }
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {
                    entries.count += 1;
                }
                Ok(entries)
            }
        }
        deserializer.deserialize_map(V)
    }
}

/// The value of one entry, parsed once its raw JSON is known to be at most `limit` bytes.
fn entry_value(raw: &RawValue, limit: usize, too_big: impl FnOnce(usize) -> Error) -> Result<Value> {
    if raw.get().len() > limit {
        return Err(too_big(raw.get().len()));
    }
    serde_json::from_str(raw.get())
        .map_err(|e| Error::invalid(format!("an entry of the header is not JSON: {e}")))
}

fn out_of_memory(tensors: usize) -> Error {
    Error::invalid(format!("the header's {tensors} tensors do not fit in memory"))
}

fn bad(name: &str, what: impl fmt::Display) -> Error {
    Error::invalid(format!("tensor `{}`: {what}", Escaped(name)))
}

fn as_u64s(name: &str, field: &str, value: &Value) -> Result<Vec<u64>> {
    let items = value
        .as_array()
        .ok_or_else(|| bad(name, format!("`{field}` is {}, not an array", escaped(value))))?;
    items
        .iter()
        .enumerate()
        .map(|(i, v)| {
            v.as_u64().ok_or_else(|| {
                bad(name, format!("`{field}[{i}]` is {}, not a non-negative integer", escaped(v)))
            })
        })
        .collect()
}

fn tensor_entry(name: &str, value: &Value) -> Result<TensorInfo> {
    let fields = value
        .as_object()
        .ok_or_else(|| bad(name, format!("the entry is {}, not an object", escaped(value))))?;
    if let Some(unknown) = fields.keys().find(|k| !matches!(k.as_str(), "dtype" | "shape" | "data_offsets")) {
        return Err(bad(
            name,
            format!("unknown field `{}`; accepted: dtype, shape, data_offsets", Escaped(unknown)),
        ));
    }
    let field = |f: &str| fields.get(f).ok_or_else(|| bad(name, format!("the entry has no `{f}`")));
    let dtype_value = field("dtype")?;
    let dtype_name = dtype_value
        .as_str()
        .ok_or_else(|| bad(name, format!("`dtype` is {}, not a string", escaped(dtype_value))))?;
    let dtype = Dtype::parse(dtype_name).map_err(|e| bad(name, e.message))?;
    let shape = as_u64s(name, "shape", field("shape")?)?;
    if shape.len() > MAX_DIMS {
        return Err(bad(
            name,
            format!("its shape has {} dims, more than the limit of {MAX_DIMS}", shape.len()),
        ));
    }
    let offsets = as_u64s(name, "data_offsets", field("data_offsets")?)?;
    let &[begin, end] = offsets.as_slice() else {
        return Err(bad(name, format!("`data_offsets` has {} entries; give [begin, end]", offsets.len())));
    };
    if end < begin {
        return Err(bad(name, format!("`data_offsets` [{begin}, {end}] end before they begin")));
    }
    let bits = shape
        .iter()
        .try_fold(dtype.bits(), |acc, &d| acc.checked_mul(d))
        .ok_or_else(|| bad(name, format!("shape {shape:?} of {dtype} has more than {} bits", u64::MAX)))?;
    if bits % 8 != 0 || bits / 8 != end - begin {
        return Err(bad(
            name,
            format!(
                "shape {shape:?} of {dtype} is {bits} bits ({} bytes) but `data_offsets` [{begin}, {end}] \
                 span {} bytes",
                bits as f64 / 8.0,
                end - begin
            ),
        ));
    }
    Ok(TensorInfo { name: name.to_string(), dtype, shape, data_offsets: (begin, end) })
}

/// Parses and validates a safetensors header. `bytes` holds the start of the file: at least
/// [`header_size`] bytes (more are ignored). With `file_size` (the file's length in bytes) the
/// data section must end exactly at the end of the file: a shorter file is an error naming the
/// first tensor whose bytes run past it, a longer one an error naming the extra bytes. Errors
/// (InvalidArgument) name the tensor and what is wrong; bad JSON gives serde_json's line and column.
pub fn parse_header(bytes: &[u8], file_size: Option<u64>) -> Result<Header> {
    let data_start = header_size(bytes)?;
    if let Some(size) = file_size.filter(|&s| s < data_start) {
        return Err(Error::invalid(format!(
            "the file is truncated: it has {size} bytes but its header needs {data_start} (8 + a {}-byte JSON header)",
            data_start - 8
        )));
    }
    let json = bytes.get(8..data_start as usize).ok_or_else(|| {
        Error::invalid(format!(
            "the header needs {data_start} bytes (8 + a {}-byte JSON header) but only {} were given",
            data_start - 8,
            bytes.len()
        ))
    })?;
    let entries: Entries = serde_json::from_slice(json).map_err(|e| {
        Error::invalid(format!("the header is not a valid JSON object of tensor entries: {e}"))
    })?;
    let tensor_count =
        entries.count - usize::from(entries.kept.iter().any(|(name, _)| name == "__metadata__"));
    if tensor_count > MAX_TENSORS {
        return Err(Error::invalid(format!(
            "the header holds {tensor_count} tensors, more than the limit of {MAX_TENSORS} per file"
        )));
    }
    let mut tensors = Vec::new();
    tensors.try_reserve_exact(tensor_count).map_err(|_| out_of_memory(tensor_count))?;
    let mut metadata = BTreeMap::new();
    let mut seen = HashMap::new();
    seen.try_reserve(entries.kept.len()).map_err(|_| out_of_memory(tensor_count))?;
    for (name, raw) in &entries.kept {
        if seen.insert(name.as_str(), ()).is_some() {
            return Err(bad(name, "the header names it twice"));
        }
        if name == "__metadata__" {
            let value = &entry_value(raw, MAX_METADATA_BYTES, |n| {
                Error::invalid(format!(
                    "`__metadata__` is {n} bytes of JSON, more than the limit of {MAX_METADATA_BYTES}"
                ))
            })?;
            let object = value.as_object().ok_or_else(|| {
                Error::invalid(format!("`__metadata__` is {}, not an object of strings", escaped(value)))
            })?;
            for (k, v) in object {
                let s = v.as_str().ok_or_else(|| {
                    Error::invalid(format!(
                        "`__metadata__.{}` is {}; metadata values must be strings",
                        Escaped(k),
                        escaped(v)
                    ))
                })?;
                metadata.insert(k.clone(), s.to_string());
            }
        } else {
            let value = entry_value(raw, MAX_ENTRY_BYTES, |n| {
                bad(name, format!("its entry is {n} bytes of JSON, more than the limit of {MAX_ENTRY_BYTES}"))
            })?;
            tensors.push(tensor_entry(name, &value)?);
        }
    }
    // The data section is tiled by the tensors in offset order, from 0, without holes or overlaps.
    tensors.sort_by_key(|t| t.data_offsets);
    let mut end = 0u64;
    for (i, t) in tensors.iter().enumerate() {
        let (b, e) = t.data_offsets;
        if b < end {
            let prev = &tensors[i - 1];
            return Err(bad(
                &t.name,
                format!(
                    "`data_offsets` [{b}, {e}] overlap tensor `{}` at [{}, {}]",
                    Escaped(&prev.name),
                    prev.data_offsets.0,
                    prev.data_offsets.1
                ),
            ));
        }
        if b > end {
            let after = if i == 0 {
                "the data section starts at 0".to_string()
            } else {
                format!("the previous tensor `{}` ends at {end}", Escaped(&tensors[i - 1].name))
            };
            return Err(bad(
                &t.name,
                format!(
                    "`data_offsets` [{b}, {e}] begin at {b} but {after}: a hole of {} bytes (the format has none)",
                    b - end
                ),
            ));
        }
        if let Some(size) = file_size.filter(|&s| e > s - data_start) {
            return Err(bad(
                &t.name,
                format!(
                    "its bytes [{}, {}) run past the end of the file ({size} bytes): the file is truncated",
                    data_start + b,
                    data_start + e
                ),
            ));
        }
        end = e;
    }
    if let Some(size) = file_size.filter(|&s| s - data_start > end) {
        return Err(Error::invalid(format!(
            "the file has {size} bytes but its header and tensors end at byte {}: {} bytes after the last tensor",
            data_start + end,
            size - data_start - end
        )));
    }
    let index = tensors.iter().enumerate().map(|(i, t)| (t.name.clone(), i)).collect();
    Ok(Header { data_start, data_bytes: end, tensors, metadata, index })
}

// --- read plans ---------------------------------------------------------------------------

/// How the global tensor is made of checkpoint tensors.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// One checkpoint tensor of the global shape.
    Direct,
    /// Row `e` of the global tensor `[E, R, …]` is the dim-0 concatenation of the sources
    /// `e * parts_per_row .. (e + 1) * parts_per_row`, each `[R_j, …]` with `Σ R_j = R`.
    Stacked { parts_per_row: usize },
}

/// A checkpoint tensor as a source of a read plan: its file (an index the caller chose), the
/// start of that file's data section, and its header entry.
#[derive(Clone, Copy, Debug)]
pub struct Source<'a> {
    pub file: usize,
    pub data_start: u64,
    pub info: &'a TensorInfo,
}

/// `len` bytes at `offset` of file `file` are the bytes at `dst` of the local tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize)]
pub struct ByteRange {
    pub file: usize,
    pub offset: u64,
    pub len: u64,
    pub dst: u64,
}

/// The reads that fill one rank's local tensor (row-major, contiguous, in the checkpoint's
/// dtype): `dst` increases from 0 to `local_bytes` without gaps.
#[derive(Clone, Debug, PartialEq, Eq, Serialize)]
pub struct ReadPlan {
    pub dtype: Dtype,
    pub local_shape: Vec<u64>,
    pub local_bytes: u64,
    pub ranges: Vec<ByteRange>,
}

/// Checks the sources against the global shape and layout; returns their common dtype.
fn check_sources(sources: &[Source], layout: Layout, global_shape: &[u64]) -> Result<Dtype> {
    let first = sources.first().ok_or_else(|| Error::invalid("no source tensor given; give at least one"))?;
    if let Some(other) = sources.iter().find(|s| s.info.dtype != first.info.dtype) {
        return Err(bad(
            &other.info.name,
            format!(
                "its dtype {} differs from {} of `{}`; the tensors of one stack must share a dtype",
                other.info.dtype,
                first.info.dtype,
                Escaped(&first.info.name)
            ),
        ));
    }
    match layout {
        Layout::Direct => {
            if sources.len() != 1 {
                return Err(Error::invalid(format!(
                    "a direct tensor has exactly one source, {} were given",
                    sources.len()
                )));
            }
            if first.info.shape != global_shape {
                return Err(bad(
                    &first.info.name,
                    format!(
                        "its shape is {:?} but the tensor to load has shape {global_shape:?}",
                        first.info.shape
                    ),
                ));
            }
        }
        Layout::Stacked { parts_per_row } => {
            let (&[rows, row_dim, ..], rest) = (global_shape, global_shape.get(2..).unwrap_or(&[])) else {
                return Err(Error::invalid(format!(
                    "a stacked tensor has at least 2 dims [rows, rows_of_each, …], got {global_shape:?}"
                )));
            };
            if parts_per_row == 0 || (sources.len() as u128) != rows as u128 * parts_per_row as u128 {
                return Err(Error::invalid(format!(
                    "a stack of {rows} rows of {parts_per_row} parts needs {} sources, {} were given \
                     (parts_per_row must be >= 1)",
                    rows as u128 * parts_per_row as u128,
                    sources.len()
                )));
            }
            for (e, row) in sources.chunks(parts_per_row).enumerate() {
                let mut sum = 0u64;
                for s in row {
                    let shape = &s.info.shape;
                    if shape.is_empty() || shape[1..] != *rest {
                        return Err(bad(
                            &s.info.name,
                            format!(
                                "its shape is {shape:?} but the parts of row {e} of {global_shape:?} must be \
                                 [n, {}]",
                                rest.iter().map(u64::to_string).collect::<Vec<_>>().join(", ")
                            ),
                        ));
                    }
                    sum = sum.saturating_add(shape[0]);
                }
                if sum != row_dim {
                    let names: Vec<&str> = row.iter().map(|s| s.info.name.as_str()).collect();
                    return Err(Error::invalid(format!(
                        "row {e} of {global_shape:?} has {row_dim} rows but its parts {names:?} hold {sum}"
                    )));
                }
            }
        }
    }
    if first.info.dtype.bits() % 8 != 0 {
        return Err(bad(
            &first.info.name,
            format!(
                "its dtype {} is smaller than a byte; the byte-range planner needs whole bytes",
                first.info.dtype
            ),
        ));
    }
    Ok(first.info.dtype)
}

/// The coordinate of `rank` (row-major over the mesh, as torch's `init_device_mesh` numbers
/// ranks) on a mesh of `mesh_shape`.
pub fn coordinate_of(mesh_shape: &[u64], rank: u64) -> Result<Vec<u64>> {
    let size = mesh_shape.iter().try_fold(1u64, |a, &d| a.checked_mul(d)).unwrap_or(u64::MAX);
    if rank >= size {
        return Err(Error::invalid(format!(
            "`rank` is {rank} but the mesh {mesh_shape:?} has {size} ranks; accepted: 0..{size}"
        )));
    }
    let mut coordinate = vec![0u64; mesh_shape.len()];
    let mut r = rank;
    for k in (0..mesh_shape.len()).rev() {
        coordinate[k] = r % mesh_shape[k];
        r /= mesh_shape[k];
    }
    Ok(coordinate)
}

fn push_range(ranges: &mut Vec<ByteRange>, r: ByteRange) {
    if r.len == 0 {
        return;
    }
    match ranges.last_mut() {
        Some(last)
            if last.file == r.file && last.offset + last.len == r.offset && last.dst + last.len == r.dst =>
        {
            last.len += r.len
        }
        _ => ranges.push(r),
    }
}

/// The byte ranges of `coordinate`'s local slice of the tensor of `global_shape` made of
/// `sources` by `layout`, placed by `placements` on a mesh of `mesh_shape` (torch DTensor's
/// slicing, from [`crate::placement::copy_plan`]). Ranges are in local order, adjacent ones
/// merged (same file, contiguous in the file and in the local tensor). Errors name the tensor:
/// a shape or dtype that does not fit the layout, a sub-byte dtype, a Partial placement, and
/// every error of `copy_plan`.
pub fn read_plan(
    sources: &[Source],
    layout: Layout,
    global_shape: &[u64],
    mesh_shape: &[u64],
    coordinate: &[u64],
    placements: &[Placement],
) -> Result<ReadPlan> {
    let dtype = check_sources(sources, layout, global_shape)?;
    let plan = placement::copy_plan(global_shape, mesh_shape, coordinate, placements).map_err(|e| {
        Error::new(e.kind, format!("tensor `{}`: {}", Escaped(&sources[0].info.name), e.message))
    })?;
    let esize = dtype.bits() / 8;
    let local_bytes = plan.local_numel().checked_mul(esize).ok_or_else(|| {
        Error::new(
            ErrorKind::InvalidArgument,
            format!("the local tensor {:?} has too many bytes", plan.local_shape),
        )
    })?;
    // The global tensor's bytes are the sources' bytes in order: `starts[i]` is where source i begins.
    let mut starts = Vec::with_capacity(sources.len());
    let mut total = 0u64;
    for s in sources {
        starts.push(total);
        total += s.info.nbytes();
    }
    let mut ranges = Vec::new();
    for run in &plan.runs {
        let (mut at, end, mut dst) = (run.src * esize, (run.src + run.len) * esize, run.dst * esize);
        // The last source that begins at or before `at` (zero-byte sources are skipped by the walk).
        let mut i = starts.partition_point(|&s| s <= at) - 1;
        while at < end {
            let s = &sources[i];
            let within = at - starts[i];
            let len = (s.info.nbytes() - within).min(end - at);
            push_range(
                &mut ranges,
                ByteRange { file: s.file, offset: s.data_start + s.info.data_offsets.0 + within, len, dst },
            );
            at += len;
            dst += len;
            i += 1;
        }
    }
    Ok(ReadPlan { dtype, local_shape: plan.local_shape, local_bytes, ranges })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn file(json: &str) -> Vec<u8> {
        let mut out = (json.len() as u64).to_le_bytes().to_vec();
        out.extend_from_slice(json.as_bytes());
        out
    }

    #[test]
    fn coordinate_is_row_major() {
        assert_eq!(coordinate_of(&[2, 3], 4).unwrap(), [1, 1]);
        assert_eq!(coordinate_of(&[], 0).unwrap(), Vec::<u64>::new());
        assert!(coordinate_of(&[2, 3], 6).unwrap_err().message.contains("0..6"));
    }

    #[test]
    fn sub_byte_sizes_are_checked_in_bits() {
        let h = file(r#"{"a":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}}"#);
        let err = parse_header(&h, None).unwrap_err().message;
        assert!(err.contains("12 bits (1.5 bytes)"), "{err}");
        let h = file(r#"{"a":{"dtype":"F4","shape":[4],"data_offsets":[0,2]}}"#);
        assert_eq!(parse_header(&h, None).unwrap().tensors[0].dtype.bits(), 4);
    }
}
