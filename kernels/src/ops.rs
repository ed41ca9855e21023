//! The element-wise kernels of the model's forward pass on the GPU (`cuda/ops.cu`): the
//! embedding lookup, RMSNorm (alone and fused with the residual add), attention's inputs
//! (bias, per-head norms, the store's copy, RoPE and the KV buffer write, in one launch), the
//! RoPE of keys already in a KV buffer ([`rotate_keys`]), the MLP's gated activation and type
//! conversion. The matrix products are [`crate::Gemm`]'s.
//!
//! Layouts are row-major with contiguous rows: the residual stream `[tokens, hidden]` (f32),
//! the fused Q/K/V projection `[tokens, heads + 2 * kv_heads, head_dim]` (f32), queries
//! `[tokens, heads, head_dim]`, a layer's KV buffer `[kv_heads, capacity, head_dim]`
//! ([`KvCache`]). Inputs are views, so a caller can pass rows of a larger buffer
//! (`slice.slice(a..b)`). Every launch goes on [`Gpu::stream`] and returns before the
//! kernel runs; every length is checked on the host first. Every launch is a programmatic
//! dependent launch on GPUs that have them (`follow_previous_launch` in `ops.cu`): a decode
//! step's short kernels start their blocks while the launch before them finishes.
//!
//! Arithmetic is f32 in the CPU's order where the CPU's numbers are the reference: RMSNorm
//! is candle's `x / sqrt(mean(x²) + eps) * w` with correctly rounded division and square
//! root, RoPE takes angles in f64 and rounds cos and sin to f32 as `kvdb_model::Rope` does.

use std::ffi::c_void;

use cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, DeviceRepr,
    LaunchConfig,
};

use crate::buffers::KvCache;
use crate::error::{length, KernelError, Result};
use crate::gpu::{param, Float, Gpu};

/// `ops.cu` after the gated activation it shares with `gemv.cu`.
const SOURCE: &str = concat!(
    include_str!("../cuda/gate.cuh"),
    include_str!("../cuda/ops.cu")
);

/// Threads of the row kernels (`ROW_THREADS` in `ops.cu`).
const ROW_THREADS: u32 = 256;
/// Threads of the norms' blocks, one per row (`NORM_THREADS` in `ops.cu`).
const NORM_THREADS: u32 = 1024;
/// Threads of `ops_argmax_rows`'s blocks (`ARGMAX_THREADS` in `ops.cu`).
const ARGMAX_THREADS: u32 = 256;
/// Values one block of `ops_argmax_rows` reads: 16 a thread, so that a 256K-token
/// vocabulary spreads over 64 blocks.
const ARGMAX_PER_BLOCK: usize = 16 * ARGMAX_THREADS as usize;
/// Heads one block of `ops_attention_inputs` takes at a time: one a warp.
const HEADS_PER_BLOCK: usize = ROW_THREADS as usize / 32;
/// Threads of the grid-stride kernels.
const FLAT_THREADS: u32 = 256;
/// The longest head [`attention_inputs`] handles (`MAX_HEAD_DIM` in `ops.cu`).
pub const MAX_HEAD_DIM: usize = 512;

/// How RoPE pairs a head's dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RopePairs {
    /// Dimensions `(i, i + d/2)`: neox style, Gemma and Qwen2.
    Halves,
    /// Dimensions `(2i, 2i + 1)`: llama GGUF files (whose Q/K rows are permuted for it).
    Interleaved,
}

/// The gate's activation in [`gated_activation`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GateActivation {
    /// GELU, tanh approximation, as `x / (1 + exp(-2u))`, `u = sqrt(2/π)(x + 0.044715x³)`.
    GeluTanh,
    /// SiLU: `x / (1 + exp(-x))`.
    Silu,
}

impl GateActivation {
    /// `act` of `gate_activation` (`gate.cuh`).
    pub(crate) fn code(self) -> u32 {
        match self {
            GateActivation::GeluTanh => 0,
            GateActivation::Silu => 1,
        }
    }
}

/// RMSNorm's learned scale: `y = x / sqrt(mean(x²) + eps) * (weight + offset)`. `offset` is
/// 0.0 for the usual form and 1.0 for Gemma's `1 + w` form (GGUF files store Gemma's weights
/// with the 1 added already, so a GGUF model passes 0.0).
#[derive(Debug, Clone, Copy)]
pub struct Norm<'a> {
    /// The weight, one per normalised element.
    pub weight: &'a CudaView<'a, f32>,
    /// Added to the mean square.
    pub eps: f32,
    /// Added to every weight.
    pub offset: f32,
}

/// A layer's rotary embedding: inverse frequencies `[head_dim / 2]` in f64 (as
/// `kvdb_model::Rope` computes them) and the pairing.
#[derive(Debug, Clone, Copy)]
pub struct Rotary<'a> {
    /// `inv_freq[i]`: the angle of pair `i` at position `p` is `p * inv_freq[i]`.
    pub inv_freq: &'a CudaView<'a, f64>,
    /// Which dimensions form a pair.
    pub pairs: RopePairs,
}

/// Shapes of one chunk's fused Q/K/V projection output.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QkvShape {
    /// Tokens of the chunk.
    pub tokens: usize,
    /// Query heads.
    pub heads: usize,
    /// Key (and value) heads.
    pub kv_heads: usize,
    /// Length of every head.
    pub head_dim: usize,
}

impl QkvShape {
    /// Elements of one token's row: `(heads + 2 * kv_heads) * head_dim`.
    pub fn row(&self) -> usize {
        (self.heads + 2 * self.kv_heads) * self.head_dim
    }
}

