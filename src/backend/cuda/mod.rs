//! NVIDIA's libraries: the driver, NVRTC and the CUDA kernels it compiles, cuBLAS, NCCL.

pub mod cublas;
pub mod driver;
pub mod kernels;
pub mod nccl;
pub mod nvrtc;
