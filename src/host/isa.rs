//! The one choice of instruction set for the host kernels (GEMM, p-norm, unpermute).
//!
//! The kernels use the best instruction set this CPU and this build have: `avx512` where the CPU
//! has AVX-512F and the crate was built with the AVX-512 tile (`cfg(fsdpturbo_avx512)`, rustc
//! ≥ 1.89), else `avx2` where it has AVX2, FMA and F16C, else `portable` (every CPU other than
//! x86-64 runs the portable loops). [`HOST_ISA_VAR`] caps that choice for the whole process:
//! `portable`, `avx2` or `avx512`; unset or empty means the best available. It is read once, at
//! the first kernel call or query ([`current`]). A value that is not one of these, or that names
//! an instruction set this CPU or build lacks, is an error of every host kernel call (and of
//! [`current`]) naming the variable, the value, what is accepted and what this host supports.
//!
//! What the choice changes: speed only. Every path gives the same bits (NaN payloads aside), as
//! the kernels document and their tests check on every instruction set the test machine has.

use std::ffi::{CStr, OsStr};
use std::sync::OnceLock;

use crate::error::{Error, ErrorKind, Result};

/// The environment variable that caps the host kernels' instruction set.
pub const HOST_ISA_VAR: &str = "FSDPTURBO_HOST_ISA";

/// A code path of the host kernels, from the most portable to the widest; each needs what the
/// one before it needs.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Isa {
    /// The plain Rust loops, as the compiler builds them for the target.
    Portable,
    /// AVX2, FMA and F16C (x86-64).
    Avx2,
    /// AVX-512F on top of those: the GEMM's 12 × 32 f32 tile; the other kernels run their AVX2
    /// code.
    Avx512,
}

impl Isa {
    /// Every instruction set, in order.
    pub const ALL: [Isa; 3] = [Isa::Portable, Isa::Avx2, Isa::Avx512];

    /// The name [`HOST_ISA_VAR`] takes and the queries report: "portable", "avx2", "avx512".
    pub fn name(self) -> &'static str {
        self.c_name().to_str().expect("ASCII names")
    }

    /// [`Isa::name`] NUL-terminated, for the C API.
    pub fn c_name(self) -> &'static CStr {
        match self {
            Isa::Portable => c"portable",
            Isa::Avx2 => c"avx2",
            Isa::Avx512 => c"avx512",
        }
    }
}

/// What this CPU and this build can run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Capabilities {
    /// The CPU architecture (`std::env::consts::ARCH`).
    pub arch: &'static str,
    /// The CPU has AVX2, FMA and F16C.
    pub avx2: bool,
    /// The CPU has AVX-512F.
    pub avx512f: bool,
    /// The crate was built with the AVX-512 tile (`cfg(fsdpturbo_avx512)`).
    pub avx512_built: bool,
}

impl Capabilities {
    /// This CPU (CPUID) and this build.
    pub fn detect() -> Capabilities {
        #[cfg(target_arch = "x86_64")]
        let (avx2, avx512f) = (
            std::arch::is_x86_feature_detected!("avx2")
                && std::arch::is_x86_feature_detected!("fma")
                && std::arch::is_x86_feature_detected!("f16c"),
            std::arch::is_x86_feature_detected!("avx512f"),
        );
        #[cfg(not(target_arch = "x86_64"))]
        let (avx2, avx512f) = (false, false);
        Capabilities { arch: std::env::consts::ARCH, avx2, avx512f, avx512_built: cfg!(fsdpturbo_avx512) }
    }

    /// Why `isa` cannot run here, or `None` when it can.
    fn lack(self, isa: Isa) -> Option<String> {
        let x86 = self.arch == "x86_64";
        match isa {
            Isa::Portable => None,
            _ if !x86 => {
                Some(format!("{} is an x86-64 instruction set and this CPU is {}", isa.name(), self.arch))
            }
            _ if !self.avx2 => Some("this CPU lacks AVX2, FMA or F16C".to_string()),
            Isa::Avx2 => None,
            Isa::Avx512 if !self.avx512f => Some("this CPU has no AVX-512F".to_string()),
            Isa::Avx512 if !self.avx512_built => {
                Some("this build has no AVX-512 kernels (they need rustc >= 1.89)".to_string())
            }
            Isa::Avx512 => None,
        }
    }