/// Where [`attention_inputs`] writes the store's copy: keys before RoPE and values, rounded to
/// f16, `[tokens, kv_heads, head_dim]` each, and optionally the queries before RoPE (f32),
/// which an index searches with.
#[derive(Debug)]
pub struct StoreRows<'a, 'b> {
    /// Pre-RoPE keys.
    pub keys: &'a mut CudaViewMut<'b, half::f16>,
    /// Values.
    pub values: &'a mut CudaViewMut<'b, half::f16>,
    /// Pre-RoPE queries, if wanted.
    pub queries: Option<QueryRows<'a, 'b>>,
}

/// The store's pre-RoPE queries ([`StoreRows::queries`]): those of the positions `p` with
/// `(p + 1) % every == 0` only, one row each in order (`[rows, heads, head_dim]` f32, as
/// many rows as [`sampled_rows`] counts); `every` 1 keeps every token's. An ingest keeps a
/// sample: every token's queries would take 4 bytes a query dimension of the chunk in every
/// layer (2 GiB for Llama-3-8B's 32 layers at 4,096 tokens).
#[derive(Debug)]
pub struct QueryRows<'a, 'b> {
    /// The sampled rows.
    pub rows: &'a mut CudaViewMut<'b, f32>,
    /// One position in `every` (at least 1; a batched decode step's rows keep every one).
    pub every: usize,
}

/// How many of the positions `first..first + tokens` a sample of one in `every` keeps: those
/// with `(p + 1) % every == 0` ([`QueryRows`]); `every` 0 keeps none.
pub fn sampled_rows(first: usize, tokens: usize, every: usize) -> usize {
    (first + tokens)
        .checked_div(every)
        .map_or(0, |through| through - first / every)
}

/// `out` row `i` (f32, `[ids, hidden]`) = row `ids[i]` of `table` (`[vocab, hidden]`) times
/// `scale` (Gemma scales by `sqrt(hidden)`, others by 1). The caller checks the ids; for an id
/// `>= vocab` the kernel writes a row of zeros rather than read out of bounds.
pub fn embed<W: Float>(
    gpu: &Gpu,
    table: &CudaView<'_, W>,
    hidden: usize,
    ids: &CudaView<'_, u32>,
    scale: f32,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    let vocab = whole_rows("embedding table [vocab, hidden]", table.len(), hidden)?;
    length("embed out [ids, hidden]", ids.len() * hidden, out.len())?;
    let (vocab, hidden) = (to_u32("vocabulary", vocab)?, to_u32("hidden size", hidden)?);
    if ids.is_empty() {
        return Ok(());
    }
    // A decode step's one row over many blocks, a prefill's rows a block each.
    let per_row =
        few_rows(gpu, ids.len()).then(|| (hidden as usize).div_ceil(ROW_THREADS as usize));
    let config = rows_config(ids.len(), per_row.unwrap_or(1), ROW_THREADS)?;
    let kernel = gpu.kernel(SOURCE, "ops_embed", &[("TABLE_T", W::NAME.to_string())])?;
    let (table, ids, out) = (
        address(gpu, table),
        address(gpu, ids),
        address_mut(gpu, out),
    );
    let mut params = [
        param(&table),
        param(&vocab),
        param(&hidden),
        param(&ids),
        param(&scale),
        param(&out),
    ];
    // Safety: the arguments match `ops_embed` in order and type; `out` holds `ids` rows of
    // `hidden` and the kernel reads only rows `< vocab` of `table`.
    unsafe { launch(gpu, &kernel, config, &mut params, "launching ops_embed") }
}

/// `out = RMSNorm(x)` row by row, rows of `width` (`x.len() / width` rows), in f32 with the
/// output rounded to `O`.
pub fn rms_norm<O: Float>(
    gpu: &Gpu,
    x: &CudaView<'_, f32>,
    width: usize,
    norm: &Norm<'_>,
    out: &mut CudaViewMut<'_, O>,
) -> Result<()> {
    let rows = whole_rows("rms_norm x [rows, width]", x.len(), width)?;
    length("rms_norm weight [width]", width, norm.weight.len())?;
    length("rms_norm out [rows, width]", x.len(), out.len())?;
    let width = to_u32("rms_norm width", width)?;
    if rows == 0 {
        return Ok(());
    }
    let kernel = gpu.kernel(SOURCE, "ops_rms_norm", &[("OUT_T", O::NAME.to_string())])?;
    let (x, weight, out) = (
        address(gpu, x),
        address(gpu, norm.weight),
        address_mut(gpu, out),
    );
    let mut params = [
        param(&x),
        param(&width),
        param(&weight),
        param(&norm.eps),
        param(&norm.offset),
        param(&out),
    ];
    let config = rows_config(rows, 1, NORM_THREADS)?;
    // Safety: the arguments match `ops_rms_norm`; x and out hold `rows` rows of `width`, the
    // weight `width` elements.
    unsafe { launch(gpu, &kernel, config, &mut params, "launching ops_rms_norm") }
}

/// `residual += RMSNorm(y)` (or `residual += y` without a norm), rows of `width`: the
/// residual add after a sublayer, with Gemma's post-norm fused.
pub fn add_rms_norm(
    gpu: &Gpu,
    residual: &mut CudaViewMut<'_, f32>,
    y: &CudaView<'_, f32>,
    width: usize,
    norm: Option<&Norm<'_>>,
) -> Result<()> {
    add_then_norm::<f32>(gpu, residual, y, width, norm, None)
}

