//! The device-operator registry (the seed's registry, docs/kernels.md): operator name × device
//! type → implementation id, with the seed's resolution rules.
//!
//! The registry stores ids, not functions: each registration gets a fresh id, and the caller
//! (the Python package, a C++ trainer) keeps the id → callable table. Resolution of
//! `(op, device)`: the device's own implementation; else the `cpu` one, with a warning shown
//! once per `(op, device)`; else an error. Re-registering an `(op, device)` replaces it
//! silently, as the seed does. Unlike the seed (plain dict keys), names are validated: an
//! operator name is `[A-Za-z_][A-Za-z0-9_.]*` and a device type is torch's
//! `torch.device(...).type` form `[a-z][a-z0-9_]*` (so `"cuda:0"` is rejected, where the
//! seed would silently fall back to CPU for it).

use std::collections::{BTreeMap, BTreeSet};

use crate::config::py_list;
use crate::error::{Error, ErrorKind, Result};

/// An implementation id handed out by [`OpRegistry::register`]; never 0.
pub type ImplId = u64;

/// The device type whose implementation stands in for devices without their own.
pub const CPU: &str = "cpu";

/// How a resolution was satisfied.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Resolution {
    /// The device has its own implementation.
    Exact,
    /// The `cpu` implementation stands in. `warn` is true the first time this `(op, device)`
    /// falls back: the caller then shows [`fallback_warning`] (the seed warns once).
    CpuFallback { warn: bool },
}

/// The result of [`OpRegistry::resolve`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Resolved {
    pub impl_id: ImplId,
    pub resolution: Resolution,
}

/// The result of [`OpRegistry::register`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Registered {
    /// The new implementation's id.
    pub impl_id: ImplId,
    /// The id this registration replaced, which callers can forget.
    pub replaced: Option<ImplId>,
}

/// The registry. Plain data: the process-wide instance used by the C ABI and Python lives in
/// `state`.
#[derive(Clone, Debug)]
pub struct OpRegistry {
    ops: BTreeMap<String, BTreeMap<String, ImplId>>,
    last_id: ImplId,
    warned: BTreeSet<(String, String)>,
}

impl Default for OpRegistry {
    fn default() -> Self {
        OpRegistry::new()
    }
}

impl OpRegistry {
    pub fn new() -> OpRegistry {
        OpRegistry { ops: BTreeMap::new(), last_id: 0, warned: BTreeSet::new() }
    }

    /// Registers a new implementation of `op_name` for `device_type` and returns its id,
    /// replacing (silently, as the seed does) any earlier one for the same pair.
    pub fn register(&mut self, op_name: &str, device_type: &str) -> Result<Registered> {
        check_op_name(op_name)?;
        check_device_type(device_type)?;
        self.last_id += 1;
        let impl_id = self.last_id;
        let replaced =
            self.ops.entry(op_name.to_string()).or_default().insert(device_type.to_string(), impl_id);
        Ok(Registered { impl_id, replaced })
    }

    /// The implementation of `op_name` for `device_type`: its own, else the `cpu` one (the
    /// first such fallback per pair asks for the warning), else a `NotFound` error with the
    /// seed's text. Unknown operators are `NotFound` too; malformed names `InvalidArgument`.
    pub fn resolve(&mut self, op_name: &str, device_type: &str) -> Result<Resolved> {
        check_op_name(op_name)?;
        check_device_type(device_type)?;
        let devices = self.ops.get(op_name).ok_or_else(|| {
            Error::new(
                ErrorKind::NotFound,
                format!(
                    "Operator '{op_name}' is not registered; registered operators: {}",
                    py_list(self.ops.keys())
                ),
            )
        })?;
        if let Some(&impl_id) = devices.get(device_type) {
            return Ok(Resolved { impl_id, resolution: Resolution::Exact });
        }
        match devices.get(CPU) {
            Some(&impl_id) => {
                let warn = self.warned.insert((op_name.to_string(), device_type.to_string()));
                Ok(Resolved { impl_id, resolution: Resolution::CpuFallback { warn } })
            }
            None => Err(Error::new(
                ErrorKind::NotFound,
                format!(
                    "Operator '{op_name}' not available for device '{device_type}' and no CPU fallback \
                     exists; it is registered for {}",
                    py_list(devices.keys())
                ),
            )),
        }
    }

    /// Every registration: operator name → device type → implementation id, sorted by name.
    pub fn table(&self) -> &BTreeMap<String, BTreeMap<String, ImplId>> {
        &self.ops
    }
}

/// The seed's fallback warning, shown once per `(op, device)`.
pub fn fallback_warning(op_name: &str, device_type: &str) -> String {
    format!(
        "Operator '{op_name}' not available for device '{device_type}', falling back to CPU implementation"
    )
}

/// An operator name: `[A-Za-z_][A-Za-z0-9_.]*`, e.g. `grouped_mm`.
pub fn check_op_name(op_name: &str) -> Result<()> {
    let mut chars = op_name.chars();
    let ok = chars.next().is_some_and(|c| c.is_ascii_alphabetic() || c == '_')
        && chars.all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '.');
    if ok {
        Ok(())
    } else {
        Err(Error::invalid(format!(
            "operator name {op_name:?} is not valid: use ASCII letters, digits, '_' and '.', starting \
             with a letter or '_' (e.g. 'grouped_mm')"
        )))
    }
}

/// A device type as torch spells `torch.device(...).type`: `[a-z][a-z0-9_]*`, e.g. `cpu`,
/// `cuda`, `npu`. A device with an index (`cuda:0`) is rejected with a hint.
pub fn check_device_type(device_type: &str) -> Result<()> {
    let mut chars = device_type.chars();
    let ok = chars.next().is_some_and(|c| c.is_ascii_lowercase())
        && chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
    if ok {
        return Ok(());
    }
    let hint = match device_type.split_once(':') {
        Some((kind, _)) if !kind.is_empty() => {
            format!("; for a device with an index pass its type, '{kind}'")
        }
        _ => String::new(),
    };
    Err(Error::invalid(format!(
        "device type {device_type:?} is not valid: expected a torch device type such as 'cpu', 'cuda' \
         or 'npu' (lowercase ASCII letters, digits and '_', starting with a letter){hint}"
    )))
}