    /// The instruction sets this host can run, in order (`portable` always).
    pub fn supported(self) -> Vec<Isa> {
        Isa::ALL.into_iter().filter(|&isa| self.lack(isa).is_none()).collect()
    }

    /// The widest instruction set this host can run.
    pub fn best(self) -> Isa {
        *self.supported().last().expect("portable always runs")
    }
}

/// "a, b and c".
fn and_list(names: &[&str]) -> String {
    match names {
        [] => String::new(),
        [one] => one.to_string(),
        [init @ .., last] => format!("{} and {last}", init.join(", ")),
    }
}

/// The instruction set for `value` of [`HOST_ISA_VAR`] (`None`: unset) on a host with `caps`.
pub(crate) fn choose(value: Option<&OsStr>, caps: Capabilities) -> Result<Isa> {
    let Some(value) = value.filter(|v| !v.is_empty()) else {
        return Ok(caps.best());
    };
    let names: Vec<&str> = Isa::ALL.iter().map(|isa| isa.name()).collect();
    let supported: Vec<&str> = caps.supported().iter().map(|isa| isa.name()).collect();
    let accepted = format!(
        "accepted are {} (unset or empty: the best available); this CPU and build support {}",
        and_list(&names),
        and_list(&supported)
    );
    let Some(isa) = Isa::ALL.into_iter().find(|isa| value == isa.name()) else {
        return Err(Error::invalid(format!(
            "{HOST_ISA_VAR}={:?} is not an instruction set of the host kernels: {accepted}",
            value.to_string_lossy()
        )));
    };
    match caps.lack(isa) {
        None => Ok(isa),
        Some(why) => Err(Error::new(
            ErrorKind::Unavailable,
            format!("{HOST_ISA_VAR}={:?} cannot be used on this host ({why}): {accepted}", isa.name()),
        )),
    }
}

/// The instruction set of the host kernels in this process: the best this CPU and build have,
/// capped by [`HOST_ISA_VAR`] (read at the first call), or the error that variable gives.
pub fn current() -> Result<Isa> {
    static CHOSEN: OnceLock<Result<Isa>> = OnceLock::new();
    CHOSEN.get_or_init(|| choose(std::env::var_os(HOST_ISA_VAR).as_deref(), Capabilities::detect())).clone()
}

#[cfg(test)]
mod tests {
    use super::*;

    const X86_ALL: Capabilities =
        Capabilities { arch: "x86_64", avx2: true, avx512f: true, avx512_built: true };

    fn with(value: &str, caps: Capabilities) -> Result<Isa> {
        choose(Some(OsStr::new(value)), caps)
    }

    #[test]
    fn unset_or_empty_takes_the_best_this_host_has() {
        let cases = [
            (X86_ALL, Isa::Avx512),
            (Capabilities { avx512_built: false, ..X86_ALL }, Isa::Avx2),
            (Capabilities { avx512f: false, ..X86_ALL }, Isa::Avx2),
            // AVX-512F without the AVX2 level is not taken for the AVX-512 path either.
            (Capabilities { avx2: false, ..X86_ALL }, Isa::Portable),
            (
                Capabilities { arch: "aarch64", avx2: false, avx512f: false, avx512_built: true },
                Isa::Portable,
            ),
        ];
        for (caps, best) in cases {
            assert_eq!(choose(None, caps), Ok(best), "{caps:?}");
            assert_eq!(with("", caps), Ok(best), "{caps:?}");
        }
    }

