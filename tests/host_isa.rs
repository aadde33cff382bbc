//! The host kernels' instruction set end to end, through the C API: which one a process uses
//! (`fsdpturbo_host_isa`) and what five kernel calls return (a digest of their output bits, or
//! the error). This test binary runs itself again with FSDPTURBO_HOST_ISA set (the `child`
//! test) to see the variable act, and checks the bits against those every machine must give.

use std::ffi::{CStr, c_void};

use fsdpturbo::dtype::{f32_to_bf16, f32_to_f16};
use fsdpturbo::ffi::dtype::*;
use fsdpturbo::ffi::gemm::{fsdpturbo_grouped_mm, fsdpturbo_grouped_mm_grad_weight};
use fsdpturbo::ffi::host_isa::fsdpturbo_host_isa;
use fsdpturbo::ffi::norm::{fsdpturbo_grad_t, fsdpturbo_local_power_sum, fsdpturbo_scale_in_place};
use fsdpturbo::ffi::route::fsdpturbo_unpermute;
use fsdpturbo::ffi::status::Status;
use fsdpturbo::host::Isa;

mod common;
use common::{Rng, last_error};

/// What the kernels below give on every path of every machine (x86-64 AVX-512, AVX2 and the
/// portable loops, and aarch64 under qemu, when this was written).
const EVERY_MACHINE: [(&str, &str); 5] = [
    ("grouped_mm", "FSDPTURBO_OK 0df6eb8f2cbcf128"),
    ("grouped_mm_grad_weight", "FSDPTURBO_OK ec558b3bfbe98c22"),
    ("unpermute", "FSDPTURBO_OK c134a38ffdb118e7"),
    ("local_power_sum", "FSDPTURBO_OK 1af8eb06f6681995"),
    ("scale_in_place", "FSDPTURBO_OK 452cad9cb0b1169e"),
];

/// Set in the child's environment: `child` does its work only there.
const CHILD: &str = "FSDPTURBO_TEST_HOST_ISA_CHILD";

/// `STATUS text`: on success `text` is `ok()`, else the last error.
fn outcome(status: i32, ok: impl FnOnce() -> String) -> String {
    let status_name = Status::from_code(status).map_or(format!("{status}"), |s| format!("{s:?}"));
    let text = if status == Status::FSDPTURBO_OK { ok() } else { last_error() };
    format!("{status_name} {text}")
}

/// FNV-1a over the values' little-endian bytes (a digest no Rust release changes).
fn digest<const N: usize>(values: impl IntoIterator<Item = [u8; N]>) -> String {
    let hash = values
        .into_iter()
        .flatten()
        .fold(0xcbf2_9ce4_8422_2325u64, |h, byte| (h ^ u64::from(byte)).wrapping_mul(0x0000_0100_0000_01b3));
    format!("{hash:016x}")
}

fn grad(data: *mut c_void, numel: usize, dtype: i32) -> fsdpturbo_grad_t {
    let null = std::ptr::null();
    let mut_data = data;
    fsdpturbo_grad_t {
        data: null,
        mut_data,
        numel,
        dtype,
        dims: std::ptr::null(),
        roles: std::ptr::null(),
        n_dims: 0,
    }
}

/// The instruction set this process reports, as `STATUS name-or-error`.
fn host_isa() -> String {
    let mut name = std::ptr::null();
    let status = fsdpturbo_host_isa(&mut name);
    // SAFETY: on success the library wrote a static NUL-terminated string.
    outcome(status, || unsafe { CStr::from_ptr(name) }.to_str().unwrap().to_string())
}

