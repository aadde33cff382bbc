//! Routing metadata and the host MoE kernels, timed with `Instant` (medians over rounds; the
//! variants of one measurement run interleaved, one of each per round, so drift on a shared
//! machine hits them alike).
//!
//! - Routing for T = 16384 tokens × top-8 over E = 128 experts at P = 8 (Qwen3-30B-A3B at EP8):
//!   `route` (histogram + stable counting sort + splits), `route_into` into preallocated
//!   buffers, and, as the in-run reference, the argsort path done with Rust's stable sort
//!   (`sort_by_key` on the ids + bincount), which is what `torch.argsort(stable=True)` does.
//!   The torch `argsort` path itself is measured from Python.
//! - permute / unpermute (bf16, H = 2048, T = 2048 × top-8): GB/s of bytes moved.
//! - grouped_mm GFLOP/s for a Qwen3-30B-A3B-like CPU-sized layer: 16 local experts, 2048
//!   routed rows, H = 2048, I = 768 (gate_up [16, 1536, 2048], down [16, 2048, 768]), forward
//!   and both backward pieces, f32 and bf16, on all cores and on one; plus one dense
//!   2048³ GEMM (one group) as the kernel's large-problem rate.
//!
//! Run: `cargo bench --bench route` (optional argument: rounds, default 11).

use std::hint::black_box;
use std::time::{Duration, Instant};

use fsdpturbo::dtype::f32_to_bf16;
use fsdpturbo::host::gemm::*;
use fsdpturbo::host::{HostBuf, HostBufMut, KernelOptions};
use fsdpturbo::route::*;

const ONE_THREAD: KernelOptions = KernelOptions { threads: Some(1), portable: false };

struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }
    fn unit(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn time<R>(f: &mut impl FnMut() -> R) -> Duration {
    let t = Instant::now();
    black_box(f());
    t.elapsed()
}

/// Interleaved medians of the variants.
fn bench(rounds: usize, variants: &mut [&mut dyn FnMut()]) -> Vec<Duration> {
    let mut times = vec![Vec::new(); variants.len()];
    for v in variants.iter_mut() {
        v(); // warm-up
    }
    for _ in 0..rounds {
        for (v, t) in variants.iter_mut().zip(&mut times) {
            t.push(time(&mut || v()));
        }
    }
    times.into_iter().map(median).collect()
}

/// Top-k ids like `torch.topk` gives: K distinct experts per token, skewed towards low ids
/// (a popular-expert imbalance) so the counts are uneven.
fn topk_ids(rng: &mut Rng, tokens: usize, k: usize, e: usize) -> Vec<i64> {
    let mut ids = Vec::with_capacity(tokens * k);
    for _ in 0..tokens {
        let start = ids.len();
        while ids.len() < start + k {
            let a = rng.below(e);
            let id = if rng.below(4) == 0 { a % (e / 8) } else { a } as i64;
            if !ids[start..].contains(&id) {
                ids.push(id);
            }
        }
    }
    ids
}

/// The argsort path: a stable comparison sort of the slot indices by id, plus a bincount.
fn argsort_route(ids: &[i64], e: usize, p: usize) -> (Vec<u64>, Vec<u64>, Vec<u64>) {
    let mut perm: Vec<u64> = (0..ids.len() as u64).collect();
    perm.sort_by_key(|&j| ids[j as usize]);
    let mut cnt = vec![0u64; e];
    for &id in ids {
        cnt[id as usize] += 1;
    }
    let l = e / p;
    let splits = (0..p).map(|s| cnt[s * l..(s + 1) * l].iter().sum()).collect();
    (cnt, perm, splits)
}

fn routing(rounds: usize) {
    let (t, k, e, p) = (16384, 8, 128, 8);
    let mut rng = Rng(7);
    let ids = topk_ids(&mut rng, t, k, e);
    let reference = argsort_route(&ids, e, p);
    let ours = route(&ids, t, k, e, p).unwrap();
    assert_eq!(
        (ours.tokens_per_expert.clone(), ours.permutation.clone(), ours.input_splits.clone()),
        reference
    );

    let mut cnt = vec![0u64; e];
    let mut perm = vec![0u64; t * k];
    let mut splits = vec![0u64; p];
    let rounds = rounds.max(31) * 5;
    let times = bench(
        rounds,
        &mut [
            &mut || {
                black_box(route(black_box(&ids), t, k, e, p).unwrap());
            },
            &mut || {
                route_into(black_box(&ids), t, k, e, p, &mut cnt, &mut perm, &mut splits).unwrap();
                black_box(&perm);
            },
            &mut || {
                black_box(argsort_route(black_box(&ids), e, p));
            },
        ],
    );
    println!("routing metadata, T={t} K={k} E={e} P={p} ({} slots), medians of {rounds}:", t * k);
    println!("  route (counting sort, allocating)      {:>9.1} us", times[0].as_secs_f64() * 1e6);
    println!("  route_into (preallocated buffers)      {:>9.1} us", times[1].as_secs_f64() * 1e6);
    println!(
        "  argsort path (stable sort + bincount)  {:>9.1} us   ours is {:.1}x faster",
        times[2].as_secs_f64() * 1e6,
        times[2].as_secs_f64() / times[0].as_secs_f64()
    );
}

fn permute_kernels(rounds: usize) {
    let (t, k, e, h) = (2048, 8, 128, 2048);
    let mut rng = Rng(11);
    let ids = topk_ids(&mut rng, t, k, e);
    let r = route(&ids, t, k, e, 1).unwrap();
    let x: Vec<u16> = (0..t * h).map(|_| f32_to_bf16(rng.unit())).collect();
    let probs: Vec<u16> = (0..t * k).map(|_| f32_to_bf16(rng.unit().abs() / k as f32)).collect();
    let mut permuted = vec![0u16; t * k * h];
    permute_tokens(&x, h, &r.permutation, k, &mut permuted).unwrap();
    let y = permuted.clone();
    let mut out = vec![0u16; t * h];
    let times = bench(
        rounds,
        &mut [&mut || permute_tokens(&x, h, &r.permutation, k, &mut permuted).unwrap(), &mut || {
            unpermute(
                HostBuf::Bf16(&y),
                h,
                &r.permutation,
                k,
                Some(HostBuf::Bf16(&probs)),
                HostBufMut::Bf16(&mut out),
            )
            .unwrap()
        }],
    );
    // Bytes moved: permute reads and writes T·K rows; unpermute reads T·K rows, writes T.
    let row = (h * 2) as f64;
    let gbs = |bytes: f64, d: Duration| bytes / d.as_secs_f64() / 1e9;
    println!("\npermute / unpermute, bf16, T={t} K={k} H={h}, medians of {rounds}:");
    println!(
        "  permute_tokens          {:>8.2} ms  {:>6.1} GB/s",
        times[0].as_secs_f64() * 1e3,
        gbs(2.0 * (t * k) as f64 * row, times[0])
    );
    println!(
        "  unpermute (weighted)    {:>8.2} ms  {:>6.1} GB/s",
        times[1].as_secs_f64() * 1e3,
        gbs(((t * k) + t) as f64 * row, times[1])
    );
}

#[derive(Clone, Copy, PartialEq)]
enum Ty {
    F32,
    Bf16,
}

enum Buf {
    F32(Vec<f32>),
    Bf16(Vec<u16>),
}

impl Buf {
    fn random(rng: &mut Rng, n: usize, ty: Ty, scale: f32) -> Buf {
        match ty {
            Ty::F32 => Buf::F32((0..n).map(|_| rng.unit() * scale).collect()),
            Ty::Bf16 => Buf::Bf16((0..n).map(|_| f32_to_bf16(rng.unit() * scale)).collect()),
        }
    }
    fn get(&self) -> HostBuf<'_> {
        match self {
            Buf::F32(v) => HostBuf::F32(v),
            Buf::Bf16(v) => HostBuf::Bf16(v),
        }
    }
    fn get_mut(&mut self) -> HostBufMut<'_> {
        match self {
            Buf::F32(v) => HostBufMut::F32(v),
            Buf::Bf16(v) => HostBufMut::Bf16(v),
        }
    }
}

