//! NVRTC (`libnvrtc.so.13` / `.12`), loaded at run time: compiles the CUDA C of `src/backend/cuda/kernels`
//! to PTX or a cubin for one architecture, with an on-disk cache keyed by the source hash, the
//! architecture and the NVRTC version. NVRTC needs no GPU, so CI compiles every kernel.
//! Declarations hand-written from the NVRTC reference (`nvrtc.h`).

use std::ffi::{CStr, CString, c_char, c_int, c_void};
use std::path::PathBuf;

use once_cell::sync::OnceCell;

use crate::backend::{LibrarySpec, Loaded, load};
use crate::error::{Error, ErrorKind, Result};

type NvrtcResult = c_int;
type Program = *mut c_void;

fn cuda_home_dirs() -> Vec<PathBuf> {
    let mut dirs = Vec::new();
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(home) = std::env::var_os(var).filter(|v| !v.is_empty()) {
            dirs.push(PathBuf::from(&home).join("lib64"));
            dirs.push(PathBuf::from(home).join("lib"));
        }
    }
    dirs.push(PathBuf::from("/usr/local/cuda/lib64"));
    dirs
}

pub static SPEC: LibrarySpec = LibrarySpec {
    what: "NVRTC (the CUDA run-time compiler)",
    env_var: "FSDPTURBO_NVRTC_PATH",
    file_names: &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"],
    extra_dirs: cuda_home_dirs,
};

/// What to produce.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Output {
    /// PTX for the virtual architecture `compute_XY` (any later GPU can JIT it).
    Ptx,
    /// Machine code for exactly `sm_XY` (what the launchers load: no JIT at run time).
    Cubin,
}

pub struct Nvrtc {
    _lib: Loaded,
    version: (i32, i32),
    get_error_string: unsafe extern "C" fn(NvrtcResult) -> *const c_char,
    create_program: unsafe extern "C" fn(
        *mut Program,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> NvrtcResult,
    compile_program: unsafe extern "C" fn(Program, c_int, *const *const c_char) -> NvrtcResult,
    get_log_size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult,
    get_log: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult,
    get_ptx_size: unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult,
    get_ptx: unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult,
    get_cubin_size: Option<unsafe extern "C" fn(Program, *mut usize) -> NvrtcResult>,
    get_cubin: Option<unsafe extern "C" fn(Program, *mut c_char) -> NvrtcResult>,
    destroy_program: unsafe extern "C" fn(*mut Program) -> NvrtcResult,
}

// SAFETY: function pointers into a library that is never unloaded; NVRTC is thread-safe.
unsafe impl Send for Nvrtc {}
unsafe impl Sync for Nvrtc {}

static NVRTC: OnceCell<std::result::Result<Nvrtc, Error>> = OnceCell::new();

/// NVRTC, loaded on first use.
pub fn nvrtc() -> Result<&'static Nvrtc> {
    NVRTC.get_or_init(Nvrtc::load).as_ref().map_err(Clone::clone)
}

/// Destroys the program on every path out of `compile`.
struct ProgramGuard<'a>(&'a Nvrtc, Program);

impl Drop for ProgramGuard<'_> {
    fn drop(&mut self) {
        // SAFETY: created by nvrtcCreateProgram, destroyed once.
        unsafe { (self.0.destroy_program)(&mut self.1) };
    }
}

impl Nvrtc {
    fn load() -> Result<Nvrtc> {
        let lib = load(&SPEC)?;
        // SAFETY: each type is nvrtc.h's declaration of that symbol.
        unsafe {
            let version_fn: unsafe extern "C" fn(*mut c_int, *mut c_int) -> NvrtcResult =
                lib.required("nvrtcVersion")?;
            let (mut major, mut minor) = (0, 0);
            version_fn(&mut major, &mut minor);
            Ok(Nvrtc {
                version: (major, minor),
                get_error_string: lib.required("nvrtcGetErrorString")?,
                create_program: lib.required("nvrtcCreateProgram")?,
                compile_program: lib.required("nvrtcCompileProgram")?,
                get_log_size: lib.required("nvrtcGetProgramLogSize")?,
                get_log: lib.required("nvrtcGetProgramLog")?,
                get_ptx_size: lib.required("nvrtcGetPTXSize")?,
                get_ptx: lib.required("nvrtcGetPTX")?,
                get_cubin_size: lib.optional("nvrtcGetCUBINSize"),
                get_cubin: lib.optional("nvrtcGetCUBIN"),
                destroy_program: lib.required("nvrtcDestroyProgram")?,
                _lib: lib,
            })
        }
    }

    /// (major, minor), e.g. (13, 2).
    pub fn version(&self) -> (i32, i32) {
        self.version
    }

    fn error_text(&self, status: NvrtcResult) -> String {
        // SAFETY: returns a static string.
        unsafe { CStr::from_ptr((self.get_error_string)(status)) }.to_string_lossy().into_owned()
    }

    fn check(&self, status: NvrtcResult, call: &str) -> Result<()> {
        if status == 0 {
            return Ok(());
        }
        Err(Error::new(
            ErrorKind::Unavailable,
            format!("NVRTC: {call} failed with {status} ({})", self.error_text(status)),
        ))
    }

