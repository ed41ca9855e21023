//! [`prefill_attention`]: exact causal (optionally sliding-window) attention of a chunk of
//! queries over a layer's K/V buffer, the prefill's attention (`cuda/prefill.cu`).
//!
//! f16 and bf16 run FlashAttention-2 style on the tensor cores (`mma.sync` m16n8k16 through
//! inline PTX, `ldmatrix`, `cp.async` double buffering): a block takes 128 rows of GQA-packed
//! queries (64 for a short causal triangle past d = 128; see `Tiles`), the query heads of a
//! KV head sharing its key and value tiles, walks the key tiles of 64 from the diagonal down
//! with an online softmax in f32 registers (rescaling the output only when a row's maximum
//! grew), skips the tiles no row of it sees and masks only the diagonal and window-edge
//! tiles. On Hopper (compute capability 9.0, head dims 64, 128 and 256) `prefill_hopper`
//! (`cuda/prefill_hopper.cu`) takes its place: the same masks and order on warpgroup MMAs
//! (`wgmma`, FlashAttention-3's overlap of one tile's softmax with the previous tile's
//! P V), compiled for `compute_90a`; [`Gpu::portable`] keeps the mma.sync kernel. f32 runs a
//! plain kernel, one warp per query row (the exact test mode). Either way: no atomics, the
//! same bits on every run.

use cudarc::driver::sys::CUfunction_attribute;
use cudarc::driver::{CudaFunction, CudaView, CudaViewMut, DevicePtr, LaunchConfig, PushKernelArg};

use crate::buffers::KvCache;
use crate::error::{driver, length, KernelError, Result};
use crate::gpu::{Float, Gpu};

const SOURCE: &str = include_str!("../cuda/prefill.cu");
/// `prefill.cu` with the Hopper kernel after it (which reuses its masks, copies and layouts).
const HOPPER_SOURCE: &str = concat!(
    include_str!("../cuda/prefill.cu"),
    include_str!("../cuda/prefill_hopper.cu")
);

/// Which keys a query sees: query `i` of the chunk sits at position `first_position + i` and
/// sees key positions `k` with `k <= p`, and `k > p - window` when a window is set (the
/// query's own included, HF/llama.cpp convention).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Causal {
    /// Position of the chunk's first query.
    pub first_position: usize,
    /// Keys a query sees at most, its own included (a sliding-window layer); `None` for
    /// global attention.
    pub window: Option<usize>,
}

impl<T: Float> KvCache<T> {
    /// Copies keys and values of token positions `first_position..` (`[tokens, kv_heads,
    /// head_dim]` each, on the host) into their rows, position `p` at row `p % capacity` as
    /// [`prefill_attention`] reads them (at most `capacity` tokens): how tests and benchmarks
    /// fill a buffer; the model writes its rows on the GPU.
    pub fn write_positions(
        &mut self,
        gpu: &Gpu,
        first_position: usize,
        keys: &[T],
        values: &[T],
    ) -> Result<()> {
        let (heads, d, cap) = (self.kv_heads(), self.head_dim(), self.tokens());
        let row = heads * d;
        length("values", keys.len(), values.len())?;
        if row == 0 || !keys.len().is_multiple_of(row) || keys.len() / row > cap {
            return Err(KernelError::Length {
                what: "keys [tokens <= capacity, kv_heads, head_dim]",
                expected: keys.len().next_multiple_of(row.max(1)).min(cap * row),
                found: keys.len(),
            });
        }
        let tokens = keys.len() / row;
        for h in 0..heads {
            for (host, buffer) in [(keys, &mut self.keys), (values, &mut self.values)] {
                let rows: Vec<T> = (0..tokens)
                    .flat_map(|i| host[i * row + h * d..][..d].iter().copied())
                    .collect();
                // Two runs at most: up to the ring's end, then from its start.
                let mut i = 0;
                while i < tokens {
                    let slot = (first_position + i) % cap;
                    let run = (cap - slot).min(tokens - i);
                    let at = (h * cap + slot) * d;
                    gpu.stream()
                        .memcpy_htod(
                            &rows[i * d..(i + run) * d],
                            &mut buffer.slice_mut(at..at + run * d),
                        )
                        .map_err(driver("copying rows to a KV buffer"))?;
                    i += run;
                }
            }
        }
        // The host rows are temporaries: wait until the copies have read them.
        gpu.synchronize()
    }
}

