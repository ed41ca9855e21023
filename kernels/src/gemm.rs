//! [`Gemm`]: the forward pass's matrix products, `x · wᵀ (+ bias)`, through cuBLASLt (loaded
//! at run time by cudarc). Inputs in bf16 or f16 with f32 accumulation and an f32 output, or
//! all f32 (no TF32: the exact test mode). Products of one row (a decode step's at batch 1)
//! run on this crate's own matrix-vector kernel (`cuda/gemv.cu`), as fast as cuBLASLt on
//! large matrices and faster on small ones.

use std::collections::HashMap;
use std::ffi::c_void;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr::null_mut;
use std::sync::{Arc, Mutex};

use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys;
use cudarc::driver::{CudaContext, CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut};

use crate::error::{cublas, driver, length, KernelError, Result};
use crate::gpu::{param, Float, Gpu};
use crate::ops::{add_bias, convert, gated_activation, GateActivation};

/// `gemv.cu` after the gated activation it shares with `ops.cu`.
const GEMV_SOURCE: &str = concat!(
    include_str!("../cuda/gate.cuh"),
    include_str!("../cuda/gemv.cu")
);
/// Threads of a `gemv` block (`THREADS` in `gemv.cu`): 8 warps, one weight row each.
const GEMV_THREADS: u32 = 256;
/// Resident `gemv` blocks per multiprocessor the grid is sized for (2,048 threads).
const GEMV_BLOCKS_PER_SM: u32 = 8;

/// cuBLASLt's workspace: NVIDIA's recommendation, 32 MiB on Hopper and later, 4 MiB before.
const WORKSPACE_HOPPER: usize = 32 << 20;
const WORKSPACE_OLDER: usize = 4 << 20;

/// The largest pointer alignment cuBLASLt's heuristic asks about (its default assumption).
const MAX_ALIGNMENT: u32 = 256;

/// Matrix products on one [`Gpu`] through cuBLASLt: a handle, its workspace, and a plan
/// (descriptors, layouts and the heuristic's algorithm) per distinct shape, so that a
/// repeated shape costs no heuristic query.
///
/// ```no_run
/// # fn main() -> kvdb_kernels::Result<()> {
/// use kvdb_kernels::{Gemm, Gpu};
/// let gpu = Gpu::new(0)?;
/// let gemm = Gemm::new(&gpu)?;
/// let (rows, n, k) = (3, 4, 8);
/// let x = gpu.upload(&vec![half::bf16::ONE; rows * k])?;
/// let w = gpu.upload(&vec![half::bf16::ONE; n * k])?;
/// let mut out = gpu.zeros::<f32>(rows * n)?;
/// gemm.linear(&gpu, &x.as_view(), &w.as_view(), k, None, false, &mut out.as_view_mut())?;
/// assert!(gpu.download(&out)?.iter().all(|&y| y == 8.0));
/// # Ok(()) }
/// ```
pub struct Gemm {
    ctx: Arc<CudaContext>,
    /// The handle and the plans, used only under this lock (a cuBLASLt call reads its
    /// descriptors while it is made, and the bias pointer is set on a shared descriptor).
    state: Mutex<State>,
    workspace: CudaSlice<u8>,
    bias_in_epilogue: bool,
    vector_kernel: bool,
}

struct State {
    handle: sys::cublasLtHandle_t,
    plans: HashMap<Key, Plan>,
}

// Safety: the handle and the plans' descriptors are raw pointers to cuBLASLt objects, which
// may be used from any thread; every use is under `Gemm::state`'s lock.
unsafe impl Send for State {}

impl Drop for State {
    fn drop(&mut self) {
        self.plans.clear();
        if !self.handle.is_null() {
            // Safety: created by `create_handle`, destroyed once; a failure cannot be reported.
            let _ = unsafe { lt::destroy_handle(self.handle) };
        }
    }
}

impl std::fmt::Debug for Gemm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let (plans, bias_epilogues) = self
            .state
            .lock()
            .map(|s| {
                let epilogues = s.plans.values().filter(|p| p.bias_epilogue).count();
                (s.plans.len(), epilogues)
            })
            .unwrap_or((0, 0));
        f.debug_struct("Gemm")
            .field("workspace_bytes", &self.workspace.len())
            .field("plans", &plans)
            .field("plans_adding_bias_in_epilogue", &bias_epilogues)
            .field("bias_in_epilogue", &self.bias_in_epilogue)
            .field("vector_kernel", &self.vector_kernel)
            .finish_non_exhaustive()
    }
}