/// [`add_rms_norm`], then `out = RMSNorm(residual)` by `next` (rounded to `O`) in the same
/// launch: the next sublayer's input norm, with the numbers [`rms_norm`] would give.
pub fn add_rms_norm_then_norm<O: Float>(
    gpu: &Gpu,
    residual: &mut CudaViewMut<'_, f32>,
    y: &CudaView<'_, f32>,
    width: usize,
    norm: Option<&Norm<'_>>,
    next: &Norm<'_>,
    out: &mut CudaViewMut<'_, O>,
) -> Result<()> {
    add_then_norm(gpu, residual, y, width, norm, Some((next, out)))
}

/// `ops_add_rms_norm`, with `then` (THEN=1) or without.
fn add_then_norm<O: Float>(
    gpu: &Gpu,
    residual: &mut CudaViewMut<'_, f32>,
    y: &CudaView<'_, f32>,
    width: usize,
    norm: Option<&Norm<'_>>,
    then: Option<(&Norm<'_>, &mut CudaViewMut<'_, O>)>,
) -> Result<()> {
    let rows = whole_rows("add_rms_norm y [rows, width]", y.len(), width)?;
    length(
        "add_rms_norm residual [rows, width]",
        y.len(),
        residual.len(),
    )?;
    if let Some(norm) = norm {
        length("add_rms_norm weight [width]", width, norm.weight.len())?;
    }
    if let Some((next, out)) = &then {
        length("add_rms_norm next weight [width]", width, next.weight.len())?;
        length("add_rms_norm next out [rows, width]", y.len(), out.len())?;
    }
    let width = to_u32("add_rms_norm width", width)?;
    if rows == 0 {
        return Ok(());
    }
    let defines = [
        ("NORMED", u32::from(norm.is_some()).to_string()),
        ("THEN", u32::from(then.is_some()).to_string()),
        ("OUT_T", O::NAME.to_string()),
    ];
    let kernel = gpu.kernel(SOURCE, "ops_add_rms_norm", &defines)?;
    // Without a norm the kernel reads no weight, without `then` no next weight and no out:
    // any address will do.
    let (weight, eps, offset) = match norm {
        Some(norm) => (address(gpu, norm.weight), norm.eps, norm.offset),
        None => (0u64, 0.0f32, 0.0f32),
    };
    let (next_weight, next_eps, next_offset, out) = match then {
        Some((next, out)) => (
            address(gpu, next.weight),
            next.eps,
            next.offset,
            address_mut(gpu, out),
        ),
        None => (0u64, 0.0f32, 0.0f32, 0u64),
    };
    let (residual, y) = (address_mut(gpu, residual), address(gpu, y));
    let mut params = [
        param(&residual),
        param(&y),
        param(&width),
        param(&weight),
        param(&eps),
        param(&offset),
        param(&next_weight),
        param(&next_eps),
        param(&next_offset),
        param(&out),
    ];
    let config = rows_config(rows, 1, NORM_THREADS)?;
    // Safety: the arguments match `ops_add_rms_norm`; residual and y (and out, read only
    // with THEN=1) hold `rows` rows of `width`, the weights (read only with NORMED=1 and
    // THEN=1) `width` elements.
    unsafe {
        launch(
            gpu,
            &kernel,
            config,
            &mut params,
            "launching ops_add_rms_norm",
        )
    }
}

