//! [`Gpu`]: the device, its stream, and the kernels compiled for it with NVRTC.

use std::collections::HashMap;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use cudarc::driver::sys::{self, CUdevice_attribute};
use cudarc::driver::{
    CudaContext, CudaEvent, CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr,
    ValidAsZeroBits,
};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileError, CompileOptions, Ptx};

use crate::error::{driver, KernelError, Result};

/// `attend.cu` after the block-level helpers it shares with `route.cu`.
const ATTEND_SOURCE: &str = concat!(
    include_str!("../cuda/blocks.cuh"),
    include_str!("../cuda/attend.cu")
);
const FILL_SOURCE: &str = include_str!("../cuda/fill.cu");
/// `follow.cu` after the block-level helpers.
const FOLLOW_SOURCE: &str = concat!(
    include_str!("../cuda/blocks.cuh"),
    include_str!("../cuda/follow.cu")
);

/// Threads per block of the attention kernel.
pub(crate) const THREADS: u32 = 128;
/// Rows each team of threads loads before using any (see `attend.cu`).
pub(crate) const UNROLL: u32 = 4;
/// Query heads per KV head the attention kernel is built for: its registers grow with it.
pub(crate) const MAX_GROUP: usize = 8;
/// Partials one merge of the attention kernel reads at most (`MAX_MERGE` in `attend.cu`).
pub(crate) const MAX_MERGE: usize = 128;

/// A kernel parameter for [`Gpu::launch_raw`]: the address of its value, which the driver
/// copies during the call.
pub(crate) fn param<T>(value: &T) -> *mut std::ffi::c_void {
    value as *const T as *mut std::ffi::c_void
}

/// Element type of keys, values and queries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KvDtype {
    /// IEEE half precision.
    F16,
    /// bfloat16.
    Bf16,
}

mod sealed {
    pub trait Sealed {}
    impl Sealed for half::f16 {}
    impl Sealed for half::bf16 {}
}

/// A 16-bit float the attention kernels read: [`half::f16`] or [`half::bf16`]. Accumulation
/// is f32.
pub trait KvElement: Float + sealed::Sealed {
    /// Which of the two.
    const DTYPE: KvDtype;
}

impl KvElement for half::f16 {
    const DTYPE: KvDtype = KvDtype::F16;
}

impl KvElement for half::bf16 {
    const DTYPE: KvDtype = KvDtype::Bf16;
}

/// An element type the model's kernels read or write: f32, f16 or bf16. Kernels are compiled
/// once per type with `-DT=<NAME>` (or another macro name) and convert through `float`.
pub trait Float:
    DeviceRepr + ValidAsZeroBits + Copy + Default + Send + Sync + Unpin + 'static
{
    /// The CUDA C type: `float`, `__half` or `__nv_bfloat16`.
    const NAME: &'static str;
    /// Rounds an f32 to this type (nearest even).
    fn from_f32(x: f32) -> Self;
    /// The exact f32 value.
    fn to_f32(self) -> f32;
}

impl Float for f32 {
    const NAME: &'static str = "float";
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl Float for half::f16 {
    const NAME: &'static str = "__half";
    fn from_f32(x: f32) -> Self {
        half::f16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        half::f16::to_f32(self)
    }
}

impl Float for half::bf16 {
    const NAME: &'static str = "__nv_bfloat16";
    fn from_f32(x: f32) -> Self {
        half::bf16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        half::bf16::to_f32(self)
    }
}

/// One compiled variant of the attention kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Variant {
    pub(crate) dtype: KvDtype,
    pub(crate) head_dim: usize,
    pub(crate) group: usize,
    /// `attend`'s tensor-core path (`MMA=1` in `attend.cu`), for the head dimensions of
    /// [`Variant::TENSOR_CORE_HEAD_DIMS`]; `attention_mass` ignores it.
    pub(crate) tensor_cores: bool,
}

impl Variant {
    /// Head dimensions `attend`'s tensor-core path is built for.
    pub(crate) const TENSOR_CORE_HEAD_DIMS: [usize; 2] = [64, 128];
}

/// The attention kernel of one variant and how many of its blocks fit on a multiprocessor.
#[derive(Debug, Clone)]
pub(crate) struct AttendKernel {
    pub(crate) function: CudaFunction,
    pub(crate) blocks_per_sm: u32,
}

