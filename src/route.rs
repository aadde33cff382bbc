//! Token routing for expert parallelism and the host MoE kernels (DESIGN §4.4, seed semantics
//! §5.1).
//!
//! Routing metadata, for one rank of an EP group of size P with E global experts (L = E / P
//! local experts per rank) and T tokens routed to K experts each:
//!
//! - [`route`]: the histogram `cnt[e]` of the flat expert ids, the seed's `sorted` (a stable
//!   counting sort of the flat ids: expert-major, ties by flat position, so it equals
//!   `argsort(f, stable=True)`), and the rows sent to each destination rank
//!   (`cnt.reshape(P, L).sum(1)`). Out-of-range ids are rejected (the seed's `histc` silently
//!   drops them or re-bins E into E - 1).
//! - [`receive`]: from the all-gathered counts `G [P, E]`, what this rank receives: the tokens
//!   per local expert, the rows from each source rank, the local expert of every received row in
//!   receive order (the seed's `global_indices`), and the second stable sort (receive order to
//!   local-expert-major) with its inverse. It works for L = 1 (experts == ep), where the seed
//!   crashes.
//!
//! Host kernels (row-major, `hidden` columns; the element types of [`HostBuf`]: f32, f64, bf16
//! and f16 as bit patterns):
//!
//! - [`permute`] / [`permute_tokens`]: a row gather (`index_select`).
//! - [`unpermute`]: `out[t] = Σ_k w[t, k] · y[inv(t·K + k)]` through the inverse permutation:
//!   a gather, then a sum over k in k order with f32 accumulation (f64 for f64 data), rounded
//!   once at the end. Deterministic, and without the seed's `index_copy` + in-dtype products.
//! - [`grouped_matmul`] and its backward pieces [`grouped_matmul_grad_input`] and
//!   [`grouped_matmul_grad_weight`]: one GEMM per group of rows with the HF expert layout
//!   `W [G, out, in]` (`y = x @ W[g]^T`). A blocked kernel: operands are packed into
//!   register-tile panels (converted to the accumulator type on the way: bf16/f16 → f32), a
//!   6×16 (f32) or 6×8 (f64) register tile is updated with AVX2 + FMA where the CPU has it
//!   (portable loops elsewhere), K is cut into fixed blocks of [`GEMM_KC`], and the tiles of C
//!   are spread over threads (`std::thread::scope`) when the problem is large. Every output
//!   element is computed by one thread with the same sequence of operations whatever the thread
//!   count, so results are bit-for-bit independent of it.

use std::ops::{Add, Mul};
use std::sync::atomic::{AtomicUsize, Ordering};

use crate::dtype::{bf16_to_f32, f16_to_f32, f32_to_bf16, f32_to_f16};
use crate::error::{Error, ErrorKind, Result};
use crate::norm::{HostBuf, HostBufMut};

// ---------------------------------------------------------------------------------------------
// Routing metadata.

/// Routing of this rank's tokens: from the top-k expert ids `[T, K]` (flattened row-major),
/// E global experts and P = ep size.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Routing {
    pub num_experts: usize,
    pub ep_size: usize,
    pub tokens: usize,
    pub top_k: usize,
    /// `cnt[e]`: how many (token, k) slots chose expert e. Length E.
    pub tokens_per_expert: Vec<u64>,
    /// The seed's `sorted`: the flat slot indices `t·K + k` in expert-major order, ties by flat
    /// position (a stable counting sort). Length T·K. Permuted row i is token
    /// `permutation[i] / K`.
    pub permutation: Vec<u64>,
    /// Rows this rank sends to each destination ep rank (`cnt.reshape(P, L).sum(1)`). Length P.
    pub input_splits: Vec<u64>,
}

impl Routing {
    /// L = E / P.
    pub fn num_local_experts(&self) -> usize {
        self.num_experts / self.ep_size
    }

    /// `inv[slot] = i` where `permutation[i] = slot`: the permuted row of each (token, k) slot.
    pub fn inverse_permutation(&self) -> Vec<u64> {
        let mut inv = vec![0u64; self.permutation.len()];
        for (i, &slot) in self.permutation.iter().enumerate() {
            inv[slot as usize] = i as u64;
        }
        inv
    }

    /// The token of every permuted row: `permutation[i] / K` (the rows [`permute`] gathers).
    pub fn token_of_row(&self) -> Vec<u64> {
        let k = self.top_k as u64;
        self.permutation.iter().map(|&slot| slot / k).collect()
    }
}

fn invalid(message: String) -> Error {
    Error::invalid(message)
}

/// Checks E and P; returns L = E / P. The indivisible case keeps the seed's text.
fn local_experts(num_experts: usize, ep_size: usize) -> Result<usize> {
    if num_experts == 0 {
        return Err(invalid("num_experts must be >= 1, got 0".into()));
    }
    if ep_size == 0 {
        return Err(invalid("ep_size must be >= 1, got 0".into()));
    }
    if num_experts % ep_size != 0 {
        return Err(invalid(format!(
            "Number of experts({num_experts}) is not divisible by ep size({ep_size})."
        )));
    }
    Ok(num_experts / ep_size)
}

/// Checks the arguments of [`route`] (not the ids) and returns T·K.
pub fn route_slots(tokens: usize, top_k: usize, num_experts: usize, ep_size: usize) -> Result<usize> {
    if top_k == 0 {
        return Err(invalid("top_k must be >= 1, got 0".into()));
    }
    local_experts(num_experts, ep_size)?;
    let slots = tokens
        .checked_mul(top_k)
        .filter(|&n| n <= isize::MAX as usize / 8)
        .ok_or_else(|| invalid(format!("tokens ({tokens}) × top_k ({top_k}) overflows the address space")))?;
    Ok(slots)
}

fn check_len(what: &str, got: usize, want: usize, shape: &str) -> Result<()> {
    if got != want {
        return Err(invalid(format!("`{what}` has {got} elements but must have {want} ({shape})")));
    }
    Ok(())
}

/// Reserves a zeroed vector of `n` u64 without aborting the process when `n` is absurd.
fn zeroed(n: usize, what: &str) -> Result<Vec<u64>> {
    let mut v = Vec::new();
    v.try_reserve_exact(n).map_err(|_| {
        Error::new(ErrorKind::InvalidArgument, format!("cannot allocate {n} elements for {what}"))
    })?;
    v.resize(n, 0);
    Ok(v)
}

