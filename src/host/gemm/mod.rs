//! The grouped GEMM of the experts and its backward pieces: one GEMM per group of rows with
//! the HF expert layout `W [G, out, in]` (`y = x @ W[g]^T`). A blocked kernel: operands are
//! packed into register-tile panels (converted to the accumulator type on the way: bf16/f16 →
//! f32), a 12×32 (f32) or 6×8 (f64) register tile is updated with AVX-512 or AVX2 + FMA
//! (`x86.rs`) or by portable loops, as [`super::isa`] chooses, K is cut into fixed blocks of
//! [`GEMM_KC`], and the tiles of C are spread over threads ([`super::threads::run_workers`])
//! when the problem is large. Every output element is computed by one thread with the same sequence of
//! operations whatever the thread count and the instruction set: per K block a chain of fused
//! multiply-adds from zero (the portable loops use `mul_add`), added to the element's sum in
//! block order. So results are bit for bit the same for every thread count, on AVX-512, AVX2
//! and the portable loops, and on every architecture whose `mul_add` is IEEE's fused
//! multiply-add (NaN payloads aside).
//!
//! The cost of that: x86-64's baseline has no FMA instruction, so the portable loops there call
//! a fused multiply-add routine per element (hardware FMA where the CPU has it, else software,
//! which is no faster) and run 8–15× slower than unfused loops (one thread, 512 rows × 512 × 384
//! on an AVX-512 Xeon: f32 0.85 against 7.1 GFLOP/s, f64 0.85 against 13). x86-64 CPUs take the
//! portable loops only without AVX2 + FMA or with `FSDPTURBO_HOST_ISA=portable`; on aarch64
//! `mul_add` compiles to vector `fmla`.

use std::sync::atomic::{AtomicUsize, Ordering};

use super::buf::{Acc, HostBuf, HostBufMut, check_len, ident, same_dtype};
use super::isa::Isa;
use super::threads::{GEMM_PARALLEL_MIN_FLOPS, KernelOptions, run_workers};
use crate::dtype::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use crate::error::{Error, Result};

/// Depth of a K block: every output element is a sum of per-block partial sums, added in
/// block order. Fixed, so results do not depend on how C is split over threads.
pub const GEMM_KC: usize = 256;
/// Rows of A packed at a time (a multiple of every accumulator type's MR).
const MC: usize = 72;
/// Elements of packed B per task and thread: B is packed this many K blocks at a time.
const B_PACK_BUDGET: usize = 1 << 20;
/// The most rows of C per task (a multiple of every MR): B is packed once per task and K block, so
/// tasks are tall; a group's rows are cut into near-equal parts of at most MB rows.
const MB: usize = 1020;

/// The per-accumulator-type parts of the GEMM: register-tile height and width, columns per
/// task, the packing of A and B, and the micro-kernel
/// `c[i·ldc + j] += Σ_p a[p·MR + i] · b[p·NR + j]` over an MR × NR tile (`c[…] = 0 + Σ` in the
/// first K block, so C needs no zeroing) of which the first `cols` columns are wanted (the rest
/// are padding of C's last tile, which a kernel may skip: a narrow C, such as a LoRA factor's
/// rank-sized side, then costs its own width, not NR).
trait GemmAcc: Acc {
    const MR: usize;
    const NR: usize;
    const NC: usize;
    /// `self · b + c` rounded once (IEEE fusedMultiplyAdd), as the SIMD kernels' FMA does.
    fn fused_mul_add(self, b: Self, c: Self) -> Self;
    /// [`pack`] with MR lanes: the A panels. `tmp` is scratch.
    #[allow(clippy::too_many_arguments)]
    fn pack_a<T: Copy>(
        src: &[T],
        op: Operand,
        mn0: usize,
        len: usize,
        k0: usize,
        kc: usize,
        dst: &mut [Self],
        dec: &impl Fn(T) -> Self,
        isa: Isa,
        tmp: &mut Vec<Self>,
    );
    /// Packs depth `k0..k0 + klen` of B (indices `mn0..mn0 + len`) as consecutive K blocks of
    /// [`GEMM_KC`] (the last may be shorter), block `kb` at `dst[np·(kb - k0)..]` with
    /// np = `len` rounded up to NR, each laid out as [`pack`] does. `tmp` is scratch.
    #[allow(clippy::too_many_arguments)]
    fn pack_b<T: Copy>(
        src: &[T],
        op: Operand,
        mn0: usize,
        len: usize,
        k0: usize,
        klen: usize,
        dst: &mut [Self],
        dec: &impl Fn(T) -> Self,
        isa: Isa,
        tmp: &mut Vec<Self>,
    );
    fn kernel(isa: Isa, kc: usize, a: &[Self], b: &[Self], c: &mut [Self], out: TileOut);
}

