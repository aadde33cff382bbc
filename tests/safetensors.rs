//! safetensors headers (valid files and every kind of bad input) and shard-on-read byte plans:
//! the bytes a plan reads from a file equal the copy plan's slice of the full tensor (the
//! placement core, itself checked against torch), for direct tensors and per-expert stacks;
//! and the C ABI.

use std::ffi::{CString, c_char};

use fsdpturbo::ffi::error::fsdpturbo_last_error;
use fsdpturbo::ffi::placement::*;
use fsdpturbo::ffi::safetensors::*;
use fsdpturbo::ffi::status::*;
use fsdpturbo::placement::{Placement, copy_plan};
use fsdpturbo::safetensors::{
    Layout, MAX_DIMS, MAX_ENTRY_BYTES, MAX_HEADER_BYTES, MAX_METADATA_BYTES, MAX_TENSORS, Source,
    header_size, parse_header, read_plan,
};

use Placement::{Replicate, Shard};

// --- writing files -----------------------------------------------------------------------

/// A tensor to write: name, dtype, bits per element, shape.
struct T<'a>(&'a str, &'a str, u64, Vec<u64>);

/// A safetensors file of `tensors` (written in the given order, data = a byte counter so
/// every byte is distinct modulo 251), and its data section.
fn write(tensors: &[T]) -> Vec<u8> {
    let mut entries = Vec::new();
    let mut at = 0u64;
    for T(name, dtype, bits, shape) in tensors {
        let n = shape.iter().product::<u64>() * bits / 8;
        entries.push(format!(
            r#""{name}":{{"dtype":"{dtype}","shape":{shape:?},"data_offsets":[{at},{}]}}"#,
            at + n
        ));
        at += n;
    }
    let mut json = format!("{{{},\"__metadata__\":{{\"format\":\"pt\"}}}}", entries.join(","));
    while json.len() % 8 != 0 {
        json.push(' '); // the format's alignment padding
    }
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(json.as_bytes());
    out.extend((0..at).map(|i| (i % 251) as u8));
    out
}

