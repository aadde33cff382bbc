//! Builds the C test doubles of the CANN libraries (csrc/testing) for cargo's tests, with the
//! system C compiler, and points libfsdpturbo's loaders at them. (ctest's Python suite uses the
//! copies CMake builds from the same sources.)

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard, OnceLock};

fn compile(out: &Path, source: &str, link: &[&str], defines: &[&str]) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = out.parent().unwrap();
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(cc)
        .args(["-std=c11", "-D_POSIX_C_SOURCE=200809L", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror"])
        .arg("-Wno-unused-parameter")
        .args(defines)
        .arg(format!("-I{}", root.join("csrc/include").display()))
        .arg(root.join("csrc/testing").join(source))
        .arg("-o")
        .arg(out)
        .arg(format!("-L{}", dir.parent().unwrap_or(dir).display()))
        .arg(format!("-L{}", dir.display()))
        .args(link)
        .arg(format!("-Wl,-rpath,{}:{}", dir.display(), dir.parent().unwrap_or(dir).display()))
        .status()
        .expect("a C compiler (cc) builds the Ascend test doubles");
    assert!(status.success(), "compiling {source} failed");
}

/// The directory holding libascendcl.so, libhccl.so, libopapi.so, libnnopbase.so (doubles) and
/// v4only/libopapi.so (no aclnnGroupedMatmulV5). Built once per test binary.
pub fn dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir =
            Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("ascend_double_{}", std::process::id()));
        std::fs::create_dir_all(dir.join("v4only")).unwrap();
        compile(&dir.join("libascendcl.so"), "acl_double.c", &[], &[]);
        compile(&dir.join("libhccl.so"), "hccl_double.c", &["-lascendcl", "-lpthread", "-lrt"], &[]);
        compile(&dir.join("libopapi.so"), "opapi_double.c", &["-lascendcl", "-lpthread"], &[]);
        compile(&dir.join("libnnopbase.so"), "nnopbase_double.c", &["-lopapi"], &[]);
        compile(
            &dir.join("v4only/libopapi.so"),
            "opapi_double.c",
            &["-lascendcl", "-lpthread"],
            &["-DFSDPTURBO_DOUBLE_NO_V5"],
        );
        dir
    })
}

/// Serialises the tests of one binary (they share environment variables and the call log).
pub fn lock() -> MutexGuard<'static, ()> {
    static LOCK: Mutex<()> = Mutex::new(());
    LOCK.lock().unwrap_or_else(|e| e.into_inner())
}

/// Points every Ascend loader at the doubles; `opapi` names the libopapi to use.
pub fn use_doubles(opapi: &Path) {
    let d = dir();
    // SAFETY: the tests of a binary hold `lock()` while touching the environment.
    unsafe {
        std::env::set_var("FSDPTURBO_ACL_PATH", d.join("libascendcl.so"));
        std::env::set_var("FSDPTURBO_HCCL_PATH", d.join("libhccl.so"));
        std::env::set_var("FSDPTURBO_OPAPI_PATH", opapi);
        std::env::set_var("FSDPTURBO_NNOPBASE_PATH", d.join("libnnopbase.so"));
    }
}

/// Starts a fresh call log and returns its path.
pub fn fresh_log(name: &str) -> PathBuf {
    let path = dir().join(format!("{name}.log"));
    let _ = std::fs::remove_file(&path);
    // SAFETY: under `lock()`.
    unsafe { std::env::set_var("FSDPTURBO_DOUBLE_LOG", &path) };
    path
}

pub fn read_log(path: &Path) -> Vec<String> {
    std::fs::read_to_string(path).unwrap_or_default().lines().map(str::to_owned).collect()
}
