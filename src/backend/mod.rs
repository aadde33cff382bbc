//! Vendor libraries loaded at run time (one file per library, in a folder per vendor family:
//! `cuda/`, `ascend/`), so that one build serves hosts with and without CUDA or CANN. This module holds what they share: where a library is looked
//! for, and how its symbols are resolved without ever panicking.
//!
//! Search order for a library: its environment variable (an explicit file; no fallback when it
//! is set), then the directories handed over by the embedder (the Python layer passes the
//! `nvidia/*/lib` folders of installed wheels), then the library's own extra directories (e.g.
//! under `ASCEND_HOME_PATH`), then the bare file names through the system loader.
//! Loaded libraries are never unloaded: resolved function pointers stay valid for the process.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

use parking_lot::RwLock;

use crate::error::{Error, ErrorKind, Result};

pub mod ascend;
pub mod cuda;

/// A device stream (`cudaStream_t`, `aclrtStream`) of the caller, or null for host work. The
/// device libraries order their calls on it; the collectives of `comm` take it too.
#[derive(Clone, Copy, Debug)]
pub struct Stream(pub *mut std::ffi::c_void);

impl Stream {
    pub const HOST: Stream = Stream(std::ptr::null_mut());
}

/// How to find one vendor library.
pub struct LibrarySpec {
    /// Human name used in errors ("NCCL").
    pub what: &'static str,
    /// Environment variable naming the library file, e.g. `FSDPTURBO_NCCL_PATH`.
    pub env_var: &'static str,
    /// File names, preferred first (`libnccl.so.2`, `libnccl.so`).
    pub file_names: &'static [&'static str],
    /// Directories of this library's own installation layout, searched after the embedder's.
    pub extra_dirs: fn() -> Vec<PathBuf>,
}

impl LibrarySpec {
    /// No directories beyond the embedder's and the system loader's.
    pub fn no_extra_dirs() -> Vec<PathBuf> {
        Vec::new()
    }
}

static SEARCH_DIRS: RwLock<Vec<PathBuf>> = RwLock::new(Vec::new());

/// Adds directories searched (in order, before the system loader) for every vendor library.
pub fn add_search_dirs<I: IntoIterator<Item = PathBuf>>(dirs: I) {
    let mut current = SEARCH_DIRS.write();
    for dir in dirs {
        if !current.contains(&dir) {
            current.push(dir);
        }
    }
}

/// The directories handed over so far.
pub fn search_dirs() -> Vec<PathBuf> {
    SEARCH_DIRS.read().clone()
}

/// A loaded vendor library and the file it came from.
pub struct Loaded {
    library: libloading::Library,
    what: &'static str,
    path: PathBuf,
}

impl Loaded {
    /// The file the library was loaded from (or the bare name the system loader resolved).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// A required symbol, copied out (a function pointer type).
    ///
    /// # Safety
    /// `T` must be the symbol's true type.
    pub unsafe fn required<T: Copy>(&self, symbol: &str) -> Result<T> {
        // SAFETY: the caller vouches for T; the library outlives the copy (never unloaded).
        unsafe { self.optional(symbol) }.ok_or_else(|| {
            Error::new(
                ErrorKind::Unavailable,
                format!(
                    "{} loaded from {} has no symbol `{symbol}`, which libfsdpturbo needs: \
                     the library is too old or not the vendor's",
                    self.what,
                    self.path.display()
                ),
            )
        })
    }

    /// An optional symbol: `None` when this version of the library lacks it.
    ///
    /// # Safety
    /// `T` must be the symbol's true type.
    pub unsafe fn optional<T: Copy>(&self, symbol: &str) -> Option<T> {
        // SAFETY: as for `required`.
        unsafe { self.library.get::<T>(symbol.as_bytes()).ok().map(|s| *s) }
    }
}

/// Loads the library described by `spec`, or says everything that was tried.
pub fn load(spec: &LibrarySpec) -> Result<Loaded> {
    let mut tried = Vec::new();
    if let Some(explicit) = std::env::var_os(spec.env_var).filter(|v| !v.is_empty()) {
        return open(spec, Path::new(&explicit)).map_err(|why| {
            unavailable(spec, vec![format!("{}={} ({why})", spec.env_var, Path::new(&explicit).display())])
        });
    }
    tried.push(format!("{} (unset)", spec.env_var));
    let dirs: Vec<PathBuf> = search_dirs().into_iter().chain((spec.extra_dirs)()).collect();
    for dir in &dirs {
        for name in spec.file_names {
            let candidate = dir.join(name);
            if !candidate.exists() {
                tried.push(format!("{} (not found)", candidate.display()));
                continue;
            }
            match open(spec, &candidate) {
                Ok(loaded) => return Ok(loaded),
                Err(why) => tried.push(format!("{} ({why})", candidate.display())),
            }
        }
    }
    for name in spec.file_names {
        match open(spec, Path::new(name)) {
            Ok(loaded) => return Ok(loaded),
            Err(why) => tried.push(format!("{name} through the system loader ({why})")),
        }
    }
    Err(unavailable(spec, tried))
}

fn open(spec: &LibrarySpec, path: &Path) -> std::result::Result<Loaded, String> {
    // SAFETY: loading runs the library's initialisers; vendor libraries are trusted here exactly
    // as they would be when linked.
    let library = unsafe { libloading::Library::new(OsStr::new(path)) }.map_err(|e| e.to_string())?;
    Ok(Loaded { library, what: spec.what, path: path.to_path_buf() })
}

fn unavailable(spec: &LibrarySpec, tried: Vec<String>) -> Error {
    Error::new(
        ErrorKind::Unavailable,
        format!(
            "{} is not available on this host; tried: {}. Set {} to the library file",
            spec.what,
            tried.join("; "),
            spec.env_var
        ),
    )
}
