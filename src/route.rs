//! Token routing for expert parallelism (docs/design.md §4.4).
//!
//! Routing metadata, for one rank of an EP group of size P with E global experts (L = E / P
//! local experts per rank) and T tokens routed to K experts each:
//!
//! - [`route`]: the histogram `cnt[e]` of the flat expert ids, the seed's `sorted` (a stable
//!   counting sort of the flat ids: expert-major, ties by flat position, so it equals
//!   `argsort(f, stable=True)`), and the rows sent to each destination rank
//!   (`cnt.reshape(P, L).sum(1)`). Out-of-range ids are rejected (the seed's `histc` silently
//!   drops them or re-bins E into E - 1).
//!
//! The routing operators on token rows (row-major, `hidden` columns; the element types of
//! [`HostBuf`]), checked here and computed by `host::permute`:
//!
//! - [`permute`] / [`permute_tokens`]: a row gather (`index_select`).
//! - [`unpermute`]: `out[t] = Σ_k w[t, k] · y[inv(t·K + k)]` through the inverse permutation:
//!   a gather, then a sum over k in k order with f32 accumulation (f64 for f64 data), rounded
//!   once at the end. Deterministic, and without the seed's `index_copy` + in-dtype products.
//!
//! The experts' grouped GEMM is `host::gemm`.

use crate::error::{Error, ErrorKind, Result};
use crate::host::buf::{check_len, same_dtype};
use crate::host::{HostBuf, HostBufMut, KernelOptions};

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
    crate::host::permute::gather_rows(src, hidden, rows, divisor, dst);
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
    crate::host::permute::unpermute_rows_into(permuted, hidden, &inv, top_k, probs, out, want, options)
}
