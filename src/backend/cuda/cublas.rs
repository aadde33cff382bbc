//! cuBLAS (`libcublas.so.13` / `.12`), loaded at run time, for the experts' grouped GEMM and its
//! two backward GEMMs (host/gemm `grouped_mm*`: row-major `x [N, in]`, `W [G, out, in]`,
//! `y = x_g @ W[g]^T` per group of consecutive rows). `cublasGemmGroupedBatchedEx` (cuBLAS
//! 12.5+) runs all groups in one call; without it, one `cublasGemmEx` per group. Signatures and
//! enum values from cuBLAS's `cublas_api.h`. Inputs of 16-bit types compute in f32, f64 in
//! f64. Empty groups give no rows and an all-zero weight gradient.

use std::collections::HashMap;
use std::ffi::{c_int, c_void};

use once_cell::sync::OnceCell;
use parking_lot::Mutex;

use super::driver::{CUstream, driver};
use crate::backend::Stream;
use crate::backend::{LibrarySpec, Loaded, load};
use crate::dtype::Dtype;
use crate::error::{Error, ErrorKind, Result};

type Status = c_int;
type Handle = *mut c_void;

const CUBLAS_OP_N: c_int = 0;
const CUBLAS_OP_T: c_int = 1;
const CUDA_R_32F: c_int = 0;
const CUDA_R_64F: c_int = 1;
const CUDA_R_16F: c_int = 2;
const CUDA_R_16BF: c_int = 14;
const CUBLAS_COMPUTE_32F: c_int = 68;
const CUBLAS_COMPUTE_64F: c_int = 70;
const CUBLAS_GEMM_DEFAULT: c_int = -1;

pub static SPEC: LibrarySpec = LibrarySpec {
    what: "cuBLAS",
    env_var: "FSDPTURBO_CUBLAS_PATH",
    file_names: &["libcublas.so.13", "libcublas.so.12", "libcublas.so"],
    extra_dirs: LibrarySpec::no_extra_dirs,
};

type GemmEx = unsafe extern "C" fn(
    Handle,
    c_int,
    c_int,
    c_int,
    c_int,
    c_int,
    *const c_void,
    *const c_void,
    c_int,
    c_int,
    *const c_void,
    c_int,
    c_int,
    *const c_void,
    *mut c_void,
    c_int,
    c_int,
    c_int,
    c_int,
) -> Status;

type GroupedEx = unsafe extern "C" fn(
    Handle,
    *const c_int,
    *const c_int,
    *const c_int,
    *const c_int,
    *const c_int,
    *const c_void,
    *const *const c_void,
    c_int,
    *const c_int,
    *const *const c_void,
    c_int,
    *const c_int,
    *const c_void,
    *const *mut c_void,
    c_int,
    *const c_int,
    c_int,
    *const c_int,
    c_int,
) -> Status;

pub struct Cublas {
    _lib: Loaded,
    create: unsafe extern "C" fn(*mut Handle) -> Status,
    set_stream: unsafe extern "C" fn(Handle, CUstream) -> Status,
    get_version: unsafe extern "C" fn(Handle, *mut c_int) -> Status,
    gemm_ex: GemmEx,
    grouped: Option<GroupedEx>,
    /// One handle per device, used under the lock (a handle is not for concurrent use).
    handles: Mutex<HashMap<i32, usize>>,
}

// SAFETY: function pointers into a library that is never unloaded; handles are used under a lock.
unsafe impl Send for Cublas {}
unsafe impl Sync for Cublas {}

static CUBLAS: OnceCell<std::result::Result<Cublas, Error>> = OnceCell::new();

/// cuBLAS, loaded on first use.
pub fn cublas() -> Result<&'static Cublas> {
    CUBLAS.get_or_init(Cublas::load).as_ref().map_err(Clone::clone)
}

