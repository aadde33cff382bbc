//! Helpers shared by the integration tests (`mod common;` in each test file that needs them).
#![allow(dead_code)] // each test binary uses its own subset

use std::process::Command;

use fsdpturbo::ffi::error::fsdpturbo_last_error;
use fsdpturbo::ffi::topology::fsdpturbo_topology_options_t;

/// Cargo's environment variable for the runner of the target the tests are built for.
pub fn runner_variable() -> String {
    format!("CARGO_TARGET_{}_RUNNER", env!("FSDPTURBO_TARGET").to_uppercase().replace(['-', '.'], "_"))
}

/// A command that runs `program` (built for the test's target) the way cargo runs the tests:
/// through the target's runner when one is set (a cross-compiled test runs under e.g.
/// `qemu-aarch64-static`, which the processes it starts do not inherit), directly otherwise.
/// Cargo splits the variable's value on whitespace; so do we.
pub fn target_command(program: &std::path::Path) -> Command {
    let runner = std::env::var(runner_variable()).unwrap_or_default();
    let mut words = runner.split_whitespace();
    match words.next() {
        Some(first) => {
            let mut command = Command::new(first);
            command.args(words).arg(program);
            command
        }
        None => Command::new(program),
    }
}

/// splitmix64: a small deterministic generator, so failures reproduce.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (modulo; fine for test data).
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// [`Rng::below`] in u64.
    pub fn below_u64(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }

    /// Uniform in [-1, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }

    /// One of `items`, uniformly.
    pub fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.below(items.len())]
    }
}

/// The text of the last failure on this thread, read as C callers do (length first), checking
/// that the length fsdpturbo_last_error reports is the length of the text.
pub fn last_error() -> String {
    let len = fsdpturbo_last_error(std::ptr::null_mut(), 0);
    let mut buf = vec![0u8; len + 1];
    assert_eq!(fsdpturbo_last_error(buf.as_mut_ptr().cast(), buf.len()), len);
    buf.truncate(len);
    String::from_utf8(buf).unwrap()
}

/// What FSDPTURBO_TOPOLOGY_OPTIONS_INIT gives, with three sizes set.
pub fn topology_options(world: u64, cp: u64, ep: u64) -> fsdpturbo_topology_options_t {
    fsdpturbo_topology_options_t {
        struct_size: std::mem::size_of::<fsdpturbo_topology_options_t>(),
        world_size: world,
        dp_size: 0,
        cp_size: cp,
        mp_replicate_size: 1,
        mp_shard_size: 0,
        ep_size: ep,
        efsdp_size: 0,
    }
}
