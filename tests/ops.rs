//! The device-operator registry: the seed's resolution rules and texts
//! (docs/kernels.md) on `OpRegistry` values, name validation, and the C ABI of
//! `ffi/ops.rs` over the process-wide registry (each test uses its own operator names, so the
//! tests of this file can share it).

use std::collections::BTreeMap;
use std::ffi::{CStr, CString, c_char};
use std::ptr;
use std::thread;

use fsdpturbo::error::ErrorKind;
use fsdpturbo::ffi::ops::*;
use fsdpturbo::ffi::status::*;
use fsdpturbo::registry::{OpRegistry, Registered, Resolution, Resolved, check_device_type, check_op_name};

mod common;
use common::last_error;

fn exact(impl_id: u64) -> Resolved {
    Resolved { impl_id, resolution: Resolution::Exact }
}

fn fallback(impl_id: u64, warn: bool) -> Resolved {
    Resolved { impl_id, resolution: Resolution::CpuFallback { warn } }
}

#[test]
fn exact_match_then_cpu_fallback_warned_once_per_pair() {
    let mut r = OpRegistry::new();
    let cpu = r.register("grouped_mm", "cpu").unwrap();
    let npu = r.register("grouped_mm", "npu").unwrap();
    assert_eq!(cpu, Registered { impl_id: 1, replaced: None });
    assert_eq!(npu, Registered { impl_id: 2, replaced: None });
    assert_eq!(r.resolve("grouped_mm", "npu").unwrap(), exact(2));
    assert_eq!(r.resolve("grouped_mm", "cpu").unwrap(), exact(1));
    // cuda has none: the cpu one, with the warning asked for the first time only, per device.
    assert_eq!(r.resolve("grouped_mm", "cuda").unwrap(), fallback(1, true));
    assert_eq!(r.resolve("grouped_mm", "cuda").unwrap(), fallback(1, false));
    assert_eq!(r.resolve("grouped_mm", "xpu").unwrap(), fallback(1, true));
    assert_eq!(r.resolve("grouped_mm", "cuda").unwrap(), fallback(1, false));
    assert_eq!(
        fsdpturbo::registry::fallback_warning("grouped_mm", "cuda"),
        "Operator 'grouped_mm' not available for device 'cuda', falling back to CPU implementation"
    );
}

#[test]
fn re_registering_replaces_silently_with_a_fresh_id() {
    let mut r = OpRegistry::new();
    r.register("rms_norm", "cpu").unwrap();
    let again = r.register("rms_norm", "cpu").unwrap();
    assert_eq!(again, Registered { impl_id: 2, replaced: Some(1) });
    assert_eq!(r.resolve("rms_norm", "cpu").unwrap(), exact(2));
    let expected: BTreeMap<String, BTreeMap<String, u64>> =
        [("rms_norm".to_string(), [("cpu".to_string(), 2)].into_iter().collect())].into_iter().collect();
    assert_eq!(r.table(), &expected);
}

#[test]
fn unknown_operator_and_missing_cpu_fallback_are_the_seeds_key_errors() {
    let mut r = OpRegistry::new();
    let e = r.resolve("permute", "cpu").unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound);
    assert_eq!(e.message, "Operator 'permute' is not registered; registered operators: []");

    r.register("all2all_grouped_mm", "npu").unwrap();
    r.register("permute", "cuda").unwrap();
    let e = r.resolve("unpermute", "npu").unwrap_err();
    assert_eq!(
        e.message,
        "Operator 'unpermute' is not registered; registered operators: ['all2all_grouped_mm', 'permute']"
    );
    let e = r.resolve("all2all_grouped_mm", "cuda").unwrap_err();
    assert_eq!(e.kind, ErrorKind::NotFound);
    assert_eq!(
        e.message,
        "Operator 'all2all_grouped_mm' not available for device 'cuda' and no CPU fallback exists; \
         it is registered for ['npu']"
    );
    // The seed's rule for device "cpu" itself: no cpu entry is the same error.
    let e = r.resolve("permute", "cpu").unwrap_err();
    assert!(
        e.message.starts_with("Operator 'permute' not available for device 'cpu' and no CPU fallback exists")
    );
}

