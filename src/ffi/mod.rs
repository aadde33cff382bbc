//! Every `extern "C"` item of the library: one file per core module it exposes, plus the
//! plumbing (status codes, last error, panic boundary, marshalling).

pub mod error;
pub mod handle;
pub mod panic;
pub mod status;
pub mod version;

pub mod config;
pub mod norm;
pub mod pattern;
pub mod placement;
pub mod plan;
pub mod spec;
pub mod state;
pub mod topology;