/// One CUDA device: its context, the stream every launch of this crate goes to, and the
/// kernels compiled for it (NVRTC, once per variant, on first use).
///
/// ```no_run
/// # fn main() -> kvdb_kernels::Result<()> {
/// match kvdb_kernels::Gpu::new(0) {
///     Ok(gpu) => println!("running on {}", gpu.name()?),
///     // No driver, no NVRTC or no device: a typed error, never a panic.
///     Err(e) => println!("no GPU: {e}"),
/// }
/// # Ok(()) }
/// ```
pub struct Gpu {
    ctx: Arc<CudaContext>,
    stream: Arc<CudaStream>,
    /// NVRTC's target, `compute_XY` for the device's compute capability X.Y.
    arch: String,
    /// Whether kernels built for `compute_90a` (Hopper's warpgroup MMAs) are used: on a
    /// device of compute capability 9.0, unless [`Gpu::portable`] turned them off.
    hopper: bool,
    multiprocessors: u32,
    attend: Arc<Mutex<HashMap<Variant, AttendKernel>>>,
    /// The model's kernels (ops, prefill), by entry point and defines.
    compiled: Arc<Mutex<HashMap<String, CudaFunction>>>,
    /// Where compiled PTX is kept between runs, if anywhere.
    ptx_cache: Option<PathBuf>,
    /// Whether launches that may overlap the launch before them do so (see
    /// [`Gpu::set_programmatic_launch`]); shared with forks.
    overlap: Arc<AtomicBool>,
}

impl std::fmt::Debug for Gpu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gpu")
            .field("ordinal", &self.ctx.ordinal())
            .field("arch", &self.arch)
            .field("hopper", &self.hopper)
            .field("multiprocessors", &self.multiprocessors)
            .finish_non_exhaustive()
    }
}