/// Attention's inputs for a chunk of tokens, from the fused projection's output `qkv`
/// (`[tokens, (heads + 2 * kv_heads) * head_dim]`: per row all query heads, then all key
/// heads, then all value heads). Per head:
///
/// 1. `bias` (`[(heads + 2 * kv_heads) * head_dim]`, Qwen2) is added;
/// 2. query heads are RMS-normed over `head_dim` by `q_norm`, key heads by `k_norm` (Gemma 3);
/// 3. with `round_kv_to_f16`, keys and values are rounded to f16 (and back), so that the
///    GPU attends to exactly what the store keeps;
/// 4. `store`, if given, receives those keys (before RoPE) and values as f16,
///    `[tokens, kv_heads, head_dim]`, and the queries of its sample before RoPE
///    ([`QueryRows`]: a chunk's positions one in `every`, a batched step's every row);
/// 5. queries and keys of token `i` are rotated at its position `p` (see [`KvPlacement`]);
/// 6. queries go to `queries` (`[tokens, heads, head_dim]`), keys and values to their KV
///    buffer at slot `p % kv.tokens()` (row `h * kv.tokens() + slot`: a buffer smaller than
///    the sequence is a ring, as a sliding-window layer's).
///
/// One launch for a [`KvPlacement::Chunk`], which must fit in its buffer (`tokens <=
/// kv.tokens()`, so that no two tokens of one launch share a slot); one per
/// [`MAX_TARGET_ROWS`] rows for [`KvPlacement::Rows`], where a launch per row would cost
/// the host a driver call each.
#[allow(clippy::too_many_arguments)]
pub fn attention_inputs<A: Float>(
    gpu: &Gpu,
    qkv: &CudaView<'_, f32>,
    shape: &QkvShape,
    bias: Option<&CudaView<'_, f32>>,
    q_norm: Option<&Norm<'_>>,
    k_norm: Option<&Norm<'_>>,
    rotary: &Rotary<'_>,
    round_kv_to_f16: bool,
    queries: &mut CudaViewMut<'_, A>,
    placement: KvPlacement<'_, '_, A>,
    store: Option<StoreRows<'_, '_>>,
) -> Result<()> {
    let tokens = shape.tokens;
    match &placement {
        KvPlacement::Chunk { kv, first_position } => {
            check_attention_shape(shape, kv)?;
            if first_position.checked_add(tokens).is_none() {
                return Err(KernelError::TooLarge {
                    what: "attention_inputs first position",
                    value: *first_position,
                });
            }
        }
        KvPlacement::Rows(targets) => {
            length(
                "attention_inputs rows (one target each)",
                tokens,
                targets.len(),
            )?;
            let one = QkvShape {
                tokens: 1,
                ..*shape
            };
            for target in targets.iter() {
                check_attention_shape(&one, target.kv)?;
                if target.position.checked_add(1).is_none() {
                    return Err(KernelError::TooLarge {
                        what: "attention_inputs position",
                        value: target.position,
                    });
                }
            }
        }
    }
    // Where the store's queries go: a chunk keeps its sample's rows, a batched step's rows
    // every one.
    let every = store
        .as_ref()
        .and_then(|rows| rows.queries.as_ref())
        .map_or(1, |q| q.every);
    let query_rows = match &placement {
        KvPlacement::Chunk { first_position, .. } if every >= 1 => {
            sampled_rows(*first_position, tokens, every)
        }
        KvPlacement::Rows(_) if every == 1 => tokens,
        _ => {
            return Err(KernelError::Unsupported {
                what: "attention_inputs query sample, one position in",
                value: every,
                supported: "1 or more for a chunk, 1 for a batched step's rows",
            })
        }
    };
    let query_every = u32::try_from(every).map_err(|_| KernelError::TooLarge {
        what: "attention_inputs query sample",
        value: every,
    })?;
    let inputs = Inputs {
        qkv,
        shape,
        bias,
        q_norm,
        k_norm,
        rotary,
        round_kv_to_f16,
    };
    let args = inputs.args(gpu, queries, store, query_rows)?;
    if tokens == 0 {
        return Ok(());
    }
    let entry = match placement {
        KvPlacement::Chunk { .. } => "ops_attention_inputs",
        KvPlacement::Rows(_) => "ops_attention_inputs_rows",
    };
    let kernel = gpu.kernel(SOURCE, entry, &[("KV_T", A::NAME.to_string())])?;
    match placement {
        KvPlacement::Chunk { kv, first_position } => {
            let (first_position, capacity) = (first_position as u64, kv.tokens() as u32);
            let keys = kv.keys.device_ptr_mut(gpu.stream()).0;
            let values = kv.values.device_ptr_mut(gpu.stream()).0;
            let mut params = args.params().to_vec();
            params.extend([
                param(&first_position),
                param(&args.round_kv),
                param(&args.store.0),
                param(&args.store.1),
                param(&args.store.2),
                param(&query_every),
                param(&args.queries),
                param(&keys),
                param(&values),
                param(&capacity),
            ]);
            let config = args.config(gpu, tokens)?;
            // Safety: the arguments match `ops_attention_inputs` in order and type; every
            // buffer's length was checked against the shape (qkv, bias, norm weights,
            // inv_freq, queries, store rows; the store's queries against the rows the sample
            // of `query_every >= 1` keeps of the chunk's positions, which the kernel counts
            // the same way), the KV buffer has `kv_heads` heads
            // of `capacity >= tokens` rows of `head_dim`, and head_dim is even and at most
            // MAX_HEAD_DIM.
            let op = "launching ops_attention_inputs";
            unsafe { launch(gpu, &kernel, config, &mut params, op) }?;
        }
        KvPlacement::Rows(targets) => {
            for (c, chunk) in targets.chunks_mut(MAX_TARGET_ROWS).enumerate() {
                let rows = RowTargets::of(gpu, chunk);
                let chunk_args = args.at_row(c * MAX_TARGET_ROWS, shape, std::mem::size_of::<A>());
                let mut params = chunk_args.params().to_vec();
                params.extend([
                    param(&chunk_args.round_kv),
                    param(&chunk_args.store.0),
                    param(&chunk_args.store.1),
                    param(&chunk_args.store.2),
                    param(&chunk_args.queries),
                    param(&rows),
                ]);
                let config = args.config(gpu, chunk.len())?;
                // Safety: the arguments match `ops_attention_inputs_rows` in order and type;
                // the batch-wide buffers' lengths were checked against the shape (the
                // chunk's rows are within them), each target's KV buffer against one token,
                // and the targets are distinct buffers (mutable borrows), so no two rows
                // write the same row.
                let op = "launching ops_attention_inputs_rows";
                unsafe { launch(gpu, &kernel, config, &mut params, op) }?;
            }
        }
    }
    Ok(())
}

/// Where [`attention_inputs`] puts the tokens' keys and values.
#[derive(Debug)]
pub enum KvPlacement<'a, 'b, A> {
    /// One sequence's chunk: token `i` at position `first_position + i` of `kv`.
    Chunk {
        /// The sequence's KV buffer.
        kv: &'a mut KvCache<A>,
        /// The chunk's first position.
        first_position: usize,
    },
    /// One token of each of several sequences (a batched decode step): token `i` at
    /// `targets[i]`.
    Rows(&'a mut [RowTarget<'b, A>]),
}

/// One row of a batched decode step ([`KvPlacement::Rows`]): its sequence's keys and
/// values, and its token's position.
#[derive(Debug)]
pub struct RowTarget<'a, A> {
    /// The sequence's KV buffer (a ring when shorter than the sequence).
    pub kv: &'a mut KvCache<A>,
    /// The token's position.
    pub position: usize,
}