/// Tiles of the fast kernel for one head dimension.
#[derive(Debug, Clone, Copy)]
struct Tiles {
    /// Warps per block.
    warps: u32,
    /// 16-row query tiles per warp.
    m_tiles: u32,
    /// Keys per tile.
    block_n: u32,
    /// Blocks per multiprocessor the registers are capped for (255 registers a thread).
    min_blocks: u32,
}

impl Tiles {
    /// Up to d = 128, 4 warps of 32 query rows (two m tiles share each key and value
    /// fragment read from shared memory, which halves those reads per multiply: at 16 rows a
    /// warp the H100's shared memory, not its tensor cores, would bound the loop) and 64 keys
    /// a tile: 104 KB of shared memory at d = 128, two blocks a multiprocessor. Past 128 the
    /// output alone would take 256 registers at 32 rows, so 8 warps of 16 rows: at d = 256
    /// 198 KB of shared memory, one block of 8 warps a multiprocessor.
    fn for_head_dim(head_dim: usize) -> Self {
        if head_dim <= 128 {
            Self {
                warps: 4,
                m_tiles: 2,
                block_n: 64,
                min_blocks: 2,
            }
        } else {
            Self {
                warps: 8,
                m_tiles: 1,
                block_n: 64,
                min_blocks: 1,
            }
        }
    }

    /// The tiles of a call: [`Tiles::for_head_dim`], except for a causal triangle that
    /// fills less than one wave of blocks past d = 128 (Gemma's 4K prefill from position 0):
    /// there the longest block is the critical path, and blocks of 4 warps (64 rows) halve
    /// it. Measured on the H100 (bf16, 4 query heads over 1 KV head, d 256): 4K tokens
    /// 0.189 ms instead of 0.267; where blocks are about equally long (a chunk after a
    /// longer prefix, a sliding window) the smaller blocks were slower (32K chunked: 9.9 ms
    /// instead of 8.7).
    fn for_call(plan: &Plan, kv_heads: usize, multiprocessors: u32) -> Self {
        let tiles = Self::for_head_dim(plan.head_dim);
        if plan.head_dim <= 128 {
            return tiles;
        }
        let blocks = (plan.tokens * plan.group).div_ceil(tiles.block_m() as usize) * kv_heads;
        if blocks > multiprocessors as usize {
            return tiles;
        }
        // Keys query i sees, and whether their mean is under 3/4 of the last query's.
        let keys = |i: usize| {
            let seen = plan.first_position as usize + i + 1;
            seen.min(plan.window as usize)
        };
        let total: usize = (0..plan.tokens).map(keys).sum();
        if 4 * total <= 3 * plan.tokens * keys(plan.tokens - 1) {
            Self { warps: 4, ..tiles }
        } else {
            tiles
        }
    }

    fn block_m(self) -> u32 {
        self.warps * 16 * self.m_tiles
    }

    fn threads(self) -> u32 {
        self.warps * 32
    }

    /// Queries, then two stages of keys and values, rows padded by 16 bytes.
    fn shared_bytes(self, head_dim: usize) -> usize {
        (self.block_m() + 4 * self.block_n) as usize * (head_dim + 8) * 2
    }
}

/// Tiles of the Hopper kernel (`cuda/prefill_hopper.cu`): two warpgroups of 64 query rows
/// (one block a multiprocessor) and key tiles of 128 keys up to d = 128, 64 at d = 256,
/// where the output alone takes 128 registers a thread.
#[derive(Debug, Clone, Copy)]
struct HopperTiles {
    warpgroups: u32,
    block_n: u32,
}

impl HopperTiles {
    /// The head dims it takes: whole 64-element panels of the swizzled layout, and an
    /// output of at most 256 columns (one wgmma).
    fn for_head_dim(head_dim: usize) -> Option<Self> {
        match head_dim {
            64 | 128 => Some(Self {
                warpgroups: 2,
                block_n: 128,
            }),
            256 => Some(Self {
                warpgroups: 2,
                block_n: 64,
            }),
            _ => None,
        }
    }

    fn block_m(self) -> u32 {
        self.warpgroups * 64
    }

    /// Queries, two key and two value tiles, and 1 KB to align them to the swizzle's atoms:
    /// 161 KB at d = 128, 193 KB at d = 256.
    fn shared_bytes(self, head_dim: usize) -> usize {
        (self.block_m() + 4 * self.block_n) as usize * head_dim * 2 + 1024
    }
}

/// A tensor-core kernel ready for a call: which one, and its block's shape.
struct TensorCoreKernel {
    function: CudaFunction,
    block_m: u32,
    threads: u32,
    shared: usize,
}