/// Routes this rank's tokens: `expert_ids` are the top-k ids `[T, K]` flattened row-major
/// (entry j belongs to token j / K). Rejects ids outside `[0, E)` (naming the value and its
/// (token, k) position), E not divisible by P (with the seed's text), zero `top_k`,
/// `num_experts` or `ep_size`, T·K overflow and a length that is not T·K. Zero tokens are fine.
pub fn route(
    expert_ids: &[i64],
    tokens: usize,
    top_k: usize,
    num_experts: usize,
    ep_size: usize,
) -> Result<Routing> {
    let slots = route_slots(tokens, top_k, num_experts, ep_size)?;
    check_len("expert_ids", expert_ids.len(), slots, &format!("tokens {tokens} × top_k {top_k}"))?;
    let mut tokens_per_expert = vec![0u64; num_experts];
    let mut permutation = zeroed(slots, "the permutation")?;
    let mut input_splits = vec![0u64; ep_size];
    route_into(
        expert_ids,
        tokens,
        top_k,
        num_experts,
        ep_size,
        &mut tokens_per_expert,
        &mut permutation,
        &mut input_splits,
    )?;
    Ok(Routing { num_experts, ep_size, tokens, top_k, tokens_per_expert, permutation, input_splits })
}

/// [`route`] into caller buffers of lengths E, T·K and P. On any error nothing is written.
#[allow(clippy::too_many_arguments)]
pub fn route_into(
    expert_ids: &[i64],
    tokens: usize,
    top_k: usize,
    num_experts: usize,
    ep_size: usize,
    tokens_per_expert: &mut [u64],
    permutation: &mut [u64],
    input_splits: &mut [u64],
) -> Result<()> {
    let slots = route_slots(tokens, top_k, num_experts, ep_size)?;
    let l = num_experts / ep_size;
    check_len("expert_ids", expert_ids.len(), slots, &format!("tokens {tokens} × top_k {top_k}"))?;
    check_len("tokens_per_expert", tokens_per_expert.len(), num_experts, "num_experts")?;
    check_len("permutation", permutation.len(), slots, &format!("tokens {tokens} × top_k {top_k}"))?;
    check_len("input_splits", input_splits.len(), ep_size, "ep_size")?;

    // Pass 1: the histogram, which also validates every id before anything is written.
    let mut counts = vec![0usize; num_experts];
    for (j, &id) in expert_ids.iter().enumerate() {
        if (id as u64) >= num_experts as u64 {
            return Err(invalid(format!(
                "expert id {id} at token {}, k {} (flat index {j}) is outside [0, {num_experts}): \
                 ids must name one of the {num_experts} experts",
                j / top_k,
                j % top_k
            )));
        }
        counts[id as usize] += 1;
    }
    // Pass 2: exclusive prefix sums, the start of each expert's rows.
    let mut next = Vec::with_capacity(num_experts);
    let mut start = 0usize;
    for &c in &counts {
        next.push(start);
        start += c;
    }
    // Pass 3: scatter in flat order, which makes the sort stable.
    for (j, &id) in expert_ids.iter().enumerate() {
        let at = &mut next[id as usize];
        permutation[*at] = j as u64;
        *at += 1;
    }
    for (dst, &c) in tokens_per_expert.iter_mut().zip(&counts) {
        *dst = c as u64;
    }
    for (s, split) in input_splits.iter_mut().enumerate() {
        *split = counts[s * l..(s + 1) * l].iter().sum::<usize>() as u64;
    }
    Ok(())
}

/// What this rank receives in the dispatch all-to-all, from the all-gathered counts.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Receive {
    /// Rows for each local expert, summed over source ranks (`Gl.sum(0)`). Length L.
    pub tokens_per_local_expert: Vec<u64>,
    /// Rows received from each source rank (`Gl.sum(1)`). Length P.
    pub output_splits: Vec<u64>,
    /// The local expert of every received row, in receive order (source-major, then local
    /// expert): the seed's `global_indices`. Length N = Σ output_splits.
    pub local_expert_of_row: Vec<u64>,
    /// The second stable sort: `chunk_order[i]` is the receive-order row that goes to
    /// local-expert-major position i. Length N.
    pub chunk_order: Vec<u64>,
    /// Its inverse: the local-expert-major position of receive-order row j. Length N.
    pub chunk_order_inverse: Vec<u64>,
}

/// Checks the arguments of [`receive`] and returns N, the number of rows this rank receives.
pub fn receive_rows(
    gathered_counts: &[u64],
    ep_size: usize,
    num_experts: usize,
    rank: usize,
) -> Result<usize> {
    let l = local_experts(num_experts, ep_size)?;
    if rank >= ep_size {
        return Err(invalid(format!("rank {rank} is outside the ep group of size {ep_size} (0..{ep_size})")));
    }
    let want = ep_size
        .checked_mul(num_experts)
        .ok_or_else(|| invalid(format!("ep_size ({ep_size}) × num_experts ({num_experts}) overflows")))?;
    check_len(
        "gathered_counts",
        gathered_counts.len(),
        want,
        &format!("[ep_size {ep_size}, num_experts {num_experts}]"),
    )?;
    let mut total = 0u64;
    for s in 0..ep_size {
        for (i, &c) in gathered_counts[s * num_experts + rank * l..][..l].iter().enumerate() {
            total = total.checked_add(c).filter(|&t| t <= isize::MAX as u64 / 8).ok_or_else(|| {
                invalid(format!(
                    "the counts this rank receives overflow at gathered_counts[{s}][{}] = {c}",
                    rank * l + i
                ))
            })?;
        }
    }
    Ok(total as usize)
}

/// From the all-gathered counts `G [P, E]` (row s = rank s's `tokens_per_expert`, row-major)
/// and this rank's ep rank: what it receives, and the second sort. With `Gl = G[:, rL:(r+1)L]`:
/// `tokens_per_local_expert = Gl.sum(0)`, `output_splits = Gl.sum(1)`,
/// `local_expert_of_row = repeat_interleave(l for each (s, l), Gl[s, l])`, `chunk_order` =
/// its stable argsort.
pub fn receive(gathered_counts: &[u64], ep_size: usize, num_experts: usize, rank: usize) -> Result<Receive> {
    let rows = receive_rows(gathered_counts, ep_size, num_experts, rank)?;
    let mut out = Receive {
        tokens_per_local_expert: vec![0; num_experts / ep_size],
        output_splits: vec![0; ep_size],
        local_expert_of_row: zeroed(rows, "the received rows")?,
        chunk_order: zeroed(rows, "the chunk order")?,
        chunk_order_inverse: zeroed(rows, "the inverse chunk order")?,
    };
    receive_into(
        gathered_counts,
        ep_size,
        num_experts,
        rank,
        &mut out.tokens_per_local_expert,
        &mut out.output_splits,
        &mut out.local_expert_of_row,
        &mut out.chunk_order,
        &mut out.chunk_order_inverse,
    )?;
    Ok(out)
}