/// What five host kernel calls give in this process, by name.
fn kernel_reports() -> Vec<(&'static str, String)> {
    let mut rng = Rng(7);
    // Exactly representable inputs: the same on every machine.
    let mut values = |n: usize| (0..n).map(|_| rng.unit() as f32).collect::<Vec<f32>>();
    let mut reports = Vec::new();

    // Edge tiles, an empty group and a depth above the K block.
    let (counts, i, o) = ([70u64, 0, 33], 300, 50);
    let n = counts.iter().sum::<u64>() as usize;
    let (x, w) = (values(n * i), values(counts.len() * o * i));
    let mut y = vec![0f32; n * o];
    let bytes = |v: &[f32]| 4 * v.len();
    let status = fsdpturbo_grouped_mm(
        FSDPTURBO_DTYPE_F32,
        x.as_ptr().cast(),
        bytes(&x),
        counts.as_ptr(),
        counts.len(),
        i,
        o,
        w.as_ptr().cast(),
        bytes(&w),
        y.as_mut_ptr().cast(),
        bytes(&y),
    );
    reports.push(("grouped_mm", outcome(status, || digest(y.iter().map(|v| v.to_le_bytes())))));

    // bf16, accumulated in f32 over each group's rows (70: a depth below the K block).
    let halve = |v: &[f32]| v.iter().map(|&f| f32_to_bf16(f)).collect::<Vec<u16>>();
    let (gy, xb) = (halve(&values(n * o)), halve(&x));
    let mut gw = vec![0u16; counts.len() * o * i];
    let status = fsdpturbo_grouped_mm_grad_weight(
        FSDPTURBO_DTYPE_BF16,
        gy.as_ptr().cast(),
        2 * gy.len(),
        xb.as_ptr().cast(),
        2 * xb.len(),
        counts.as_ptr(),
        counts.len(),
        i,
        o,
        gw.as_mut_ptr().cast(),
        2 * gw.len(),
    );
    reports.push(("grouped_mm_grad_weight", outcome(status, || digest(gw.iter().map(|v| v.to_le_bytes())))));

    let (tokens, top_k, hidden) = (40, 2, 37);
    let (permuted, probs) = (values(tokens * top_k * hidden), values(tokens * top_k));
    let slots = (tokens * top_k) as u64;
    let permutation: Vec<u64> = (0..slots).map(|s| s * 7 % slots).collect();
    let mut out = vec![0f32; tokens * hidden];
    let status = fsdpturbo_unpermute(
        FSDPTURBO_DTYPE_F32,
        permuted.as_ptr().cast(),
        bytes(&permuted),
        hidden,
        permutation.as_ptr(),
        tokens,
        top_k,
        probs.as_ptr().cast(),
        bytes(&probs),
        out.as_mut_ptr().cast(),
        bytes(&out),
    );
    reports.push(("unpermute", outcome(status, || digest(out.iter().map(|v| v.to_le_bytes())))));

    // Σ x² in f32 lanes, Σ|x| in f64 lanes and max |x|, over more than a block.
    let mut grads = values(70_001);
    let list = [grad(grads.as_mut_ptr().cast(), grads.len(), FSDPTURBO_DTYPE_F32)];
    let mut sums = Vec::new();
    let mut status = Status::FSDPTURBO_OK as i32;
    for (p, accumulate_f64) in [(2.0, false), (1.0, true), (f64::INFINITY, true)] {
        let mut sum = 0.0;
        if status == Status::FSDPTURBO_OK {
            status = fsdpturbo_local_power_sum(list.as_ptr(), 1, p, accumulate_f64, &mut sum);
        }
        sums.push(sum);
    }
    reports.push(("local_power_sum", outcome(status, || digest(sums.iter().map(|v| v.to_le_bytes())))));

    let mut halves: Vec<u16> = values(10_007).into_iter().map(f32_to_f16).collect();
    let list = [grad(halves.as_mut_ptr().cast(), halves.len(), FSDPTURBO_DTYPE_F16)];
    let status = fsdpturbo_scale_in_place(list.as_ptr(), 1, 0.3);
    reports.push(("scale_in_place", outcome(status, || digest(halves.iter().map(|v| v.to_le_bytes())))));
    reports
}

/// The child's work: prints `host_isa: ...` and one line per kernel (a no-op in the test run
/// itself).
#[test]
fn child() {
    if std::env::var_os(CHILD).is_none() {
        return;
    }
    println!("host_isa: {}", host_isa());
    for (name, text) in kernel_reports() {
        println!("{name}: {text}");
    }
}