/// What a plan depends on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct Key {
    dtype: sys::cudaDataType,
    rows: usize,
    n: usize,
    k: usize,
    bias: bool,
    accumulate: bool,
    /// Alignment in bytes (up to [`MAX_ALIGNMENT`]) of w, x and out.
    align: [u32; 3],
}

/// Descriptors, layouts and algorithm of one shape (null where not created yet).
struct Plan {
    desc: sys::cublasLtMatmulDesc_t,
    /// w as column-major `[k, n]`, transposed by the product.
    a: sys::cublasLtMatrixLayout_t,
    /// x as column-major `[k, rows]`.
    b: sys::cublasLtMatrixLayout_t,
    /// out as column-major `[n, rows]` (C and D).
    d: sys::cublasLtMatrixLayout_t,
    algo: sys::cublasLtMatmulAlgo_t,
    /// Whether the descriptor adds the bias (else a kernel adds it after).
    bias_epilogue: bool,
}

impl Drop for Plan {
    fn drop(&mut self) {
        // Safety: each was created once by cuBLASLt and is destroyed once; failures cannot be
        // reported from here.
        unsafe {
            for layout in [self.a, self.b, self.d] {
                if !layout.is_null() {
                    let _ = lt::destroy_matrix_layout(layout);
                }
            }
            if !self.desc.is_null() {
                let _ = lt::destroy_matmul_desc(self.desc);
            }
        }
    }
}

impl Gemm {
    /// A cuBLASLt handle and workspace on `gpu`. Without libcublasLt this is
    /// [`KernelError::NoCublas`], never a panic.
    pub fn new(gpu: &Gpu) -> Result<Self> {
        // cudarc panics when it cannot load libcublasLt: look for it first.
        if !unsafe { sys::is_culib_present() } {
            return Err(KernelError::NoCublas);
        }
        gpu.context()
            .bind_to_thread()
            .map_err(driver("binding the context"))?;
        // It also panics on a symbol the installed library lacks.
        let handle = catch_unwind(AssertUnwindSafe(lt::create_handle))
            .map_err(|_| KernelError::NoCublas)?
            .map_err(cublas("creating a handle"))?;
        let state = State {
            handle,
            plans: HashMap::new(),
        };
        let (major, _) = gpu
            .context()
            .compute_capability()
            .map_err(driver("reading the compute capability"))?;
        let size = if major >= 9 {
            WORKSPACE_HOPPER
        } else {
            WORKSPACE_OLDER
        };
        Ok(Self {
            ctx: gpu.context().clone(),
            state: Mutex::new(state),
            workspace: gpu.zeros(size)?,
            bias_in_epilogue: true,
            vector_kernel: true,
        })
    }

    /// Whether [`Gemm::linear`] runs products of one row of 16-bit inputs on the crate's
    /// matrix-vector kernel (the default) or on cuBLASLt like the others: benchmarks compare
    /// the two, tests check both.
    pub fn set_vector_kernel(&mut self, on: bool) {
        self.vector_kernel = on;
    }

    /// Whether [`Gemm::linear`] adds the bias in cuBLASLt's epilogue (the default) or with a
    /// separate kernel after the product. Both give the same numbers to rounding; a shape
    /// whose epilogue cuBLASLt does not support falls back to the kernel by itself.
    pub fn set_bias_in_epilogue(&mut self, on: bool) {
        self.bias_in_epilogue = on;
    }

    /// `x [rows, k]` against `w [n, k]`: `(rows, n)`, after checking that this Gemm was made
    /// on `gpu`'s context and that the lengths make whole rows of `k` that fit in i32.
    fn shape<X, T>(
        &self,
        gpu: &Gpu,
        x: &CudaView<'_, X>,
        w: &CudaView<'_, T>,
        k: usize,
    ) -> Result<(usize, usize)> {
        if !Arc::ptr_eq(gpu.context(), &self.ctx) {
            return Err(KernelError::Unsupported {
                what: "Gemm on device",
                value: gpu.context().ordinal(),
                supported: "the Gpu the Gemm was created on",
            });
        }
        if k == 0 {
            return Err(KernelError::Unsupported {
                what: "linear inner dimension k",
                value: 0,
                supported: "at least 1",
            });
        }
        let n = w.len() / k;
        if n == 0 || n * k != w.len() {
            return Err(KernelError::Length {
                what: "linear w [n, k]",
                expected: n.max(1) * k,
                found: w.len(),
            });
        }
        let rows = x.len() / k;
        length("linear x [rows, k]", rows * k, x.len())?;
        for (what, value) in [("linear rows", rows), ("linear n", n), ("linear k", k)] {
            if i32::try_from(value).is_err() {
                return Err(KernelError::TooLarge { what, value });
            }
        }
        Ok((rows, n))
    }