impl TensorCoreKernel {
    /// The Hopper kernel where the device and head dim allow it, else the mma.sync one.
    fn for_call(gpu: &Gpu, plan: &Plan, kv_heads: usize, kinds: (u32, u32)) -> Result<Self> {
        let common = [
            ("IN_KIND", kinds.0.to_string()),
            ("OUT_KIND", kinds.1.to_string()),
            ("HEAD_DIM", plan.head_dim.to_string()),
        ];
        if let Some(tiles) = HopperTiles::for_head_dim(plan.head_dim).filter(|_| gpu.hopper()) {
            let mut defines = common.to_vec();
            defines.push(("WARPGROUPS", tiles.warpgroups.to_string()));
            defines.push(("BLOCK_N", tiles.block_n.to_string()));
            return Ok(Self {
                function: gpu.hopper_kernel(HOPPER_SOURCE, "prefill_hopper", &defines)?,
                block_m: tiles.block_m(),
                threads: tiles.warpgroups * 128,
                shared: tiles.shared_bytes(plan.head_dim),
            });
        }
        let tiles = Tiles::for_call(plan, kv_heads, gpu.multiprocessors());
        let mut defines = common.to_vec();
        defines.extend([
            ("WARPS", tiles.warps.to_string()),
            ("M_TILES", tiles.m_tiles.to_string()),
            ("BLOCK_N", tiles.block_n.to_string()),
            ("MIN_BLOCKS", tiles.min_blocks.to_string()),
        ]);
        Ok(Self {
            function: gpu.kernel(SOURCE, "prefill", &defines)?,
            block_m: tiles.block_m(),
            threads: tiles.threads(),
            shared: tiles.shared_bytes(plan.head_dim),
        })
    }
}

/// The kernels' number for an element type (`IN_KIND`, `OUT_KIND` in `prefill.cu`).
fn kind<T: Float>() -> Result<u32> {
    match T::NAME {
        "float" => Ok(0),
        "__half" => Ok(1),
        "__nv_bfloat16" => Ok(2),
        _ => Err(KernelError::Unsupported {
            what: "prefill element type (its size in bytes)",
            value: std::mem::size_of::<T>(),
            supported: "f32, f16 and bf16",
        }),
    }
}

/// Exact causal attention of a chunk of queries over a layer's K/V buffer (the chunk's own
/// keys already appended, and the prefix before it): `out[i, qh, :] = softmax_k(scale *
/// q·k) · v` over the visible keys (see [`Causal`]), query head `qh` using KV head `qh /
/// (heads / kv_heads)` (GQA). `queries [tokens, heads, head_dim]` (`A`, rotated); `out
/// [tokens, heads, head_dim]` (`O`); `tokens` follows from the length. f32 accumulation,
/// online softmax; deterministic (no atomics).
///
/// f16 and bf16 take the tensor-core path, for head dims that are multiples of 16 from 16
/// to 256, with `queries` 16-byte aligned and `out` aligned to two elements; f32 takes a plain kernel, for any head dim up to
/// 256. Errors, checked on the host: lengths, `heads` not a multiple of `kv_heads`, a window
/// of 0, a `scale` that is not finite and positive, and a buffer that no longer holds every
/// key the chunk needs (global attention needs `first_position + tokens <= capacity`; a
/// window `w` that or `capacity >= w + tokens - 1`, the ring holding position `p` at row
/// `p % capacity`).
pub fn prefill_attention<A: Float, O: Float>(
    gpu: &Gpu,
    queries: &CudaView<'_, A>,
    heads: usize,
    kv: &KvCache<A>,
    mask: &Causal,
    scale: f32,
    out: &mut CudaViewMut<'_, O>,
) -> Result<()> {
    let plan = Plan::new::<A>(queries.len(), heads, kv, mask, scale)?;
    length(
        "prefill out [tokens, heads, head_dim]",
        queries.len(),
        out.len(),
    )?;
    let (in_kind, out_kind) = (kind::<A>()?, kind::<O>()?);
    if plan.tokens == 0 {
        return Ok(());
    }
    if in_kind == 0 {
        return launch_exact(gpu, &plan, queries, kv, scale, out, out_kind);
    }
    // 16-byte copies of query rows, pairs of outputs stored at once.
    let q_address = queries.device_ptr(gpu.stream()).0;
    let out_address = out.device_ptr(gpu.stream()).0;
    let pair = 2 * std::mem::size_of::<O>();
    for (what, address, bytes) in [
        ("prefill queries", q_address, 16),
        ("prefill out", out_address, pair),
    ] {
        if address % bytes as u64 != 0 {
            return Err(KernelError::Misaligned { what, bytes });
        }
    }
    launch_fast(gpu, &plan, queries, kv, scale, out, (in_kind, out_kind))
}

