//! Host gradient-norm kernels on 300 bf16 tensors totalling 256 MB (p = 2 unless stated):
//! `local_power_sum` time and GB/s, against a naive per-tensor loop and a plain read of the
//! same bytes (the memory-bandwidth ceiling), plus `scale_in_place` and the kernels on
//! cache-resident data. GB/s = gradient bytes read / time, comparable with
//! `torch._foreach_norm` measured from Python. The variants run interleaved, one of each per
//! round, so drift on a shared machine hits them alike; medians over the rounds.
//! Run: `cargo bench --bench norm` (optional argument: rounds, default 11).

use std::hint::black_box;
use std::time::Instant;

use fsdpturbo::dtype::{bf16_to_f32, f32_to_bf16};
use fsdpturbo::host::pnorm::scale_in_place;
use fsdpturbo::host::{HostBuf, HostBufMut};
use fsdpturbo::norm::{NormType, local_power_sum, local_power_sum_threads};

const TENSORS: usize = 300;
const TOTAL_BYTES: usize = 256 << 20;
/// Repetitions per timing of the cache-resident variants.
const IN_CACHE_REPS: usize = 1000;

/// 300 tensors of uneven sizes (0.25× to 1.75× the mean) that add up to exactly 256 MB.
fn tensors() -> Vec<Vec<u16>> {
    let total = TOTAL_BYTES / 2;
    let weights: Vec<usize> = (0..TENSORS).map(|i| 1 + (i * 37) % 7).collect();
    let sum: usize = weights.iter().sum();
    let mut sizes: Vec<usize> = weights.iter().map(|w| total * w / sum).collect();
    let short = total - sizes.iter().sum::<usize>();
    sizes[0] += short;
    let mut state = 0x2545_f491_4f6c_dd1du64;
    sizes
        .iter()
        .map(|&n| {
            (0..n)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 7;
                    state ^= state << 17;
                    f32_to_bf16(((state >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 0.02)
                })
                .collect()
        })
        .collect()
}

