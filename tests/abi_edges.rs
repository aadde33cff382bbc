//! C-ABI edge cases a careless caller can reach: an array argument that is misaligned or longer
//! than the address space is an INVALID_ARGUMENT naming it (it was made into a slice as is:
//! undefined behaviour), and workspace sizes saturate at `usize::MAX` (they wrapped to 7).

use std::ffi::{CString, c_char};

use fsdpturbo::ffi::error::fsdpturbo_last_error;
use fsdpturbo::ffi::internal::cuda::{fsdpturbo_cuda_route_workspace, fsdpturbo_cuda_unpermute_workspace};
use fsdpturbo::ffi::placement::{FSDPTURBO_PLACEMENT_SHARD, fsdpturbo_placement_t};
use fsdpturbo::ffi::safetensors::*;
use fsdpturbo::ffi::status::FSDPTURBO_ERR_INVALID_ARGUMENT;

fn last_error() -> String {
    let mut buf = vec![0 as c_char; 512];
    let n = fsdpturbo_last_error(buf.as_mut_ptr(), buf.len());
    String::from_utf8(buf[..n.min(511)].iter().map(|&c| c as u8).collect()).unwrap()
}

/// A read plan of a one-tensor file with `shape` (a pointer and a length) as the global shape.
fn read_plan_with_shape(shape: *const u64, ndim: usize) -> (i32, String) {
    let json = r#"{"w":{"dtype":"U8","shape":[4],"data_offsets":[0,4]}}"#;
    let mut bytes = (json.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(json.as_bytes());
    bytes.extend_from_slice(&[0; 4]);
    let mut file = std::ptr::null_mut();
    assert_eq!(fsdpturbo_safetensors_parse(bytes.as_ptr(), bytes.len(), bytes.len() as u64, &mut file), 0);
    let name = CString::new("w").unwrap();
    let placement = fsdpturbo_placement_t { kind: FSDPTURBO_PLACEMENT_SHARD, dim: 0, split_factor: 0 };
    let mut plan = std::ptr::null_mut();
    let status = fsdpturbo_safetensors_read_plan_new(
        [file.cast_const()].as_ptr(),
        1,
        [name.as_ptr()].as_ptr(),
        1,
        0,
        shape,
        ndim,
        [2u64].as_ptr(),
        1,
        &placement,
        0,
        &mut plan,
    );
    let message = last_error();
    fsdpturbo_read_plan_free(plan);
    fsdpturbo_safetensors_free(file);
    (status, message)
}

#[test]
fn misaligned_or_oversized_arrays_are_refused() {
    let words = [4u64, 4];
    let (status, _) = read_plan_with_shape(words.as_ptr(), 1);
    assert_eq!(status, 0, "the aligned array is read");

    let misaligned = words.as_ptr().cast::<u8>().wrapping_add(1).cast::<u64>();
    let (status, message) = read_plan_with_shape(misaligned, 1);
    assert_eq!(status, FSDPTURBO_ERR_INVALID_ARGUMENT as i32);
    assert!(
        message.contains("`global_shape`") && message.contains("is not aligned to its 8-byte element type"),
        "{message}"
    );

    let (status, message) = read_plan_with_shape(words.as_ptr(), usize::MAX / 4);
    assert_eq!(status, FSDPTURBO_ERR_INVALID_ARGUMENT as i32);
    assert!(message.contains("too many for the address space"), "{message}");
}

#[test]
fn workspace_sizes_saturate() {
    assert_eq!(fsdpturbo_cuda_route_workspace(usize::MAX, 1, usize::MAX), usize::MAX);
    assert_eq!(fsdpturbo_cuda_unpermute_workspace(usize::MAX, usize::MAX), usize::MAX);
    assert_eq!(fsdpturbo_cuda_unpermute_workspace(3, 2), 8 + 3 * 2 * 8);
}