/// Which GEMM of the grouped matmul.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GemmKind {
    /// `y [N, out] = x_g @ W[g]^T`; a = x, b = W, c = y.
    Forward,
    /// `grad_x [N, in] = grad_y_g @ W[g]`; a = grad_y, b = W, c = grad_x.
    GradInput,
    /// `grad_W[g] [out, in] = grad_y_g^T @ x_g`; a = grad_y, b = x, c = grad_W.
    GradWeight,
}

/// One GEMM in cuBLAS's column-major terms.
struct Problem {
    transa: c_int,
    transb: c_int,
    m: c_int,
    n: c_int,
    k: c_int,
    a: u64,
    lda: c_int,
    b: u64,
    ldb: c_int,
    c: u64,
}

impl Cublas {
    fn load() -> Result<Cublas> {
        let lib = load(&SPEC)?;
        // SAFETY: each type is cublas_api.h's declaration of that symbol.
        unsafe {
            Ok(Cublas {
                create: lib.required("cublasCreate_v2")?,
                set_stream: lib.required("cublasSetStream_v2")?,
                get_version: lib.required("cublasGetVersion_v2")?,
                gemm_ex: lib.required("cublasGemmEx")?,
                grouped: lib.optional("cublasGemmGroupedBatchedEx"),
                handles: Mutex::new(HashMap::new()),
                _lib: lib,
            })
        }
    }

    fn check(status: Status, call: &str) -> Result<()> {
        if status == 0 {
            return Ok(());
        }
        Err(Error::new(ErrorKind::Unavailable, format!("cuBLAS: {call} failed with status {status}")))
    }

    fn handle(&self, handles: &mut HashMap<i32, usize>, device: i32) -> Result<Handle> {
        if let Some(&h) = handles.get(&device) {
            return Ok(h as Handle);
        }
        let mut h: Handle = std::ptr::null_mut();
        // SAFETY: writes one handle; the device's context is current (use_device before).
        Self::check(unsafe { (self.create)(&mut h) }, "cublasCreate")?;
        handles.insert(device, h as usize);
        Ok(h)
    }

    /// The library version (e.g. 130200), through a handle on `device`.
    pub fn version(&self, device: i32) -> Result<i32> {
        driver()?.use_device(device)?;
        let mut handles = self.handles.lock();
        let h = self.handle(&mut handles, device)?;
        let mut v = 0;
        // SAFETY: writes one int.
        Self::check(unsafe { (self.get_version)(h, &mut v) }, "cublasGetVersion")?;
        Ok(v)
    }
}

fn types(elem: Dtype) -> Result<(c_int, c_int)> {
    Ok(match elem {
        Dtype::F32 => (CUDA_R_32F, CUBLAS_COMPUTE_32F),
        Dtype::F64 => (CUDA_R_64F, CUBLAS_COMPUTE_64F),
        Dtype::F16 => (CUDA_R_16F, CUBLAS_COMPUTE_32F),
        Dtype::Bf16 => (CUDA_R_16BF, CUBLAS_COMPUTE_32F),
        Dtype::U8 | Dtype::I32 | Dtype::I64 => {
            return Err(Error::invalid(format!(
                "the grouped GEMM takes floating-point elements, not {elem}"
            )));
        }
    })
}

fn dim(v: usize, what: &str) -> Result<c_int> {
    c_int::try_from(v).map_err(|_| {
        Error::invalid(format!("grouped GEMM: {what} = {v} is above the int range cuBLAS takes"))
    })
}

/// Device pointers of one grouped GEMM.
pub struct GemmBuffers {
    pub a: u64,
    pub b: u64,
    pub c: u64,
    /// 3 × groups × 8 bytes: the device pointer arrays of the grouped call.
    pub workspace: u64,
    pub workspace_bytes: usize,
}

/// Workspace bytes of [`grouped_gemm`].
pub fn grouped_gemm_workspace(groups: usize) -> usize {
    groups.saturating_mul(24)
}