fn raw(json: &str, data: usize) -> Vec<u8> {
    let mut out = (json.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(json.as_bytes());
    out.extend(std::iter::repeat_n(0u8, data));
    out
}

fn err(bytes: &[u8], file_size: Option<u64>) -> String {
    parse_header(bytes, file_size).expect_err("must be refused").message
}

fn entry(name: &str, dtype: &str, shape: &str, offsets: &str) -> String {
    format!(r#""{name}":{{"dtype":"{dtype}","shape":{shape},"data_offsets":{offsets}}}"#)
}

// --- headers -----------------------------------------------------------------------------

#[test]
fn parses_a_valid_header() {
    let f = write(&[T("b", "BF16", 16, vec![2, 3]), T("a", "F32", 32, vec![4]), T("s", "I64", 64, vec![])]);
    let h = parse_header(&f, Some(f.len() as u64)).unwrap();
    assert_eq!(h.file_size(), f.len() as u64);
    assert_eq!(h.data_bytes, 12 + 16 + 8);
    assert_eq!(h.data_start, header_size(&f).unwrap());
    let names: Vec<&str> = h.tensors.iter().map(|t| t.name.as_str()).collect();
    assert_eq!(names, ["b", "a", "s"], "file order");
    let a = h.get("a").unwrap();
    assert_eq!((a.dtype.name(), a.shape.clone(), a.data_offsets), ("F32", vec![4], (12, 28)));
    assert_eq!(h.metadata["format"], "pt");
    assert!(h.get("zz").is_none());
    // Only the header is needed (file size unknown), and extra bytes are ignored.
    let prefix = &f[..h.data_start as usize];
    assert_eq!(parse_header(prefix, None).unwrap().tensors, h.tensors);
    // Empty and zero-size tensors are fine, also at the same offset.
    let f = write(&[T("e", "F32", 32, vec![0, 3]), T("z", "U8", 8, vec![0]), T("x", "U8", 8, vec![2])]);
    assert_eq!(parse_header(&f, Some(f.len() as u64)).unwrap().tensors.len(), 3);
    assert_eq!(parse_header(&raw("{}", 0), Some(10)).unwrap().tensors.len(), 0);
    let json = h.to_json();
    assert_eq!(json["tensors"][1]["data_offsets"], serde_json::json!([12, 28]));
}

#[test]
fn refuses_bad_lengths_and_json() {
    assert!(header_size(&[1, 2, 3]).unwrap_err().message.contains("only 3 bytes"));
    let huge = (MAX_HEADER_BYTES + 1).to_le_bytes();
    assert!(header_size(&huge).unwrap_err().message.contains("limit"));
    assert!(err(&raw("{}", 0)[..9], None).contains("only 9 were given"));
    assert!(err(&raw("{\"a\": 1", 0), None).contains("not a valid JSON object"));
    assert!(err(&raw("[1, 2]", 0), None).contains("not a valid JSON object"));
    assert!(err(&raw("{}", 0), Some(9)).contains("truncated: it has 9 bytes but its header needs 10"));
    let e = err(
        &raw(&format!("{{{},{}}}", entry("a", "U8", "[1]", "[0,1]"), entry("a", "U8", "[1]", "[1,2]")), 2),
        None,
    );
    assert!(e.contains("tensor `a`: the header names it twice"), "{e}");
    let e = err(&raw(r#"{"__metadata__": {"k": 1}}"#, 0), None);
    assert!(e.contains("`__metadata__.k` is 1"), "{e}");
}

/// A small header cannot make the parser do unbounded work: tensors per file, dims per tensor,
/// bytes per entry and of the metadata are capped, each an error naming the limit.
#[test]
fn refuses_headers_beyond_the_limits() {
    let many: Vec<String> = (0..=MAX_TENSORS)
        .map(|i| entry(&format!("t{i}"), "U8", "[1]", &format!("[{i},{}]", i + 1)))
        .collect();
    let e = err(&raw(&format!("{{{}}}", many.join(",")), MAX_TENSORS + 1), None);
    assert_eq!(
        e,
        format!(
            "the header holds {} tensors, more than the limit of {MAX_TENSORS} per file",
            MAX_TENSORS + 1
        )
    );
    let at_the_limit = &many[..MAX_TENSORS];
    assert_eq!(
        parse_header(&raw(&format!("{{{}}}", at_the_limit.join(",")), MAX_TENSORS), None)
            .unwrap()
            .tensors
            .len(),
        MAX_TENSORS
    );

    let dims = format!("{:?}", vec![1u64; MAX_DIMS + 1]);
    let e = err(&raw(&format!("{{{}}}", entry("w", "U8", &dims, "[0,1]")), 1), None);
    assert_eq!(
        e,
        format!("tensor `w`: its shape has {} dims, more than the limit of {MAX_DIMS}", MAX_DIMS + 1)
    );

    let long = format!("[{}1]", "1,".repeat(MAX_ENTRY_BYTES / 2));
    let e = err(&raw(&format!("{{{}}}", entry("w", "U8", &long, "[0,1]")), 1), None);
    assert!(
        e.starts_with("tensor `w`: its entry is ")
            && e.ends_with(&format!("more than the limit of {MAX_ENTRY_BYTES}")),
        "{e}"
    );

    let metadata = format!(r#"{{"__metadata__": {{"k": "{}"}}}}"#, "x".repeat(MAX_METADATA_BYTES));
    let e = err(&raw(&metadata, 0), None);
    assert!(e.ends_with(&format!("bytes of JSON, more than the limit of {MAX_METADATA_BYTES}")), "{e}");
}

#[test]
fn refuses_bad_entries_naming_the_tensor() {
    let one = |e: String| err(&raw(&format!("{{{e}}}"), 64), None);
    let e = one(entry("w", "BF17", "[2]", "[0,4]"));
    assert!(e.starts_with("tensor `w`: dtype \"BF17\" is not a safetensors dtype; accepted: BOOL"), "{e}");
    let e = one(entry("w", "BF16", "[2, -1]", "[0,4]"));
    assert!(e.contains("tensor `w`: `shape[1]` is -1"), "{e}");
    let e = one(entry("w", "BF16", "[2]", "[0]"));
    assert!(e.contains("tensor `w`: `data_offsets` has 1 entries"), "{e}");
    let e = one(entry("w", "BF16", "[2]", "[4,0]"));
    assert!(e.contains("end before they begin"), "{e}");
    let e = one(entry("w", "BF16", "[2, 3]", "[0,10]"));
    assert!(
        e.contains(
            "tensor `w`: shape [2, 3] of BF16 is 96 bits (12 bytes) but `data_offsets` [0, 10] span 10"
        ),
        "{e}"
    );
    let e = one(r#""w":{"dtype":"U8","shape":[1],"data_offsets":[0,1],"extra":1}"#.into());
    assert!(e.contains("tensor `w`: unknown field `extra`"), "{e}");
    let e = one(r#""w":{"dtype":"U8","shape":[1]}"#.into());
    assert!(e.contains("tensor `w`: the entry has no `data_offsets`"), "{e}");
    let e = one(r#""w":[1]"#.into());
    assert!(e.contains("tensor `w`: the entry is [1], not an object"), "{e}");
    let e = one(entry("w", "U8", "[4294967296, 4294967296, 4294967296]", "[0,1]"));
    assert!(e.contains("more than"), "{e}");
}

#[test]
fn refuses_overlaps_holes_and_files_of_the_wrong_size() {
    let two = |a: &str, b: &str| format!("{{{},{}}}", entry("a", "U8", "[4]", a), entry("b", "U8", "[4]", b));
    let e = err(&raw(&two("[0,4]", "[2,6]"), 6), None);
    assert!(e.contains("tensor `b`: `data_offsets` [2, 6] overlap tensor `a` at [0, 4]"), "{e}");
    let e = err(&raw(&two("[0,4]", "[6,10]"), 10), None);
    assert!(
        e.contains(
            "tensor `b`: `data_offsets` [6, 10] begin at 6 but the previous tensor `a` ends at 4: a hole of 2"
        ),
        "{e}"
    );
    let e = err(&raw(&two("[2,6]", "[6,10]"), 10), None);
    assert!(
        e.contains("tensor `a`: `data_offsets` [2, 6] begin at 2 but the data section starts at 0"),
        "{e}"
    );
    // Truncated: the first tensor that runs past the end is named.
    let f = write(&[T("a", "F32", 32, vec![4]), T("b", "F32", 32, vec![4]), T("c", "F32", 32, vec![4])]);
    let start = header_size(&f).unwrap();
    let cut = start + 20;
    let e = err(&f[..cut as usize], Some(cut));
    assert_eq!(
        e,
        format!(
            "tensor `b`: its bytes [{}, {}) run past the end of the file ({cut} bytes): the file is truncated",
            start + 16,
            start + 32
        )
    );
    let e = err(&f, Some(f.len() as u64 + 3));
    assert!(e.contains("3 bytes after the last tensor"), "{e}");
}

// --- read plans ----------------------------------------------------------------------------

fn ss(dim: usize, split_factor: u64) -> Placement {
    Placement::StridedShard { dim, split_factor }
}

/// The bytes a read plan gathers from `files` (index = `ByteRange::file`).
fn gather(files: &[&[u8]], ranges: &[fsdpturbo::safetensors::ByteRange], local_bytes: u64) -> Vec<u8> {
    let mut out = vec![0u8; local_bytes as usize];
    let mut next = 0u64;
    for r in ranges {
        assert_eq!(r.dst, next, "ranges fill the local tensor in order without gaps");
        let f = files[r.file];
        out[r.dst as usize..(r.dst + r.len) as usize]
            .copy_from_slice(&f[r.offset as usize..(r.offset + r.len) as usize]);
        next += r.len;
    }
    assert_eq!(next, local_bytes);
    for w in ranges.windows(2) {
        let (a, b) = (w[0], w[1]);
        assert!(
            !(a.file == b.file && a.offset + a.len == b.offset),
            "contiguous ranges are merged: {a:?} {b:?}"
        );
    }
    out
}

/// The expected local bytes: the copy plan applied to the full tensor's bytes (element size `e`).
fn expected(
    full: &[u8],
    e: u64,
    shape: &[u64],
    mesh: &[u64],
    coord: &[u64],
    placements: &[Placement],
) -> Vec<u8> {
    let plan = copy_plan(shape, mesh, coord, placements).unwrap();
    let mut out = vec![0u8; (plan.local_numel() * e) as usize];
    fsdpturbo::placement::copy_runs_bytes(&plan, e as usize, full, &mut out).unwrap();
    out
}

fn coords(mesh: &[u64]) -> Vec<Vec<u64>> {
    let n: u64 = mesh.iter().product();
    (0..n).map(|r| fsdpturbo::safetensors::coordinate_of(mesh, r).unwrap()).collect()
}

#[test]
fn direct_plans_read_the_copy_plan_slice() {
    let cases: Vec<(Vec<u64>, Vec<u64>, Vec<Placement>)> = vec![
        (vec![10, 6], vec![4], vec![Shard(0)]), // uneven, one block per rank
        (vec![3, 5], vec![4], vec![Shard(0)]),  // an empty shard
        (vec![10, 6], vec![2, 3], vec![Shard(1), Shard(0)]), // rows
        (vec![8, 4, 3], vec![2, 2], vec![Shard(0), ss(0, 2)]), // _StridedShard
        (vec![7], vec![2, 2], vec![Replicate, Shard(0)]),
        (vec![], vec![3], vec![Replicate]),    // a scalar
        (vec![0, 4], vec![2], vec![Shard(1)]), // no elements
    ];
    for (shape, mesh, placements) in cases {
        let f =
            write(&[T("pad", "U8", 8, vec![5]), T("w", "BF16", 16, shape.clone()), T("z", "U8", 8, vec![3])]);
        let h = parse_header(&f, Some(f.len() as u64)).unwrap();
        let info = h.get("w").unwrap();
        let start = (h.data_start + info.data_offsets.0) as usize;
        let full = &f[start..start + info.nbytes() as usize];
        for c in coords(&mesh) {
            let src = [Source { file: 0, data_start: h.data_start, info }];
            let plan = read_plan(&src, Layout::Direct, &shape, &mesh, &c, &placements).unwrap();
            let got = gather(&[&f], &plan.ranges, plan.local_bytes);
            assert_eq!(
                got,
                expected(full, 2, &shape, &mesh, &c, &placements),
                "{shape:?} {mesh:?} {c:?} {placements:?}"
            );
        }
    }
}

#[test]
fn stacked_plans_read_per_expert_tensors_across_files() {
    // gate_up_proj [E=5, 2I=6, H=4] from experts.{e}.gate_proj [3,4] + up_proj [3,4]; down_proj
    // [5, 4, 3] from experts.{e}.down_proj; experts split over two files, HF's key order.
    let (e_n, i, hd) = (5u64, 3u64, 4u64);
    let mut files: Vec<Vec<u8>> = Vec::new();
    for part in [0..3u64, 3..5] {
        let mut ts = Vec::new();
        for e in part {
            for p in ["down_proj", "gate_proj", "up_proj"] {
                let shape = if p == "down_proj" { vec![hd, i] } else { vec![i, hd] };
                ts.push((format!("experts.{e}.{p}.weight"), shape));
            }
        }
        let ts: Vec<T> = ts.iter().map(|(n, s)| T(n, "F16", 16, s.clone())).collect();
        let mut f = write(&ts);
        let start = header_size(&f).unwrap() as usize;
        let salt = files.len() as u8 * 101;
        for b in &mut f[start..] {
            *b = b.wrapping_add(salt); // the two files' data differ
        }
        files.push(f);
    }
    let headers: Vec<_> = files.iter().map(|f| parse_header(f, Some(f.len() as u64)).unwrap()).collect();
    let find = |name: &str| {
        headers
            .iter()
            .enumerate()
            .find_map(|(k, h)| h.get(name).map(|info| Source { file: k, data_start: h.data_start, info }))
            .unwrap()
    };
    let bytes_of = |s: &Source| {
        let f = &files[s.file];
        let a = (s.data_start + s.info.data_offsets.0) as usize;
        f[a..a + s.info.nbytes() as usize].to_vec()
    };
    for (parts, shape) in
        [(vec!["gate_proj", "up_proj"], vec![e_n, 2 * i, hd]), (vec!["down_proj"], vec![e_n, hd, i])]
    {
        let sources: Vec<Source> = (0..e_n)
            .flat_map(|e| parts.iter().map(move |p| format!("experts.{e}.{p}.weight")))
            .map(|n| find(&n))
            .collect();
        let full: Vec<u8> = sources.iter().flat_map(&bytes_of).collect();
        let layouts: Vec<(Vec<u64>, Vec<Placement>)> = vec![
            (vec![2], vec![Shard(0)]),
            (vec![4], vec![Shard(0)]),
            (vec![2, 2], vec![Shard(0), Shard(1)]),
            (vec![3, 2], vec![Shard(1), Shard(0)]),
            (vec![2, 2], vec![Shard(0), ss(0, 2)]),
            (vec![2], vec![Shard(2)]),
            (vec![1], vec![Replicate]),
        ];
        for (mesh, placements) in layouts {
            for c in coords(&mesh) {
                let layout = Layout::Stacked { parts_per_row: parts.len() };
                let plan = read_plan(&sources, layout, &shape, &mesh, &c, &placements).unwrap();
                let refs: Vec<&[u8]> = files.iter().map(|f| f.as_slice()).collect();
                let got = gather(&refs, &plan.ranges, plan.local_bytes);
                assert_eq!(
                    got,
                    expected(&full, 2, &shape, &mesh, &c, &placements),
                    "{parts:?} {mesh:?} {c:?} {placements:?}"
                );
            }
        }
        // Shard(0) over 5 experts on 5 ranks: gate and up of one expert are adjacent in the file: one read.
        if parts.len() == 2 {
            let plan =
                read_plan(&sources, Layout::Stacked { parts_per_row: 2 }, &shape, &[5], &[1], &[Shard(0)])
                    .unwrap();
            assert_eq!(plan.ranges.len(), 1, "{:?}", plan.ranges);
        }
    }
}

#[test]
fn plans_refuse_sources_that_do_not_fit() {
    let f = write(&[
        T("a", "BF16", 16, vec![2, 4]),
        T("b", "BF16", 16, vec![1, 4]),
        T("c", "F32", 32, vec![1, 4]),
        T("d", "BF16", 16, vec![1, 3]),
        T("q", "F4", 4, vec![2, 2]),
    ]);
    let h = parse_header(&f, None).unwrap();
    let s = |n: &str| Source { file: 0, data_start: h.data_start, info: h.get(n).unwrap() };
    let msg = |srcs: &[Source], layout, shape: &[u64], p: &[Placement]| {
        read_plan(srcs, layout, shape, &[2], &[0], p).unwrap_err().message
    };
    let direct = Layout::Direct;
    let e = msg(&[s("a")], direct, &[4, 2], &[Shard(0)]);
    assert_eq!(e, "tensor `a`: its shape is [2, 4] but the tensor to load has shape [4, 2]");
    let e = msg(&[s("a"), s("b")], direct, &[2, 4], &[Shard(0)]);
    assert!(e.contains("exactly one source"), "{e}");
    let stacked = Layout::Stacked { parts_per_row: 2 };
    let e = msg(&[s("b"), s("c")], stacked, &[1, 2, 4], &[Shard(0)]);
    assert!(e.contains("tensor `c`: its dtype F32 differs from BF16 of `b`"), "{e}");
    let e = msg(&[s("b"), s("d")], stacked, &[1, 2, 4], &[Shard(0)]);
    assert!(e.contains("tensor `d`: its shape is [1, 3] but the parts of row 0"), "{e}");
    let e = msg(&[s("a"), s("b")], stacked, &[1, 2, 4], &[Shard(0)]);
    assert!(e.contains("row 0 of [1, 2, 4] has 2 rows but its parts [\"a\", \"b\"] hold 3"), "{e}");
    let e = msg(&[s("a"), s("b")], stacked, &[2, 2, 4], &[Shard(0)]);
    assert!(e.contains("needs 4 sources, 2 were given"), "{e}");
    let e = msg(&[s("q")], direct, &[2, 2], &[Shard(0)]);
    assert!(e.contains("tensor `q`: its dtype F4 is smaller than a byte"), "{e}");
    let e = msg(&[s("a")], direct, &[2, 4], &[Placement::Partial]);
    assert!(e.starts_with("tensor `a`: `placements[0]` is Partial()"), "{e}");
    let e = msg(&[s("a")], direct, &[2, 4], &[Shard(2)]);
    assert!(e.starts_with("tensor `a`: `placements[0]` is Shard(dim=2)"), "{e}");
}

// --- C ABI -------------------------------------------------------------------------------

fn last_error() -> String {
    let mut buf = vec![0 as c_char; 512];
    let n = fsdpturbo_last_error(buf.as_mut_ptr(), buf.len());
    let bytes: Vec<u8> = buf[..n.min(511)].iter().map(|&c| c as u8).collect();
    String::from_utf8(bytes).unwrap()
}

fn shard(dim: i64) -> fsdpturbo_placement_t {
    fsdpturbo_placement_t { kind: FSDPTURBO_PLACEMENT_SHARD, dim, split_factor: 0 }
}

/// fsdpturbo_safetensors_read_plan_new on a 1-D mesh of 2 ranks; a plan made is freed.
fn plan_on_2(
    files: &[*const fsdpturbo_safetensors_t],
    names: &[*const c_char],
    parts_per_row: usize,
    shape: &[u64],
    placement: fsdpturbo_placement_t,
    rank: u64,
) -> i32 {
    let mut plan = std::ptr::null_mut();
    let status = fsdpturbo_safetensors_read_plan_new(
        files.as_ptr(),
        files.len(),
        names.as_ptr(),
        names.len(),
        parts_per_row,
        shape.as_ptr(),
        shape.len(),
        [2u64].as_ptr(),
        1,
        &placement,
        rank,
        &mut plan,
    );
    fsdpturbo_read_plan_free(plan);
    status
}

#[test]
fn c_abi_parses_and_plans() {
    let f = write(&[
        T("e.0.g", "BF16", 16, vec![2, 3]),
        T("e.0.u", "BF16", 16, vec![2, 3]),
        T("e.1.g", "BF16", 16, vec![2, 3]),
        T("e.1.u", "BF16", 16, vec![2, 3]),
    ]);
    let mut size = 0u64;
    assert_eq!(fsdpturbo_safetensors_header_size(f.as_ptr(), 8, &mut size), 0);
    assert_eq!(
        fsdpturbo_safetensors_header_size(f.as_ptr(), 7, &mut size),
        FSDPTURBO_ERR_INVALID_ARGUMENT as i32
    );
    let mut file = std::ptr::null_mut();
    assert_eq!(fsdpturbo_safetensors_parse(f.as_ptr(), size as usize, f.len() as u64, &mut file), 0);
    let mut bad = std::ptr::null_mut();
    assert_eq!(
        fsdpturbo_safetensors_parse(f.as_ptr(), size as usize, f.len() as u64 - 1, &mut bad),
        FSDPTURBO_ERR_INVALID_ARGUMENT as i32
    );
    assert!(
        last_error().contains("tensor `e.1.u`") && last_error().contains("truncated"),
        "{}",
        last_error()
    );
    assert!(bad.is_null());
    assert_eq!(
        fsdpturbo_safetensors_parse(std::ptr::null(), 8, 0, &mut bad),
        FSDPTURBO_ERR_NULL_ARGUMENT as i32
    );

    let files = [file.cast_const()];
    let names: Vec<CString> =
        ["e.0.g", "e.0.u", "e.1.g", "e.1.u"].iter().map(|s| CString::new(*s).unwrap()).collect();
    let ptrs: Vec<*const c_char> = names.iter().map(|s| s.as_ptr()).collect();
    let shape = [2u64, 4, 3];
    let mesh = [2u64];
    let placements = [shard(0)];
    let mut plan = std::ptr::null_mut();
    let status = fsdpturbo_safetensors_read_plan_new(
        files.as_ptr(),
        1,
        ptrs.as_ptr(),
        4,
        2,
        shape.as_ptr(),
        3,
        mesh.as_ptr(),
        1,
        placements.as_ptr(),
        1,
        &mut plan,
    );
    assert_eq!(status, 0, "{}", last_error());
    let mut n = 0usize;
    assert_eq!(
        fsdpturbo_read_plan_ranges(plan, std::ptr::null_mut(), 0, &mut n),
        FSDPTURBO_ERR_BUFFER_TOO_SMALL as i32
    );
    assert_eq!(n, 1);
    let mut ranges = [fsdpturbo_byte_range_t::default(); 1];
    assert_eq!(fsdpturbo_read_plan_ranges(plan, ranges.as_mut_ptr(), 1, &mut n), 0);
    assert_eq!(ranges[0], fsdpturbo_byte_range_t { file: 0, offset: size + 24, length: 24, dst_offset: 0 });
    let mut local = [0u64; 3];
    assert_eq!(fsdpturbo_read_plan_local_shape(plan, local.as_mut_ptr(), 3, &mut n), 0);
    assert_eq!((local, n), ([1, 4, 3], 3));
    let mut bytes = 0u64;
    assert_eq!(fsdpturbo_read_plan_local_bytes(plan, &mut bytes), 0);
    assert_eq!(bytes, 24);
    let mut dtype = [0 as c_char; 8];
    assert_eq!(fsdpturbo_read_plan_dtype(plan, dtype.as_mut_ptr(), 8, &mut n), 0);
    assert_eq!((dtype[0] as u8, dtype[3] as u8, n), (b'B', b'6', 5));
    fsdpturbo_read_plan_free(plan);

    // Errors: a missing name, a rank outside the mesh, names for a direct tensor, a bad placement.
    let missing = CString::new("nope").unwrap();
    let s2 = [2u64, 3];
    assert_eq!(plan_on_2(&files, &[missing.as_ptr()], 0, &s2, shard(0), 0), FSDPTURBO_ERR_NOT_FOUND as i32);
    assert_eq!(last_error(), "tensor `nope` is in none of the 1 files given");
    assert_eq!(plan_on_2(&files, &ptrs[..1], 0, &s2, shard(0), 2), FSDPTURBO_ERR_INVALID_ARGUMENT as i32);
    assert!(last_error().contains("`rank` is 2 but the mesh [2] has 2 ranks"), "{}", last_error());
    assert_eq!(plan_on_2(&files, &ptrs[..2], 0, &s2, shard(0), 0), FSDPTURBO_ERR_INVALID_ARGUMENT as i32);
    assert!(
        last_error().contains("`parts_per_row` is 0 (one checkpoint tensor) but 2 names"),
        "{}",
        last_error()
    );
    let bad_placement = fsdpturbo_placement_t { kind: 7, dim: 0, split_factor: 0 };
    assert_eq!(
        plan_on_2(&files, &ptrs[..1], 0, &s2, bad_placement, 0),
        FSDPTURBO_ERR_INVALID_ARGUMENT as i32
    );
    assert!(last_error().contains("`placements[0].kind` is 7"), "{}", last_error());
    // The same file twice: every name is ambiguous.
    let twice = [file.cast_const(), file.cast_const()];
    assert_eq!(plan_on_2(&twice, &ptrs[..1], 0, &s2, shard(0), 0), FSDPTURBO_ERR_INVALID_ARGUMENT as i32);
    assert!(last_error().contains("is in files[0] and files[1]"), "{}", last_error());

    let mut len = 0usize;
    assert_eq!(
        fsdpturbo_safetensors_to_json(file, std::ptr::null_mut(), 0, &mut len),
        FSDPTURBO_ERR_BUFFER_TOO_SMALL as i32
    );
    let mut buf = vec![0 as c_char; len];
    assert_eq!(fsdpturbo_safetensors_to_json(file, buf.as_mut_ptr(), len, &mut len), 0);
    let text: String = buf[..len - 1].iter().map(|&c| c as u8 as char).collect();
    let v: serde_json::Value = serde_json::from_str(&text).unwrap();
    assert_eq!(v["tensors"][3]["name"], "e.1.u");
    fsdpturbo_safetensors_free(file);
    fsdpturbo_safetensors_free(std::ptr::null_mut());
    fsdpturbo_read_plan_free(std::ptr::null_mut());
}

/// The tensors without JSON: names concatenated, and per tensor its name's length in characters,
/// its first byte in the file, its dims.
#[test]
fn c_abi_lists_names_and_layout() {
    let f = write(&[T("a", "F32", 32, vec![2, 3]), T("é.ü", "BF16", 16, vec![4]), T("s", "U8", 8, vec![])]);
    let mut file = std::ptr::null_mut();
    assert_eq!(fsdpturbo_safetensors_parse(f.as_ptr(), f.len(), f.len() as u64, &mut file), 0);
    let data_start = header_size(&f).unwrap();

    let mut len = 0usize;
    assert_eq!(
        fsdpturbo_safetensors_tensor_names(file, std::ptr::null_mut(), 0, &mut len),
        FSDPTURBO_ERR_BUFFER_TOO_SMALL as i32
    );
    let mut buf = vec![0 as c_char; len];
    assert_eq!(fsdpturbo_safetensors_tensor_names(file, buf.as_mut_ptr(), len, &mut len), 0);
    let names = String::from_utf8(buf[..len - 1].iter().map(|&c| c as u8).collect()).unwrap();
    assert_eq!(names, "aé.üs");

    let mut n = 0usize;
    assert_eq!(
        fsdpturbo_safetensors_tensor_layout(file, std::ptr::null_mut(), 0, &mut n),
        FSDPTURBO_ERR_BUFFER_TOO_SMALL as i32
    );
    let mut layout = vec![0u64; n];
    assert_eq!(fsdpturbo_safetensors_tensor_layout(file, layout.as_mut_ptr(), n, &mut n), 0);
    let s = data_start;
    assert_eq!(layout, [1, s, 2, 2, 3, 3, s + 24, 1, 4, 1, s + 32, 0]);
    fsdpturbo_safetensors_free(file);
}
