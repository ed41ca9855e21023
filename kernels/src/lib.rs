//! kvdb-kernels: the decode step's attention on an NVIDIA GPU. CUDA C sources
//! (`kernels/cuda/*.cu`) compiled at run time with NVRTC and launched through cudarc, which
//! loads libcuda and libnvrtc dynamically: building needs no CUDA toolkit, and a machine
//! without a driver gets `KernelError::NoDriver` (or `KernelError::NoNvrtc`) from
//! `Gpu::new`, never a panic.
//!
//! | feature | what it adds |
//! |---|---|
//! | (none, the default) | nothing: an empty library, so CPU builds and CI need no CUDA |
//! | `gpu` | everything below; running it needs an NVIDIA driver and NVRTC (CUDA 13) |
//!
//! | item | job |
//! |---|---|
//! | `Gpu` | the device, its stream (and forks of it sharing the kernels), kernels compiled per (dtype, head dim, GQA group) |
//! | `KvCache`, `Csr` | a layer's keys and values on the GPU; per-head id lists and bucket layouts |
//! | `flash_decode` | exact attention over every token: the baseline |
//! | `retrieval_attention` | dense part (sinks + window) plus each KV head's selected ids, merged in one launch |
//! | `bucket_attention` | dense part plus every key of each head's visited buckets, which its work items share evenly |
//! | `attention_mass` | the attention each stored row received in the workspace's last launch (from the queries and log-sum-exp it kept), added up: provenance on the GPU, on any stream |
//! | `attention_weights` | the same weights per item of the last launch's selection, in list order: what a query following its most attended tokens ranks them by |
//! | `Partition`, `Visits` | a bucket index's centroids and buckets on the GPU; routing a step's queries to buckets there, and the ids the bucket attention then attended |
//! | `HostKv`, `BlockCache` | keys and values in pinned host memory behind an LRU GPU cache of blocks |
//! | `BucketCache` | a GPU cache of whole buckets of a partition in front of its rows in host memory, which bucket launches read the buckets it holds from |
//! | `Gemm` | the model's matrix products: cuBLASLt, and a matrix-vector kernel (`cuda/gemv.cu`) for a decode step's one row |
//! | `ops` | the model's element-wise kernels: embedding, norms, attention inputs (RoPE, KV writes), activations |
//! | `prefill_attention`, `Causal` | causal (sliding-window) attention of a chunk of queries `[tokens, heads, head_dim]` over a `KvCache` ring: flash attention on the tensor cores for f16/bf16, a plain kernel for f32 |
//!
//! The three attention launchers are one launch of one kernel (`cuda/attend.cu`): blocks attend to
//! work items (a slice of the dense rows, a slice of a selection or a share of the visited buckets' ids) for all query
//! heads of a GQA group at once, each writing a `kvdb_attention::Partial`-like triple (unnormalised output,
//! max, sum of exponentials); the last block of each KV head merges them by log-sum-exp, as
//! `kvdb_attention::merge` does on the CPU. Inputs are f16 or bf16 (`KvElement`),
//! accumulation and outputs f32.
//!
//! Layouts are stated once. Keys and values `[kv_heads, tokens, head_dim]` (keys rotated by
//! RoPE already, as a GPU cache holds them); queries `[kv_heads, group, head_dim]`, query
//! head `h * group + g` using KV head `h` (the usual GQA order); outputs the same shape in
//! f32. Token ids are `u32`.

#![warn(missing_docs, missing_debug_implementations, unreachable_pub)]
#![deny(unused_must_use, unsafe_op_in_unsafe_fn)]

#[cfg(feature = "gpu")]
mod attention;
#[cfg(feature = "gpu")]
mod bucket_cache;
#[cfg(feature = "gpu")]
mod buffers;
#[cfg(feature = "gpu")]
mod cache;
#[cfg(feature = "gpu")]
mod error;
#[cfg(feature = "gpu")]
mod gemm;
#[cfg(feature = "gpu")]
mod gpu;
#[cfg(feature = "gpu")]
pub mod ops;
#[cfg(feature = "gpu")]
mod prefill;
#[cfg(feature = "gpu")]
mod route;

#[cfg(feature = "gpu")]
pub use attention::{
    attention_mass, attention_weights, bucket_attention, dense_attention, flash_decode,
    follow_most_attended, retrieval_attention, BucketOf, Buckets, CachedBuckets, Dense,
    FollowScratch, Followed, KvRows, ListPart, Query, Selected, Workspace, MAX_VISITED_BUCKETS,
    NO_TOKEN,
};
#[cfg(feature = "gpu")]
pub use bucket_cache::BucketCache;
#[cfg(feature = "gpu")]
pub use buffers::{Csr, KvCache};
#[cfg(feature = "gpu")]
pub use cache::{BlockCache, CacheStats, HostKv};
#[cfg(feature = "gpu")]
pub use cudarc;
#[cfg(feature = "gpu")]
pub use error::{KernelError, Result};
#[cfg(feature = "gpu")]
pub use gemm::Gemm;
#[cfg(feature = "gpu")]
pub use gpu::{Float, Gpu, Graph, KvDtype, KvElement};
#[cfg(feature = "gpu")]
pub use prefill::{prefill_attention, Causal};
#[cfg(feature = "gpu")]
pub use route::{ClassifierHead, Partition, RouteRope, RouteStep, Visits, MAX_ROUTED_BUCKETS};