/// [`receive`] into caller buffers of lengths L, P, N, N, N (N from [`receive_rows`]). On any
/// error nothing is written.
#[allow(clippy::too_many_arguments)]
pub fn receive_into(
    gathered_counts: &[u64],
    ep_size: usize,
    num_experts: usize,
    rank: usize,
    tokens_per_local_expert: &mut [u64],
    output_splits: &mut [u64],
    local_expert_of_row: &mut [u64],
    chunk_order: &mut [u64],
    chunk_order_inverse: &mut [u64],
) -> Result<()> {
    let rows = receive_rows(gathered_counts, ep_size, num_experts, rank)?;
    let l = num_experts / ep_size;
    check_len("tokens_per_local_expert", tokens_per_local_expert.len(), l, "num_experts / ep_size")?;
    check_len("output_splits", output_splits.len(), ep_size, "ep_size")?;
    check_len("local_expert_of_row", local_expert_of_row.len(), rows, "the rows received")?;
    check_len("chunk_order", chunk_order.len(), rows, "the rows received")?;
    check_len("chunk_order_inverse", chunk_order_inverse.len(), rows, "the rows received")?;

    let gl = |s: usize, e: usize| gathered_counts[s * num_experts + rank * l + e] as usize;
    tokens_per_local_expert.fill(0);
    // Receive order: source-major, then local expert. `recv_start[s·L + e]` is the first
    // receive-order row of chunk (s, e).
    let mut recv_start = vec![0usize; ep_size * l];
    let mut row = 0usize;
    for s in 0..ep_size {
        let mut from_s = 0usize;
        for e in 0..l {
            let n = gl(s, e);
            recv_start[s * l + e] = row;
            local_expert_of_row[row..row + n].fill(e as u64);
            row += n;
            from_s += n;
            tokens_per_local_expert[e] += n as u64;
        }
        output_splits[s] = from_s as u64;
    }
    // Local-expert-major order, sources in rank order within an expert (the stable sort).
    let mut q = 0usize;
    for e in 0..l {
        for s in 0..ep_size {
            let start = recv_start[s * l + e];
            let n = gl(s, e);
            for (j, inv) in (start..start + n).zip(&mut chunk_order_inverse[start..start + n]) {
                chunk_order[q] = j as u64;
                *inv = q as u64;
                q += 1;
            }
        }
    }
    Ok(())
}

/// The inverse of a permutation of `0..n`: `inv[perm[i]] = i`. Rejects values outside `0..n`
/// and repeated values, naming the position.
pub fn invert_permutation(permutation: &[u64]) -> Result<Vec<u64>> {
    let n = permutation.len();
    let mut inv = vec![u64::MAX; n];
    for (i, &p) in permutation.iter().enumerate() {
        if p >= n as u64 {
            return Err(invalid(format!("permutation[{i}] = {p} is outside [0, {n}): not a permutation")));
        }
        if inv[p as usize] != u64::MAX {
            return Err(invalid(format!(
                "permutation[{i}] repeats the value {p} of permutation[{}]: not a permutation",
                inv[p as usize]
            )));
        }
        inv[p as usize] = i as u64;
    }
    Ok(inv)
}

// ---------------------------------------------------------------------------------------------
// Threads.

/// Kernels that touch at least this many elements use all available cores.
/// cbindgen:ignore
pub const PARALLEL_MIN_ELEMS: usize = 1 << 20;
/// Grouped GEMMs of at least this many flops (2·N·in·out) use all available cores.
/// cbindgen:ignore
pub const GEMM_PARALLEL_MIN_FLOPS: usize = 1 << 24;

fn available_threads() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

/// How the host kernels run. The default: all available cores for large problems, and the
/// AVX2 + FMA code where the CPU has it.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KernelOptions {
    /// The most threads to use (`Some(0)` and `Some(1)`: the calling thread alone); `None`:
    /// all available cores for problems above [`PARALLEL_MIN_ELEMS`] elements
    /// ([`GEMM_PARALLEL_MIN_FLOPS`] for the GEMMs), one thread below. Results never depend on it.
    pub threads: Option<usize>,
    /// Use the portable loops even where the CPU has AVX2 + FMA. The unpermute gives identical
    /// results either way; the GEMM's register tile uses fused multiply-adds on the AVX2 path,
    /// so its last bits differ between the two (each is deterministic).
    pub portable: bool,
}

impl KernelOptions {
    fn threads_for(&self, work: usize, threshold: usize) -> usize {
        self.threads.unwrap_or(if work >= threshold { available_threads() } else { 1 })
    }

    fn simd(&self) -> bool {
        !self.portable && simd_available()
    }
}

/// Runs `f(i, chunk)` over consecutive chunks of `dst` of `per` elements (the last may be
/// shorter) on up to `threads` threads.
fn for_chunks<T: Send>(dst: &mut [T], per: usize, threads: usize, f: impl Fn(usize, &mut [T]) + Sync) {
    let per = per.max(1);
    let chunks = dst.len().div_ceil(per);
    if threads <= 1 || chunks <= 1 {
        dst.chunks_mut(per).enumerate().for_each(|(i, c)| f(i, c));
        return;
    }
    let threads = threads.min(chunks);
    // Hand out contiguous runs of chunks, one run per thread.
    let run = chunks.div_ceil(threads);
    std::thread::scope(|scope| {
        let f = &f;
        let mut rest = dst;
        let mut first = 0usize;
        let mut handles = Vec::new();
        while !rest.is_empty() {
            let take = (run * per).min(rest.len());
            let (head, tail) = rest.split_at_mut(take);
            rest = tail;
            let base = first;
            first += run;
            let mut work = move || head.chunks_mut(per).enumerate().for_each(|(i, c)| f(base + i, c));
            if rest.is_empty() {
                work();
            } else {
                handles.push(scope.spawn(work));
            }
        }
        for h in handles {
            if let Err(payload) = h.join() {
                std::panic::resume_unwind(payload);
            }
        }
    });
}

// ---------------------------------------------------------------------------------------------
// Permute (row gather).