/// Reads every byte once (u64 sums), split over `threads` threads like the kernels.
fn read_all(data: &[Vec<u16>], threads: usize) -> u64 {
    let per = data.len().div_ceil(threads);
    std::thread::scope(|s| {
        let handles: Vec<_> = data
            .chunks(per)
            .map(|chunk| {
                s.spawn(move || {
                    let mut acc = [0u64; 8];
                    for t in chunk {
                        // SAFETY: any bit pattern is a valid u64. The unaligned head and tail
                        // (a few bytes) are not read.
                        let (_, words, _) = unsafe { t.align_to::<u64>() };
                        let mut chunks = words.chunks_exact(8);
                        for c in &mut chunks {
                            for j in 0..8 {
                                acc[j] = acc[j].wrapping_add(c[j]);
                            }
                        }
                        acc[0] = chunks.remainder().iter().fold(acc[0], |a, &w| a.wrapping_add(w));
                    }
                    acc.iter().fold(0u64, |a, &b| a.wrapping_add(b))
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).fold(0, u64::wrapping_add)
    })
}

/// What a straightforward implementation does: one tensor at a time, one accumulator.
fn naive(data: &[Vec<u16>]) -> f64 {
    let mut total = 0.0f64;
    for t in data {
        total += t
            .iter()
            .map(|&b| {
                let v = bf16_to_f32(b) as f64;
                v * v
            })
            .sum::<f64>();
    }
    total
}

struct Variant<'a> {
    name: &'static str,
    bytes: usize,
    /// Seconds per call are the measured time divided by this.
    reps: usize,
    run: Box<dyn FnMut() + 'a>,
    times: Vec<f64>,
}

fn main() {
    let rounds: usize = std::env::args().skip(1).find_map(|a| a.parse().ok()).unwrap_or(11);
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let data = tensors();
    let mut scaled = data.clone();
    let bytes: usize = data.iter().map(|t| t.len() * 2).sum();
    println!(
        "host p-norm: {TENSORS} bf16 tensors, {} MB, {threads} cores available, median of {rounds} interleaved rounds",
        bytes >> 20
    );
    let bufs: Vec<HostBuf> = data.iter().map(|t| HostBuf::Bf16(t)).collect();
    let small_data = &data[1][..1 << 16];
    let small = [HostBuf::Bf16(small_data)];
    let mut small_mut = small_data.to_vec();
    let small_bytes = small_data.len() * 2;
    let norm2 = NormType::P(2.0);

    let sum = |bufs: &'_ [HostBuf<'_>], norm, acc, threads: Option<usize>| match threads {
        Some(t) => local_power_sum_threads(bufs, norm, acc, t).unwrap(),
        None => local_power_sum(bufs, norm, acc).unwrap(),
    };
    let mut v: Vec<Variant> = vec![
        Variant {
            name: "memory read ceiling (u64 sum, all threads)",
            bytes,
            reps: 1,
            run: Box::new(|| {
                black_box(read_all(&data, threads));
            }),
            times: vec![],
        },
        Variant {
            name: "naive per-tensor loop (1 thread, f64)",
            bytes,
            reps: 1,
            run: Box::new(|| {
                black_box(naive(&data));
            }),
            times: vec![],
        },
        Variant {
            name: "local_power_sum p=2, f64 acc",
            bytes,
            reps: 1,
            run: Box::new(|| {
                black_box(sum(&bufs, norm2, true, None));
            }),
            times: vec![],
        },
        Variant {
            name: "local_power_sum p=2, f32 acc",
            bytes,
            reps: 1,
            run: Box::new(|| {
                black_box(sum(&bufs, norm2, false, None));
            }),
            times: vec![],
        },
        Variant {
            name: "local_power_sum p=2, f64 acc, 1 thread",
            bytes,
            reps: 1,
            run: Box::new(|| {
                black_box(sum(&bufs, norm2, true, Some(1)));
            }),
            times: vec![],
        },
        Variant {
            name: "local_power_sum p=inf",
            bytes,
            reps: 1,
            run: Box::new(|| {
                black_box(sum(&bufs, NormType::Inf, true, None));
            }),
            times: vec![],
        },
        Variant {
            name: "scale_in_place bf16 (read + write)",
            bytes,
            reps: 1,
            run: Box::new(|| {
                let mut muts: Vec<HostBufMut> = scaled.iter_mut().map(|t| HostBufMut::Bf16(t)).collect();
                scale_in_place(&mut muts, black_box(1.0)).unwrap();
            }),
            times: vec![],
        },
        Variant {
            name: "in-cache 128 KB, p=2, f64 acc (1 thread)",
            bytes: small_bytes,
            reps: IN_CACHE_REPS,
            run: Box::new(|| {
                for _ in 0..IN_CACHE_REPS {
                    black_box(sum(black_box(&small), norm2, true, None));
                }
            }),
            times: vec![],
        },
        Variant {
            name: "in-cache 128 KB, p=2, f32 acc (1 thread)",
            bytes: small_bytes,
            reps: IN_CACHE_REPS,
            run: Box::new(|| {
                for _ in 0..IN_CACHE_REPS {
                    black_box(sum(black_box(&small), norm2, false, None));
                }
            }),
            times: vec![],
        },
        Variant {
            name: "in-cache 128 KB, p=1, f64 acc (1 thread)",
            bytes: small_bytes,
            reps: IN_CACHE_REPS,
            run: Box::new(|| {
                for _ in 0..IN_CACHE_REPS {
                    black_box(sum(black_box(&small), NormType::P(1.0), true, None));
                }
            }),
            times: vec![],
        },
        Variant {
            name: "in-cache 128 KB, p=inf (1 thread)",
            bytes: small_bytes,
            reps: IN_CACHE_REPS,
            run: Box::new(|| {
                for _ in 0..IN_CACHE_REPS {
                    black_box(sum(black_box(&small), NormType::Inf, true, None));
                }
            }),
            times: vec![],
        },
        Variant {
            name: "in-cache 128 KB, scale bf16 (1 thread)",
            bytes: small_bytes,
            reps: IN_CACHE_REPS,
            run: Box::new(|| {
                for _ in 0..IN_CACHE_REPS {
                    scale_in_place(&mut [HostBufMut::Bf16(black_box(&mut small_mut))], 1.0).unwrap();
                }
            }),
            times: vec![],
        },
    ];

    for round in 0..=rounds {
        for variant in &mut v {
            let start = Instant::now();
            (variant.run)();
            let t = start.elapsed().as_secs_f64() / variant.reps as f64;
            if round > 0 {
                variant.times.push(t); // round 0 warms up
            }
        }
    }
    let median = |times: &mut Vec<f64>| {
        times.sort_by(f64::total_cmp);
        times[times.len() / 2]
    };
    let medians: Vec<f64> = v.iter_mut().map(|x| median(&mut x.times)).collect();
    let (ceiling, naive_t) = (medians[0], medians[1]);
    println!("{:<44} {:>10} {:>10} {:>9} {:>9}", "", "time", "GB/s", "vs naive", "% ceiling");
    for (variant, &t) in v.iter().zip(&medians) {
        let gbs = variant.bytes as f64 / t / 1e9;
        let time = if t >= 1e-3 { format!("{:.2} ms", t * 1e3) } else { format!("{:.1} us", t * 1e6) };
        if variant.bytes == bytes && variant.name.starts_with("local_power_sum") {
            println!(
                "{:<44} {time:>10} {gbs:>10.2} {:>8.2}x {:>8.0}%",
                variant.name,
                naive_t / t,
                ceiling / t * 100.0
            );
        } else {
            println!("{:<44} {time:>10} {gbs:>10.2}", variant.name);
        }
    }

    // p through powf, once (slow: a libm call per element).
    let start = Instant::now();
    let value = black_box(local_power_sum(&bufs, NormType::P(3.5), true).unwrap());
    let t = start.elapsed().as_secs_f64();
    println!(
        "{:<44} {:>7.0} ms {:>10.2}   (one run; value {value:.6e})",
        "local_power_sum p=3.5 (powf)",
        t * 1e3,
        bytes as f64 / t / 1e9
    );
}