    /// Compiles `source` (named `name` in messages) for compute capability `arch` (e.g. 90).
    /// A compile error carries NVRTC's log.
    pub fn compile(&self, source: &str, name: &str, arch: u32, output: Output) -> Result<Vec<u8>> {
        let src =
            CString::new(source).map_err(|_| Error::invalid(format!("kernel source {name} contains NUL")))?;
        let cname = CString::new(name).map_err(|_| Error::invalid("kernel name contains NUL"))?;
        let arch_flag = match output {
            Output::Ptx => format!("--gpu-architecture=compute_{arch}"),
            Output::Cubin => format!("--gpu-architecture=sm_{arch}"),
        };
        let options: Vec<CString> = [arch_flag.as_str(), "--std=c++17", "--fmad=false"]
            .iter()
            .map(|o| CString::new(*o).expect("options have no NUL"))
            .collect();
        let option_ptrs: Vec<*const c_char> = options.iter().map(|o| o.as_ptr()).collect();
        let mut program: Program = std::ptr::null_mut();
        // SAFETY: NUL-terminated strings; no headers.
        self.check(
            unsafe {
                (self.create_program)(
                    &mut program,
                    src.as_ptr(),
                    cname.as_ptr(),
                    0,
                    std::ptr::null(),
                    std::ptr::null(),
                )
            },
            "nvrtcCreateProgram",
        )?;
        let guard = ProgramGuard(self, program);
        // SAFETY: a live program and valid option strings.
        let status =
            unsafe { (self.compile_program)(guard.1, option_ptrs.len() as c_int, option_ptrs.as_ptr()) };
        if status != 0 {
            return Err(Error::new(
                ErrorKind::InvalidArgument,
                format!(
                    "NVRTC {}.{} could not compile {name} for {arch_flag} ({}); compiler log:\n{}",
                    self.version.0,
                    self.version.1,
                    self.error_text(status),
                    self.log(guard.1)
                ),
            ));
        }
        let (size_fn, get_fn, what) = match output {
            Output::Ptx => (Some(self.get_ptx_size), Some(self.get_ptx), "PTX"),
            Output::Cubin => (self.get_cubin_size, self.get_cubin, "CUBIN"),
        };
        let (Some(size_fn), Some(get_fn)) = (size_fn, get_fn) else {
            return Err(Error::new(
                ErrorKind::Unavailable,
                format!(
                    "NVRTC {}.{} cannot produce a {what} (nvrtcGet{what} is missing)",
                    self.version.0, self.version.1
                ),
            ));
        };
        let mut size = 0usize;
        // SAFETY: writes one size.
        self.check(unsafe { size_fn(guard.1, &mut size) }, &format!("nvrtcGet{what}Size"))?;
        let mut out = vec![0u8; size];
        // SAFETY: `out` holds `size` bytes.
        self.check(unsafe { get_fn(guard.1, out.as_mut_ptr().cast()) }, &format!("nvrtcGet{what}"))?;
        if output == Output::Ptx && out.last() == Some(&0) {
            out.pop();
        }
        Ok(out)
    }

    fn log(&self, program: Program) -> String {
        let mut size = 0usize;
        // SAFETY: writes one size.
        if unsafe { (self.get_log_size)(program, &mut size) } != 0 || size == 0 {
            return String::new();
        }
        let mut log = vec![0u8; size];
        // SAFETY: `log` holds `size` bytes.
        unsafe { (self.get_log)(program, log.as_mut_ptr().cast()) };
        String::from_utf8_lossy(&log).trim_end_matches('\0').to_string()
    }

    /// [`Nvrtc::compile`] through the on-disk cache (see [`cache_dir`]); a cache that cannot be
    /// read or written only costs a compile.
    pub fn compile_cached(&self, source: &str, name: &str, arch: u32, output: Output) -> Result<Vec<u8>> {
        let ext = match output {
            Output::Ptx => "ptx",
            Output::Cubin => "cubin",
        };
        let (major, minor) = self.version;
        let file = format!("{name}-{:016x}-sm{arch}-nvrtc{major}.{minor}.{ext}", fnv1a64(source.as_bytes()));
        let dir = cache_dir();
        if let Some(dir) = &dir {
            if let Ok(bytes) = std::fs::read(dir.join(&file)) {
                if !bytes.is_empty() {
                    return Ok(bytes);
                }
            }
        }
        let bytes = self.compile(source, name, arch, output)?;
        if let Some(dir) = dir {
            // Written under a unique name, then renamed: concurrent processes never read half a file.
            let tmp = dir.join(format!("{file}.{}.tmp", std::process::id()));
            if std::fs::create_dir_all(&dir).is_ok() && std::fs::write(&tmp, &bytes).is_ok() {
                let _ = std::fs::rename(&tmp, dir.join(&file));
            }
        }
        Ok(bytes)
    }
}

/// The kernel cache: `FSDPTURBO_KERNEL_CACHE` (empty disables it), else
/// `$XDG_CACHE_HOME/fsdpturbo/kernels`, else `$HOME/.cache/fsdpturbo/kernels`.
pub fn cache_dir() -> Option<PathBuf> {
    if let Some(dir) = std::env::var_os("FSDPTURBO_KERNEL_CACHE") {
        return if dir.is_empty() { None } else { Some(PathBuf::from(dir)) };
    }
    let base =
        std::env::var_os("XDG_CACHE_HOME").filter(|v| !v.is_empty()).map(PathBuf::from).or_else(|| {
            std::env::var_os("HOME").filter(|v| !v.is_empty()).map(|h| PathBuf::from(h).join(".cache"))
        })?;
    Some(base.join("fsdpturbo").join("kernels"))
}

/// 64-bit FNV-1a: a stable hash of the source text (the cache key needs stability across
/// builds and processes, not collision resistance against an adversary).
fn fnv1a64(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, &b| (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3))
}