#[test]
fn names_and_device_types_are_validated() {
    for ok in ["grouped_mm", "_private", "fla.chunk_gated_delta_rule", "op2"] {
        check_op_name(ok).unwrap();
    }
    for bad in ["", "2op", "grouped matmul", "a-b", "op:cuda", "é"] {
        let e = check_op_name(bad).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{bad:?}");
        assert!(e.message.contains("is not valid") && e.message.contains("'grouped_mm'"), "{}", e.message);
    }
    for ok in ["cpu", "cuda", "npu", "xpu", "privateuseone", "hpu", "mtia"] {
        check_device_type(ok).unwrap();
    }
    for bad in ["", "CUDA", "cuda:0", "0cuda", " cpu", "meta device"] {
        let e = check_device_type(bad).unwrap_err();
        assert_eq!(e.kind, ErrorKind::InvalidArgument, "{bad:?}");
        assert!(e.message.contains("'cpu', 'cuda' or 'npu'"), "{}", e.message);
    }
    assert!(check_device_type("cuda:0").unwrap_err().message.ends_with("pass its type, 'cuda'"));
    // Nothing is stored by a rejected registration.
    let mut r = OpRegistry::new();
    assert!(r.register("ok_name", "cuda:1").is_err());
    assert!(r.register("bad name", "cpu").is_err());
    assert!(r.table().is_empty());
    assert_eq!(r.resolve("ok_name", "CPU").unwrap_err().kind, ErrorKind::InvalidArgument);
}

// ---- the C ABI ------------------------------------------------------------------------------

fn c(s: &str) -> CString {
    CString::new(s).unwrap()
}

fn register(op: &str, device: &str) -> (i32, u64, u64) {
    let (op, device) = (c(op), c(device));
    let (mut id, mut replaced) = (u64::MAX, u64::MAX);
    let status = fsdpturbo_op_register(op.as_ptr(), device.as_ptr(), &mut id, &mut replaced);
    (status, id, replaced)
}

fn resolve(op: &str, device: &str) -> (i32, u64, i32) {
    let (op, device) = (c(op), c(device));
    let (mut id, mut how) = (u64::MAX, -1);
    let status = fsdpturbo_op_resolve(op.as_ptr(), device.as_ptr(), &mut id, &mut how);
    (status, id, how)
}

/// Asks for the size, then copies; again while the text outgrew the buffer (the tests of this
/// binary register operators concurrently, so the global table can grow in between).
fn text_out(f: impl Fn(*mut c_char, usize, *mut usize) -> i32) -> (i32, String) {
    let mut needed = 0usize;
    let mut status = f(ptr::null_mut(), 0, &mut needed);
    while status == FSDPTURBO_ERR_BUFFER_TOO_SMALL {
        let mut buf = vec![0u8; needed];
        status = f(buf.as_mut_ptr().cast(), needed, &mut needed);
        if status != FSDPTURBO_ERR_BUFFER_TOO_SMALL {
            return (status, CStr::from_bytes_until_nul(&buf).unwrap().to_str().unwrap().to_string());
        }
    }
    (status, String::new())
}

#[test]
fn c_abi_register_resolve_and_warning_text() {
    let (status, cpu, replaced) = register("abi_matmul", "cpu");
    assert_eq!((status, replaced), (FSDPTURBO_OK as i32, 0));
    assert_ne!(cpu, 0);
    let (status, npu, _) = register("abi_matmul", "npu");
    assert_eq!(status, FSDPTURBO_OK);
    assert_eq!(resolve("abi_matmul", "npu"), (FSDPTURBO_OK as i32, npu, FSDPTURBO_OP_EXACT));
    assert_eq!(resolve("abi_matmul", "cuda"), (FSDPTURBO_OK as i32, cpu, FSDPTURBO_OP_CPU_FALLBACK_WARN));
    assert_eq!(resolve("abi_matmul", "cuda"), (FSDPTURBO_OK as i32, cpu, FSDPTURBO_OP_CPU_FALLBACK));

    let (status, again, replaced) = register("abi_matmul", "cpu");
    assert_eq!((status, replaced), (FSDPTURBO_OK as i32, cpu));
    assert_eq!(resolve("abi_matmul", "cuda"), (FSDPTURBO_OK as i32, again, FSDPTURBO_OP_CPU_FALLBACK));

    let (op, dev) = (c("abi_matmul"), c("cuda"));
    let (status, warning) =
        text_out(|buf, cap, len| fsdpturbo_op_fallback_warning(op.as_ptr(), dev.as_ptr(), buf, cap, len));
    assert_eq!(status, FSDPTURBO_OK);
    assert_eq!(
        warning,
        "Operator 'abi_matmul' not available for device 'cuda', falling back to CPU implementation"
    );

    let (status, json) = text_out(|buf, cap, len| fsdpturbo_op_table_json(buf, cap, len));
    assert_eq!(status, FSDPTURBO_OK);
    let table: serde_json::Value = serde_json::from_str(&json).unwrap();
    assert_eq!(table["abi_matmul"], serde_json::json!({"cpu": again, "npu": npu}));
}

