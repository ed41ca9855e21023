//! kvdb-kernels: CUDA C sources compiled at run time with NVRTC through cudarc, and their
//! launchers (fused gather + merge attention, flash-decode baseline, bucket attention).
//!
//! Nothing is implemented yet: the GPU-kernels issue fills this crate behind feature `cuda`.
//! The default build needs no CUDA toolkit and compiles to an empty library.