/// A strided operand: element (mn, p) (row/column index, depth index) at
/// `off + mn·s_mn + p·s_k`.
#[derive(Clone, Copy, Debug)]
struct Operand {
    off: usize,
    s_mn: usize,
    s_k: usize,
}

/// Packs indices `mn0..mn0 + len` × depth `k0..k0 + kc` of `op` into panels of R lanes:
/// lane l of panel q at depth p goes to `dst[q·kc·R + p·R + l]`; lanes past `len` are zero.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn pack<T: Copy, A: Acc, const R: usize>(
    src: &[T],
    op: Operand,
    mn0: usize,
    len: usize,
    k0: usize,
    kc: usize,
    dst: &mut [A],
    dec: &impl Fn(T) -> A,
) {
    let panels = len.div_ceil(R);
    for q in 0..panels {
        let panel = &mut dst[q * kc * R..(q + 1) * kc * R];
        let lanes = R.min(len - q * R);
        let first = op.off + (mn0 + q * R) * op.s_mn + k0 * op.s_k;
        if op.s_k == 1 && lanes == R {
            // Depth is contiguous: R rows read side by side, 8 steps at a time (a transpose
            // into the panel).
            const STEP: usize = 8;
            let rows: [&[T]; R] = std::array::from_fn(|l| &src[first + l * op.s_mn..][..kc]);
            let whole = kc / STEP * STEP;
            for (b, out) in panel[..whole * R].chunks_exact_mut(STEP * R).enumerate() {
                let block: [[T; STEP]; R] = std::array::from_fn(|l| {
                    rows[l][b * STEP..(b + 1) * STEP].try_into().expect("STEP elements")
                });
                for p in 0..STEP {
                    for l in 0..R {
                        out[p * R + l] = dec(block[l][p]);
                    }
                }
            }
            for p in whole..kc {
                for l in 0..R {
                    panel[p * R + l] = dec(rows[l][p]);
                }
            }
        } else if op.s_mn == 1 && lanes == R {
            // The panel's lanes are contiguous: R elements per depth step.
            for (p, out) in panel.chunks_exact_mut(R).enumerate() {
                let run: [T; R] = src[first + p * op.s_k..][..R].try_into().expect("R elements");
                for l in 0..R {
                    out[l] = dec(run[l]);
                }
            }
        } else if op.s_mn == 1 {
            // The panel's lanes are contiguous: one short run per depth step.
            for (p, out) in panel.chunks_exact_mut(R).enumerate() {
                let run = &src[first + p * op.s_k..][..lanes];
                for (o, &v) in out.iter_mut().zip(run) {
                    *o = dec(v);
                }
                out[lanes..].fill(A::default());
            }
        } else {
            for (p, out) in panel.chunks_exact_mut(R).enumerate() {
                for (l, o) in out.iter_mut().enumerate() {
                    *o = if l < lanes { dec(src[first + l * op.s_mn + p * op.s_k]) } else { A::default() };
                }
            }
        }
    }
}

/// [`pack`] for every K block of depth `k0..k0 + klen`, laid out as `GemmAcc::pack_b` says.
#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn pack_blocks<T: Copy, A: Acc, const R: usize>(
    src: &[T],
    op: Operand,
    mn0: usize,
    len: usize,
    k0: usize,
    klen: usize,
    dst: &mut [A],
    dec: &impl Fn(T) -> A,
) {
    let np = round_up(len, R);
    for kb in (k0..k0 + klen).step_by(GEMM_KC) {
        let kc = GEMM_KC.min(k0 + klen - kb);
        pack::<T, A, R>(src, op, mn0, len, kb, kc, &mut dst[np * (kb - k0)..np * (kb - k0 + kc)], dec);
    }
}