impl Gpu {
    /// Opens device `ordinal`. Without a driver, NVRTC or such a device this is an error.
    pub fn new(ordinal: usize) -> Result<Self> {
        // cudarc panics when it cannot load libcuda or libnvrtc: look for both first.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(KernelError::NoDriver);
        }
        if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            return Err(KernelError::NoNvrtc);
        }
        // It also panics on a symbol the installed driver lacks.
        catch_unwind(AssertUnwindSafe(|| Self::open(ordinal))).unwrap_or_else(|panic| {
            let message = panic
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| panic.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_else(|| "cudarc panicked".into());
            Err(KernelError::Open { ordinal, message })
        })
    }

    fn open(ordinal: usize) -> Result<Self> {
        let ctx = CudaContext::new(ordinal).map_err(driver("opening the device"))?;
        // Everything runs on one stream, in order, so cudarc's per-buffer events (a wait and
        // a record per kernel argument) would only add launch overhead.
        unsafe { ctx.disable_event_tracking() };
        // A stream of our own rather than the legacy default stream: it can be captured into
        // a CUDA graph.
        let stream = ctx.new_stream().map_err(driver("creating a stream"))?;
        let (major, minor) = ctx
            .compute_capability()
            .map_err(driver("reading the compute capability"))?;
        let multiprocessors = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(driver("reading the multiprocessor count"))?;
        Ok(Self {
            ctx,
            stream,
            arch: format!("compute_{major}{minor}"),
            hopper: (major, minor) == (9, 0),
            multiprocessors: multiprocessors.max(1) as u32,
            attend: Arc::default(),
            compiled: Arc::default(),
            ptx_cache: None,
            overlap: Arc::new(AtomicBool::new(true)),
        })
    }

    /// Keeps the PTX that NVRTC compiles in `dir` (created when absent) and loads it from
    /// there in later runs, which saves the first use of each kernel its compilation (about a
    /// second for a model's kernels). Files carry what they were compiled from, so a changed
    /// kernel or option is compiled again.
    pub fn with_ptx_cache(mut self, dir: impl Into<PathBuf>) -> Self {
        self.ptx_cache = Some(dir.into());
        self
    }

    /// Uses only the kernels every supported GPU runs (compute capability 8.0 and up), also
    /// where faster ones exist for this device (Hopper's `prefill_hopper`): how tests cover
    /// both paths on one device, and how benchmarks compare them.
    pub fn portable(mut self) -> Self {
        self.hopper = false;
        self
    }

    /// Each set of kernels this device runs, by name: this handle (`"hopper"` where it uses
    /// Hopper's own kernels), then, on such a device, a second handle on the same device
    /// that uses only the portable ones (`"mma.sync"`, as on every other GPU): how tests
    /// cover both paths and benchmarks compare them.
    pub fn kernel_sets(self) -> Result<Vec<(&'static str, Gpu)>> {
        Ok(if self.hopper {
            let portable = Gpu::new(self.ctx.ordinal())?.portable();
            vec![("hopper", self), ("mma.sync", portable)]
        } else {
            vec![("mma.sync", self)]
        })
    }

    /// Whether Hopper's own kernels (warpgroup MMAs, `sm_90a`) are used; see
    /// [`Gpu::portable`].
    pub fn hopper(&self) -> bool {
        self.hopper
    }

    /// The device's name, e.g. "NVIDIA H100 80GB HBM3".
    pub fn name(&self) -> Result<String> {
        self.ctx.name().map_err(driver("reading the device name"))
    }

    /// The CUDA context, for what this crate does not wrap (events, graphs, pinned memory).
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// The stream every launch of this crate is queued on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// A handle on the same device with a stream of its own, sharing this handle's compiled
    /// kernels: what is queued on it runs beside this handle's work, ordered only by events
    /// ([`Gpu::record`], [`Gpu::wait`]).
    pub fn fork(&self) -> Result<Self> {
        Ok(Self {
            ctx: self.ctx.clone(),
            stream: self.ctx.new_stream().map_err(driver("creating a stream"))?,
            arch: self.arch.clone(),
            hopper: self.hopper,
            multiprocessors: self.multiprocessors,
            attend: self.attend.clone(),
            compiled: self.compiled.clone(),
            ptx_cache: self.ptx_cache.clone(),
            overlap: self.overlap.clone(),
        })
    }

    /// A new event (without timing), for [`Gpu::record`] and [`Gpu::wait`]: made once and
    /// recorded again for each use, since creating one costs a driver call per use.
    pub fn event(&self) -> Result<CudaEvent> {
        self.ctx
            .new_event(None)
            .map_err(driver("creating an event"))
    }

    /// Records `event`: it completes once everything queued on the stream so far has run.
    pub fn record(&self, event: &CudaEvent) -> Result<()> {
        event
            .record(&self.stream)
            .map_err(driver("recording an event"))
    }

    /// Makes what is queued on the stream from now on wait for `event` (of any stream).
    pub fn wait(&self, event: &CudaEvent) -> Result<()> {
        self.stream
            .wait(event)
            .map_err(driver("waiting for another stream's event"))
    }

    /// Captures the work `queue` puts on the stream into a CUDA graph, without running it:
    /// [`Graph::launch`] then queues all of it with one call, which saves each kernel its
    /// launch (a few microseconds of the CPU's, and the GPU's wait for it when kernels are
    /// short). The graph keeps every argument `queue` passed, buffer addresses included, so
    /// it may be launched only while those buffers live and only where the same work with
    /// the same arguments is wanted. `queue` must only launch kernels and copies between
    /// device buffers (no allocation, copy to or from the host, or synchronization: those
    /// fail the capture). Where `queue` or the capture fails, this is an error and nothing
    /// was queued; where `queue` queued nothing, there is no graph.
    pub fn capture<E: From<KernelError>>(
        &self,
        queue: impl FnOnce() -> std::result::Result<(), E>,
    ) -> std::result::Result<Option<Graph>, E> {
        // Thread-local: what other threads do meanwhile (their own streams, allocations) is
        // not this capture's concern.
        self.stream
            .begin_capture(sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(driver("starting a CUDA graph capture"))?;
        let queued = queue();
        // Ended whatever happened, so that the stream leaves capture mode.
        let ended = self
            .stream
            .end_capture(sys::CUgraphInstantiate_flags(0))
            .map_err(driver("ending a CUDA graph capture"));
        queued?;
        Ok(ended?.map(|graph| Graph { graph }))
    }

    /// Whether launches may overlap the launch before them on the stream (programmatic
    /// dependent launch: compute capability 9.0 and up, unless turned off).
    pub(crate) fn programmatic_launch(&self) -> bool {
        self.overlap.load(Ordering::Relaxed)
            && self
                .arch
                .trim_start_matches("compute_")
                .parse::<u32>()
                .is_ok_and(|cc| cc >= 90)
    }

    /// Whether kernels start their blocks while the launch before them on the stream
    /// finishes (programmatic dependent launch, on by default where the device has it: the
    /// model's kernels, the matrix-vector products, the attention after its routing): off,
    /// every launch waits for the one before it to finish and only then starts. The results
    /// are the same either way (each kernel waits for its inputs); how benchmarks measure
    /// what the overlap saves. Applies to this handle and its forks, for launches made after
    /// it (a CUDA graph keeps what it captured).
    pub fn set_programmatic_launch(&self, on: bool) {
        self.overlap.store(on, Ordering::Relaxed);
    }

    /// Launches `function` on the stream with raw parameters (`cuLaunchKernelEx`): a grid
    /// of `grid` blocks of `threads` threads and `shared` bytes of dynamic shared memory. When
    /// `programmatic` and the device has it ([`Gpu::programmatic_launch`]), as a programmatic
    /// dependent launch: the kernel's blocks may start before the launch before it on the
    /// stream has finished, so the kernel must run `griddepcontrol.wait` before it touches
    /// anything that launch writes or reads.
    ///
    /// # Safety
    /// `params` holds the address of one value for each of the kernel's parameters, in order
    /// and of its types, alive until the call returns (the driver copies them); every device
    /// address among them is of a live buffer long enough for what the kernel does with it.
    pub(crate) unsafe fn launch_raw(
        &self,
        function: &CudaFunction,
        (grid, threads, shared): ((u32, u32), u32, u32),
        params: &mut [*mut std::ffi::c_void],
        programmatic: bool,
        op: &'static str,
    ) -> Result<()> {
        let programmatic = programmatic && self.programmatic_launch();
        let mut attribute = sys::CUlaunchAttribute {
            id: sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION,
            pad: [0; 4],
            // Safety: a plain-data union of the driver's; zero is every member's default.
            value: unsafe { std::mem::zeroed() },
        };
        attribute.value.programmaticStreamSerializationAllowed = 1;
        let config = sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: 1,
            blockDimX: threads,
            blockDimY: 1,
            blockDimZ: 1,
            sharedMemBytes: shared,
            hStream: self.stream.cu_stream(),
            attrs: &mut attribute,
            numAttrs: u32::from(programmatic),
        };
        // The raw launch needs the context current on this thread, as cudarc's own
        // launches do.
        self.ctx
            .bind_to_thread()
            .map_err(driver("binding the context to the thread"))?;
        // Safety: the caller vouches for the parameters; the configuration and its one
        // attribute live until the call returns.
        unsafe {
            sys::cuLaunchKernelEx(
                &config,
                function.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
            .result()
        }
        .map_err(driver(op))
    }

    /// Number of streaming multiprocessors.
    pub fn multiprocessors(&self) -> u32 {
        self.multiprocessors
    }

    /// Bytes of device memory free now.
    pub fn free_memory(&self) -> Result<usize> {
        let (free, _total) = self
            .ctx
            .mem_get_info()
            .map_err(driver("reading the free device memory"))?;
        Ok(free)
    }

    /// Copies `data` to a new device buffer (at least one element long, so that an empty
    /// list still has an address).
    pub fn upload<T: DeviceRepr + ValidAsZeroBits>(&self, data: &[T]) -> Result<CudaSlice<T>> {
        if data.is_empty() {
            return self.zeros(1);
        }
        self.stream
            .clone_htod(data)
            .map_err(driver("copying to the device"))
    }

    /// A new device buffer of `len` zeros (at least one element).
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, len: usize) -> Result<CudaSlice<T>> {
        self.stream
            .alloc_zeros(len.max(1))
            .map_err(driver("allocating device memory"))
    }

    /// Copies a device buffer back to the host (waits for the stream).
    pub fn download<T: DeviceRepr + Default + Clone>(&self, data: &CudaSlice<T>) -> Result<Vec<T>> {
        let host = self
            .stream
            .clone_dtoh(data)
            .map_err(driver("copying from the device"))?;
        self.synchronize()?;
        Ok(host)
    }

    /// Waits until everything queued on the stream has run.
    pub fn synchronize(&self) -> Result<()> {
        self.stream
            .synchronize()
            .map_err(driver("waiting for the stream"))
    }

    /// The device address of a buffer, as the kernels take it.
    pub(crate) fn address<T>(&self, data: &CudaSlice<T>) -> u64 {
        data.device_ptr(&self.stream).0
    }

    /// The attention kernel of `variant`, compiled on first use.
    pub(crate) fn attend_kernel(&self, variant: Variant) -> Result<AttendKernel> {
        let mut kernels = self.attend.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(kernel) = kernels.get(&variant) {
            return Ok(kernel.clone());
        }
        let function = self.attend_source_kernel(variant, "attend")?;
        let blocks_per_sm = function
            .occupancy_max_active_blocks_per_multiprocessor(THREADS, 0, None)
            .map_err(driver("reading the attention kernel's occupancy"))?
            .max(1);
        let kernel = AttendKernel {
            function,
            blocks_per_sm,
        };
        kernels.insert(variant, kernel.clone());
        Ok(kernel)
    }

    /// Kernel `entry` of `attend.cu` (`attend`, `attention_mass`) for `variant`, compiled
    /// on first use.
    pub(crate) fn attend_source_kernel(
        &self,
        variant: Variant,
        entry: &'static str,
    ) -> Result<CudaFunction> {
        let defines = [
            (
                "KV_BF16",
                u32::from(variant.dtype == KvDtype::Bf16).to_string(),
            ),
            ("HEAD_DIM", variant.head_dim.to_string()),
            ("GROUP", variant.group.to_string()),
            ("THREADS", THREADS.to_string()),
            ("UNROLL", UNROLL.to_string()),
            (
                "MMA",
                u32::from(variant.tensor_cores && entry == "attend").to_string(),
            ),
        ];
        self.kernel(ATTEND_SOURCE, entry, &defines)
    }

    /// Kernel `entry` of `fill.cu` (`fill_slots`, `fill_buckets`: the caches' copies from
    /// host memory), compiled on first use.
    pub(crate) fn fill_kernel(&self, entry: &'static str) -> Result<CudaFunction> {
        self.kernel(FILL_SOURCE, entry, &[])
    }

    /// Kernel `entry` of `follow.cu` (`bucket_of`, `follow_pick`), compiled on first use.
    pub(crate) fn follow_kernel(&self, entry: &'static str) -> Result<CudaFunction> {
        self.kernel(FOLLOW_SOURCE, entry, &[])
    }

    /// Kernel `entry` of `source` compiled with `defines` (e.g. `("T", "float")`), once per
    /// distinct (entry, defines) on first use. Defines are passed as `-DNAME=VALUE`.
    pub(crate) fn kernel(
        &self,
        source: &'static str,
        entry: &'static str,
        defines: &[(&str, String)],
    ) -> Result<CudaFunction> {
        self.kernel_for(&self.arch, source, entry, defines)
    }

    /// [`Gpu::kernel`] for Hopper's architecture-specific target (`compute_90a`: warpgroup
    /// MMAs), which runs on compute capability 9.0 alone; an error unless
    /// [`Gpu::hopper`].
    pub(crate) fn hopper_kernel(
        &self,
        source: &'static str,
        entry: &'static str,
        defines: &[(&str, String)],
    ) -> Result<CudaFunction> {
        if !self.hopper {
            return Err(KernelError::Unsupported {
                what: "Hopper kernel on a device of another compute capability (or portable)",
                value: 0,
                supported: "compute capability 9.0",
            });
        }
        self.kernel_for("compute_90a", source, entry, defines)
    }

    fn kernel_for(
        &self,
        arch: &str,
        source: &'static str,
        entry: &'static str,
        defines: &[(&str, String)],
    ) -> Result<CudaFunction> {
        let key = defines.iter().fold(format!("{entry} {arch}"), |k, (n, v)| {
            format!("{k} {n}={v}")
        });
        let mut compiled = self.compiled.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(function) = compiled.get(&key) {
            return Ok(function.clone());
        }
        let options: Vec<String> = defines.iter().map(|(k, v)| format!("-D{k}={v}")).collect();
        let function = self.compile_with(&key, source, options, entry, arch)?;
        compiled.insert(key, function.clone());
        Ok(function)
    }

    fn compile_with(
        &self,
        name: &str,
        source: &str,
        mut options: Vec<String>,
        entry: &str,
        arch: &str,
    ) -> Result<CudaFunction> {
        options.push(format!("--gpu-architecture={arch}"));
        // exp2 as one hardware instruction; its error (~1e-7) is far under the tests' bound.
        options.push("--use_fast_math".into());
        // What the PTX depends on, stated in the cache file's first line: a file whose line
        // differs (another source, option or NVRTC) is compiled again.
        let header = format!(
            "// kvdb {entry} {} {:016x} {}",
            source.len(),
            fnv1a(source.as_bytes()),
            options.join(" ")
        );
        let cached = self
            .ptx_cache
            .as_ref()
            .map(|dir| dir.join(format!("{entry}-{:016x}.ptx", fnv1a(header.as_bytes()))));
        let hit = cached
            .as_ref()
            .and_then(|path| std::fs::read_to_string(path).ok())
            .filter(|text| text.lines().next() == Some(header.as_str()));
        let ptx = match hit {
            Some(text) => Ptx::from_src(text),
            None => {
                let opts = CompileOptions {
                    options,
                    name: Some(format!("{entry}.cu")),
                    ..Default::default()
                };
                let ptx =
                    compile_ptx_with_opts(source, opts).map_err(|e| KernelError::Compile {
                        kernel: name.to_string(),
                        log: match e {
                            CompileError::CompileError { log, .. } => {
                                log.to_string_lossy().into_owned()
                            }
                            other => other.to_string(),
                        },
                    })?;
                if let Some(path) = &cached {
                    // Best effort: a cache that cannot be written only costs the next run
                    // this compilation again.
                    let _ = store_ptx(path, &header, &ptx.to_src());
                }
                ptx
            }
        };
        let module = self
            .ctx
            .load_module(ptx)
            .map_err(driver("loading a compiled module"))?;
        module
            .load_function(entry)
            .map_err(driver("finding a kernel in its module"))
    }
}