/// A validated call: shapes and the ring's coordinates as the kernels take them.
#[derive(Debug)]
struct Plan {
    tokens: usize,
    heads: usize,
    group: usize,
    head_dim: usize,
    /// `Causal::window`, `i32::MAX` for none.
    window: i32,
    first_position: i32,
    /// Positions `[lo_valid, first_position + tokens)` are in the buffer, `lo_valid` at row
    /// `lo_row`.
    lo_valid: i32,
    lo_row: u32,
}

impl Plan {
    fn new<A: Float>(
        len: usize,
        heads: usize,
        kv: &KvCache<A>,
        mask: &Causal,
        scale: f32,
    ) -> Result<Self> {
        let (kv_heads, head_dim, capacity) = (kv.kv_heads(), kv.head_dim(), kv.tokens());
        let fast = kind::<A>()? != 0;
        let supported = if fast {
            head_dim.is_multiple_of(16) && (16..=256).contains(&head_dim)
        } else {
            (1..=256).contains(&head_dim)
        };
        if !supported {
            return Err(KernelError::Unsupported {
                what: "prefill head dimension",
                value: head_dim,
                supported: "multiples of 16 from 16 to 256 (f16, bf16); 1 to 256 (f32)",
            });
        }
        if kv_heads == 0 || heads == 0 || !heads.is_multiple_of(kv_heads) {
            return Err(KernelError::Heads { heads, kv_heads });
        }
        let row = heads * head_dim;
        if !len.is_multiple_of(row) {
            return Err(KernelError::Length {
                what: "prefill queries [tokens, heads, head_dim]",
                expected: len.next_multiple_of(row),
                found: len,
            });
        }
        let tokens = len / row;
        if mask.window == Some(0) {
            return Err(KernelError::Unsupported {
                what: "attention window",
                value: 0,
                supported: "1 or more keys (None for global attention)",
            });
        }
        // The kernels take row maxima of unscaled scores.
        if !(scale.is_finite() && scale > 0.0) {
            return Err(KernelError::Scale { scale });
        }
        let end = mask.first_position.checked_add(tokens);
        let end = end
            .filter(|&e| i32::try_from(e).is_ok())
            .ok_or(KernelError::TooLarge {
                what: "prefill positions (first_position + tokens, at most i32::MAX)",
                value: mask.first_position.saturating_add(tokens),
            })?;
        for (what, value) in [
            ("prefill query rows (tokens × heads)", tokens * heads),
            ("KV buffer rows (kv_heads × capacity)", kv_heads * capacity),
        ] {
            if u32::try_from(value).is_err() {
                return Err(KernelError::TooLarge { what, value });
            }
        }
        // Keys the chunk needs: from the first query's lowest key to the last query.
        let needed = match mask.window {
            None => end,
            Some(w) => end.min((w + tokens).saturating_sub(1)),
        };
        if tokens > 0 && needed > capacity {
            return Err(KernelError::Evicted { needed, capacity });
        }
        let lo_valid = end.saturating_sub(capacity);
        Ok(Self {
            tokens,
            heads,
            group: heads / kv_heads,
            head_dim,
            window: mask
                .window
                .map_or(i32::MAX, |w| i32::try_from(w).unwrap_or(i32::MAX)),
            first_position: mask.first_position as i32,
            lo_valid: lo_valid as i32,
            lo_row: (lo_valid % capacity.max(1)) as u32,
        })
    }
}