/// Rows one launch of `ops_attention_inputs_rows` places (`MAX_TARGET_ROWS` in `ops.cu`):
/// their targets travel as one of the launch's parameters (1 KiB).
pub const MAX_TARGET_ROWS: usize = 32;

/// `RowTargets` in `ops.cu`.
#[repr(C)]
#[derive(Clone, Copy)]
struct RowTargets {
    position: [u64; MAX_TARGET_ROWS],
    keys: [u64; MAX_TARGET_ROWS],
    values: [u64; MAX_TARGET_ROWS],
    capacity: [u64; MAX_TARGET_ROWS],
}

// Safety: plain integers, laid out as the kernel's struct (four arrays of u64).
unsafe impl DeviceRepr for RowTargets {}

impl RowTargets {
    /// The targets of up to [`MAX_TARGET_ROWS`] rows (their capacities checked to fit u32
    /// by [`check_attention_shape`]).
    fn of<A>(gpu: &Gpu, rows: &mut [RowTarget<'_, A>]) -> Self {
        let mut targets = Self {
            position: [0; MAX_TARGET_ROWS],
            keys: [0; MAX_TARGET_ROWS],
            values: [0; MAX_TARGET_ROWS],
            capacity: [0; MAX_TARGET_ROWS],
        };
        for (i, target) in rows.iter_mut().enumerate() {
            targets.position[i] = target.position as u64;
            targets.keys[i] = target.kv.keys.device_ptr_mut(gpu.stream()).0;
            targets.values[i] = target.kv.values.device_ptr_mut(gpu.stream()).0;
            targets.capacity[i] = target.kv.tokens() as u64;
        }
        targets
    }
}

/// Rotates the keys of `kv` in place: row `t` of every KV head at position
/// `first_position + t`, exactly as [`attention_inputs`] rotates a key whose value is
/// already `A` (with `round_kv_to_f16` for f16). A stored corpus's pre-RoPE f16 keys,
/// uploaded as they are ([`KvCache::upload`]) and rotated here, are the numbers the model's
/// own keys at those positions would be, with no f32 copy on the host.
pub fn rotate_keys<A: Float>(
    gpu: &Gpu,
    kv: &mut KvCache<A>,
    rotary: &Rotary<'_>,
    first_position: usize,
) -> Result<()> {
    let (kv_heads, tokens, head_dim) = (kv.kv_heads(), kv.tokens(), kv.head_dim());
    if head_dim == 0 || head_dim % 2 == 1 || head_dim > MAX_HEAD_DIM {
        return Err(KernelError::Unsupported {
            what: "rotate_keys head dimension",
            value: head_dim,
            supported: "even, 2 to 512",
        });
    }
    length(
        "rotate_keys inv_freq [head_dim / 2]",
        head_dim / 2,
        rotary.inv_freq.len(),
    )?;
    if first_position.checked_add(tokens).is_none() {
        return Err(KernelError::TooLarge {
            what: "rotate_keys first position",
            value: first_position,
        });
    }
    if tokens == 0 {
        return Ok(());
    }
    let (kv_heads_arg, tokens_arg) = (
        to_u32("rotate_keys KV heads", kv_heads)?,
        to_u32("rotate_keys tokens", tokens)?,
    );
    let kernel = gpu.kernel(SOURCE, "ops_rotate_keys", &[("KV_T", A::NAME.to_string())])?;
    let (head_dim_arg, interleaved, first) = (
        head_dim as u32,
        u32::from(rotary.pairs == RopePairs::Interleaved),
        first_position as u64,
    );
    let keys = kv.keys.device_ptr_mut(gpu.stream()).0;
    let inv_freq = address(gpu, rotary.inv_freq);
    let mut params = [
        param(&keys),
        param(&kv_heads_arg),
        param(&tokens_arg),
        param(&head_dim_arg),
        param(&inv_freq),
        param(&interleaved),
        param(&first),
    ];
    let config = rows_config(tokens, 1, ROW_THREADS)?;
    // Safety: the arguments match `ops_rotate_keys` in order and type; the keys hold
    // kv_heads * tokens rows of head_dim (the buffer's own shape), head_dim is even and at
    // most MAX_HEAD_DIM, and inv_freq holds head_dim / 2 angles.
    unsafe {
        launch(
            gpu,
            &kernel,
            config,
            &mut params,
            "launching ops_rotate_keys",
        )
    }
}

/// `attention_inputs`' checks of the shape against the KV buffer.
fn check_attention_shape<A>(shape: &QkvShape, kv: &KvCache<A>) -> Result<()> {
    let QkvShape {
        tokens,
        heads,
        kv_heads,
        head_dim,
    } = *shape;
    if head_dim == 0 || head_dim % 2 == 1 || head_dim > MAX_HEAD_DIM {
        return Err(KernelError::Unsupported {
            what: "attention_inputs head dimension",
            value: head_dim,
            supported: "even, 2 to 512",
        });
    }
    if heads == 0 || kv_heads == 0 {
        return Err(KernelError::Unsupported {
            what: "attention_inputs heads (query or KV)",
            value: heads.min(kv_heads),
            supported: "at least 1 of each",
        });
    }
    to_u32("attention_inputs heads", heads + 2 * kv_heads)?;
    to_u32("attention_inputs KV buffer capacity", kv.tokens())?;
    length("attention_inputs KV buffer heads", kv_heads, kv.kv_heads())?;
    length(
        "attention_inputs KV buffer head_dim",
        head_dim,
        kv.head_dim(),
    )?;
    if tokens > kv.tokens() {
        return Err(KernelError::OutOfRange {
            what: "attention_inputs tokens in one chunk (at most the KV buffer's capacity)",
            index: tokens as u64,
            len: kv.tokens() as u64,
        });
    }
    Ok(())
}

/// What both attention-input kernels take besides where the keys and values go.
struct Inputs<'a, 'b> {
    qkv: &'a CudaView<'b, f32>,
    shape: &'a QkvShape,
    bias: Option<&'a CudaView<'b, f32>>,
    q_norm: Option<&'a Norm<'b>>,
    k_norm: Option<&'a Norm<'b>>,
    rotary: &'a Rotary<'b>,
    round_kv_to_f16: bool,
}

impl Inputs<'_, '_> {
    /// The kernels' common arguments, every length checked against the shape (the store's
    /// queries against `query_rows` rows).
    fn args<A: Float>(
        &self,
        gpu: &Gpu,
        queries: &mut CudaViewMut<'_, A>,
        store: Option<StoreRows<'_, '_>>,
        query_rows: usize,
    ) -> Result<Args> {
        let QkvShape {
            tokens,
            heads,
            kv_heads,
            head_dim,
        } = *self.shape;
        length(
            "attention_inputs qkv [tokens, (heads + 2 kv_heads) head_dim]",
            tokens * self.shape.row(),
            self.qkv.len(),
        )?;
        if let Some(bias) = self.bias {
            length(
                "attention_inputs bias [(heads + 2 kv_heads) head_dim]",
                self.shape.row(),
                bias.len(),
            )?;
        }
        for norm in [self.q_norm, self.k_norm].into_iter().flatten() {
            length(
                "attention_inputs q/k norm weight [head_dim]",
                head_dim,
                norm.weight.len(),
            )?;
        }
        length(
            "attention_inputs inv_freq [head_dim / 2]",
            head_dim / 2,
            self.rotary.inv_freq.len(),
        )?;
        length(
            "attention_inputs queries [tokens, heads, head_dim]",
            tokens * heads * head_dim,
            queries.len(),
        )?;
        let store_len = tokens * kv_heads * head_dim;
        let store = match store {
            Some(rows) => {
                length(
                    "attention_inputs store keys [tokens, kv_heads, head_dim]",
                    store_len,
                    rows.keys.len(),
                )?;
                length(
                    "attention_inputs store values [tokens, kv_heads, head_dim]",
                    store_len,
                    rows.values.len(),
                )?;
                if let Some(queries) = &rows.queries {
                    length(
                        "attention_inputs store queries [sampled rows, heads, head_dim]",
                        query_rows * heads * head_dim,
                        queries.rows.len(),
                    )?;
                }
                let queries = rows.queries.map_or(0, |q| address_mut(gpu, q.rows));
                (
                    address_mut(gpu, rows.keys),
                    address_mut(gpu, rows.values),
                    queries,
                )
            }
            None => (0, 0, 0),
        };
        Ok(Args {
            qkv: address(gpu, self.qkv),
            bias: self.bias.map_or(0, |b| address(gpu, b)),
            heads: heads as u32,
            kv_heads: kv_heads as u32,
            head_dim: head_dim as u32,
            q_norm: norm_args(gpu, self.q_norm),
            k_norm: norm_args(gpu, self.k_norm),
            inv_freq: address(gpu, self.rotary.inv_freq),
            interleaved: u32::from(self.rotary.pairs == RopePairs::Interleaved),
            round_kv: u32::from(self.round_kv_to_f16),
            store,
            queries: address_mut(gpu, queries),
        })
    }
}

/// The attention-input kernels' common arguments: addresses (0 for none) and scalars.
#[derive(Clone, Copy)]
struct Args {
    qkv: u64,
    bias: u64,
    heads: u32,
    kv_heads: u32,
    head_dim: u32,
    q_norm: (u64, f32, f32),
    k_norm: (u64, f32, f32),
    inv_freq: u64,
    interleaved: u32,
    round_kv: u32,
    store: (u64, u64, u64),
    queries: u64,
}

impl Args {
    /// The arguments of the rows from `first` on: the batch-wide buffers' addresses moved
    /// on by `first` rows (`element` the queries' bytes; none stays none).
    fn at_row(&self, first: usize, shape: &QkvShape, element: usize) -> Self {
        let first = first as u64;
        let (heads, kv_heads, d) = (
            shape.heads as u64,
            shape.kv_heads as u64,
            shape.head_dim as u64,
        );
        let at = |base: u64, row_bytes: u64| match base {
            0 => 0,
            base => base + first * row_bytes,
        };
        Self {
            qkv: at(self.qkv, (heads + 2 * kv_heads) * d * 4),
            queries: at(self.queries, heads * d * element as u64),
            store: (
                at(self.store.0, kv_heads * d * 2),
                at(self.store.1, kv_heads * d * 2),
                at(self.store.2, heads * d * 4),
            ),
            ..*self
        }
    }

