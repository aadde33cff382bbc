//! Helpers shared by the integration tests (`mod common;` in each test file that needs them).
#![allow(dead_code)] // each test binary uses its own subset

use fsdpturbo::ffi::error::fsdpturbo_last_error;

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