/// The tensor-core kernel.
fn launch_fast<A: Float, O: Float>(
    gpu: &Gpu,
    plan: &Plan,
    queries: &CudaView<'_, A>,
    kv: &KvCache<A>,
    scale: f32,
    out: &mut CudaViewMut<'_, O>,
    (in_kind, out_kind): (u32, u32),
) -> Result<()> {
    let kv_heads = kv.kv_heads();
    let TensorCoreKernel {
        function: kernel,
        block_m,
        threads,
        shared,
    } = TensorCoreKernel::for_call(gpu, plan, kv_heads, (in_kind, out_kind))?;
    // Past 48 KB a block's dynamic shared memory must be asked for; the carveout preference
    // lets two blocks of 104 KB share a multiprocessor.
    kernel
        .set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
            shared as i32,
        )
        .map_err(driver("raising the prefill kernel's shared memory"))?;
    kernel
        .set_attribute(
            CUfunction_attribute::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
            100,
        )
        .map_err(driver(
            "setting the prefill kernel's shared memory carveout",
        ))?;

    let rows = plan.tokens * plan.group;
    let m_blocks = rows.div_ceil(block_m as usize);
    let blocks = u32::try_from(m_blocks * kv_heads).map_err(|_| KernelError::TooLarge {
        what: "prefill blocks",
        value: m_blocks * kv_heads,
    })?;
    let args = (
        plan.tokens as u32,
        plan.heads as u32,
        plan.group as u32,
        kv_heads as u32,
        kv.tokens() as u32,
        plan.first_position,
        plan.window,
        plan.lo_valid,
        plan.lo_row,
        m_blocks as u32,
        scale * std::f32::consts::LOG2_E,
    );
    let config = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: shared as u32,
    };
    let mut builder = gpu.stream().launch_builder(&kernel);
    builder
        .arg(queries)
        .arg(&kv.keys)
        .arg(&kv.values)
        .arg(out)
        .arg(&args.0)
        .arg(&args.1)
        .arg(&args.2)
        .arg(&args.3)
        .arg(&args.4)
        .arg(&args.5)
        .arg(&args.6)
        .arg(&args.7)
        .arg(&args.8)
        .arg(&args.9)
        .arg(&args.10);
    // Safety: the arguments match the signatures of `prefill` and `prefill_hopper` in order
    // and type; the queries and out hold tokens × heads rows, the buffers kv_heads ×
    // capacity rows of head_dim, and the kernel reads only rows of positions the plan found
    // in the buffer.
    unsafe { builder.launch(config) }.map_err(driver("launching prefill"))?;
    Ok(())
}

/// The plain kernel: one warp per (token, query head).
fn launch_exact<A: Float, O: Float>(
    gpu: &Gpu,
    plan: &Plan,
    queries: &CudaView<'_, A>,
    kv: &KvCache<A>,
    scale: f32,
    out: &mut CudaViewMut<'_, O>,
    out_kind: u32,
) -> Result<()> {
    let defines = [
        ("IN_KIND", kind::<A>()?.to_string()),
        ("OUT_KIND", out_kind.to_string()),
    ];
    let kernel = gpu.kernel(SOURCE, "prefill_exact", &defines)?;
    const WARPS: usize = 4;
    let items = plan.tokens * plan.heads;
    let blocks = u32::try_from(items.div_ceil(WARPS)).map_err(|_| KernelError::TooLarge {
        what: "prefill query rows",
        value: items,
    })?;
    let args = (
        plan.tokens as u32,
        plan.heads as u32,
        plan.group as u32,
        plan.head_dim as u32,
        kv.tokens() as u32,
        plan.first_position,
        plan.window,
        plan.lo_valid,
        plan.lo_row,
        scale,
    );
    let config = LaunchConfig {
        grid_dim: (blocks, 1, 1),
        block_dim: (32 * WARPS as u32, 1, 1),
        shared_mem_bytes: 0,
    };
    let mut builder = gpu.stream().launch_builder(&kernel);
    builder
        .arg(queries)
        .arg(&kv.keys)
        .arg(&kv.values)
        .arg(out)
        .arg(&args.0)
        .arg(&args.1)
        .arg(&args.2)
        .arg(&args.3)
        .arg(&args.4)
        .arg(&args.5)
        .arg(&args.6)
        .arg(&args.7)
        .arg(&args.8)
        .arg(&args.9);
    // Safety: the arguments match `prefill_exact`'s signature in order and type; lengths as
    // in `launch_fast`.
    unsafe { builder.launch(config) }.map_err(driver("launching prefill_exact"))?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A block of the Hopper kernel fits the H100's and H200's 227 KB of shared memory a
    /// block, its key tiles are whole k16 steps, and head dims that are not whole 64-column
    /// panels (or more than one wgmma's 256 output columns) go to the mma.sync kernel.
    #[test]
    fn hopper_tiles_fit_shared_memory() {
        const HOPPER_SHARED_PER_BLOCK: usize = 232_448;
        for head_dim in [64, 128, 256] {
            let tiles = HopperTiles::for_head_dim(head_dim).expect("supported head dim");
            let bytes = tiles.shared_bytes(head_dim);
            assert!(
                bytes <= HOPPER_SHARED_PER_BLOCK,
                "d {head_dim}: {bytes} bytes"
            );
            assert_eq!(tiles.block_n % 16, 0, "d {head_dim}: whole k16 steps");
        }
        for head_dim in [16, 32, 48, 96, 112, 192, 240] {
            assert!(
                HopperTiles::for_head_dim(head_dim).is_none(),
                "d {head_dim}"
            );
        }
    }
}