impl GemmAcc for f32 {
    const MR: usize = 12;
    const NR: usize = 32;
    const NC: usize = 256;
    #[inline(always)]
    fn fused_mul_add(self, b: f32, c: f32) -> f32 {
        self.mul_add(b, c)
    }
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn pack_a<T: Copy>(
        src: &[T],
        op: Operand,
        mn0: usize,
        len: usize,
        k0: usize,
        kc: usize,
        dst: &mut [f32],
        dec: &impl Fn(T) -> f32,
        isa: Isa,
        tmp: &mut Vec<f32>,
    ) {
        #[cfg(target_arch = "x86_64")]
        if isa != Isa::Portable && op.s_k == 1 {
            // SAFETY: the CPU has AVX2 and FMA (`isa` comes from `isa::current`).
            return unsafe { x86::pack_a_t12(src, op, mn0, len, k0, kc, dst, dec, tmp) };
        }
        let _ = (isa, tmp);
        pack::<T, f32, 12>(src, op, mn0, len, k0, kc, dst, dec)
    }
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn pack_b<T: Copy>(
        src: &[T],
        op: Operand,
        mn0: usize,
        len: usize,
        k0: usize,
        klen: usize,
        dst: &mut [f32],
        dec: &impl Fn(T) -> f32,
        isa: Isa,
        tmp: &mut Vec<f32>,
    ) {
        #[cfg(target_arch = "x86_64")]
        if isa != Isa::Portable && op.s_k == 1 {
            // SAFETY: the CPU has AVX2 and FMA (`isa` comes from `isa::current`).
            return unsafe { x86::pack_b_t32(src, op, mn0, len, k0, klen, dst, dec, tmp) };
        }
        let _ = (isa, tmp);
        pack_blocks::<T, f32, 32>(src, op, mn0, len, k0, klen, dst, dec)
    }
    #[inline(always)]
    fn kernel(isa: Isa, kc: usize, a: &[f32], b: &[f32], c: &mut [f32], out: TileOut) {
        let TileOut { ldc, cols, first } = out;
        assert!(a.len() >= kc * 12 && b.len() >= kc * 32 && c.len() >= 11 * ldc + 32 && ldc >= 32);
        assert!((1..=32).contains(&cols));
        #[cfg(target_arch = "x86_64")]
        match isa {
            Isa::Portable => {}
            // SAFETY (both): the CPU has the instructions (`isa` comes from `isa::current`),
            // and the lengths checked above cover every access of the kernels.
            #[cfg(fsdpturbo_avx512)]
            Isa::Avx512 => {
                let (a, b, c) = (a.as_ptr(), b.as_ptr(), c.as_mut_ptr());
                return unsafe {
                    if cols <= 16 {
                        x86::kernel_f32_avx512::<1>(kc, a, b, c, ldc, first)
                    } else {
                        x86::kernel_f32_avx512::<2>(kc, a, b, c, ldc, first)
                    }
                };
            }
            // AVX2 (a build without the AVX-512 tile never chooses Avx512).
            _ => {
                return unsafe {
                    x86::kernel_f32_avx2(kc, a.as_ptr(), b.as_ptr(), c.as_mut_ptr(), ldc, cols, first)
                };
            }
        }
        let _ = isa;
        match cols {
            0..=8 => portable_kernel::<f32, 12, 32, 8>(kc, a, b, c, ldc, first),
            9..=16 => portable_kernel::<f32, 12, 32, 16>(kc, a, b, c, ldc, first),
            _ => portable_kernel::<f32, 12, 32, 32>(kc, a, b, c, ldc, first),
        }
    }
}

/// The portable micro-kernel (f32 and f64): the first W columns of an MR × NR tile of
/// C += A-panel × B-panel over `kc` steps (C = 0 + A-panel × B-panel when `first`), per element
/// the SIMD kernels' operations (a chain of fused multiply-adds from zero, added to C, or to
/// zero, at the end), so it gives their bits.
#[inline(always)]
fn portable_kernel<T: GemmAcc, const MR: usize, const NR: usize, const W: usize>(
    kc: usize,
    a: &[T],
    b: &[T],
    c: &mut [T],
    ldc: usize,
    first: bool,
) {
    let mut acc = [[T::default(); W]; MR];
    for (ap, bp) in a.chunks_exact(MR).zip(b.chunks_exact(NR)).take(kc) {
        for i in 0..MR {
            for j in 0..W {
                acc[i][j] = ap[i].fused_mul_add(bp[j], acc[i][j]);
            }
        }
    }
    for (i, row) in acc.iter().enumerate() {
        for (cv, &v) in c[i * ldc..i * ldc + W].iter_mut().zip(row) {
            *cv = if first { T::default() } else { *cv } + v;
        }
    }
}