#[test]
fn c_abi_errors_name_what_was_wrong() {
    assert_eq!(resolve("abi_never_registered", "cpu").0, FSDPTURBO_ERR_NOT_FOUND);
    assert!(
        last_error().starts_with("Operator 'abi_never_registered' is not registered"),
        "{}",
        last_error()
    );
    register("abi_npu_only", "npu");
    assert_eq!(resolve("abi_npu_only", "cuda").0, FSDPTURBO_ERR_NOT_FOUND);
    assert!(last_error().starts_with(
        "Operator 'abi_npu_only' not available for device 'cuda' and no CPU fallback exists; it is registered for ['npu']"
    ));

    assert_eq!(register("abi_bad", "cuda:0").0, FSDPTURBO_ERR_INVALID_ARGUMENT);
    assert!(last_error().contains("device type \"cuda:0\" is not valid"), "{}", last_error());
    assert_eq!(resolve("abi_bad", "cuda").0, FSDPTURBO_ERR_NOT_FOUND, "nothing was registered");

    let op = c("abi_null");
    let (mut id, mut replaced, mut how) = (0u64, 0u64, 0i32);
    assert_eq!(
        fsdpturbo_op_register(ptr::null(), op.as_ptr(), &mut id, &mut replaced),
        FSDPTURBO_ERR_NULL_ARGUMENT
    );
    assert!(last_error().contains("`op_name`"));
    assert_eq!(
        fsdpturbo_op_register(op.as_ptr(), c("cpu").as_ptr(), &mut id, ptr::null_mut()),
        FSDPTURBO_ERR_NULL_ARGUMENT
    );
    assert!(last_error().contains("`out_replaced`"));
    assert_eq!(resolve("abi_null", "cpu").0, FSDPTURBO_ERR_NOT_FOUND, "a NULL out-pointer registers nothing");
    assert_eq!(
        fsdpturbo_op_resolve(op.as_ptr(), c("cpu").as_ptr(), &mut id, ptr::null_mut()),
        FSDPTURBO_ERR_NULL_ARGUMENT
    );
    let bad_utf8 = [0xffu8, 0];
    assert_eq!(
        fsdpturbo_op_resolve(bad_utf8.as_ptr().cast(), c("cpu").as_ptr(), &mut id, &mut how),
        FSDPTURBO_ERR_UTF8
    );
    let (status, _) = text_out(|buf, cap, len| {
        fsdpturbo_op_fallback_warning(c("x y").as_ptr(), c("cuda").as_ptr(), buf, cap, len)
    });
    assert_eq!(status, FSDPTURBO_ERR_INVALID_ARGUMENT);
    // SAFETY: status names are static NUL-terminated strings.
    let name = unsafe {
        CStr::from_ptr(fsdpturbo::ffi::error::fsdpturbo_status_name(FSDPTURBO_ERR_NOT_FOUND as i32))
    };
    assert_eq!(name.to_str().unwrap(), "FSDPTURBO_ERR_NOT_FOUND");
}

#[test]
fn concurrent_registrations_get_distinct_ids_and_one_warning() {
    let ids: Vec<u64> = thread::scope(|s| {
        let handles: Vec<_> =
            (0..8).map(|i| s.spawn(move || register(&format!("abi_conc_{i}"), "cpu").1)).collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let mut sorted = ids.clone();
    sorted.sort_unstable();
    sorted.dedup();
    assert_eq!(sorted.len(), 8);
    let warnings: usize = thread::scope(|s| {
        let handles: Vec<_> = (0..8).map(|_| s.spawn(|| resolve("abi_conc_0", "npu").2)).collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap())
            .filter(|&how| how == FSDPTURBO_OP_CPU_FALLBACK_WARN)
            .count()
    });
    assert_eq!(warnings, 1);
}