    /// Whether a product of `rows` rows runs on the matrix-vector kernel: one row, 16-bit
    /// weights (inputs in their type or f32), `k` a multiple of 8, w and x 16-byte aligned
    /// (its loads), and the kernel on.
    fn on_vector_kernel<X, T: Float>(
        &self,
        gpu: &Gpu,
        x: &CudaView<'_, X>,
        w: &CudaView<'_, T>,
        rows: usize,
        k: usize,
    ) -> bool {
        self.vector_kernel
            && T::NAME != "float"
            && rows == 1
            && k.is_multiple_of(8)
            && alignment(w.device_ptr(gpu.stream()).0) >= 16
            && alignment(x.device_ptr(gpu.stream()).0) >= 16
    }

    /// The MLP's first product and its gated activation: `out [rows, n] = act(x · w_gateᵀ) *
    /// (x · w_upᵀ)` rounded to `T`, where `w [2n, k]` holds the gate's `n` rows and then the
    /// up projection's. One row on the matrix-vector kernel runs both in one launch
    /// (`gemv_gated`), with the numbers [`Gemm::linear`] then
    /// [`crate::ops::gated_activation`] give; other shapes run those two, through `gate_up`
    /// (`[rows, 2n]` f32, left as it was by the one launch).
    #[allow(clippy::too_many_arguments)]
    pub fn gated_linear<T: Float>(
        &self,
        gpu: &Gpu,
        x: &CudaView<'_, T>,
        w: &CudaView<'_, T>,
        k: usize,
        activation: GateActivation,
        gate_up: &mut CudaViewMut<'_, f32>,
        out: &mut CudaViewMut<'_, T>,
    ) -> Result<()> {
        let (rows, n2) = self.shape(gpu, x, w, k)?;
        if !n2.is_multiple_of(2) {
            return Err(KernelError::Length {
                what: "gated_linear w [2n, k] (gate rows, then up rows)",
                expected: (n2 + 1) * k,
                found: w.len(),
            });
        }
        let n = n2 / 2;
        length("gated_linear gate_up [rows, 2n]", rows * n2, gate_up.len())?;
        length("gated_linear out [rows, n]", rows * n, out.len())?;
        if rows == 0 {
            return Ok(());
        }
        if !self.on_vector_kernel(gpu, x, w, rows, k) {
            self.linear(gpu, x, w, k, None, false, gate_up)?;
            return gated_activation(gpu, &gate_up.as_view(), n, activation, out);
        }
        let (w, x) = (w.device_ptr(gpu.stream()).0, x.device_ptr(gpu.stream()).0);
        let out = out.device_ptr_mut(gpu.stream()).0;
        let act = activation.code();
        let (n, k) = (n as u32, k as u32);
        let mut params = [
            param(&w),
            param(&x),
            param(&n),
            param(&k),
            param(&act),
            param(&out),
        ];
        // Safety: the parameters match `gemv_gated`'s; w holds 2n rows of k, x k and out n
        // elements (checked above); k is a multiple of 8 and w and x are 16-byte aligned.
        unsafe {
            launch_gemv::<T>(
                gpu,
                ("gemv_gated", "launching gemv_gated"),
                n,
                false,
                &mut params,
            )
        }
    }

    /// [`Gemm::linear`] of f32 inputs rounded to `T`, the numbers of
    /// [`crate::ops::convert`] into `staging` (as long as `x`) then `linear` from it, to the
    /// bit. One row on the matrix-vector kernel rounds the inputs as it reads them: one
    /// launch, `staging` untouched (a decode step's attention output, which the attention
    /// writes in f32, goes into the output projection so); other shapes convert first.
    #[allow(clippy::too_many_arguments)]
    pub fn linear_of_f32<T: Float>(
        &self,
        gpu: &Gpu,
        x: &CudaView<'_, f32>,
        staging: &mut CudaViewMut<'_, T>,
        w: &CudaView<'_, T>,
        k: usize,
        bias: Option<&CudaView<'_, f32>>,
        accumulate: bool,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let (rows, n) = self.shape(gpu, x, w, k)?;
        length("linear_of_f32 staging", x.len(), staging.len())?;
        output_lengths(rows, n, bias, out)?;
        if rows == 0 {
            return Ok(());
        }
        if self.on_vector_kernel(gpu, x, w, rows, k) {
            return gemv(gpu, x, w, (n, k), bias, accumulate, out);
        }
        convert(gpu, x, staging)?;
        self.linear(gpu, &staging.as_view(), w, k, bias, accumulate, out)
    }

