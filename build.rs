//! Generates the two C headers from `src/ffi`, gives the cdylib its SONAME, says whether rustc
//! can build the AVX-512 GEMM kernel (`cfg(fsdpturbo_avx512)`), and tells the tests the target
//! they are built for and its C compiler (`FSDPTURBO_TARGET`, `FSDPTURBO_TARGET_CC`).
//!
//! cbindgen reads source files, not the crate: `include/fsdpturbo.h` (the public C API) comes from
//! the files directly in `src/ffi/`, and `include/fsdpturbo_internal.h` (the op library's device
//! kernels and the test hooks) from those in `src/ffi/internal/`. Nothing outside `src/ffi` can
//! reach either header, so the vendor constants and types of `src/backend` stay private to the
//! crate however they are declared there (docs/design.md §3). The public header is ordered by
//! topic, in sections with banners (`PUBLIC_SECTIONS`).

use std::path::{Path, PathBuf};

/// The public header's sections, in order: a banner and the files of `src/ffi` whose functions
/// it holds (files of helpers, types and constants only go with the first section). Every file
/// there is in exactly one section; a new one fails the build until it is placed.
const PUBLIC_SECTIONS: &[(&str, &[&str])] = &[
    ("Errors and versions", &["status.rs", "error.rs", "version.rs", "dtype.rs", "handle.rs", "panic.rs"]),
    ("Device libraries: the search path, NVRTC and the CUDA kernels", &["backend.rs", "cuda.rs"]),
    ("Configuration", &["config.rs"]),
    ("Topology and the process-wide parallel state", &["topology.rs", "state.rs"]),
    ("Plans: module patterns, model specs, the expert plan", &["pattern.rs", "spec.rs", "plan.rs"]),
    ("Weights: shard placement and safetensors files", &["placement.rs", "safetensors.rs"]),
    (
        "Host kernels: routing, the grouped GEMM, the instruction set, the threads",
        &["route.rs", "gemm.rs", "host_isa.rs", "host_threads.rs"],
    ),
    ("Gradient norm and clipping", &["norm.rs"]),
    ("Collectives: communicators and NCCL", &["comm.rs", "nccl.rs"]),
    ("Ascend: HCCL and the NPU operators", &["hccl.rs", "npu.rs"]),
    ("The operator registry", &["ops.rs"]),
];