fn check_hidden(hidden: usize) -> Result<()> {
    if hidden == 0 {
        return Err(invalid("hidden must be >= 1, got 0".into()));
    }
    Ok(())
}

fn gather<T: Copy + Send + Sync>(
    src: &[T],
    hidden: usize,
    rows: &[u64],
    divisor: usize,
    dst: &mut [T],
    rows_name: &str,
) -> Result<()> {
    check_hidden(hidden)?;
    if src.len() % hidden != 0 {
        return Err(invalid(format!(
            "`src` has {} elements, not a whole number of rows of hidden {hidden}",
            src.len()
        )));
    }
    let src_rows = src.len() / hidden;
    let want = rows.len().checked_mul(hidden).ok_or_else(|| invalid("rows × hidden overflows".into()))?;
    check_len("dst", dst.len(), want, &format!("{} rows × hidden {hidden}", rows.len()))?;
    check_rows(rows, divisor, src_rows, rows_name)?;
    let div = divisor as u64;
    let threads = if dst.len() >= PARALLEL_MIN_ELEMS { available_threads() } else { 1 };
    let per_chunk = (PARALLEL_MIN_ELEMS / 4 / hidden).max(1);
    for_chunks(dst, per_chunk * hidden, threads, |c, out| {
        let first = c * per_chunk;
        for (i, row) in out.chunks_exact_mut(hidden).enumerate() {
            let r = (rows[first + i] / div) as usize;
            row.copy_from_slice(&src[r * hidden..(r + 1) * hidden]);
        }
    });
    Ok(())
}

/// Checks that every `rows[i] / divisor` names one of the `src_rows` rows of `src` (the device
/// kernels report the first bad entry with the same text).
pub fn check_rows(rows: &[u64], divisor: usize, src_rows: usize, rows_name: &str) -> Result<()> {
    let div = divisor as u64;
    if let Some((i, &r)) = rows.iter().enumerate().find(|&(_, &r)| r / div >= src_rows as u64) {
        let what = if divisor == 1 { String::new() } else { format!(" (row {} = {r} / {divisor})", r / div) };
        return Err(invalid(format!("{rows_name}[{i}] = {r}{what} is outside the {src_rows} rows of `src`")));
    }
    Ok(())
}

/// Row gather: `dst[i, :] = src[rows[i], :]` for row-major `src [src_rows, hidden]` and
/// `dst [rows.len(), hidden]`. Rejects rows outside `src` before writing anything.
pub fn permute<T: Copy + Send + Sync>(src: &[T], hidden: usize, rows: &[u64], dst: &mut [T]) -> Result<()> {
    gather(src, hidden, rows, 1, dst, "rows")
}

/// The dispatch permute: `dst[i, :] = src[permutation[i] / top_k, :]`, with the routing
/// permutation (`Routing::permutation`) and tokens `src [T, hidden]`.
pub fn permute_tokens<T: Copy + Send + Sync>(
    src: &[T],
    hidden: usize,
    permutation: &[u64],
    top_k: usize,
    dst: &mut [T],
) -> Result<()> {
    if top_k == 0 {
        return Err(invalid("top_k must be >= 1, got 0".into()));
    }
    gather(src, hidden, permutation, top_k, dst, "permutation")
}

// ---------------------------------------------------------------------------------------------
// Element types.

/// Accumulator types: f32 (for f32, bf16, f16 data) and f64.
trait Acc: Copy + Default + Send + Sync + Add<Output = Self> + Mul<Output = Self> + 'static {}
impl Acc for f32 {}
impl Acc for f64 {}

fn dtype_name(buf: &HostBuf) -> &'static str {
    match buf {
        HostBuf::F32(_) => "f32",
        HostBuf::F64(_) => "f64",
        HostBuf::F16(_) => "f16",
        HostBuf::Bf16(_) => "bf16",
    }
}

fn same_dtype(bufs: &[(&str, HostBuf)]) -> Result<()> {
    let (first, b0) = bufs[0];
    for &(name, b) in &bufs[1..] {
        if std::mem::discriminant(&b) != std::mem::discriminant(&b0) {
            return Err(invalid(format!(
                "`{first}` is {} but `{name}` is {}: all buffers must have one element type",
                dtype_name(&b0),
                dtype_name(&b)
            )));
        }
    }
    Ok(())
}

fn ident<T>(x: T) -> T {
    x
}

// ---------------------------------------------------------------------------------------------
// Unpermute (gather, weighted sum over k).

/// The combine unpermute: `out[t, :] = Σ_k w[t, k] · permuted[inv[t·K + k], :]`, where `inv` is
/// the inverse of `permutation` (the seed's `sorted`, a permutation of `0..T·K`) and
/// `permuted [T·K, hidden]` is in permuted order. `probs [T, K]` (same element type) are the
/// weights; `None` weighs every slot 1 (the seed's unpermute without probabilities, whose
/// topk is then 1). The sum runs over k in k order, in f32 (f64 for f64 data), and is rounded
/// once at the end; the first term is the product itself (no `0 +`), so with K = 1 and no
/// weights the result is an exact inverse of [`permute_tokens`].
pub fn unpermute(
    permuted: HostBuf,
    hidden: usize,
    permutation: &[u64],
    top_k: usize,
    probs: Option<HostBuf>,
    out: HostBufMut,
) -> Result<()> {
    unpermute_with(permuted, hidden, permutation, top_k, probs, out, KernelOptions::default())
}

