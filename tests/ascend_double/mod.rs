//! Builds the C test doubles of the CANN libraries (csrc/testing) for cargo's tests, with the C
//! compiler of the target the tests are built for (build.rs), and points libfsdpturbo's loaders
//! at them. (ctest's Python suite uses the copies CMake builds from the same sources.)
// Shared by several test binaries, each of which uses a part.
#![allow(dead_code)]

use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard, OnceLock};

use fsdpturbo::backend::acl::{ACL_FLOAT, Acl};
use fsdpturbo::backend::aclnn::View;
use fsdpturbo::comm::Stream;

fn compile(out: &Path, sources: &[&str], link: &[&str], defines: &[&str]) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let dir = out.parent().unwrap();
    let mut command = env!("FSDPTURBO_TARGET_CC").split('\u{1f}');
    let compiler = command.next().unwrap();
    let status = Command::new(compiler)
        .args(command)
        .args(["-std=c11", "-D_POSIX_C_SOURCE=200809L", "-fPIC", "-shared", "-Wall", "-Wextra", "-Werror"])
        .arg("-Wno-unused-parameter")
        .args(defines)
        .arg(format!("-I{}", root.join("csrc/include").display()))
        .args(sources.iter().map(|s| root.join("csrc/testing").join(s)))
        .arg("-o")
        .arg(out)
        .arg(format!("-L{}", dir.parent().unwrap_or(dir).display()))
        .arg(format!("-L{}", dir.display()))
        .args(link)
        .arg(format!("-Wl,-rpath,{}:{}", dir.display(), dir.parent().unwrap_or(dir).display()))
        .status()
        .unwrap_or_else(|e| {
            panic!("cannot run the target's C compiler {compiler} for the Ascend test doubles: {e}")
        });
    assert!(status.success(), "compiling {sources:?} failed");
}

/// The directory holding libascendcl.so, libhccl.so, libopapi.so, libnnopbase.so (doubles) and
/// v4only/libopapi.so (no aclnnGroupedMatmulV5). Built once per test binary.
pub fn dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir =
            Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("ascend_double_{}", std::process::id()));
        std::fs::create_dir_all(dir.join("v4only")).unwrap();
        compile(&dir.join("libascendcl.so"), &["acl_double.c"], &[], &[]);
        compile(&dir.join("libhccl.so"), &["hccl_double.c"], &["-lascendcl", "-lpthread", "-lrt"], &[]);
        compile(
            &dir.join("libopapi.so"),
            &["opapi_double.c", "opapi_moe_double.c", "opapi_mc2_double.c"],
            &["-lascendcl", "-lhccl", "-lpthread"],
            &[],
        );
        compile(&dir.join("libnnopbase.so"), &["nnopbase_double.c"], &["-lopapi"], &[]);
        compile(
            &dir.join("v4only/libopapi.so"),
            &["opapi_double.c"],
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

pub fn stream() -> Stream {
    let acl = Acl::get().unwrap();
    let mut s = std::ptr::null_mut();
    assert_eq!(unsafe { (acl.create_stream)(&mut s) }, 0);
    Stream(s)
}

/// Renumbers the double's object ids (T, L, E, S) in order of first appearance, so expected
/// logs do not depend on what ran before.
pub fn normalize(lines: &[String]) -> Vec<String> {
    let mut seen: Vec<(char, String)> = Vec::new();
    lines
        .iter()
        .map(|line| {
            let mut out = String::new();
            let chars: Vec<char> = line.chars().collect();
            let mut i = 0;
            while i < chars.len() {
                let c = chars[i];
                let boundary = i == 0 || !chars[i - 1].is_alphanumeric();
                if "TLES".contains(c) && boundary && i + 1 < chars.len() && chars[i + 1].is_ascii_digit() {
                    let mut j = i + 1;
                    while j < chars.len() && chars[j].is_ascii_digit() {
                        j += 1;
                    }
                    let key = (c, chars[i + 1..j].iter().collect::<String>());
                    if !seen.contains(&key) {
                        seen.push(key.clone());
                    }
                    let n = seen.iter().filter(|(k, _)| *k == c).position(|k| *k == key).unwrap() + 1;
                    out.push_str(&format!("{c}{n}"));
                    i = j;
                } else {
                    out.push(c);
                    i += 1;
                }
            }
            out
        })
        .collect()
}

pub fn live_objects() -> i64 {
    let lib = unsafe { libloading::Library::new(dir().join("libopapi.so")) }.unwrap();
    let f: libloading::Symbol<unsafe extern "C" fn() -> i64> =
        unsafe { lib.get(b"fsdpturbo_double_live_objects") }.unwrap();
    unsafe { f() }
}

pub struct Host {
    pub buffers: Vec<Vec<u8>>,
}

impl Host {
    pub fn workspace(&mut self, bytes: u64) -> fsdpturbo::error::Result<*mut c_void> {
        self.buffers.push(vec![0u8; bytes as usize]);
        Ok(self.buffers.last_mut().unwrap().as_mut_ptr().cast())
    }
}

pub fn f32_view<'a>(dims: &'a [i64], strides: &'a [i64], offset: i64, data: &'a mut [f32]) -> View<'a> {
    View {
        dtype: ACL_FLOAT,
        dims,
        strides,
        offset,
        storage_len: data.len() as i64,
        storage: data.as_mut_ptr().cast(),
    }
}