impl GemmAcc for f64 {
    const MR: usize = 6;
    const NR: usize = 8;
    const NC: usize = 128;
    #[inline(always)]
    fn fused_mul_add(self, b: f64, c: f64) -> f64 {
        self.mul_add(b, c)
    }
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn pack_a<T: Copy>(
        src: &[T],
        op: Operand,
        mn0: usize,
        len: usize,
        k0: usize,
        kc: usize,
        dst: &mut [f64],
        dec: &impl Fn(T) -> f64,
        _isa: Isa,
        _tmp: &mut Vec<f64>,
    ) {
        pack::<T, f64, 6>(src, op, mn0, len, k0, kc, dst, dec)
    }
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    fn pack_b<T: Copy>(
        src: &[T],
        op: Operand,
        mn0: usize,
        len: usize,
        k0: usize,
        klen: usize,
        dst: &mut [f64],
        dec: &impl Fn(T) -> f64,
        _isa: Isa,
        _tmp: &mut Vec<f64>,
    ) {
        pack_blocks::<T, f64, 8>(src, op, mn0, len, k0, klen, dst, dec)
    }
    #[inline(always)]
    fn kernel(isa: Isa, kc: usize, a: &[f64], b: &[f64], c: &mut [f64], out: TileOut) {
        let TileOut { ldc, first, .. } = out;
        assert!(a.len() >= kc * 6 && b.len() >= kc * 8 && c.len() >= 5 * ldc + 8 && ldc >= 8);
        #[cfg(target_arch = "x86_64")]
        if isa != Isa::Portable {
            // SAFETY: as for f32 (the AVX2 kernel serves AVX-512 too).
            return unsafe { x86::kernel_f64(kc, a.as_ptr(), b.as_ptr(), c.as_mut_ptr(), ldc, first) };
        }
        let _ = isa;
        portable_kernel::<f64, 6, 8, 8>(kc, a, b, c, ldc, first)
    }
}

/// Where a micro-kernel's tile of C goes: its row stride, the columns wanted (the first `cols`
/// of the tile), and whether this is the first K block (the tile is written, not added to).
#[derive(Clone, Copy)]
struct TileOut {
    ldc: usize,
    cols: usize,
    first: bool,
}

/// The x86 register tiles: AVX-512 (f32: 24 accumulators, 12 rows × two 16-float vectors) and
/// AVX2 + FMA (f32: that tile as four 6 × 16 quarters; f64: 6 rows × two 4-double vectors).
#[cfg(target_arch = "x86_64")]
mod x86;

/// One GEMM `C[m, n] = Σ_p A(i, p) · B(p, j)`: A's (i, p) and B's (j, p) through their
/// operands, C row-major at `c_off` with row stride `ldc`.
#[derive(Clone, Copy, Debug)]
struct Problem {
    m: usize,
    n: usize,
    k: usize,
    a: Operand,
    b: Operand,
    c_off: usize,
    ldc: usize,
}

/// A rectangle of one problem's C: the unit of work of a thread.
#[derive(Clone, Copy, Debug)]
struct Task {
    problem: usize,
    m0: usize,
    m_len: usize,
    n0: usize,
    n_len: usize,
}