/// [`unpermute`] with explicit [`KernelOptions`].
pub fn unpermute_with(
    permuted: HostBuf,
    hidden: usize,
    permutation: &[u64],
    top_k: usize,
    probs: Option<HostBuf>,
    out: HostBufMut,
    options: KernelOptions,
) -> Result<()> {
    check_hidden(hidden)?;
    if top_k == 0 {
        return Err(invalid("top_k must be >= 1, got 0".into()));
    }
    let slots = permutation.len();
    if slots % top_k != 0 {
        return Err(invalid(format!("the permutation has {slots} entries, not a multiple of top_k {top_k}")));
    }
    let tokens = slots / top_k;
    let want = slots.checked_mul(hidden).ok_or_else(|| invalid("T·K × hidden overflows".into()))?;
    check_len("permuted", permuted.len(), want, &format!("T·K {slots} × hidden {hidden}"))?;
    check_len("out", out.len(), tokens * hidden, &format!("tokens {tokens} × hidden {hidden}"))?;
    let mut bufs = vec![("permuted", permuted), ("out", out.as_buf())];
    if let Some(p) = probs {
        check_len("probs", p.len(), slots, &format!("tokens {tokens} × top_k {top_k}"))?;
        bufs.push(("probs", p));
    }
    same_dtype(&bufs)?;
    let inv = invert_permutation(permutation)?;
    let threads = options.threads_for(want, PARALLEL_MIN_ELEMS);
    let simd = options.simd();
    macro_rules! go {
        ($y:expr, $p:expr, $out:expr, $dec:expr, $enc:expr, $acc:ty) => {
            unpermute_kernel::<_, $acc>($y, hidden, &inv, top_k, $p, $out, $dec, $enc, threads, simd)
        };
    }
    match (permuted, probs, out) {
        (HostBuf::F32(y), p, HostBufMut::F32(o)) => {
            go!(y, p.map(|p| if let HostBuf::F32(p) = p { p } else { unreachable!() }), o, ident, ident, f32)
        }
        (HostBuf::F64(y), p, HostBufMut::F64(o)) => {
            go!(y, p.map(|p| if let HostBuf::F64(p) = p { p } else { unreachable!() }), o, ident, ident, f64)
        }
        (HostBuf::Bf16(y), p, HostBufMut::Bf16(o)) => go!(
            y,
            p.map(|p| if let HostBuf::Bf16(p) = p { p } else { unreachable!() }),
            o,
            bf16_to_f32,
            f32_to_bf16,
            f32
        ),
        (HostBuf::F16(y), p, HostBufMut::F16(o)) => go!(
            y,
            p.map(|p| if let HostBuf::F16(p) = p { p } else { unreachable!() }),
            o,
            f16_to_f32,
            f32_to_f16,
            f32
        ),
        _ => unreachable!("dtypes checked above"),
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn unpermute_kernel<T: Copy + Send + Sync, A: Acc>(
    y: &[T],
    hidden: usize,
    inv: &[u64],
    k: usize,
    probs: Option<&[T]>,
    out: &mut [T],
    dec: impl Fn(T) -> A + Sync,
    enc: impl Fn(A) -> T + Sync,
    threads: usize,
    simd: bool,
) {
    let per_chunk = (PARALLEL_MIN_ELEMS / 4 / (hidden * k)).max(1);
    for_chunks(out, per_chunk * hidden, threads, |c, out| {
        let rows = Rows { y, hidden, inv, k, probs, first: c * per_chunk };
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: the CPU has AVX2 and FMA (checked at run time).
            return unsafe { unpermute_rows_avx2(&rows, out, &dec, &enc) };
        }
        let _ = simd;
        unpermute_rows(&rows, out, &dec, &enc)
    });
}

/// The inputs of one chunk of unpermuted tokens, starting at token `first`.
struct Rows<'a, T> {
    y: &'a [T],
    hidden: usize,
    inv: &'a [u64],
    k: usize,
    probs: Option<&'a [T]>,
    first: usize,
}

/// [`unpermute_rows`] compiled for AVX2 (element-wise operations only, so the results are
/// those of the portable build).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn unpermute_rows_avx2<T: Copy, A: Acc>(
    rows: &Rows<T>,
    out: &mut [T],
    dec: &impl Fn(T) -> A,
    enc: &impl Fn(A) -> T,
) {
    unpermute_rows(rows, out, dec, enc)
}

#[inline(always)]
fn unpermute_rows<T: Copy, A: Acc>(
    rows: &Rows<T>,
    out: &mut [T],
    dec: &impl Fn(T) -> A,
    enc: &impl Fn(A) -> T,
) {
    let (hidden, k) = (rows.hidden, rows.k);
    let mut acc = vec![A::default(); hidden];
    for (i, dst) in out.chunks_exact_mut(hidden).enumerate() {
        let t = rows.first + i;
        for kk in 0..k {
            let slot = t * k + kk;
            let r = rows.inv[slot] as usize;
            let row = &rows.y[r * hidden..(r + 1) * hidden];
            match (rows.probs, kk) {
                (None, 0) => acc.iter_mut().zip(row).for_each(|(a, &v)| *a = dec(v)),
                (None, _) => acc.iter_mut().zip(row).for_each(|(a, &v)| *a = *a + dec(v)),
                (Some(p), 0) => {
                    let w = dec(p[slot]);
                    acc.iter_mut().zip(row).for_each(|(a, &v)| *a = w * dec(v));
                }
                (Some(p), _) => {
                    let w = dec(p[slot]);
                    acc.iter_mut().zip(row).for_each(|(a, &v)| *a = *a + w * dec(v));
                }
            }
        }
        dst.iter_mut().zip(&acc).for_each(|(d, &a)| *d = enc(a));
    }
}

// ---------------------------------------------------------------------------------------------
// Grouped GEMM.

/// Rows of the register tile (all accumulator types).
const MR: usize = 6;
/// Depth of a K block: every output element is a sum of per-block partial sums, added in
/// block order. Fixed, so results do not depend on how C is split over threads.
/// cbindgen:ignore
pub const GEMM_KC: usize = 256;
/// Rows of A packed at a time (a multiple of MR).
const MC: usize = 72;
/// Elements of packed B per task and thread: B is packed this many K blocks at a time.
const B_PACK_BUDGET: usize = 1 << 20;
/// The most rows of C per task (a multiple of MR): B is packed once per task and K block, so
/// tasks are tall; a group's rows are cut into near-equal parts of at most MB rows.
const MB: usize = 1020;

/// The per-accumulator-type parts of the GEMM: register-tile width, columns per task, and the
/// micro-kernel `c[i·ldc + j] += Σ_p a[p·MR + i] · b[p·NR + j]` over a full MR × NR tile.
trait GemmAcc: Acc {
    const NR: usize;
    const NC: usize;
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
        simd: bool,
        tmp: &mut Vec<Self>,
    );
    fn kernel(simd: bool, kc: usize, a: &[Self], b: &[Self], c: &mut [Self], ldc: usize);
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
    const NR: usize = 16;
    const NC: usize = 256;
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
        simd: bool,
        tmp: &mut Vec<f32>,
    ) {
        #[cfg(target_arch = "x86_64")]
        if simd && op.s_k == 1 {
            // SAFETY: the CPU has AVX2 and FMA (`simd` comes from the run-time check).
            return unsafe { x86::pack_b_t16(src, op, mn0, len, k0, klen, dst, dec, tmp) };
        }
        let _ = (simd, tmp);
        pack_blocks::<T, f32, 16>(src, op, mn0, len, k0, klen, dst, dec)
    }
    #[inline(always)]
    fn kernel(simd: bool, kc: usize, a: &[f32], b: &[f32], c: &mut [f32], ldc: usize) {
        assert!(a.len() >= kc * MR && b.len() >= kc * 16 && c.len() >= (MR - 1) * ldc + 16 && ldc >= 16);
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: the CPU has AVX2 and FMA (`simd` comes from `simd()`), and the lengths
            // checked above cover every access of the kernel.
            return unsafe { x86::kernel_f32(kc, a.as_ptr(), b.as_ptr(), c.as_mut_ptr(), ldc) };
        }
        let _ = simd;
        portable_kernel::<f32, 16>(kc, a, b, c, ldc)
    }
}