/// The child's report with FSDPTURBO_HOST_ISA set to `value` (`None`: unset): the instruction
/// set, then the kernels.
fn run_child(value: Option<&str>) -> (String, Vec<(String, String)>) {
    let mut command = common::target_command(&std::env::current_exe().unwrap());
    command.args(["child", "--exact", "--nocapture", "--test-threads=1"]).env(CHILD, "1");
    match value {
        Some(value) => command.env("FSDPTURBO_HOST_ISA", value),
        None => command.env_remove("FSDPTURBO_HOST_ISA"),
    };
    let output = command.output().unwrap();
    let stdout = String::from_utf8(output.stdout).unwrap();
    assert!(output.status.success(), "the child failed: {stdout}{}", String::from_utf8_lossy(&output.stderr));
    // The harness prints "test child ... " before the first line of the child's output.
    let names = std::iter::once("host_isa").chain(EVERY_MACHINE.iter().map(|(name, _)| *name));
    let lines: Vec<(String, String)> = names
        .filter_map(|name| {
            let text = stdout.lines().find_map(|line| line.split_once(&format!("{name}: ")))?.1;
            Some((name.to_string(), text.to_string()))
        })
        .collect();
    assert_eq!(lines.len(), 1 + EVERY_MACHINE.len(), "{stdout}");
    (lines[0].1.clone(), lines[1..].to_vec())
}

fn owned(reports: &[(&str, &str)]) -> Vec<(String, String)> {
    reports.iter().map(|(name, text)| (name.to_string(), text.to_string())).collect()
}

#[test]
fn the_kernels_give_the_same_bits_on_every_machine() {
    let got: Vec<(&str, String)> = kernel_reports();
    let got: Vec<(&str, &str)> = got.iter().map(|(name, text)| (*name, text.as_str())).collect();
    assert_eq!(got, EVERY_MACHINE, "on {}", host_isa());
}

#[test]
fn the_variable_sets_the_reported_instruction_set_and_changes_no_bit() {
    let (default, kernels) = run_child(None);
    let best = default.strip_prefix("FSDPTURBO_OK ").expect("the query succeeds");
    let best = Isa::ALL.into_iter().find(|isa| isa.name() == best).expect("a known name");
    assert_eq!(run_child(Some("")), (default.clone(), kernels.clone()), "empty is unset");
    // Every instruction set up to the best one is taken when asked for, and changes no bit.
    for isa in Isa::ALL.into_iter().filter(|&isa| isa <= best) {
        assert_eq!(
            run_child(Some(isa.name())),
            (format!("FSDPTURBO_OK {}", isa.name()), owned(&EVERY_MACHINE))
        );
    }
    // One above the best is refused by the query and every kernel alike.
    if let Some(lacking) = Isa::ALL.into_iter().find(|&isa| isa > best) {
        let (isa, kernels) = run_child(Some(lacking.name()));
        let refusal =
            format!("FSDPTURBO_ERR_UNAVAILABLE FSDPTURBO_HOST_ISA=\"{}\" cannot be used", lacking.name());
        assert!(isa.starts_with(&refusal), "{isa}");
        for (name, text) in kernels {
            assert!(text.starts_with(&refusal), "{name}: {text}");
        }
    }
}

#[test]
fn a_value_that_is_no_instruction_set_fails_the_query_and_every_kernel() {
    let refusal = "FSDPTURBO_ERR_INVALID_ARGUMENT FSDPTURBO_HOST_ISA=\"avx9\" is not an instruction set of the \
                   host kernels: accepted are portable, avx2 and avx512 (unset or empty: the best available); \
                   this CPU and build support portable";
    let (isa, kernels) = run_child(Some("avx9"));
    assert!(isa.starts_with(refusal), "{isa}");
    for (name, text) in kernels {
        assert!(text.starts_with(refusal), "{name}: {text}");
    }
}