/// The `.rs` files directly in `dir` except `mod.rs` (a module list, no items), sorted so the
/// headers do not depend on the order of the directory.
fn sources(dir: &Path) -> Vec<PathBuf> {
    let mut files: Vec<PathBuf> = std::fs::read_dir(dir)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", dir.display()))
        .map(|entry| entry.expect("a readable directory entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "rs") && !p.ends_with("mod.rs"))
        .collect();
    files.sort();
    files
}

/// The names of the C functions a source file exports, in source order.
fn exported_functions(src: &Path) -> Vec<String> {
    let text = std::fs::read_to_string(src).unwrap_or_else(|e| panic!("cannot read {}: {e}", src.display()));
    text.lines()
        .filter_map(|line| {
            let rest = line.trim_start().strip_prefix("pub ")?;
            let rest = rest.strip_prefix("unsafe ").unwrap_or(rest).strip_prefix("extern \"C\" fn ")?;
            Some(rest.split('(').next()?.trim().to_string())
        })
        .collect()
}

/// `header` with each section's banner above the declaration of the first function of its
/// files (above that function's comment).
fn with_banners(header: &str, sections: &[(&str, Vec<PathBuf>)]) -> String {
    let mut lines: Vec<String> = header.lines().map(str::to_string).collect();
    for (banner, files) in sections {
        let Some(first) = files.iter().flat_map(|f| exported_functions(f)).next() else { continue };
        let call = format!("{first}(");
        let declared = |line: &String| {
            line.starts_with(|c: char| c.is_ascii_alphabetic())
                && line.split_whitespace().any(|w| w.trim_start_matches('*').starts_with(&call))
        };
        let Some(mut at) = lines.iter().position(declared) else { continue };
        while at > 0 && lines[at - 1].starts_with("//") {
            at -= 1;
        }
        let rule = "=".repeat(92);
        let block = [format!("/* {rule}"), format!(" * {banner}"), format!(" * {rule} */"), String::new()];
        lines.splice(at..at, block);
    }
    lines.join("\n") + "\n"
}

/// Writes the header cbindgen makes of `srcs` (with banners when `sections` are given) to
/// `out`, only if its text changed.
fn generate(config: cbindgen::Config, srcs: &[PathBuf], sections: &[(&str, Vec<PathBuf>)], out: &Path) {
    let builder = srcs.iter().fold(cbindgen::Builder::new().with_config(config), |b, src| b.with_src(src));
    match builder.generate() {
        Ok(bindings) => {
            let mut text = Vec::new();
            bindings.write(&mut text);
            let text = with_banners(&String::from_utf8(text).expect("cbindgen writes UTF-8"), sections);
            if std::fs::read_to_string(out).ok().as_deref() != Some(text.as_str()) {
                std::fs::write(out, text).unwrap_or_else(|e| panic!("cannot write {}: {e}", out.display()));
            }
        }
        // A half-edited source tree must still produce rustc's own diagnostics, so a parse
        // failure here is reported as a warning and the committed header is left alone.
        Err(err) => println!("cargo:warning=cbindgen could not regenerate {}: {err}", out.display()),
    }
}

/// The files of `dir` in `PUBLIC_SECTIONS`' order, each section with its files.
fn public_sections(dir: &Path) -> Vec<(&'static str, Vec<PathBuf>)> {
    let listed: Vec<&str> = PUBLIC_SECTIONS.iter().flat_map(|(_, files)| files.iter().copied()).collect();
    for file in sources(dir) {
        let name = file.file_name().and_then(|n| n.to_str()).unwrap_or_default().to_string();
        assert!(
            listed.iter().filter(|l| **l == name).count() == 1,
            "src/ffi/{name} must be in exactly one section of PUBLIC_SECTIONS in build.rs"
        );
    }
    PUBLIC_SECTIONS
        .iter()
        .map(|(banner, files)| (*banner, files.iter().map(|f| dir.join(f)).collect()))
        .collect()
}

fn rustc_minor() -> Option<u32> {
    let out = std::process::Command::new(std::env::var_os("RUSTC")?).arg("--version").output().ok()?;
    String::from_utf8(out.stdout).ok()?.split_whitespace().nth(1)?.split('.').nth(1)?.parse().ok()
}

/// The target's C compiler as cc-rs picks it (`CC_<target>`, `TARGET_CC`, `CC`, else the
/// target's default, e.g. `aarch64-linux-gnu-gcc` when cross-compiling) and its flags for the
/// target (cc-rs's defaults and `CFLAGS`), as one string with the words separated by U+001F. The
/// tests compile the C test doubles (`tests/ascend_double`) with it, so that a cross-built test
/// loads doubles built for its own target.
fn target_c_compiler() -> String {
    let compiler = cc::Build::new().opt_level(0).debug(false).get_compiler();
    std::iter::once(compiler.path().as_os_str())
        .chain(compiler.args().iter().map(|arg| arg.as_os_str()))
        .map(|part| part.to_str().expect("the C compiler command is UTF-8"))
        .collect::<Vec<_>>()
        .join("\u{1f}")
}

fn main() {
    // The GEMM's AVX-512 kernel (x86_64 targets only) needs the AVX-512 intrinsics and target
    // features, stable since Rust 1.89; older compilers (the MSRV is 1.85) build the crate
    // without it.
    println!("cargo:rustc-check-cfg=cfg(fsdpturbo_avx512)");
    let x86_64 = std::env::var("CARGO_CFG_TARGET_ARCH").is_ok_and(|arch| arch == "x86_64");
    if x86_64 && rustc_minor().is_some_and(|minor| minor >= 89) {
        println!("cargo:rustc-cfg=fsdpturbo_avx512");
    }
    println!("cargo:rerun-if-changed=src/ffi");
    println!("cargo:rerun-if-changed=cbindgen.toml");
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libfsdpturbo.so.0");
    // The CLI test runs the target's binary through cargo's runner for that target (tests/cli.rs).
    let target = std::env::var("TARGET").expect("cargo sets TARGET");
    println!("cargo:rustc-env=FSDPTURBO_TARGET={target}");
    println!("cargo:rustc-env=FSDPTURBO_TARGET_CC={}", target_c_compiler());

    let root = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").expect("cargo sets CARGO_MANIFEST_DIR"));
    let public = cbindgen::Config::from_file(root.join("cbindgen.toml")).expect("cbindgen.toml is valid");

    // The internal header: the same conventions, on top of the public one.
    let mut internal = public.clone();
    internal.include_guard = Some("FSDPTURBO_INTERNAL_H".to_string());
    internal.header = Some(
        "/*\n * libfsdpturbo: the internal C entry points, for the torch op library (torch_ext) and the\n \
         * tests only: device kernels on raw device pointers and test hooks. Not installed, no\n \
         * stability promise; C and C++ trainers use fsdpturbo.h.\n *\n \
         * GENERATED by build.rs (cbindgen) from src/ffi/internal/; do not edit by hand.\n */"
            .to_string(),
    );
    internal.includes = vec!["fsdpturbo.h".to_string()];
    internal.after_includes = None;
    internal.export.include.clear();

    let sections = public_sections(&root.join("src/ffi"));
    let public_srcs: Vec<PathBuf> = sections.iter().flat_map(|(_, files)| files.iter().cloned()).collect();
    generate(public, &public_srcs, &sections, &root.join("include/fsdpturbo.h"));
    generate(
        internal,
        &sources(&root.join("src/ffi/internal")),
        &[],
        &root.join("include/fsdpturbo_internal.h"),
    );
}
