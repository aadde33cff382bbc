//! C ABI of the training-configuration parser (`src/config.rs`).

use std::ffi::c_char;

use super::error::FfiError;
use super::handle::{arg_ref, arg_slice, free_handle, into_handle, write_out, write_string};
use super::panic::boundary;
use crate::config::{Dispatcher, TrainConfig, parse_train_config_bytes};
use crate::error::Error;

/// `dist_config.ep_dispatcher: eager` (also when there is no dist_config).
pub const FSDPTURBO_DISPATCHER_EAGER: i32 = 0;
/// `dist_config.ep_dispatcher: fused`.
pub const FSDPTURBO_DISPATCHER_FUSED: i32 = 1;
/// `dist_config.ep_dispatcher: mc2`.
pub const FSDPTURBO_DISPATCHER_MC2: i32 = 2;
/// `dist_config.ep_dispatcher: domino`.
pub const FSDPTURBO_DISPATCHER_DOMINO: i32 = 3;

/// A parsed and validated training configuration (opaque). Made by fsdpturbo_config_parse,
/// released with fsdpturbo_config_free.
pub struct fsdpturbo_config_t {
    config: TrainConfig,
}

impl fsdpturbo_config_t {
    /// The configuration behind a handle (for the other ffi modules that take one).
    pub fn config(&self) -> &TrainConfig {
        &self.config
    }
}

/// The FSDPTURBO_DISPATCHER_* constant of a dispatcher.
pub fn dispatcher_code(dispatcher: Dispatcher) -> i32 {
    match dispatcher {
        Dispatcher::Eager => FSDPTURBO_DISPATCHER_EAGER,
        Dispatcher::Fused => FSDPTURBO_DISPATCHER_FUSED,
        Dispatcher::Mc2 => FSDPTURBO_DISPATCHER_MC2,
        Dispatcher::Domino => FSDPTURBO_DISPATCHER_DOMINO,
    }
}

/// Parses and validates a training YAML of `len` bytes at `yaml` (need not be NUL-terminated;
/// NULL is accepted when `len` is 0). On success `*out` receives a new handle; on failure
/// `*out` is set to NULL and the status is FSDPTURBO_ERR_CONFIG (also for bytes that are not
/// UTF-8), and fsdpturbo_last_error() holds every problem found, one per line, each with its
/// YAML path and line, e.g. "dist_config.ep_size (line 7): ep_size must be positive, got 0. Accepted:
/// a positive integer.".
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_config_parse(
    yaml: *const c_char,
    len: usize,
    out: *mut *mut fsdpturbo_config_t,
) -> i32 {
    boundary(|| {
        write_out(out, "out", std::ptr::null_mut())?;
        let bytes = arg_slice(yaml.cast::<u8>(), len, "yaml")?;
        let config = parse_train_config_bytes(bytes).map_err(Error::from)?;
        write_out(out, "out", into_handle(fsdpturbo_config_t { config }))
    })
}

/// Releases a configuration made by fsdpturbo_config_parse; NULL is a no-op.
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_config_free(config: *mut fsdpturbo_config_t) {
    boundary(|| {
        free_handle(config);
        Ok(())
    });
}

/// Writes the whole configuration as JSON (NUL-terminated) into `buf` of `cap` bytes.
/// `*out_len` receives the bytes needed including the NUL; a short buffer (NULL is fine with
/// `cap` 0) gives FSDPTURBO_ERR_BUFFER_TOO_SMALL and is left untouched. Keys are those of the
/// YAML, every default filled in: `dist` holds every dist_config key also when the YAML has no
/// dist_config. Null stands for what no default fills: `kernel` without a kernel_config,
/// `dist.capacity_factor`, `dist.expert_capacity` and `dist.capacity_overflow` without a
/// capacity, unset `dist.dcp_path` and `dist.expert_bias_update_rate`, and `dp_size`,
/// `mp_shard_size` and `dist.efsdp_size` left to their formulas of the world size
/// (fsdpturbo_topology_from_config applies them).
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_config_to_json(
    config: *const fsdpturbo_config_t,
    buf: *mut c_char,
    cap: usize,
    out_len: *mut usize,
) -> i32 {
    boundary(|| {
        let config = &arg_ref(config, "config")?.config;
        let json = serde_json::to_string(config).map_err(|e| {
            FfiError::from(Error::invalid(format!("cannot serialise the configuration: {e}")))
        })?;
        write_string(buf, cap, out_len, &json, "buf")
    })
}

fn get<T>(config: *const fsdpturbo_config_t, out: *mut T, read: impl FnOnce(&TrainConfig) -> T) -> i32 {
    boundary(|| {
        let config = &arg_ref(config, "config")?.config;
        write_out(out, "out", read(config))
    })
}

/// `dist_config.ep_size` (1 when there is no dist_config).
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_config_ep_size(config: *const fsdpturbo_config_t, out: *mut u64) -> i32 {
    get(config, out, |c| c.dist.ep_size)
}

/// The top-level `cp_size` (default 1).
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_config_cp_size(config: *const fsdpturbo_config_t, out: *mut u64) -> i32 {
    get(config, out, |c| c.cp_size)
}

/// The top-level `dp_size`; 0 when not set (the default: world size / cp_size).
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_config_dp_size(config: *const fsdpturbo_config_t, out: *mut u64) -> i32 {
    get(config, out, |c| c.dp_size.unwrap_or(0))
}

/// `dist_config.efsdp_size`; 0 when not set (the default: dp_size / ep_size).
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_config_efsdp_size(config: *const fsdpturbo_config_t, out: *mut u64) -> i32 {
    get(config, out, |c| c.dist.efsdp_size.unwrap_or(0))
}

/// `dist_config.ep_dispatcher` as a FSDPTURBO_DISPATCHER_* constant (EAGER when there is no
/// dist_config).
#[unsafe(no_mangle)]
pub extern "C" fn fsdpturbo_config_dispatcher(config: *const fsdpturbo_config_t, out: *mut i32) -> i32 {
    get(config, out, |c| dispatcher_code(c.dist.ep_dispatcher))
}