    /// `out [rows, n] = x [rows, k] · w [n, k]ᵀ (+ bias [n]) (+ out, if accumulate)`, all
    /// row-major; `rows` and `n` follow from the lengths. Products accumulate in f32 and
    /// `out` is f32. `T` is bf16 or f16 (inputs in `T`) or f32 (f32 arithmetic throughout,
    /// no TF32). One row of 16-bit inputs with `k` a multiple of 8 and w and x 16-byte
    /// aligned runs on the matrix-vector kernel (see [`Gemm::set_vector_kernel`]).
    #[allow(clippy::too_many_arguments)]
    pub fn linear<T: Float>(
        &self,
        gpu: &Gpu,
        x: &CudaView<'_, T>,
        w: &CudaView<'_, T>,
        k: usize,
        bias: Option<&CudaView<'_, f32>>,
        accumulate: bool,
        out: &mut CudaViewMut<'_, f32>,
    ) -> Result<()> {
        let dtype = data_type::<T>()?;
        let (rows, n) = self.shape(gpu, x, w, k)?;
        output_lengths(rows, n, bias, out)?;
        if rows == 0 {
            return Ok(());
        }
        gpu.context()
            .bind_to_thread()
            .map_err(driver("binding the context"))?;

        let stream = gpu.stream();
        let w_ptr = w.device_ptr(stream).0;
        let x_ptr = x.device_ptr(stream).0;
        if self.on_vector_kernel(gpu, x, w, rows, k) {
            return gemv(gpu, x, w, (n, k), bias, accumulate, out);
        }
        let out_ptr = out.device_ptr_mut(stream).0;
        let bias_ptr = bias.map(|b| b.device_ptr(stream).0);
        let key = Key {
            dtype,
            rows,
            n,
            k,
            bias: bias.is_some() && self.bias_in_epilogue,
            accumulate,
            align: [alignment(w_ptr), alignment(x_ptr), alignment(out_ptr)],
        };

        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        let handle = state.handle;
        let plan = match state.plans.entry(key) {
            std::collections::hash_map::Entry::Occupied(plan) => plan.into_mut(),
            std::collections::hash_map::Entry::Vacant(slot) => {
                slot.insert(make_plan(handle, &key, bias_ptr, self.workspace.len())?)
            }
        };
        if plan.bias_epilogue {
            if let Some(pointer) = bias_ptr {
                // Safety: a live descriptor; the attribute is a device pointer (8 bytes).
                unsafe {
                    lt::set_matmul_desc_attribute(
                        plan.desc,
                        sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                        (&pointer as *const u64).cast(),
                        size_of::<u64>(),
                    )
                }
                .map_err(cublas("setting the bias pointer"))?;
            }
        }
        let alpha = 1.0f32;
        let beta = if accumulate { 1.0f32 } else { 0.0f32 };
        let workspace = self.workspace.device_ptr(stream).0;
        // Safety: the descriptors and layouts describe exactly these buffers, whose lengths
        // were checked (w [n, k], x [rows, k], out [rows, n], bias [n]); C is D (in place,
        // read only when accumulating); the workspace is ours and as large as the heuristic
        // was told; everything is queued on the crate's stream.
        unsafe {
            lt::matmul(
                handle,
                plan.desc,
                (&alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                w_ptr as *const c_void,
                plan.a,
                x_ptr as *const c_void,
                plan.b,
                out_ptr as *const c_void,
                plan.d,
                out_ptr as *mut c_void,
                plan.d,
                &plan.algo,
                workspace as *mut c_void,
                self.workspace.len(),
                stream.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(cublas("running a matrix product"))?;
        let bias_by_kernel = !plan.bias_epilogue;
        drop(state);
        match bias {
            Some(bias) if bias_by_kernel => add_bias(gpu, out, bias),
            _ => Ok(()),
        }
    }
}

/// Checks a product's `out [rows, n]` and `bias [n]` (if any) against its shape.
fn output_lengths(
    rows: usize,
    n: usize,
    bias: Option<&CudaView<'_, f32>>,
    out: &CudaViewMut<'_, f32>,
) -> Result<()> {
    length("linear out [rows, n]", rows * n, out.len())?;
    if let Some(bias) = bias {
        length("linear bias [n]", n, bias.len())?;
    }
    Ok(())
}

/// [`Gemm::linear`] for one row on `gemv.cu`, inputs `X` in the weights' type or f32 (the
/// caller checked the lengths, `k`'s multiple of 8 and the 16-byte alignment of w and x).
fn gemv<X: Float, T: Float>(
    gpu: &Gpu,
    x: &CudaView<'_, X>,
    w: &CudaView<'_, T>,
    (n, k): (usize, usize),
    bias: Option<&CudaView<'_, f32>>,
    accumulate: bool,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    let bias = bias.map_or(0u64, |b| b.device_ptr(gpu.stream()).0);
    let (w, x) = (w.device_ptr(gpu.stream()).0, x.device_ptr(gpu.stream()).0);
    let out = out.device_ptr_mut(gpu.stream()).0;
    let (n, k, accumulate) = (n as u32, k as u32, u32::from(accumulate));
    let mut params = [
        param(&w),
        param(&x),
        param(&bias),
        param(&n),
        param(&k),
        param(&accumulate),
        param(&out),
    ];
    // Safety: the parameters match `gemv`'s; w holds n rows of k, x k and out n elements
    // (checked by `Gemm::linear`, which also checked that n and k fit in i32), bias n or is
    // null; k is a multiple of 8 and w and x are 16-byte aligned, as the kernel's 16-byte
    // loads need; X_F32 says x's type.
    let x_f32 = X::NAME == "float";
    unsafe { launch_gemv::<T>(gpu, ("gemv", "launching gemv"), n, x_f32, &mut params) }
}

/// Launches `entry` of `gemv.cu` (`op` names the launch in errors) for weights of `T`
/// (inputs in f32 if `x_f32`, else in `T`) over `rows` rows (a warp each at a time): enough blocks for every row, at most as many as are
/// resident at once (the warps then stride over the rest). A programmatic dependent launch:
/// the weights are not the previous launch's output, so the kernel starts reading them while
/// that launch (a norm, the gated product, the attention) still runs, and waits for it before
/// it reads x or touches out.
///
/// # Safety
/// `params` are `entry`'s, as [`Gpu::launch_raw`] asks.
unsafe fn launch_gemv<T: Float>(
    gpu: &Gpu,
    (entry, op): (&'static str, &'static str),
    rows: u32,
    x_f32: bool,
    params: &mut [*mut c_void],
) -> Result<()> {
    let defines = [
        ("W_BF16", u8::from(T::NAME == "__nv_bfloat16").to_string()),
        ("X_F32", u8::from(x_f32).to_string()),
    ];
    let kernel = gpu.kernel(GEMV_SOURCE, entry, &defines)?;
    let most = gpu.multiprocessors() * GEMV_BLOCKS_PER_SM;
    let blocks = rows.div_ceil(GEMV_THREADS / 32).clamp(1, most);
    // Safety: the caller's.
    unsafe { gpu.launch_raw(&kernel, ((blocks, 1), GEMV_THREADS, 0), params, true, op) }
}

/// cuBLASLt's data type of `T`.
fn data_type<T: Float>() -> Result<sys::cudaDataType> {
    match T::NAME {
        "float" => Ok(sys::cudaDataType::CUDA_R_32F),
        "__half" => Ok(sys::cudaDataType::CUDA_R_16F),
        "__nv_bfloat16" => Ok(sys::cudaDataType::CUDA_R_16BF),
        _ => Err(KernelError::Unsupported {
            what: "linear element type (bytes)",
            value: size_of::<T>(),
            supported: "f32, f16, bf16",
        }),
    }
}

/// The largest power of two, up to [`MAX_ALIGNMENT`], that divides a device address.
fn alignment(address: u64) -> u32 {
    1 << address.trailing_zeros().min(MAX_ALIGNMENT.trailing_zeros())
}

/// Descriptors and the heuristic's algorithm for `key`. With the bias in the epilogue,
/// falls back to a plan without it (the bias then added by a kernel) when cuBLASLt refuses
/// the epilogue for this combination of types and shape.
fn make_plan(
    handle: sys::cublasLtHandle_t,
    key: &Key,
    bias: Option<u64>,
    workspace: usize,
) -> Result<Plan> {
    match try_plan(handle, key, bias.filter(|_| key.bias), workspace) {
        Err(KernelError::Cublas { .. }) if key.bias => try_plan(handle, key, None, workspace),
        other => other,
    }
}

fn try_plan(
    handle: sys::cublasLtHandle_t,
    key: &Key,
    bias: Option<u64>,
    workspace: usize,
) -> Result<Plan> {
    let mut plan = Plan {
        desc: null_mut(),
        a: null_mut(),
        b: null_mut(),
        d: null_mut(),
        algo: sys::cublasLtMatmulAlgo_t { data: [0; 8] },
        bias_epilogue: bias.is_some(),
    };
    let (rows, n, k) = (key.rows as u64, key.n as u64, key.k as u64);
    plan.desc = lt::create_matmul_desc(
        sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
        sys::cudaDataType::CUDA_R_32F,
    )
    .map_err(cublas("creating a matmul descriptor"))?;
    set_desc(
        plan.desc,
        sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
        &1i32,
    )?;
    set_desc(
        plan.desc,
        sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
        &0i32,
    )?;
    if let Some(pointer) = bias {
        set_desc(
            plan.desc,
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_EPILOGUE,
            &sys::cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
        )?;
        set_desc(
            plan.desc,
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
            &sys::cudaDataType::CUDA_R_32F,
        )?;
        set_desc(
            plan.desc,
            sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_BIAS_POINTER,
            &pointer,
        )?;
    }
    let layout = |dtype, rows, cols, ld: u64| {
        lt::create_matrix_layout(dtype, rows, cols, ld as i64)
            .map_err(cublas("creating a matrix layout"))
    };
    plan.a = layout(key.dtype, k, n, k)?;
    plan.b = layout(key.dtype, k, rows, k)?;
    plan.d = layout(sys::cudaDataType::CUDA_R_32F, n, rows, n)?;

    let preference = Preference(lt::create_matmul_pref().map_err(cublas("creating preferences"))?);
    type Pref = sys::cublasLtMatmulPreferenceAttributes_t;
    let [align_w, align_x, align_out] = key.align;
    set_pref(
        &preference,
        Pref::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
        &(workspace as u64),
    )?;
    set_pref(
        &preference,
        Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
        &align_w,
    )?;
    set_pref(
        &preference,
        Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
        &align_x,
    )?;
    set_pref(
        &preference,
        Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
        &align_out,
    )?;
    set_pref(
        &preference,
        Pref::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
        &align_out,
    )?;
    // Safety: live descriptors, layouts and preferences.
    let heuristic = unsafe {
        lt::get_matmul_algo_heuristic(
            handle,
            plan.desc,
            plan.a,
            plan.b,
            plan.d,
            plan.d,
            preference.0,
        )
    }
    .map_err(cublas("choosing an algorithm"))?;
    plan.algo = heuristic.algo;
    Ok(plan)
}

/// Matmul preferences, destroyed on drop.
struct Preference(sys::cublasLtMatmulPreference_t);

impl Drop for Preference {
    fn drop(&mut self) {
        // Safety: created once by `create_matmul_pref`, destroyed once.
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}

/// Sets a matmul descriptor's attribute to `value` (of the attribute's C type).
fn set_desc<V>(
    desc: sys::cublasLtMatmulDesc_t,
    attribute: sys::cublasLtMatmulDescAttributes_t,
    value: &V,
) -> Result<()> {
    // Safety: a live descriptor; `V` is the attribute's type, read for its size.
    unsafe {
        lt::set_matmul_desc_attribute(desc, attribute, (value as *const V).cast(), size_of::<V>())
    }
    .map_err(cublas("setting a matmul attribute"))
}

/// Sets a preference attribute to `value` (of the attribute's C type).
fn set_pref<V>(
    preference: &Preference,
    attribute: sys::cublasLtMatmulPreferenceAttributes_t,
    value: &V,
) -> Result<()> {
    // Safety: live preferences; `V` is the attribute's type, read for its size.
    unsafe {
        lt::set_matmul_pref_attribute(
            preference.0,
            attribute,
            (value as *const V).cast(),
            size_of::<V>(),
        )
    }
    .map_err(cublas("setting a matmul preference"))
}