/// The portable micro-kernel (f32 and f64): an MR × NR tile of C += A-panel × B-panel over
/// `kc` steps, for CPUs without AVX2/FMA.
#[inline(always)]
fn portable_kernel<T, const NR: usize>(kc: usize, a: &[T], b: &[T], c: &mut [T], ldc: usize)
where
    T: Copy + Default + std::ops::AddAssign + std::ops::Mul<Output = T>,
{
    let mut acc = [[T::default(); NR]; MR];
    for (ap, bp) in a.chunks_exact(MR).zip(b.chunks_exact(NR)).take(kc) {
        for i in 0..MR {
            for j in 0..NR {
                acc[i][j] += ap[i] * bp[j];
            }
        }
    }
    for (i, row) in acc.iter().enumerate() {
        for (cv, &v) in c[i * ldc..i * ldc + NR].iter_mut().zip(row) {
            *cv += v;
        }
    }
}

impl GemmAcc for f64 {
    const NR: usize = 8;
    const NC: usize = 128;
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
        _simd: bool,
        _tmp: &mut Vec<f64>,
    ) {
        pack_blocks::<T, f64, 8>(src, op, mn0, len, k0, klen, dst, dec)
    }
    #[inline(always)]
    fn kernel(simd: bool, kc: usize, a: &[f64], b: &[f64], c: &mut [f64], ldc: usize) {
        assert!(a.len() >= kc * MR && b.len() >= kc * 8 && c.len() >= (MR - 1) * ldc + 8 && ldc >= 8);
        #[cfg(target_arch = "x86_64")]
        if simd {
            // SAFETY: as for f32.
            return unsafe { x86::kernel_f64(kc, a.as_ptr(), b.as_ptr(), c.as_mut_ptr(), ldc) };
        }
        let _ = simd;
        portable_kernel::<f64, 8>(kc, a, b, c, ldc)
    }
}

