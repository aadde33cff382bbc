//! libfsdpturbo: the expert-parallel (EP) and expert-sharded-FSDP (EFSDP) engine for
//! Mixture-of-Experts training. Module map only; see docs/design.md §2 for the layers.

// Pure core: no I/O, no devices, no globals.
pub mod config;
pub mod dtype;
pub mod error;
pub mod host;
pub mod norm;
pub mod pattern;
pub mod placement;
pub mod plan;
pub mod registry;
pub mod route;
pub mod safetensors;
pub mod spec;
pub mod topology;

// Runtime.
pub mod backend;
pub mod comm;
pub mod state;

// The C ABI.
pub mod ffi;