    /// The kernels' first parameters, up to `inv_freq` and `interleaved` (addresses of
    /// this struct's fields, for as long as it lives).
    fn params(&self) -> [*mut c_void; 13] {
        [
            param(&self.qkv),
            param(&self.bias),
            param(&self.heads),
            param(&self.kv_heads),
            param(&self.head_dim),
            param(&self.q_norm.0),
            param(&self.q_norm.1),
            param(&self.q_norm.2),
            param(&self.k_norm.0),
            param(&self.k_norm.1),
            param(&self.k_norm.2),
            param(&self.inv_freq),
            param(&self.interleaved),
        ]
    }

    /// The grid of `tokens` rows: a decode step's tokens over a block per 8 heads (each
    /// computing the token's RoPE table), a prefill's tokens a block each.
    fn config(&self, gpu: &Gpu, tokens: usize) -> Result<LaunchConfig> {
        let all_heads = (self.heads + 2 * self.kv_heads) as usize;
        let per_row = few_rows(gpu, tokens).then(|| all_heads.div_ceil(HEADS_PER_BLOCK));
        rows_config(tokens, per_row.unwrap_or(1), ROW_THREADS)
    }
}

/// A norm's weight address (0 for none), eps and offset.
fn norm_args(gpu: &Gpu, norm: Option<&Norm<'_>>) -> (u64, f32, f32) {
    norm.map_or((0, 0.0, 0.0), |n| (address(gpu, n.weight), n.eps, n.offset))
}

/// `out = act(gate) * up` (rounded to `O`), each row of `gate_up` (`[rows, 2 * width]`) being
/// `[gate (width), up (width)]` and each row of `out` `width` long.
pub fn gated_activation<O: Float>(
    gpu: &Gpu,
    gate_up: &CudaView<'_, f32>,
    width: usize,
    activation: GateActivation,
    out: &mut CudaViewMut<'_, O>,
) -> Result<()> {
    let rows = whole_rows(
        "gated_activation gate_up [rows, 2 width]",
        gate_up.len(),
        2 * width,
    )?;
    length(
        "gated_activation out [rows, width]",
        rows * width,
        out.len(),
    )?;
    let width = to_u32("gated_activation width", width)?;
    if rows == 0 {
        return Ok(());
    }
    let act = activation.code();
    let n = out.len() as u64;
    let config = flat_config(gpu, out.len());
    let kernel = gpu.kernel(
        SOURCE,
        "ops_gated_activation",
        &[("OUT_T", O::NAME.to_string())],
    )?;
    let (gate_up, out) = (address(gpu, gate_up), address_mut(gpu, out));
    let mut params = [
        param(&gate_up),
        param(&width),
        param(&n),
        param(&act),
        param(&out),
    ];
    // Safety: the arguments match `ops_gated_activation`; gate_up holds `2 n` elements, out
    // `n`, and the grid strides over `n`.
    unsafe {
        launch(
            gpu,
            &kernel,
            config,
            &mut params,
            "launching ops_gated_activation",
        )
    }
}

/// `out[i] = x[i]` converted from `I` to `O` through f32 (rounding to nearest even).
pub fn convert<I: Float, O: Float>(
    gpu: &Gpu,
    x: &CudaView<'_, I>,
    out: &mut CudaViewMut<'_, O>,
) -> Result<()> {
    length("convert out", x.len(), out.len())?;
    if x.is_empty() {
        return Ok(());
    }
    let n = x.len() as u64;
    let defines = [
        ("IN_T", I::NAME.to_string()),
        ("OUT_T", O::NAME.to_string()),
    ];
    let config = flat_config(gpu, x.len());
    let kernel = gpu.kernel(SOURCE, "ops_convert", &defines)?;
    let (x, out) = (address(gpu, x), address_mut(gpu, out));
    let mut params = [param(&x), param(&n), param(&out)];
    // Safety: the arguments match `ops_convert`; x and out hold `n` elements.
    unsafe { launch(gpu, &kernel, config, &mut params, "launching ops_convert") }
}

/// What [`argmax_rows`] keeps between its blocks: a running best and a count of finished
/// blocks a row, zero between launches (the last block of a row sets them back).
#[derive(Debug)]
pub struct ArgmaxScratch {
    keys: CudaSlice<u64>,
    done: CudaSlice<u32>,
}

impl ArgmaxScratch {
    /// Scratch for launches of up to `rows` rows (more are refused).
    pub fn new(gpu: &Gpu, rows: usize) -> Result<Self> {
        Ok(Self {
            keys: gpu.zeros(rows.max(1))?,
            done: gpu.zeros(rows.max(1))?,
        })
    }