/// The column-major GEMMs of one grouped-matmul call (row-major operands seen transposed).
struct Plan {
    problems: Vec<Problem>,
    /// Byte ranges of `c` to zero: the weight gradients of empty groups.
    zero: Vec<(u64, usize)>,
    /// The `ldc` every problem shares.
    ldc: c_int,
}

fn problems(
    elem: Dtype,
    kind: GemmKind,
    counts: &[u64],
    in_features: usize,
    out_features: usize,
    buffers: &GemmBuffers,
) -> Result<Plan> {
    let size = elem.size() as u64;
    let (inf, outf) = (dim(in_features, "in")?, dim(out_features, "out")?);
    let mut problems = Vec::with_capacity(counts.len());
    let mut zero = Vec::new();
    let mut row = 0u64;
    for (g, &n) in counts.iter().enumerate() {
        let weight = (g * in_features * out_features) as u64 * size;
        if n == 0 {
            if kind == GemmKind::GradWeight {
                zero.push((buffers.c + weight, in_features * out_features * elem.size()));
            }
            continue;
        }
        let rows = dim(n as usize, &format!("counts[{g}]"))?;
        let (x_at, y_at) = (row * in_features as u64 * size, row * out_features as u64 * size);
        problems.push(match kind {
            GemmKind::Forward => Problem {
                transa: CUBLAS_OP_T,
                transb: CUBLAS_OP_N,
                m: outf,
                n: rows,
                k: inf,
                a: buffers.b + weight,
                lda: inf,
                b: buffers.a + x_at,
                ldb: inf,
                c: buffers.c + y_at,
            },
            GemmKind::GradInput => Problem {
                transa: CUBLAS_OP_N,
                transb: CUBLAS_OP_N,
                m: inf,
                n: rows,
                k: outf,
                a: buffers.b + weight,
                lda: inf,
                b: buffers.a + y_at,
                ldb: outf,
                c: buffers.c + x_at,
            },
            GemmKind::GradWeight => Problem {
                transa: CUBLAS_OP_N,
                transb: CUBLAS_OP_T,
                m: inf,
                n: outf,
                k: rows,
                a: buffers.b + x_at,
                lda: inf,
                b: buffers.a + y_at,
                ldb: outf,
                c: buffers.c + weight,
            },
        });
        row += n;
    }
    let ldc = match kind {
        GemmKind::Forward => outf,
        GemmKind::GradInput | GemmKind::GradWeight => inf,
    };
    Ok(Plan { problems, zero, ldc })
}