fn simd_available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// AVX2 + FMA register tiles: 12 accumulators (6 rows × two 8-float or two 4-double vectors).
#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{GEMM_KC, MR, Operand, pack, round_up};

    /// The columns of an 8 × 8 block given as 8 rows.
    #[inline]
    #[target_feature(enable = "avx2")]
    fn transpose8(r: [__m256; 8]) -> [__m256; 8] {
        let t0 = _mm256_unpacklo_ps(r[0], r[1]);
        let t1 = _mm256_unpackhi_ps(r[0], r[1]);
        let t2 = _mm256_unpacklo_ps(r[2], r[3]);
        let t3 = _mm256_unpackhi_ps(r[2], r[3]);
        let t4 = _mm256_unpacklo_ps(r[4], r[5]);
        let t5 = _mm256_unpackhi_ps(r[4], r[5]);
        let t6 = _mm256_unpacklo_ps(r[6], r[7]);
        let t7 = _mm256_unpackhi_ps(r[6], r[7]);
        // Columns j (low 128 bits) and j + 4 (high) of rows 0..4, then of rows 4..8.
        let s0 = _mm256_shuffle_ps::<0x44>(t0, t2);
        let s1 = _mm256_shuffle_ps::<0xee>(t0, t2);
        let s2 = _mm256_shuffle_ps::<0x44>(t1, t3);
        let s3 = _mm256_shuffle_ps::<0xee>(t1, t3);
        let s4 = _mm256_shuffle_ps::<0x44>(t4, t6);
        let s5 = _mm256_shuffle_ps::<0xee>(t4, t6);
        let s6 = _mm256_shuffle_ps::<0x44>(t5, t7);
        let s7 = _mm256_shuffle_ps::<0xee>(t5, t7);
        [
            _mm256_permute2f128_ps::<0x20>(s0, s4),
            _mm256_permute2f128_ps::<0x20>(s1, s5),
            _mm256_permute2f128_ps::<0x20>(s2, s6),
            _mm256_permute2f128_ps::<0x20>(s3, s7),
            _mm256_permute2f128_ps::<0x31>(s0, s4),
            _mm256_permute2f128_ps::<0x31>(s1, s5),
            _mm256_permute2f128_ps::<0x31>(s2, s6),
            _mm256_permute2f128_ps::<0x31>(s3, s7),
        ]
    }

    /// `pack_blocks::<T, f32, 16>` for an operand whose depth is contiguous (`s_k == 1`): each
    /// whole panel's 16 rows are first decoded into `tmp` over the full depth range (one long
    /// sequential read per row; reading the rows side by side, often a multiple of 4 KiB
    /// apart, would make the cache sets thrash and defeat the prefetchers), then transposed
    /// 8 × 8 in registers into each K block. Writes the same values as the portable pack.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    pub(super) fn pack_b_t16<T: Copy>(
        src: &[T],
        op: Operand,
        mn0: usize,
        len: usize,
        k0: usize,
        klen: usize,
        dst: &mut [f32],
        dec: &impl Fn(T) -> f32,
        tmp: &mut Vec<f32>,
    ) {
        const R: usize = 16;
        let full = len / R;
        let np = round_up(len, R);
        // Rows of `tmp` one cache line longer than needed, so they do not share cache sets.
        let stride = klen + 16;
        tmp.resize(R * stride, 0.0);
        for q in 0..full {
            let first = op.off + (mn0 + q * R) * op.s_mn + k0;
            for (l, out) in tmp.chunks_exact_mut(stride).enumerate() {
                for (o, &v) in out[..klen].iter_mut().zip(&src[first + l * op.s_mn..][..klen]) {
                    *o = dec(v);
                }
            }
            let rows: [&[f32]; R] = std::array::from_fn(|l| &tmp[l * stride..l * stride + klen]);
            for kb in (k0..k0 + klen).step_by(GEMM_KC) {
                let kc = GEMM_KC.min(k0 + klen - kb);
                let d = kb - k0;
                let panel = &mut dst[np * d + q * kc * R..np * d + (q + 1) * kc * R];
                let whole = kc / 8 * 8;
                for b in (0..whole).step_by(8) {
                    for half in 0..2 {
                        // SAFETY: `d + b + 8 <= klen`: each row holds the 8 floats read.
                        let v: [__m256; 8] = std::array::from_fn(|i| unsafe {
                            _mm256_loadu_ps(rows[half * 8 + i][d + b..d + b + 8].as_ptr())
                        });
                        for (p, col) in transpose8(v).into_iter().enumerate() {
                            let at = &mut panel[(b + p) * R + half * 8..][..8];
                            // SAFETY: `at` holds 8 floats.
                            unsafe { _mm256_storeu_ps(at.as_mut_ptr(), col) };
                        }
                    }
                }
                for p in whole..kc {
                    for l in 0..R {
                        panel[p * R + l] = rows[l][d + p];
                    }
                }
            }
        }
        if full * R < len {
            // The last, partial panel of each block.
            for kb in (k0..k0 + klen).step_by(GEMM_KC) {
                let kc = GEMM_KC.min(k0 + klen - kb);
                let at = np * (kb - k0) + full * kc * R;
                pack::<T, f32, R>(
                    src,
                    op,
                    mn0 + full * R,
                    len - full * R,
                    kb,
                    kc,
                    &mut dst[at..at + R * kc],
                    dec,
                );
            }
        }
    }

    /// `c[i·ldc + j] += Σ_p a[p·6 + i] · b[p·16 + j]`, i < 6, j < 16.
    ///
    /// # Safety
    /// AVX2 and FMA are available; `a` holds 6·kc, `b` 16·kc floats, and `c` a 6 × 16 tile
    /// with row stride `ldc`.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn kernel_f32(kc: usize, a: *const f32, b: *const f32, c: *mut f32, ldc: usize) {
        // SAFETY: the caller's contract covers every pointer offset below.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); 2]; MR];
            for p in 0..kc {
                let bp = b.add(p * 16);
                let b0 = _mm256_loadu_ps(bp);
                let b1 = _mm256_loadu_ps(bp.add(8));
                let ap = a.add(p * MR);
                for (i, row) in acc.iter_mut().enumerate() {
                    let ai = _mm256_broadcast_ss(&*ap.add(i));
                    row[0] = _mm256_fmadd_ps(ai, b0, row[0]);
                    row[1] = _mm256_fmadd_ps(ai, b1, row[1]);
                }
            }
            for (i, row) in acc.iter().enumerate() {
                let cp = c.add(i * ldc);
                _mm256_storeu_ps(cp, _mm256_add_ps(_mm256_loadu_ps(cp), row[0]));
                _mm256_storeu_ps(cp.add(8), _mm256_add_ps(_mm256_loadu_ps(cp.add(8)), row[1]));
            }
        }
    }

    /// `c[i·ldc + j] += Σ_p a[p·6 + i] · b[p·8 + j]`, i < 6, j < 8.
    ///
    /// # Safety
    /// As for `kernel_f32`, with 8·kc doubles of `b` and a 6 × 8 tile.
    #[target_feature(enable = "avx2,fma")]
    pub(super) unsafe fn kernel_f64(kc: usize, a: *const f64, b: *const f64, c: *mut f64, ldc: usize) {
        // SAFETY: the caller's contract covers every pointer offset below.
        unsafe {
            let mut acc = [[_mm256_setzero_pd(); 2]; MR];
            for p in 0..kc {
                let bp = b.add(p * 8);
                let b0 = _mm256_loadu_pd(bp);
                let b1 = _mm256_loadu_pd(bp.add(4));
                let ap = a.add(p * MR);
                for (i, row) in acc.iter_mut().enumerate() {
                    let ai = _mm256_broadcast_sd(&*ap.add(i));
                    row[0] = _mm256_fmadd_pd(ai, b0, row[0]);
                    row[1] = _mm256_fmadd_pd(ai, b1, row[1]);
                }
            }
            for (i, row) in acc.iter().enumerate() {
                let cp = c.add(i * ldc);
                _mm256_storeu_pd(cp, _mm256_add_pd(_mm256_loadu_pd(cp), row[0]));
                _mm256_storeu_pd(cp.add(4), _mm256_add_pd(_mm256_loadu_pd(cp.add(4)), row[1]));
            }
        }
    }
}

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
    simd: bool,
) {
    let nr = A::NR;
    let mp = round_up(task.m_len, MR);
    let np = round_up(task.n_len, nr);
    let scratch = &mut ws.c[..mp * np];
    scratch.fill(A::default());
    // B is packed a chunk of whole K blocks at a time (all of K when it fits the budget).
    let chunk = (B_PACK_BUDGET / np / GEMM_KC).max(1) * GEMM_KC;
    for c0 in (0..p.k).step_by(chunk) {
        let clen = chunk.min(p.k - c0);
        if ws.b.len() < np * clen {
            ws.b.resize(np * clen, A::default());
        }
        let bchunk = &mut ws.b[..np * clen];
        A::pack_b(b_src, p.b, task.n0, task.n_len, c0, clen, bchunk, dec, simd, &mut ws.t);
        for k0 in (c0..c0 + clen).step_by(GEMM_KC) {
            let kc = GEMM_KC.min(c0 + clen - k0);
            let bpack = &bchunk[np * (k0 - c0)..np * (k0 - c0 + kc)];
            let mut i0 = 0;
            while i0 < task.m_len {
                let mc = MC.min(task.m_len - i0);
                let mcp = round_up(mc, MR);
                let apack = &mut ws.a[..mcp * kc];
                pack::<T, A, MR>(a_src, p.a, task.m0 + i0, mc, k0, kc, apack, dec);
                for jr in 0..np / nr {
                    let bp = &bpack[jr * kc * nr..(jr + 1) * kc * nr];
                    for ir in 0..mcp / MR {
                        let ap = &apack[ir * kc * MR..(ir + 1) * kc * MR];
                        let tile = (i0 + ir * MR) * np + jr * nr;
                        A::kernel(simd, kc, ap, bp, &mut scratch[tile..], np);
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

/// [`run_task`] compiled for AVX2 + FMA, so packing and conversions use them too.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
fn run_task_avx2<T: Copy, A: GemmAcc>(
    task: Task,
    p: &Problem,
    a_src: &[T],
    b_src: &[T],
    out: &SharedOut<T>,
    ws: &mut Workspace<A>,
    dec: &impl Fn(T) -> A,
    enc: &impl Fn(A) -> T,
) {
    run_task(task, p, a_src, b_src, out, ws, dec, enc, true)
}

#[allow(clippy::too_many_arguments)]
fn run_gemm<T: Copy + Send + Sync, A: GemmAcc>(
    a_src: &[T],
    b_src: &[T],
    c: &mut [T],
    problems: &[Problem],
    threads: usize,
    simd: bool,
    dec: impl Fn(T) -> A + Sync,
    enc: impl Fn(A) -> T + Sync,
) {
    let mut tasks = Vec::new();
    for (pi, p) in problems.iter().enumerate() {
        let parts = p.m.div_ceil(MB);
        let rows = if parts == 0 { 0 } else { round_up(p.m.div_ceil(parts), MR) };
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
        let mut ws = Workspace {
            a: vec![A::default(); MC * max_k.min(GEMM_KC)],
            b: Vec::new(),
            c: vec![A::default(); MB * A::NC],
            t: Vec::new(),
        };
        loop {
            let t = next.fetch_add(1, Ordering::Relaxed);
            let Some(&task) = tasks.get(t) else { break };
            let p = &problems[task.problem];
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: the CPU has AVX2 and FMA (`simd` comes from `simd()`).
                unsafe { run_task_avx2(task, p, a_src, b_src, &out, &mut ws, &dec, &enc) };
                continue;
            }
            run_task(task, p, a_src, b_src, &out, &mut ws, &dec, &enc, simd);
        }
    };
    let threads = threads.min(tasks.len());
    if threads <= 1 {
        worker();
    } else {
        std::thread::scope(|scope| {
            let handles: Vec<_> = (1..threads).map(|_| scope.spawn(worker)).collect();
            worker();
            for h in handles {
                if let Err(payload) = h.join() {
                    std::panic::resume_unwind(payload);
                }
            }
        });
    }
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
            .ok_or_else(|| invalid(format!("the group sizes overflow at group_rows[{g}] = {n}")))?;
    }
    Ok((starts, total))
}

fn elems(a: usize, b: usize, what: &str) -> Result<usize> {
    a.checked_mul(b).ok_or_else(|| invalid(format!("the size of `{what}` overflows ({a} × {b})")))
}

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
    let simd = options.simd();
    match (a.1, b.1, c.1) {
        (HostBuf::F32(x), HostBuf::F32(w), HostBufMut::F32(y)) => {
            run_gemm(x, w, y, &problems, threads, simd, ident, ident)
        }
        (HostBuf::F64(x), HostBuf::F64(w), HostBufMut::F64(y)) => {
            run_gemm(x, w, y, &problems, threads, simd, ident::<f64>, ident::<f64>)
        }
        (HostBuf::Bf16(x), HostBuf::Bf16(w), HostBufMut::Bf16(y)) => {
            run_gemm(x, w, y, &problems, threads, simd, bf16_to_f32, f32_to_bf16)
        }
        (HostBuf::F16(x), HostBuf::F16(w), HostBufMut::F16(y)) => {
            run_gemm(x, w, y, &problems, threads, simd, f16_to_f32, f32_to_f16)
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
pub fn grouped_matmul(
    x: HostBuf,
    group_rows: &[u64],
    weight: HostBuf,
    in_features: usize,
    out_features: usize,
    y: HostBufMut,
) -> Result<()> {
    grouped_matmul_with(x, group_rows, weight, in_features, out_features, y, KernelOptions::default())
}

/// [`grouped_matmul`] with explicit [`KernelOptions`].
pub fn grouped_matmul_with(
    x: HostBuf,
    group_rows: &[u64],
    weight: HostBuf,
    in_features: usize,
    out_features: usize,
    y: HostBufMut,
    options: KernelOptions,
) -> Result<()> {
    let (a, b, c) = (("x", x), ("weight", weight), ("y", y));
    grouped(GemmOp::Forward, a, b, c, group_rows, in_features, out_features, options)
}

/// The input gradient of [`grouped_matmul`]: `grad_x[rows of g] = grad_y[rows of g] @ weight[g]`,
/// `grad_y [N, out]`, `grad_x [N, in]`.
pub fn grouped_matmul_grad_input(
    grad_y: HostBuf,
    group_rows: &[u64],
    weight: HostBuf,
    in_features: usize,
    out_features: usize,
    grad_x: HostBufMut,
) -> Result<()> {
    let options = KernelOptions::default();
    grouped_matmul_grad_input_with(grad_y, group_rows, weight, in_features, out_features, grad_x, options)
}

/// [`grouped_matmul_grad_input`] with explicit [`KernelOptions`].
pub fn grouped_matmul_grad_input_with(
    grad_y: HostBuf,
    group_rows: &[u64],
    weight: HostBuf,
    in_features: usize,
    out_features: usize,
    grad_x: HostBufMut,
    options: KernelOptions,
) -> Result<()> {
    let (a, b, c) = (("grad_y", grad_y), ("weight", weight), ("grad_x", grad_x));
    grouped(GemmOp::GradInput, a, b, c, group_rows, in_features, out_features, options)
}

/// The weight gradient of [`grouped_matmul`]: `grad_weight[g] = grad_y[rows of g]^T @ x[rows of g]`,
/// `grad_weight [G, out, in]`; zero for empty groups.
pub fn grouped_matmul_grad_weight(
    grad_y: HostBuf,
    x: HostBuf,
    group_rows: &[u64],
    in_features: usize,
    out_features: usize,
    grad_weight: HostBufMut,
) -> Result<()> {
    let options = KernelOptions::default();
    grouped_matmul_grad_weight_with(grad_y, x, group_rows, in_features, out_features, grad_weight, options)
}

/// [`grouped_matmul_grad_weight`] with explicit [`KernelOptions`].
pub fn grouped_matmul_grad_weight_with(
    grad_y: HostBuf,
    x: HostBuf,
    group_rows: &[u64],
    in_features: usize,
    out_features: usize,
    grad_weight: HostBufMut,
    options: KernelOptions,
) -> Result<()> {
    let (a, b, c) = (("grad_y", grad_y), ("x", x), ("grad_weight", grad_weight));
    grouped(GemmOp::GradWeight, a, b, c, group_rows, in_features, out_features, options)
}