    /// Rows a launch may have.
    pub fn rows(&self) -> usize {
        self.keys.len()
    }
}

/// The greedy choice of each row of `logits` (`[rows, width]`, f32) into `out` (`[rows]`):
/// the first index of the row's largest value, NaNs never chosen (a row that starts with one
/// gives 0), as candle's `argmax` picks on the CPU. What a greedy decode step copies to the
/// host instead of its logits. `scratch` holds at least the rows (else this is an error);
/// launches that share one run one after another on the stream.
pub fn argmax_rows(
    gpu: &Gpu,
    logits: &CudaView<'_, f32>,
    width: usize,
    scratch: &mut ArgmaxScratch,
    out: &mut CudaViewMut<'_, u32>,
) -> Result<()> {
    let rows = whole_rows("argmax_rows logits [rows, width]", logits.len(), width)?;
    length("argmax_rows out [rows]", rows, out.len())?;
    if rows > scratch.rows() {
        return Err(KernelError::TooLarge {
            what: "argmax_rows rows (more than its scratch holds)",
            value: rows,
        });
    }
    let width = to_u32("argmax_rows width", width)?;
    if rows == 0 {
        return Ok(());
    }
    // Past 65,535 blocks a row (the grid's y limit), longer slices.
    let per_block = ARGMAX_PER_BLOCK.max((width as usize).div_ceil(u16::MAX as usize));
    let blocks = (width as usize).div_ceil(per_block).max(1);
    let per_block = per_block as u32;
    let kernel = gpu.kernel(SOURCE, "ops_argmax_rows", &[])?;
    let (logits, out) = (address(gpu, logits), address_mut(gpu, out));
    let keys = scratch.keys.device_ptr_mut(gpu.stream()).0;
    let done = scratch.done.device_ptr_mut(gpu.stream()).0;
    let mut params = [
        param(&logits),
        param(&width),
        param(&per_block),
        param(&keys),
        param(&done),
        param(&out),
    ];
    let config = rows_config(rows, blocks, ARGMAX_THREADS)?;
    // Safety: the arguments match `ops_argmax_rows`; logits hold `rows` rows of `width`,
    // out `rows` elements, the scratch at least `rows` keys and counts, zero between
    // launches; `blocks * per_block` covers the width.
    unsafe {
        launch(
            gpu,
            &kernel,
            config,
            &mut params,
            "launching ops_argmax_rows",
        )
    }
}

/// The keys and values of a [`KvCache`] (`[kv_heads, capacity, head_dim]` each), as views:
/// to copy them back, or to hand them to a kernel this crate does not wrap.
pub fn kv_views<T>(kv: &KvCache<T>) -> (CudaView<'_, T>, CudaView<'_, T>) {
    (kv.keys.as_view(), kv.values.as_view())
}

/// `out [rows, n] += bias [n]` (f32): [`crate::Gemm`]'s bias when cuBLASLt's epilogue does
/// not add it.
pub(crate) fn add_bias(
    gpu: &Gpu,
    out: &mut CudaViewMut<'_, f32>,
    bias: &CudaView<'_, f32>,
) -> Result<()> {
    whole_rows("bias out [rows, n]", out.len(), bias.len())?;
    let n = to_u32("bias length", bias.len())?;
    if out.is_empty() {
        return Ok(());
    }
    let len = out.len() as u64;
    let config = flat_config(gpu, out.len());
    let kernel = gpu.kernel(SOURCE, "ops_add_bias", &[])?;
    let (out, bias) = (address_mut(gpu, out), address(gpu, bias));
    let mut params = [param(&out), param(&bias), param(&n), param(&len)];
    // Safety: the arguments match `ops_add_bias`; out holds whole rows of `n`, bias `n`.
    unsafe { launch(gpu, &kernel, config, &mut params, "launching ops_add_bias") }
}

/// The number of rows of `width` in `len` elements: an error unless `width > 0` divides `len`.
fn whole_rows(what: &'static str, len: usize, width: usize) -> Result<usize> {
    if width == 0 {
        return Err(KernelError::Unsupported {
            what,
            value: 0,
            supported: "a row width of at least 1",
        });
    }
    if !len.is_multiple_of(width) {
        return Err(KernelError::Length {
            what,
            expected: len.next_multiple_of(width),
            found: len,
        });
    }
    Ok(len / width)
}

fn to_u32(what: &'static str, value: usize) -> Result<u32> {
    u32::try_from(value).map_err(|_| KernelError::TooLarge { what, value })
}

/// `per_row` blocks of `threads` per row (`per_row` at most 65,535, the grid's y limit).
fn rows_config(rows: usize, per_row: usize, threads: u32) -> Result<LaunchConfig> {
    let blocks = u32::try_from(rows)
        .ok()
        .filter(|&r| r <= i32::MAX as u32)
        .ok_or(KernelError::TooLarge {
            what: "rows (one block each)",
            value: rows,
        })?;
    Ok(LaunchConfig {
        grid_dim: (blocks, per_row.clamp(1, u16::MAX as usize) as u32, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    })
}

/// Whether `rows` blocks would leave multiprocessors idle: a decode step's few rows, which
/// the row kernels then split over several blocks each.
fn few_rows(gpu: &Gpu, rows: usize) -> bool {
    rows < gpu.multiprocessors() as usize
}

/// A grid-stride launch over `n` elements: enough blocks to fill the GPU, no more.
fn flat_config(gpu: &Gpu, n: usize) -> LaunchConfig {
    let most = gpu.multiprocessors() as usize * 16;
    let blocks = n.div_ceil(FLAT_THREADS as usize).clamp(1, most);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (FLAT_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Launches `kernel` (an entry point of `ops.cu`) with `config` and `params` as a
/// programmatic dependent launch where the device has them: every entry point first waits
/// for the launch before it (`follow_previous_launch`).
///
/// # Safety
/// As [`Gpu::launch_raw`]'s: `params` hold the address of a value of each of the kernel's
/// parameters, in order and of its types, and every buffer among them is long enough for
/// what the kernel does with it.
unsafe fn launch(
    gpu: &Gpu,
    kernel: &CudaFunction,
    config: LaunchConfig,
    params: &mut [*mut c_void],
    op: &'static str,
) -> Result<()> {
    let LaunchConfig {
        grid_dim: (x, y, _),
        block_dim: (threads, _, _),
        shared_mem_bytes,
    } = config;
    // Safety: the caller's.
    unsafe {
        gpu.launch_raw(
            kernel,
            ((x, y), threads, shared_mem_bytes),
            params,
            true,
            op,
        )
    }
}

/// The device address of a view (for optional kernel arguments, 0 meaning none).
fn address<T>(gpu: &Gpu, view: &CudaView<'_, T>) -> u64 {
    view.device_ptr(gpu.stream()).0
}

/// The device address of a view the kernel writes.
fn address_mut<T>(gpu: &Gpu, view: &mut CudaViewMut<'_, T>) -> u64 {
    view.device_ptr_mut(gpu.stream()).0
}