/// One of the grouped matmul's GEMMs over groups of `counts[g]` consecutive rows, ordered on
/// `stream`. `force_loop` uses one cublasGemmEx per group even where the grouped call exists.
#[allow(clippy::too_many_arguments)]
pub fn grouped_gemm(
    device: i32,
    stream: Stream,
    elem: Dtype,
    kind: GemmKind,
    counts: &[u64],
    in_features: usize,
    out_features: usize,
    buffers: &GemmBuffers,
    force_loop: bool,
) -> Result<()> {
    if in_features == 0 || out_features == 0 {
        return Err(Error::invalid(format!(
            "grouped GEMM: in ({in_features}) and out ({out_features}) features must be >= 1"
        )));
    }
    let need = grouped_gemm_workspace(counts.len());
    if buffers.workspace_bytes < need {
        return Err(Error::new(
            ErrorKind::BufferTooSmall,
            format!("the grouped GEMM workspace has {} bytes; {need} are needed", buffers.workspace_bytes),
        ));
    }
    let drv = driver()?;
    let lib = cublas()?;
    drv.use_device(device)?;
    let Plan { problems, zero, ldc } = problems(elem, kind, counts, in_features, out_features, buffers)?;
    for (at, bytes) in zero {
        drv.memset(at, 0, bytes, stream)?;
    }
    if problems.is_empty() {
        return Ok(());
    }
    let (data_type, compute) = types(elem)?;
    let (one32, zero32, one64, zero64) = (1.0f32, 0.0f32, 1.0f64, 0.0f64);
    let mut handles = lib.handles.lock();
    let h = lib.handle(&mut handles, device)?;
    // SAFETY: a live handle on the current device; the caller's stream.
    Cublas::check(unsafe { (lib.set_stream)(h, stream.0) }, "cublasSetStream")?;
    match lib.grouped.filter(|_| !force_loop) {
        Some(grouped) => {
            let g = problems.len();
            let mut pointers = Vec::with_capacity(3 * g);
            pointers.extend(problems.iter().map(|p| p.a));
            pointers.extend(problems.iter().map(|p| p.b));
            pointers.extend(problems.iter().map(|p| p.c));
            let bytes: Vec<u8> = pointers.iter().flat_map(|p| p.to_ne_bytes()).collect();
            drv.write(buffers.workspace, &bytes, stream)?;
            let column = |f: fn(&Problem) -> c_int| problems.iter().map(f).collect::<Vec<c_int>>();
            let (ta, tb, m, n, k) = (
                column(|p| p.transa),
                column(|p| p.transb),
                column(|p| p.m),
                column(|p| p.n),
                column(|p| p.k),
            );
            let (lda, ldb, ldcs, sizes) =
                (column(|p| p.lda), column(|p| p.ldb), vec![ldc; g], vec![1 as c_int; g]);
            let (alpha, beta): (Vec<u8>, Vec<u8>) = if elem == Dtype::F64 {
                (one64.to_ne_bytes().repeat(g), zero64.to_ne_bytes().repeat(g))
            } else {
                (one32.to_ne_bytes().repeat(g), zero32.to_ne_bytes().repeat(g))
            };
            let arrays = buffers.workspace;
            let ptr_at = |i: u64| (arrays + 8 * i * g as u64) as *const *const c_void;
            // SAFETY: host arrays of g entries, device pointer arrays of g entries (written above
            // on the same stream), alpha/beta of the compute type's scale type.
            let status = unsafe {
                grouped(
                    h,
                    ta.as_ptr(),
                    tb.as_ptr(),
                    m.as_ptr(),
                    n.as_ptr(),
                    k.as_ptr(),
                    alpha.as_ptr().cast(),
                    ptr_at(0),
                    data_type,
                    lda.as_ptr(),
                    ptr_at(1),
                    data_type,
                    ldb.as_ptr(),
                    beta.as_ptr().cast(),
                    ptr_at(2) as *const *mut c_void,
                    data_type,
                    ldcs.as_ptr(),
                    g as c_int,
                    sizes.as_ptr(),
                    compute,
                )
            };
            Cublas::check(status, "cublasGemmGroupedBatchedEx")
        }
        None => {
            let (alpha, beta): (*const c_void, *const c_void) = if elem == Dtype::F64 {
                ((&one64 as *const f64).cast(), (&zero64 as *const f64).cast())
            } else {
                ((&one32 as *const f32).cast(), (&zero32 as *const f32).cast())
            };
            for p in &problems {
                // SAFETY: one column-major GEMM on the caller's device buffers.
                let status = unsafe {
                    (lib.gemm_ex)(
                        h,
                        p.transa,
                        p.transb,
                        p.m,
                        p.n,
                        p.k,
                        alpha,
                        p.a as *const c_void,
                        data_type,
                        p.lda,
                        p.b as *const c_void,
                        data_type,
                        p.ldb,
                        beta,
                        p.c as *mut c_void,
                        data_type,
                        ldc,
                        compute,
                        CUBLAS_GEMM_DEFAULT,
                    )
                };
                Cublas::check(status, "cublasGemmEx")?;
            }
            Ok(())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// cublasGemmEx's definition on host f32 memory: C = op(A) op(B), column-major, beta 0.
    fn gemm(p: &Problem, ldc: c_int) {
        let (m, n, k) = (p.m as usize, p.n as usize, p.k as usize);
        let at = |base: u64, i: usize| unsafe { *(base as *const f32).add(i) };
        for j in 0..n {
            for i in 0..m {
                let mut acc = 0.0f64;
                for l in 0..k {
                    let a = if p.transa == CUBLAS_OP_N {
                        at(p.a, i + l * p.lda as usize)
                    } else {
                        at(p.a, l + i * p.lda as usize)
                    };
                    let b = if p.transb == CUBLAS_OP_N {
                        at(p.b, l + j * p.ldb as usize)
                    } else {
                        at(p.b, j + l * p.ldb as usize)
                    };
                    acc += a as f64 * b as f64;
                }
                unsafe { *(p.c as *mut f32).add(i + j * ldc as usize) = acc as f32 };
            }
        }
    }

    fn run(kind: GemmKind, counts: &[u64], a: &[f32], b: &[f32], c: &mut [f32], inf: usize, outf: usize) {
        let buffers = GemmBuffers {
            a: a.as_ptr() as u64,
            b: b.as_ptr() as u64,
            c: c.as_mut_ptr() as u64,
            workspace: 0,
            workspace_bytes: 0,
        };
        let Plan { problems, zero, ldc } = problems(Dtype::F32, kind, counts, inf, outf, &buffers).unwrap();
        for (at, bytes) in zero {
            unsafe { std::ptr::write_bytes(at as *mut u8, 0, bytes) };
        }
        problems.iter().for_each(|p| gemm(p, ldc));
    }

    /// The column-major problems compute the row-major grouped matmul of host/gemm, including empty
    /// groups (no rows; a zero weight gradient).
    #[test]
    fn column_major_problems_are_the_row_major_grouped_mm() {
        let (inf, outf, counts) = (5usize, 3usize, [2u64, 0, 3, 1]);
        let rows = counts.iter().sum::<u64>() as usize;
        let g = counts.len();
        let x: Vec<f32> = (0..rows * inf).map(|i| ((i * 7) % 11) as f32 - 5.0).collect();
        let w: Vec<f32> = (0..g * outf * inf).map(|i| ((i * 5) % 13) as f32 - 6.0).collect();
        let gy: Vec<f32> = (0..rows * outf).map(|i| ((i * 3) % 7) as f32 - 3.0).collect();
        let group_of: Vec<usize> =
            counts.iter().enumerate().flat_map(|(e, &n)| std::iter::repeat_n(e, n as usize)).collect();

        let mut y = vec![f32::NAN; rows * outf];
        run(GemmKind::Forward, &counts, &x, &w, &mut y, inf, outf);
        for r in 0..rows {
            for o in 0..outf {
                let want: f32 =
                    (0..inf).map(|i| x[r * inf + i] * w[(group_of[r] * outf + o) * inf + i]).sum();
                assert_eq!(y[r * outf + o], want, "y[{r}, {o}]");
            }
        }
        let mut gx = vec![f32::NAN; rows * inf];
        run(GemmKind::GradInput, &counts, &gy, &w, &mut gx, inf, outf);
        for r in 0..rows {
            for i in 0..inf {
                let want: f32 =
                    (0..outf).map(|o| gy[r * outf + o] * w[(group_of[r] * outf + o) * inf + i]).sum();
                assert_eq!(gx[r * inf + i], want, "grad_x[{r}, {i}]");
            }
        }
        let mut gw = vec![f32::NAN; g * outf * inf];
        run(GemmKind::GradWeight, &counts, &gy, &x, &mut gw, inf, outf);
        for e in 0..g {
            for o in 0..outf {
                for i in 0..inf {
                    let want: f32 = (0..rows)
                        .filter(|&r| group_of[r] == e)
                        .map(|r| gy[r * outf + o] * x[r * inf + i])
                        .sum();
                    assert_eq!(gw[(e * outf + o) * inf + i], want, "grad_w[{e}, {o}, {i}]");
                }
            }
        }
        assert!(
            gw[outf * inf..2 * outf * inf].iter().all(|&v| v == 0.0),
            "the empty group's gradient is zero"
        );
    }
}