/// The output of the GEMM, shared by the threads, each of which writes its own rectangles.
struct SharedOut<T> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: threads write disjoint element ranges (one task per rectangle of C, the rectangles
// of all tasks are disjoint), and `T: Send`.
unsafe impl<T: Send> Sync for SharedOut<T> {}

impl<T> SharedOut<T> {
    /// # Safety
    /// No other live reference covers `start..start + len`.
    #[allow(clippy::mut_from_ref)]
    unsafe fn run(&self, start: usize, len: usize) -> &mut [T] {
        assert!(start <= self.len && len <= self.len - start, "GEMM output range out of bounds");
        // SAFETY: in bounds (checked), and exclusive by the caller's contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.add(start), len) }
    }
}

fn round_up(x: usize, to: usize) -> usize {
    x.div_ceil(to) * to
}

/// Per-thread buffers of the GEMM.
struct Workspace<A> {
    a: Vec<A>,
    b: Vec<A>,
    c: Vec<A>,
    t: Vec<A>,
}

#[allow(clippy::too_many_arguments)]
#[inline(always)]
fn run_task<T: Copy, A: GemmAcc>(
    task: Task,
    p: &Problem,
    a_src: &[T],
    b_src: &[T],
    out: &SharedOut<T>,
    ws: &mut Workspace<A>,
    dec: &impl Fn(T) -> A,
    enc: &impl Fn(A) -> T,
    isa: Isa,
) {
    let (mr, nr) = (A::MR, A::NR);
    let mp = round_up(task.m_len, mr);
    let np = round_up(task.n_len, nr);
    let scratch = &mut ws.c[..mp * np];
    if p.k == 0 {
        scratch.fill(A::default()); // no K block writes C: an empty sum is zero
    }
    // B is packed a chunk of whole K blocks at a time (all of K when it fits the budget).
    let chunk = (B_PACK_BUDGET / np / GEMM_KC).max(1) * GEMM_KC;
    for c0 in (0..p.k).step_by(chunk) {
        let clen = chunk.min(p.k - c0);
        if ws.b.len() < np * clen {
            ws.b.resize(np * clen, A::default());
        }
        let bchunk = &mut ws.b[..np * clen];
        A::pack_b(b_src, p.b, task.n0, task.n_len, c0, clen, bchunk, dec, isa, &mut ws.t);
        for k0 in (c0..c0 + clen).step_by(GEMM_KC) {
            let kc = GEMM_KC.min(c0 + clen - k0);
            let bpack = &bchunk[np * (k0 - c0)..np * (k0 - c0 + kc)];
            let mut i0 = 0;
            while i0 < task.m_len {
                let mc = MC.min(task.m_len - i0);
                let mcp = round_up(mc, mr);
                let apack = &mut ws.a[..mcp * kc];
                A::pack_a(a_src, p.a, task.m0 + i0, mc, k0, kc, apack, dec, isa, &mut ws.t);
                for jr in 0..np / nr {
                    let bp = &bpack[jr * kc * nr..(jr + 1) * kc * nr];
                    let out = TileOut { ldc: np, cols: nr.min(task.n_len - jr * nr), first: k0 == 0 };
                    for ir in 0..mcp / mr {
                        let ap = &apack[ir * kc * mr..(ir + 1) * kc * mr];
                        let tile = (i0 + ir * mr) * np + jr * nr;
                        A::kernel(isa, kc, ap, bp, &mut scratch[tile..], out);
                    }
                }
                i0 += MC;
            }
        }
    }
    for i in 0..task.m_len {
        // SAFETY: this task alone covers rows m0..m0+m_len, columns n0..n0+n_len of this
        // problem's C, and the problems' C regions are disjoint.
        let dst = unsafe { out.run(p.c_off + (task.m0 + i) * p.ldc + task.n0, task.n_len) };
        for (d, &v) in dst.iter_mut().zip(&scratch[i * np..i * np + task.n_len]) {
            *d = enc(v);
        }
    }
}

/// Defines `$name`: [`run_task`] on the `$isa` path compiled with `$features`, so packing and
/// conversions use them too.
macro_rules! run_task_compiled_for {
    ($(#[$cfg:meta])* $name:ident, $features:literal, $isa:expr) => {
        $(#[$cfg])*
        #[target_feature(enable = $features)]
        #[allow(clippy::too_many_arguments)]
        fn $name<T: Copy, A: GemmAcc>(
            task: Task,
            p: &Problem,
            a_src: &[T],
            b_src: &[T],
            out: &SharedOut<T>,
            ws: &mut Workspace<A>,
            dec: &impl Fn(T) -> A,
            enc: &impl Fn(A) -> T,
        ) {
            run_task(task, p, a_src, b_src, out, ws, dec, enc, $isa)
        }
    };
}

run_task_compiled_for!(
    #[cfg(target_arch = "x86_64")]
    run_task_avx2,
    "avx2,fma",
    Isa::Avx2
);
run_task_compiled_for!(
    #[cfg(all(target_arch = "x86_64", fsdpturbo_avx512))]
    run_task_avx512,
    "avx512f,avx2,fma",
    Isa::Avx512
);

#[allow(clippy::too_many_arguments)]
fn run_gemm<T: Copy + Send + Sync, A: GemmAcc>(
    a_src: &[T],
    b_src: &[T],
    c: &mut [T],
    problems: &[Problem],
    threads: usize,
    isa: Isa,
    dec: impl Fn(T) -> A + Sync,
    enc: impl Fn(A) -> T + Sync,
) {
    let mut tasks = Vec::new();
    for (pi, p) in problems.iter().enumerate() {
        let parts = p.m.div_ceil(MB);
        let rows = if parts == 0 { 0 } else { round_up(p.m.div_ceil(parts), A::MR) };
        for m0 in (0..p.m).step_by(rows.max(1)) {
            for n0 in (0..p.n).step_by(A::NC) {
                tasks.push(Task {
                    problem: pi,
                    m0,
                    m_len: rows.min(p.m - m0),
                    n0,
                    n_len: A::NC.min(p.n - n0),
                });
            }
        }
    }
    let out = SharedOut { ptr: c.as_mut_ptr(), len: c.len() };
    let next = AtomicUsize::new(0);
    let max_k = problems.iter().map(|p| p.k).max().unwrap_or(0);
    let worker = || {
        // Made on the first task: a worker a pool runs after the others took every task (one
        // thread running several workers) costs nothing.
        let mut workspace = None;
        loop {
            let t = next.fetch_add(1, Ordering::Relaxed);
            let Some(&task) = tasks.get(t) else { break };
            let ws = workspace.get_or_insert_with(|| Workspace {
                a: vec![A::default(); MC * max_k.min(GEMM_KC)],
                b: Vec::new(),
                c: vec![A::default(); MB * A::NC],
                t: Vec::new(),
            });
            let p = &problems[task.problem];
            #[cfg(target_arch = "x86_64")]
            match isa {
                Isa::Portable => {}
                // SAFETY (both): the CPU has the instructions (`isa` comes from `isa::current`).
                #[cfg(fsdpturbo_avx512)]
                Isa::Avx512 => {
                    unsafe { run_task_avx512(task, p, a_src, b_src, &out, ws, &dec, &enc) };
                    continue;
                }
                // AVX2 (a build without the AVX-512 tile never chooses Avx512).
                _ => {
                    unsafe { run_task_avx2(task, p, a_src, b_src, &out, ws, &dec, &enc) };
                    continue;
                }
            }
            run_task(task, p, a_src, b_src, &out, ws, &dec, &enc, isa);
        }
    };
    run_workers(threads.min(tasks.len()).max(1), &|_| worker());
}

/// Which of the three grouped GEMMs.
#[derive(Clone, Copy, PartialEq, Eq)]
enum GemmOp {
    Forward,
    GradInput,
    GradWeight,
}

/// The first row of each group, and N.
fn group_starts(group_rows: &[u64]) -> Result<(Vec<usize>, usize)> {
    let mut starts = Vec::with_capacity(group_rows.len());
    let mut total = 0usize;
    for (g, &n) in group_rows.iter().enumerate() {
        starts.push(total);
        total = usize::try_from(n)
            .ok()
            .and_then(|n| total.checked_add(n))
            .ok_or_else(|| Error::invalid(format!("the group sizes overflow at group_rows[{g}] = {n}")))?;
    }
    Ok((starts, total))
}

fn elems(a: usize, b: usize, what: &str) -> Result<usize> {
    a.checked_mul(b).ok_or_else(|| Error::invalid(format!("the size of `{what}` overflows ({a} × {b})")))
}

/// One of the three grouped GEMMs on the `isa` code path (the public entry points pass
/// `options.isa()`).
#[allow(clippy::too_many_arguments)]
fn grouped(
    op: GemmOp,
    a: (&str, HostBuf),
    b: (&str, HostBuf),
    c: (&str, HostBufMut),
    group_rows: &[u64],
    in_features: usize,
    out_features: usize,
    options: KernelOptions,
    isa: Isa,
) -> Result<()> {
    let (starts, n) = group_starts(group_rows)?;
    let groups = group_rows.len();
    let (i, o) = (in_features, out_features);
    let w_elems = elems(elems(groups, o, "weight")?, i, "weight")?;
    let x_rows = format!("{n} rows (Σ group_rows)");
    let shape_x = (elems(n, i, "x")?, format!("[{x_rows}, in_features {i}]"));
    let shape_y = (elems(n, o, "y")?, format!("[{x_rows}, out_features {o}]"));
    let shape_w = (w_elems, format!("[groups {groups}, out_features {o}, in_features {i}]"));
    let (sa, sb, sc) = match op {
        GemmOp::Forward => (&shape_x, &shape_w, &shape_y),
        GemmOp::GradInput => (&shape_y, &shape_w, &shape_x),
        GemmOp::GradWeight => (&shape_y, &shape_x, &shape_w),
    };
    check_len(a.0, a.1.len(), sa.0, &sa.1)?;
    check_len(b.0, b.1.len(), sb.0, &sb.1)?;
    check_len(c.0, c.1.len(), sc.0, &sc.1)?;
    same_dtype(&[(a.0, a.1), (b.0, b.1), (c.0, c.1.as_buf())])?;

    let problems: Vec<Problem> = (0..groups)
        .map(|g| {
            let (r0, m) = (starts[g], group_rows[g] as usize);
            let w_off = g * o * i;
            match op {
                // y_g [m, o] = x_g [m, i] · W_g^T: A = x (depth i), B(p, j) = W[g][j, p].
                GemmOp::Forward => Problem {
                    m,
                    n: o,
                    k: i,
                    a: Operand { off: r0 * i, s_mn: i, s_k: 1 },
                    b: Operand { off: w_off, s_mn: i, s_k: 1 },
                    c_off: r0 * o,
                    ldc: o,
                },
                // grad_x_g [m, i] = grad_y_g [m, o] · W_g: B(p, j) = W[g][p, j].
                GemmOp::GradInput => Problem {
                    m,
                    n: i,
                    k: o,
                    a: Operand { off: r0 * o, s_mn: o, s_k: 1 },
                    b: Operand { off: w_off, s_mn: 1, s_k: i },
                    c_off: r0 * i,
                    ldc: i,
                },
                // grad_W_g [o, i] = grad_y_g^T [o, m] · x_g [m, i]: depth = the group's rows.
                GemmOp::GradWeight => Problem {
                    m: o,
                    n: i,
                    k: m,
                    a: Operand { off: r0 * o, s_mn: 1, s_k: o },
                    b: Operand { off: r0 * i, s_mn: 1, s_k: i },
                    c_off: w_off,
                    ldc: i,
                },
            }
        })
        .collect();
    let flops = 2usize.saturating_mul(n).saturating_mul(i).saturating_mul(o);
    let threads = options.threads_for(flops, GEMM_PARALLEL_MIN_FLOPS);
    match (a.1, b.1, c.1) {
        (HostBuf::F32(x), HostBuf::F32(w), HostBufMut::F32(y)) => {
            run_gemm(x, w, y, &problems, threads, isa, ident, ident)
        }
        (HostBuf::F64(x), HostBuf::F64(w), HostBufMut::F64(y)) => {
            run_gemm(x, w, y, &problems, threads, isa, ident::<f64>, ident::<f64>)
        }
        (HostBuf::Bf16(x), HostBuf::Bf16(w), HostBufMut::Bf16(y)) => {
            run_gemm(x, w, y, &problems, threads, isa, bf16_to_f32, f32_to_bf16)
        }
        (HostBuf::F16(x), HostBuf::F16(w), HostBufMut::F16(y)) => {
            run_gemm(x, w, y, &problems, threads, isa, f16_to_f32, f32_to_f16)
        }
        _ => unreachable!("dtypes checked above"),
    }
    Ok(())
}

/// Grouped matmul: `x [N, in]` holds `group_rows[g]` consecutive rows for each group g
/// (N = Σ group_rows), `weight [G, out, in]` (the HF expert layout), and
/// `y[rows of g] = x[rows of g] @ weight[g]^T`, `y [N, out]`. All buffers have one element type;
/// bf16/f16 accumulate in f32 and round once; empty groups are fine. Large problems use all
/// available cores; results do not depend on the thread count.
pub fn grouped_mm(
    x: HostBuf,
    group_rows: &[u64],
    weight: HostBuf,
    in_features: usize,
    out_features: usize,
    y: HostBufMut,
) -> Result<()> {
    grouped_mm_with(x, group_rows, weight, in_features, out_features, y, KernelOptions::default())
}

/// [`grouped_mm`] with explicit [`KernelOptions`].
pub fn grouped_mm_with(
    x: HostBuf,
    group_rows: &[u64],
    weight: HostBuf,
    in_features: usize,
    out_features: usize,
    y: HostBufMut,
    options: KernelOptions,
) -> Result<()> {
    let (a, b, c) = (("x", x), ("weight", weight), ("y", y));
    grouped(GemmOp::Forward, a, b, c, group_rows, in_features, out_features, options, options.isa()?)
}

/// The input gradient of [`grouped_mm`]: `grad_x[rows of g] = grad_y[rows of g] @ weight[g]`,
/// `grad_y [N, out]`, `grad_x [N, in]`.
pub fn grouped_mm_grad_input(
    grad_y: HostBuf,
    group_rows: &[u64],
    weight: HostBuf,
    in_features: usize,
    out_features: usize,
    grad_x: HostBufMut,
) -> Result<()> {
    let options = KernelOptions::default();
    grouped_mm_grad_input_with(grad_y, group_rows, weight, in_features, out_features, grad_x, options)
}

/// [`grouped_mm_grad_input`] with explicit [`KernelOptions`].
pub fn grouped_mm_grad_input_with(
    grad_y: HostBuf,
    group_rows: &[u64],
    weight: HostBuf,
    in_features: usize,
    out_features: usize,
    grad_x: HostBufMut,
    options: KernelOptions,
) -> Result<()> {
    let (a, b, c) = (("grad_y", grad_y), ("weight", weight), ("grad_x", grad_x));
    grouped(GemmOp::GradInput, a, b, c, group_rows, in_features, out_features, options, options.isa()?)
}

/// The weight gradient of [`grouped_mm`]: `grad_weight[g] = grad_y[rows of g]^T @ x[rows of g]`,
/// `grad_weight [G, out, in]`; zero for empty groups.
pub fn grouped_mm_grad_weight(
    grad_y: HostBuf,
    x: HostBuf,
    group_rows: &[u64],
    in_features: usize,
    out_features: usize,
    grad_weight: HostBufMut,
) -> Result<()> {
    let options = KernelOptions::default();
    grouped_mm_grad_weight_with(grad_y, x, group_rows, in_features, out_features, grad_weight, options)
}

/// [`grouped_mm_grad_weight`] with explicit [`KernelOptions`].
pub fn grouped_mm_grad_weight_with(
    grad_y: HostBuf,
    x: HostBuf,
    group_rows: &[u64],
    in_features: usize,
    out_features: usize,
    grad_weight: HostBufMut,
    options: KernelOptions,
) -> Result<()> {
    let (a, b, c) = (("grad_y", grad_y), ("x", x), ("grad_weight", grad_weight));
    grouped(GemmOp::GradWeight, a, b, c, group_rows, in_features, out_features, options, options.isa()?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::dtype::Dtype;
    use crate::host::isa::Capabilities;

    /// Deterministic values in [-1, 1).
    fn values(seed: u64, len: usize) -> Vec<f32> {
        let mut state = seed;
        (0..len)
            .map(|_| {
                state = state.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    /// Owned elements of one type, made from f32 values (f64: times 1.01, to use its precision).
    enum Data {
        F32(Vec<f32>),
        F64(Vec<f64>),
        Bf16(Vec<u16>),
        F16(Vec<u16>),
    }

    impl Data {
        fn new(dtype: Dtype, v: &[f32]) -> Data {
            match dtype {
                Dtype::F32 => Data::F32(v.to_vec()),
                Dtype::F64 => Data::F64(v.iter().map(|&f| f as f64 * 1.01).collect()),
                Dtype::Bf16 => Data::Bf16(v.iter().map(|&f| f32_to_bf16(f)).collect()),
                Dtype::F16 => Data::F16(v.iter().map(|&f| f32_to_f16(f)).collect()),
                other => unreachable!("{other:?} is not a floating-point type"),
            }
        }
        fn buf(&self) -> HostBuf<'_> {
            match self {
                Data::F32(v) => HostBuf::F32(v),
                Data::F64(v) => HostBuf::F64(v),
                Data::Bf16(v) => HostBuf::Bf16(v),
                Data::F16(v) => HostBuf::F16(v),
            }
        }
        fn buf_mut(&mut self) -> HostBufMut<'_> {
            match self {
                Data::F32(v) => HostBufMut::F32(v),
                Data::F64(v) => HostBufMut::F64(v),
                Data::Bf16(v) => HostBufMut::Bf16(v),
                Data::F16(v) => HostBufMut::F16(v),
            }
        }
        fn bits(&self) -> Vec<u64> {
            match self {
                Data::F32(v) => v.iter().map(|x| x.to_bits().into()).collect(),
                Data::F64(v) => v.iter().map(|x| x.to_bits()).collect(),
                Data::Bf16(v) | Data::F16(v) => v.iter().map(|&x| x.into()).collect(),
            }
        }
    }

    #[test]
    fn every_instruction_set_gives_the_portable_bits_for_every_type() {
        let supported = Capabilities::detect().supported();
        if supported.len() == 1 {
            eprintln!("only the portable loops run on this host: nothing to compare them with");
        }
        // Edge tiles in every dimension (rows, columns and depths not multiples of the tiles
        // or of the K block), empty groups, depths of one and of three K blocks (in 530; a
        // group of 300 rows for the weight gradient), more columns than one task takes (530),
        // last tiles of 18 and 13 columns and a rank-sized side of 5 (the kernels' narrow tiles).
        let counts = [13u64, 0, 40, 300, 1, 0];
        let n = counts.iter().sum::<u64>() as usize;
        let options = KernelOptions { threads: Some(2), portable: false };
        for (i, o) in [(530, 45), (37, 5)] {
            compare_instruction_sets(&counts, n, i, o, options);
        }
    }

    fn compare_instruction_sets(counts: &[u64], n: usize, i: usize, o: usize, options: KernelOptions) {
        let supported = Capabilities::detect().supported();
        let (x, w, gy) = (values(1, n * i), values(2, counts.len() * o * i), values(3, n * o));
        let run = |isa: Isa, dtype: Dtype| {
            let (x, w, gy) = (Data::new(dtype, &x), Data::new(dtype, &w), Data::new(dtype, &gy));
            let gemm = |op, a: &Data, b: &Data, len| {
                let mut c = Data::new(dtype, &vec![0.0; len]);
                let (a, b, c_buf) = (("a", a.buf()), ("b", b.buf()), ("c", c.buf_mut()));
                grouped(op, a, b, c_buf, counts, i, o, options, isa).unwrap();
                c.bits()
            };
            [
                ("forward", gemm(GemmOp::Forward, &x, &w, n * o)),
                ("grad_input", gemm(GemmOp::GradInput, &gy, &w, n * i)),
                ("grad_weight", gemm(GemmOp::GradWeight, &gy, &x, counts.len() * o * i)),
            ]
        };
        for dtype in [Dtype::F32, Dtype::F64, Dtype::Bf16, Dtype::F16] {
            let portable = run(Isa::Portable, dtype);
            for &isa in &supported[1..] {
                for ((op, got), (_, want)) in run(isa, dtype).iter().zip(&portable) {
                    assert!(
                        got == want,
                        "{dtype:?} {op} (in {i}, out {o}): {isa:?} differs from the portable loops"
                    );
                }
            }
        }
    }
}
