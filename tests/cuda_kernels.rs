//! The CUDA kernels compile through NVRTC (no GPU needed) for sm_80 and sm_90, define every
//! function the launchers resolve, and use 16-byte vector loads where the design says so; NCCL
//! loads and makes unique ids. NVRTC and NCCL come from the directories in
//! FSDPTURBO_TEST_LIBRARY_DIRS (ctest passes the pip wheels' `nvidia/*/lib`); without it these
//! tests say so and pass, and tests/python/test_cuda_backend.py covers the same ground.

use std::path::PathBuf;

use fsdpturbo::backend::add_search_dirs;
use fsdpturbo::backend::cuda::kernels::{DeviceTensor, NORM_CHUNK, SOURCES, compile_all, multi_tensor_table};
use fsdpturbo::backend::cuda::nvrtc::Output;
use fsdpturbo::dtype::Dtype;

fn library_dirs() -> bool {
    let Some(dirs) = std::env::var_os("FSDPTURBO_TEST_LIBRARY_DIRS").filter(|d| !d.is_empty()) else {
        eprintln!("FSDPTURBO_TEST_LIBRARY_DIRS is unset: NVRTC/NCCL checks not run here");
        return false;
    };
    add_search_dirs(std::env::split_paths(&dirs).collect::<Vec<PathBuf>>());
    true
}

#[test]
fn every_kernel_compiles_to_ptx_for_sm80_and_sm90() {
    if !library_dirs() {
        return;
    }
    for arch in [80, 90] {
        let compiled = compile_all(arch, Output::Ptx).unwrap();
        assert_eq!(compiled.len(), SOURCES.len());
        for ((name, ptx), source) in compiled.iter().zip(&SOURCES) {
            let text = String::from_utf8_lossy(ptx);
            assert!(text.contains(&format!(".target sm_{arch}")), "{name}: {}", &text[..200.min(text.len())]);
            for f in source.functions {
                assert!(text.contains(&format!(".entry {f}(")), "{name} for sm_{arch} lacks {f}");
            }
            if *name == "permute" {
                assert!(text.contains("ld.global.nc.v4"), "permute_rows_v16 must use 16-byte loads");
            }
            // Per-thread arrays (the unpermute's accumulators) stay in registers.
            assert!(!text.contains(".local"), "{name} for sm_{arch} uses local memory");
        }
    }
}

#[test]
fn nccl_reports_a_version_and_unique_ids() {
    if !library_dirs() {
        return;
    }
    let nccl = fsdpturbo::backend::cuda::nccl::nccl().unwrap();
    let v = nccl.version().unwrap();
    assert!(v >= 20700, "{v}");
    assert!(fsdpturbo::backend::cuda::nccl::version_string(v).starts_with("2."));
    let (a, b) = (fsdpturbo::comm::nccl::unique_id().unwrap(), fsdpturbo::comm::nccl::unique_id().unwrap());
    assert_ne!(a, b);
}

#[test]
fn the_multi_tensor_table_counts_chunks_per_tensor() {
    let t = |ptr, numel, elem| DeviceTensor { ptr, numel, elem };
    let (words, chunks) = multi_tensor_table(&[
        t(0x1000, NORM_CHUNK + 1, Dtype::Bf16),
        t(0, 0, Dtype::F32),
        t(0x8000, 3, Dtype::F64),
    ])
    .unwrap();
    assert_eq!(chunks, 3);
    assert_eq!(&words[..4], &[0, 2, 2, 3]);
    assert_eq!(&words[4..7], &[0x1000, NORM_CHUNK as u64 + 1, 3]);
    assert_eq!(&words[10..13], &[0x8000, 3, 1]);
    let err = multi_tensor_table(&[t(0x1001, 4, Dtype::F32)]).unwrap_err();
    assert!(err.message.contains("not aligned to its 4-byte element type"), "{}", err.message);
}

#[test]
fn compiled_kernels_are_cached_on_disk_by_source_arch_and_nvrtc_version() {
    if !library_dirs() {
        return;
    }
    let dir = std::env::temp_dir().join(format!("fsdpturbo-kernel-cache-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    // SAFETY: this test binary reads the variable only through compile_cached, here.
    unsafe { std::env::set_var("FSDPTURBO_KERNEL_CACHE", &dir) };
    let nvrtc = fsdpturbo::backend::cuda::nvrtc::nvrtc().unwrap();
    let source = SOURCES[0].source();
    let first = nvrtc.compile_cached(&source, "route", 90, Output::Ptx).unwrap();
    let (major, minor) = nvrtc.version();
    let files: Vec<PathBuf> = std::fs::read_dir(&dir).unwrap().map(|e| e.unwrap().path()).collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let name = files[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("route-") && name.ends_with(&format!("-sm90-nvrtc{major}.{minor}.ptx")),
        "{name}"
    );
    assert_eq!(std::fs::read(&files[0]).unwrap(), first);
    // A second call reads the file (a marker written there comes back) ...
    std::fs::write(&files[0], b"cached").unwrap();
    assert_eq!(nvrtc.compile_cached(&source, "route", 90, Output::Ptx).unwrap(), b"cached");
    // ... and another architecture or source text is another entry.
    nvrtc.compile_cached(&source, "route", 80, Output::Ptx).unwrap();
    nvrtc.compile_cached(&format!("{source}\n// changed\n"), "route", 90, Output::Ptx).unwrap();
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 3);
    std::fs::remove_dir_all(&dir).unwrap();
}