    #[test]
    fn a_supported_value_caps_the_choice() {
        for isa in Isa::ALL {
            assert_eq!(with(isa.name(), X86_ALL), Ok(isa));
        }
        let avx2_cpu = Capabilities { avx512f: false, ..X86_ALL };
        assert_eq!(with("portable", avx2_cpu), Ok(Isa::Portable));
        assert_eq!(with("avx2", avx2_cpu), Ok(Isa::Avx2));
        let arm = Capabilities { arch: "aarch64", avx2: false, avx512f: false, avx512_built: true };
        assert_eq!(with("portable", arm), Ok(Isa::Portable));
    }

    #[test]
    fn an_unknown_value_is_an_error_naming_the_variable_value_and_choices() {
        for value in ["avx9", "AVX2", " avx2", "sse", "avx512f"] {
            let err = with(value, Capabilities { avx512_built: false, ..X86_ALL }).unwrap_err();
            assert_eq!(err.kind, ErrorKind::InvalidArgument);
            assert_eq!(
                err.message,
                format!(
                    "FSDPTURBO_HOST_ISA={value:?} is not an instruction set of the host kernels: accepted \
                     are portable, avx2 and avx512 (unset or empty: the best available); this CPU and \
                     build support portable and avx2"
                )
            );
        }
        #[cfg(unix)]
        {
            use std::os::unix::ffi::OsStrExt;
            let err = choose(Some(OsStr::from_bytes(b"avx\xff")), X86_ALL).unwrap_err();
            assert_eq!(err.kind, ErrorKind::InvalidArgument);
            assert!(err.message.starts_with("FSDPTURBO_HOST_ISA=\"avx\u{fffd}\" is not an instruction set"));
        }
    }

    #[test]
    fn an_instruction_set_this_host_lacks_is_an_error_saying_why() {
        let accepted = "accepted are portable, avx2 and avx512 (unset or empty: the best available)";
        let no_avx2 = Capabilities { avx2: false, ..X86_ALL };
        let arm = Capabilities { arch: "aarch64", avx2: false, avx512f: false, avx512_built: true };
        let cases = [
            (
                Capabilities { avx512f: false, ..X86_ALL },
                "avx512",
                "this CPU has no AVX-512F",
                "portable and avx2",
            ),
            (
                Capabilities { avx512_built: false, ..X86_ALL },
                "avx512",
                "this build has no AVX-512 kernels (they need rustc >= 1.89)",
                "portable and avx2",
            ),
            (no_avx2, "avx512", "this CPU lacks AVX2, FMA or F16C", "portable"),
            (no_avx2, "avx2", "this CPU lacks AVX2, FMA or F16C", "portable"),
            (arm, "avx2", "avx2 is an x86-64 instruction set and this CPU is aarch64", "portable"),
            (arm, "avx512", "avx512 is an x86-64 instruction set and this CPU is aarch64", "portable"),
        ];
        for (caps, value, why, supported) in cases {
            let err = with(value, caps).unwrap_err();
            assert_eq!(err.kind, ErrorKind::Unavailable, "{caps:?}");
            assert_eq!(
                err.message,
                format!(
                    "FSDPTURBO_HOST_ISA=\"{value}\" cannot be used on this host ({why}): {accepted}; this \
                     CPU and build support {supported}"
                )
            );
        }
    }

    #[test]
    fn names_round_trip_and_the_process_choice_is_one_this_host_supports() {
        for isa in Isa::ALL {
            assert_eq!(with(isa.name(), X86_ALL), Ok(isa));
            assert_eq!(isa.c_name().to_bytes(), isa.name().as_bytes());
        }
        // The variable is not set in the test environment unless someone sets it on purpose.
        let caps = Capabilities::detect();
        match std::env::var_os(HOST_ISA_VAR) {
            None => assert_eq!(current(), Ok(caps.best())),
            Some(value) => assert_eq!(current(), choose(Some(&value), caps)),
        }
        assert!(caps.supported().contains(&Isa::Portable));
    }
}
