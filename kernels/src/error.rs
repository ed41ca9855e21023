//! The crate's error type.

use cudarc::cublaslt::result::CublasError;
use cudarc::driver::DriverError;

/// What can go wrong on the GPU path.
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// libcuda could not be loaded: no NVIDIA driver on this machine.
    #[error("no CUDA driver: libcuda could not be loaded (is there an NVIDIA GPU and driver?)")]
    NoDriver,
    /// libnvrtc could not be loaded, so no kernel can be compiled.
    #[error("no NVRTC: libnvrtc could not be loaded (install CUDA's NVRTC or add it to LD_LIBRARY_PATH)")]
    NoNvrtc,
    /// libcublasLt could not be loaded (or lacks a function cudarc binds), so no matrix
    /// product can run.
    #[error("no cuBLASLt: libcublasLt could not be loaded (install CUDA's cuBLAS or add it to LD_LIBRARY_PATH)")]
    NoCublas,
    /// A cuBLASLt call failed.
    #[error("cuBLASLt, {op}: {source}")]
    Cublas {
        /// What was being done.
        op: &'static str,
        /// cuBLASLt's status.
        #[source]
        source: CublasError,
    },
    /// A driver call failed.
    #[error("CUDA driver, {op}: {source}")]
    Driver {
        /// What was being done.
        op: &'static str,
        /// The driver's error code.
        #[source]
        source: DriverError,
    },
    /// cudarc panicked while opening the device (e.g. a driver too old for a symbol it binds).
    #[error("CUDA driver, opening device {ordinal}: {message}")]
    Open {
        /// The device asked for.
        ordinal: usize,
        /// The panic's message.
        message: String,
    },
    /// NVRTC rejected a kernel source.
    #[error("NVRTC compiling {kernel}: {log}")]
    Compile {
        /// The kernel and its variant.
        kernel: String,
        /// NVRTC's message and log.
        log: String,
    },
    /// A shape the kernels are not built for.
    #[error("unsupported {what} {value}: supported are {supported}")]
    Unsupported {
        /// Which dimension.
        what: &'static str,
        /// Its value.
        value: usize,
        /// What is supported.
        supported: &'static str,
    },
    /// A buffer does not have the length its companions imply.
    #[error("{what}: expected {expected} elements, found {found}")]
    Length {
        /// Which argument.
        what: &'static str,
        /// The length implied by the other arguments.
        expected: usize,
        /// Its actual length.
        found: usize,
    },
    /// An id, row or bucket number beyond what it indexes.
    #[error("{what}: {index} is out of range (there are {len})")]
    OutOfRange {
        /// Which argument.
        what: &'static str,
        /// The value found.
        index: u64,
        /// How many there are.
        len: u64,
    },
    /// CSR offsets that are not a non-decreasing run from 0 to the item count.
    #[error("{what}: offsets must rise from 0 to the {items} items")]
    Offsets {
        /// Which argument.
        what: &'static str,
        /// Number of items.
        items: usize,
    },
    /// A size whose bytes or rows overflow the kernels' 32-bit row numbers or the address space.
    #[error("{what}: {value} is too large")]
    TooLarge {
        /// Which quantity.
        what: &'static str,
        /// Its value.
        value: usize,
    },
    /// Query heads that are not a positive multiple of the KV heads (GQA groups).
    #[error("{heads} query heads do not split into groups over {kv_heads} KV heads")]
    Heads {
        /// Query heads.
        heads: usize,
        /// KV heads of the buffer.
        kv_heads: usize,
    },
    /// An attention scale that is not finite and positive.
    #[error("attention scale {scale} must be finite and positive")]
    Scale {
        /// The scale given.
        scale: f32,
    },
    /// A chunk needs keys that its K/V buffer (a ring) no longer holds.
    #[error("the chunk needs {needed} key positions per KV head, the buffer holds {capacity}")]
    Evicted {
        /// Positions the chunk's queries need: the prefix up to the last query, or window +
        /// tokens - 1 in a sliding window.
        needed: usize,
        /// Rows per KV head of the buffer.
        capacity: usize,
    },
    /// A device view that does not start on the boundary a kernel's vector loads need.
    #[error("{what} must start on a {bytes}-byte boundary")]
    Misaligned {
        /// Which argument.
        what: &'static str,
        /// The alignment needed.
        bytes: usize,
    },
    /// One step selects more distinct blocks than the GPU block cache holds.
    #[error("block cache of {slots} blocks cannot hold the {needed} blocks one step selects")]
    CacheTooSmall {
        /// Distinct blocks the step needs.
        needed: usize,
        /// Blocks the cache holds.
        slots: usize,
    },
    /// `attention_mass` and `attention_weights` weigh the rows of the workspace's last
    /// attention launch: there was none, or it attended another shape or element type.
    #[error(
        "attention weights over {asked}, but the workspace's last attention launch was {last}"
    )]
    NotLastLaunch {
        /// What the weights were asked over (KV heads, head dim, element type).
        asked: String,
        /// What the last launch attended, or "none".
        last: String,
    },
}

/// The crate's result type.
pub type Result<T> = std::result::Result<T, KernelError>;

/// Maps a driver error to [`KernelError::Driver`] with what was being done.
pub(crate) fn driver(op: &'static str) -> impl FnOnce(DriverError) -> KernelError {
    move |source| KernelError::Driver { op, source }
}

/// Maps a cuBLASLt error to [`KernelError::Cublas`] with what was being done.
pub(crate) fn cublas(op: &'static str) -> impl FnOnce(CublasError) -> KernelError {
    move |source| KernelError::Cublas { op, source }
}

/// An error unless `found == expected`.
pub(crate) fn length(what: &'static str, expected: usize, found: usize) -> Result<()> {
    if found == expected {
        Ok(())
    } else {
        Err(KernelError::Length {
            what,
            expected,
            found,
        })
    }
}
