//! Builds the C test doubles of the CANN libraries, and of the CUDA driver and NCCL
//! (libraries.txt, the list CMake builds for ctest's Python suite too) for cargo's tests, with
//! the C compiler of the target the tests are built for (build.rs), and points libfsdpturbo's
//! Ascend loaders at them.
// Shared by several test binaries, each of which uses a part.
#![allow(dead_code)]

use std::ffi::c_void;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::{Mutex, MutexGuard, OnceLock};

use fsdpturbo::backend::ascend::acl::{ACL_FLOAT, Acl};
use fsdpturbo::backend::ascend::aclnn::View;
use fsdpturbo::comm::Stream;

/// The doubles' build list, shared with CMake (see its opening comment).
const LIBRARIES: &str = include_str!("libraries.txt");

/// Compiles one line of the list into `dir`.
fn compile(dir: &Path, flags: &[&str], line: &str) {
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut words = line.split_whitespace();
    let out = dir.join(words.next().expect("a file name"));
    std::fs::create_dir_all(out.parent().unwrap()).unwrap();
    let (sources, options): (Vec<&str>, Vec<&str>) = words.partition(|w| w.ends_with(".c"));
    let (links, defines): (Vec<&str>, Vec<&str>) = options.into_iter().partition(|w| w.starts_with("-l"));
    let mut command = env!("FSDPTURBO_TARGET_CC").split('\u{1f}');
    let compiler = command.next().unwrap();
    let status = Command::new(compiler)
        .args(command)
        .args(flags)
        .args(["-fPIC", "-shared"])
        .args(&defines)
        .arg(format!("-I{}", root.join("third_party/vendor-headers").display()))
        .args(sources.iter().map(|s| root.join("tests/doubles").join(s)))
        .arg("-o")
        .arg(&out)
        .arg(format!("-L{}", dir.display()))
        .args(&links)
        .arg(format!("-Wl,-rpath,{}:{}", out.parent().unwrap().display(), dir.display()))
        .status()
        .unwrap_or_else(|e| {
            panic!("cannot run the target's C compiler {compiler} for the Ascend test doubles: {e}")
        });
    assert!(status.success(), "compiling {sources:?} failed");
}

/// The directory holding libascendcl.so, libhccl.so, libopapi.so, libnnopbase.so (doubles),
/// v4only/libopapi.so (no aclnnGroupedMatmulV5) and cuda/libcuda.so, cuda/libnccl.so. Built once
/// per test binary.
pub fn dir() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir =
            Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("ascend_double_{}", std::process::id()));
        let lines: Vec<&str> = LIBRARIES.lines().filter(|l| !l.is_empty() && !l.starts_with('#')).collect();
        let flags: Vec<&str> = lines
            .iter()
            .find_map(|l| l.strip_prefix("flags "))
            .expect("libraries.txt has a flags line")
            .split_whitespace()
            .collect();
        for line in lines.iter().filter(|l| !l.starts_with("flags ")) {
            compile(&dir, &flags, line);
        }
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