/// Uneven routing of `rows` over `groups`, with two empty groups (as a skewed router gives).
fn group_rows(rng: &mut Rng, rows: usize, groups: usize) -> Vec<u64> {
    let mut counts = vec![0u64; groups];
    for _ in 0..rows {
        let mut g = rng.below(groups);
        if g == 3 || g == 11 {
            g = (g + 1) % groups;
        }
        counts[g] += 1;
    }
    counts
}

fn gemm(rounds: usize) {
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let (groups, rows, h, i) = (16usize, 2048usize, 2048usize, 768usize);
    let mut rng = Rng(5);
    let counts = group_rows(&mut rng, rows, groups);
    println!(
        "\ngrouped_mm, {groups} local experts, {rows} rows (two experts empty), H={h} I={i}; \
         GFLOP/s = 2·N·in·out / time, medians of {rounds}, {threads} threads unless stated:"
    );
    for ty in [Ty::F32, Ty::Bf16] {
        let name = if ty == Ty::F32 { "f32 " } else { "bf16" };
        for (label, fin, fout) in [("gate_up", h, 2 * i), ("down   ", i, h)] {
            let x = Buf::random(&mut rng, rows * fin, ty, 1.0);
            let w = Buf::random(&mut rng, groups * fout * fin, ty, 0.02);
            let gy = Buf::random(&mut rng, rows * fout, ty, 1.0);
            let mut y = Buf::random(&mut rng, rows * fout, ty, 0.0);
            let mut y1 = Buf::random(&mut rng, rows * fout, ty, 0.0);
            let mut gx = Buf::random(&mut rng, rows * fin, ty, 0.0);
            let mut gw = Buf::random(&mut rng, groups * fout * fin, ty, 0.0);
            let times = bench(
                rounds,
                &mut [
                    &mut || grouped_mm(x.get(), &counts, w.get(), fin, fout, y.get_mut()).unwrap(),
                    &mut || {
                        grouped_mm_with(x.get(), &counts, w.get(), fin, fout, y1.get_mut(), ONE_THREAD)
                            .unwrap()
                    },
                    &mut || {
                        grouped_mm_grad_input(gy.get(), &counts, w.get(), fin, fout, gx.get_mut()).unwrap()
                    },
                    &mut || {
                        grouped_mm_grad_weight(gy.get(), x.get(), &counts, fin, fout, gw.get_mut()).unwrap()
                    },
                ],
            );
            let flops = 2.0 * (rows * fin * fout) as f64;
            let g = |d: Duration| flops / d.as_secs_f64() / 1e9;
            println!(
                "  {name} {label} [{rows}x{fin}]·W^T[{fout}x{fin}]: fwd {:>6.1} GFLOP/s ({:>6.1} ms; 1 thread {:>6.1}), \
                 grad_x {:>6.1}, grad_w {:>6.1}",
                g(times[0]),
                times[0].as_secs_f64() * 1e3,
                g(times[1]),
                g(times[2]),
                g(times[3])
            );
        }
    }
    let n = 2048;
    for ty in [Ty::F32, Ty::Bf16] {
        let x = Buf::random(&mut rng, n * n, ty, 1.0);
        let w = Buf::random(&mut rng, n * n, ty, 0.02);
        let mut y = Buf::random(&mut rng, n * n, ty, 0.0);
        let mut y1 = Buf::random(&mut rng, n * n, ty, 0.0);
        let counts = [n as u64];
        let times = bench(
            rounds.min(5),
            &mut [&mut || grouped_mm(x.get(), &counts, w.get(), n, n, y.get_mut()).unwrap(), &mut || {
                grouped_mm_with(x.get(), &counts, w.get(), n, n, y1.get_mut(), ONE_THREAD).unwrap()
            }],
        );
        let flops = 2.0 * (n * n * n) as f64;
        println!(
            "  dense {n}^3 {}: {:>6.1} GFLOP/s ({threads} threads), {:>6.1} GFLOP/s (1 thread)",
            if ty == Ty::F32 { "f32 " } else { "bf16" },
            flops / times[0].as_secs_f64() / 1e9,
            flops / times[1].as_secs_f64() / 1e9
        );
    }
}

fn main() {
    let rounds = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .and_then(|a| a.parse().ok())
        .unwrap_or(11usize)
        .max(1);
    routing(rounds);
    permute_kernels(rounds);
    gemm(rounds);
}