/// FNV-1a, 64 bits: a hash that is the same in every build, for cache file names.
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Writes `header` and `ptx` to `path` through a temporary file, so that a reader never sees
/// half a file.
fn store_ptx(path: &Path, header: &str, ptx: &str) -> std::io::Result<()> {
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let temporary = path.with_extension(format!("{}.partial", std::process::id()));
    std::fs::write(&temporary, format!("{header}\n{ptx}"))?;
    std::fs::rename(&temporary, path)
}

/// Work captured from a [`Gpu`]'s stream ([`Gpu::capture`]), queued again on that stream with
/// one call.
pub struct Graph {
    graph: cudarc::driver::CudaGraph,
}

impl std::fmt::Debug for Graph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Graph").finish_non_exhaustive()
    }
}

impl Graph {
    /// Queues the captured work on the stream it was captured from.
    pub fn launch(&self) -> Result<()> {
        self.graph
            .launch()
            .map_err(driver("launching a CUDA graph"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fnv1a_is_the_published_function() {
        // Test vectors of the FNV reference (draft-eastlake-fnv).
        assert_eq!(fnv1a(b""), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(b"a"), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(b"foobar"), 0x8594_4171_f739_67e8);
    }

    #[test]
    fn cached_ptx_is_written_whole() {
        let dir = std::env::temp_dir().join(format!("kvdb-ptx-{}", std::process::id()));
        let path = dir.join("k.ptx");
        store_ptx(&path, "// kvdb k 1 2 -D", ".version 8.0").unwrap();
        let text = std::fs::read_to_string(&path).unwrap();
        assert_eq!(text.lines().next(), Some("// kvdb k 1 2 -D"));
        assert!(text.ends_with(".version 8.0"));
        assert_eq!(
            std::fs::read_dir(&dir).unwrap().count(),
            1,
            "no temporary left"
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
