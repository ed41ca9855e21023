//! The launchers: [`flash_decode`], [`retrieval_attention`] and [`bucket_attention`], all
//! one launch of `attend.cu`.

use std::marker::PhantomData;
use std::ops::Range;

use cudarc::driver::{
    CudaFunction, CudaSlice, CudaView, CudaViewMut, DevicePtr, DevicePtrMut, LaunchArgs,
    LaunchConfig, PushKernelArg,
};

use crate::buffers::{Csr, KvCache};
use crate::error::{driver, length, KernelError, Result};
use crate::gpu::{
    param, AttendKernel, Gpu, KvElement, Variant, MAX_GROUP, MAX_MERGE, THREADS, UNROLL,
};

/// The queries of one decode step: `[kv_heads, group, head_dim]` (query head `h * group + g`
/// attends with KV head `h`), and the logit scale (usually `1 / sqrt(head_dim)`).
#[derive(Debug)]
pub struct Query<'a, T> {
    /// The query heads, rotated like the keys (a view, so that one row of a batch of
    /// tokens' queries can be a step's).
    pub heads: &'a CudaView<'a, T>,
    /// Scale of `q · k`.
    pub scale: f32,
}

/// Scratch of the launches: one partial per work item and per group of items, counters that
/// the kernel leaves at zero, and the last launch's queries and log-sum-exp of every query
/// head (what [`attention_mass`] weighs rows with, so that it needs nothing of the caller's
/// but the rows: it may run later, on another stream). Grows on demand; reuse one across
/// steps.
pub struct Workspace {
    partials: CudaSlice<f32>,
    counters: CudaSlice<u32>,
    lse: CudaSlice<f32>,
    /// The last launch's queries, as the kernel read them (16-bit elements).
    queries: CudaSlice<u16>,
    last: Option<Launched>,
    /// Whether launches take the tensor-core path where it exists.
    tensor_cores: bool,
}

/// What a workspace's last launch attended: its kernel variant, KV heads and logit scale.
#[derive(Debug, Clone, Copy)]
struct Launched {
    variant: Variant,
    kv_heads: usize,
    scale: f32,
}

impl std::fmt::Debug for Workspace {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Workspace")
            .field("partial_floats", &self.partials.len())
            .field("counters", &self.counters.len())
            .field("lse", &self.lse.len())
            .field("last", &self.last)
            .field("tensor_cores", &self.tensor_cores)
            .finish()
    }
}

impl Workspace {
    /// An empty workspace.
    pub fn new(gpu: &Gpu) -> Result<Self> {
        Ok(Self {
            partials: gpu.zeros(1)?,
            counters: gpu.zeros(1)?,
            lse: gpu.zeros(1)?,
            queries: gpu.zeros(1)?,
            last: None,
            tensor_cores: true,
        })
    }

    /// Whether this workspace's launches may compute logits and outputs with tensor cores
    /// (`mma.sync`: head dimensions 64 and 128, f16 and bf16; the default) where a work item
    /// attends few rows (at most 1,024: a step's selection, not a long dense run), or always
    /// use the scalar kernel, which every shape has: how tests cover both paths and
    /// benchmarks compare them.
    pub fn with_tensor_cores(mut self, on: bool) -> Self {
        self.tensor_cores = on;
        self
    }

    /// See [`Workspace::with_tensor_cores`].
    pub fn tensor_cores(&self) -> bool {
        self.tensor_cores
    }

    fn reserve(
        &mut self,
        gpu: &Gpu,
        partial_floats: usize,
        counters: usize,
        query_heads: usize,
        query_elements: usize,
    ) -> Result<()> {
        if self.partials.len() < partial_floats {
            self.partials = gpu.zeros(partial_floats)?;
        }
        if self.counters.len() < counters {
            self.counters = gpu.zeros(counters)?;
        }
        if self.lse.len() < query_heads {
            self.lse = gpu.zeros(query_heads)?;
        }
        if self.queries.len() < query_elements {
            self.queries = gpu.zeros(query_elements)?;
        }
        Ok(())
    }
}

/// Where rows of keys and values come from: KV head `h`'s row `r` is row
/// `h * head_stride + r` of the buffers, and `rows` rows exist per head. The buffers are in
/// GPU memory ([`KvCache`], a block cache's slots) or in pinned host memory mapped into the
/// GPU's address space ([`crate::HostKv`]: the kernels read its rows over PCIe, in place).
#[derive(Debug)]
pub struct KvRows<'a, T> {
    pub(crate) keys: Buffer<'a, T>,
    pub(crate) values: Buffer<'a, T>,
    pub(crate) head_stride: u64,
    pub(crate) rows: usize,
    pub(crate) head_dim: usize,
}

impl<T> KvRows<'_, T> {
    /// Rows (tokens) per KV head.
    pub fn tokens(&self) -> usize {
        self.rows
    }
}

/// One buffer of a [`KvRows`].
#[derive(Debug)]
pub(crate) enum Buffer<'a, T> {
    /// GPU memory.
    Device(&'a CudaSlice<T>),
    /// The device address of pinned host memory that outlives `'a`.
    Mapped(u64, PhantomData<&'a T>),
}

impl<T> Clone for Buffer<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for Buffer<'_, T> {}

impl<T> Buffer<'_, T> {
    /// The address the kernels read.
    pub(crate) fn address(&self, gpu: &Gpu) -> u64 {
        match self {
            Buffer::Device(slice) => gpu.address(*slice),
            Buffer::Mapped(address, _) => *address,
        }
    }
}

impl<'a, T> From<&'a KvCache<T>> for KvRows<'a, T> {
    fn from(kv: &'a KvCache<T>) -> Self {
        Self {
            keys: Buffer::Device(&kv.keys),
            values: Buffer::Device(&kv.values),
            head_stride: kv.tokens() as u64,
            rows: kv.tokens(),
            head_dim: kv.head_dim(),
        }
    }
}

/// The selected tokens of a step, per KV head: rows of a [`KvCache`] ([`Selected::resident`])
/// or of a [`crate::BlockCache`] ([`crate::BlockCache::gather`]), with up to two runs of rows
/// of the same buffer ([`Selected::with_runs`]).
#[derive(Debug)]
pub struct Selected<'a, T> {
    pub(crate) rows: KvRows<'a, T>,
    pub(crate) lists: &'a Csr,
    pub(crate) runs: &'a [Range<u32>],
    /// For a block cache's rows, the tokens they hold (`None`: rows are tokens).
    pub(crate) tokens: Option<SlotTokens<'a>>,
}

/// The tokens of a block cache's rows: row `r` holds token `first[r >> shift] + (r & (1 <<
/// shift) - 1)` of its KV head, out of `tokens` per head.
#[derive(Debug, Clone, Copy)]
pub(crate) struct SlotTokens<'a> {
    pub(crate) first: &'a CudaSlice<u32>,
    pub(crate) shift: u32,
    pub(crate) tokens: usize,
}

impl<'a, T> Selected<'a, T> {
    /// Token ids `lists` (one list per KV head) of `kv` (a [`KvCache`], or a
    /// [`crate::HostKv`] read in place). Ids must be deduplicated and cleared of the dense
    /// part's ids by the caller, as `kvdb-attention` does; they are checked against `kv`'s
    /// length at launch.
    pub fn resident(kv: impl Into<KvRows<'a, T>>, lists: &'a Csr) -> Self {
        Self {
            rows: kv.into(),
            lists,
            runs: &[],
            tokens: None,
        }
    }

    /// The same selection plus `runs` (at most two, disjoint, none of them in the lists) of
    /// consecutive rows of the same buffer for every KV head: a stored corpus's sinks and the
    /// part of the window before a query's own tokens.
    pub fn with_runs(self, runs: &'a [Range<u32>]) -> Self {
        Self { runs, ..self }
    }
}

/// Every key of each KV head's visited buckets, rows of a stored corpus (a [`KvCache`], or a
/// [`crate::HostKv`] read in place), with up to two runs of its rows (sinks and window)
/// attended whole and skipped inside the buckets, so that no token counts twice.
#[derive(Debug)]
pub struct Buckets<'a, T> {
    /// Where the rows are.
    pub kv: KvRows<'a, T>,
    /// Disjoint runs of rows, at most two, attended whole.
    pub runs: &'a [Range<u32>],
    /// Each bucket's token ids, ascending (CSR; the buckets of all KV heads numbered
    /// together).
    pub ids: &'a Csr,
    /// One list of bucket numbers per KV head.
    pub visited: &'a Csr,
    /// Where an attention launch adds the number of bucket ids it attended (those outside
    /// `runs`: what the index selected), as [`crate::Visits`] keeps it; [`attention_mass`]
    /// leaves it alone. [`crate::Partition::list_part`] sets it.
    pub count: Option<&'a CudaSlice<u64>>,
    /// Ids each KV head attends besides its visited buckets, if any.
    pub follow: Option<Followed<'a>>,
    /// A GPU cache of whole buckets in front of `kv` (rows in host memory), if any: the
    /// visited buckets it holds are read from it, the others from `kv`
    /// ([`crate::BucketCache::cached`]).
    pub cache: Option<CachedBuckets<'a, T>>,
}

/// The GPU rows of a [`crate::BucketCache`] as a bucket launch reads them: bucket (list) `l`
/// of the partition starts at row `slot_of[l]` of `keys` and `values` (all KV heads share
/// the rows), or is not cached ([`NO_TOKEN`]), and `token_of[r]` is the token row `r` holds.
#[derive(Debug)]
pub struct CachedBuckets<'a, T> {
    pub(crate) keys: &'a CudaSlice<T>,
    pub(crate) values: &'a CudaSlice<T>,
    pub(crate) slot_of: &'a CudaSlice<u32>,
    pub(crate) token_of: &'a CudaSlice<u32>,
}

/// Tokens each KV head of a bucket launch attends besides its visited buckets: the
/// successors of the tokens its last step weighed most ([`follow_most_attended`] writes
/// them), so that an answer copying a passage also reads the token after the one it copied.
/// An id is skipped where it is [`NO_TOKEN`], past the rows, inside the launch's runs or
/// inside one of its head's visited buckets (told by `buckets`): no token counts twice.
#[derive(Debug, Clone, Copy)]
pub struct Followed<'a> {
    /// `[kv_heads, per head]` token ids.
    pub ids: &'a CudaSlice<u32>,
    /// The bucket of every row of the launch's buffer.
    pub buckets: &'a BucketOf,
}

/// No token, in a [`Followed`] list.
pub const NO_TOKEN: u32 = u32::MAX;

/// Every row's bucket in a partition ([`crate::Partition::bucket_of`]): one more than the
/// number of the list that holds row `r` of KV head `h` (`h * buckets + b`, numbered as a
/// launch's visits are), 0 for a row no list holds.
#[derive(Debug)]
pub struct BucketOf {
    pub(crate) lists: CudaSlice<u32>,
    pub(crate) rows: usize,
}

impl BucketOf {
    /// Bytes of GPU memory the map takes.
    pub fn bytes(&self) -> usize {
        self.lists.len() * size_of::<u32>()
    }

    /// The buckets of `rows` rows per KV head from `ids` (`kv_heads * buckets` lists of
    /// token ids, each id of a head in at most one of its lists, as [`Buckets::ids`]; lists
    /// after those are ignored), computed on the GPU; ready for any stream when returned.
    pub fn new(gpu: &Gpu, ids: &Csr, kv_heads: usize, buckets: usize, rows: usize) -> Result<Self> {
        let lists = kv_heads * buckets;
        if lists > ids.lists() {
            return Err(KernelError::Length {
                what: "bucket lists (kv_heads * buckets)",
                expected: lists,
                found: ids.lists(),
            });
        }
        ids.check("bucket token ids", ids.lists(), rows)?;
        let too_large = |what, value| KernelError::TooLarge { what, value };
        let (lists_u32, buckets_u32, rows_u32) = (
            u32::try_from(lists).map_err(|_| too_large("bucket lists", lists))?,
            u32::try_from(buckets.max(1)).map_err(|_| too_large("buckets", buckets))?,
            u32::try_from(rows).map_err(|_| too_large("rows per KV head", rows))?,
        );
        let of = gpu.zeros::<u32>((kv_heads * rows).max(1))?;
        if lists > 0 {
            let function = gpu.follow_kernel("bucket_of")?;
            let (offsets, items) = (gpu.address(&ids.offsets), gpu.address(&ids.items));
            let out = gpu.address(&of);
            let mut builder = gpu.stream().launch_builder(&function);
            builder
                .arg(&offsets)
                .arg(&items)
                .arg(&lists_u32)
                .arg(&buckets_u32)
                .arg(&rows_u32)
                .arg(&out);
            let config = LaunchConfig {
                grid_dim: (lists_u32.min(65_535), 1, 1),
                block_dim: (128, 1, 1),
                shared_mem_bytes: 0,
            };
            // Safety: the arguments match `bucket_of`'s signature in order and type; the
            // CSR has at least `lists` lists, its ids are below `rows` (checked above), and
            // `of` holds `kv_heads * rows` entries.
            unsafe { builder.launch(config) }.map_err(driver("launching bucket_of"))?;
        }
        // Launches on other streams (other questions) may read the map once it is returned.
        gpu.synchronize()?;
        Ok(Self { lists: of, rows })
    }
}

/// Scratch of [`follow_most_attended`]: every candidate's weight and id, each slice's picks,
/// and a counter per KV head that the ranking leaves at zero. Grows on demand.
#[derive(Debug)]
pub struct FollowScratch {
    weight: CudaSlice<f32>,
    id: CudaSlice<u32>,
    slice_weight: CudaSlice<f32>,
    slice_id: CudaSlice<u32>,
    counters: CudaSlice<u32>,
}

impl FollowScratch {
    /// An empty scratch.
    pub fn new(gpu: &Gpu) -> Result<Self> {
        Ok(Self {
            weight: gpu.zeros(1)?,
            id: gpu.zeros(1)?,
            slice_weight: gpu.zeros(1)?,
            slice_id: gpu.zeros(1)?,
            counters: gpu.zeros(1)?,
        })
    }
}

/// What a launch attends to besides its dense part, and what [`attention_mass`] weighs.
#[derive(Debug)]
pub enum ListPart<'a, T> {
    /// Selected rows.
    Selected(Selected<'a, T>),
    /// Visited buckets.
    Buckets(Buckets<'a, T>),
}

/// The dense part of a step: up to two runs of rows of a [`KvCache`] (sinks and recent
/// window, as `DensePolicy::dense_ranges` gives them, or a query's own tail), the same for
/// every KV head.
#[derive(Debug)]
pub struct Dense<'a, T> {
    /// Where the rows are.
    pub kv: &'a KvCache<T>,
    /// Disjoint runs of rows, at most two.
    pub runs: &'a [Range<u32>],
}

// Copy whatever `T` is: these only borrow.
macro_rules! impl_copy {
    ($($name:ident),*) => {$(
        impl<T> Clone for $name<'_, T> {
            fn clone(&self) -> Self {
                *self
            }
        }
        impl<T> Copy for $name<'_, T> {}
    )*};
}
impl_copy!(
    Query,
    KvRows,
    Selected,
    Buckets,
    ListPart,
    Dense,
    CachedBuckets
);

/// Work items per head merged by one block in one level (see `launch`).
const SINGLE_MERGE: usize = 32;

/// Most rows a work item of the tensor-core path attends (see `launch`).
const TENSOR_CORE_MAX_CHUNK: usize = 1024;

/// Most buckets a KV head visits in one bucket launch (`MAX_VISITS` in `attend.cu`: their
/// starts and running sizes live in shared memory).
pub const MAX_VISITED_BUCKETS: usize = 128;

/// Rows per work item of [`attention_mass`]'s runs and lists.
const MASS_CHUNK: usize = 64;

/// Threads of `follow_pick` and the candidates each block ranks (`PICK_THREADS` and
/// `PICK_SLICE` in `follow.cu`).
const FOLLOW_PICK_THREADS: u32 = 256;
const FOLLOW_PICK_SLICE: usize = 256 * 8;

/// The list part of a launch after validation: rows of one buffer, up to two runs of them,
/// and a list per KV head (of rows, or of buckets whose ids are rows).
#[derive(Clone, Copy)]
struct Rows<'a, T> {
    rows: KvRows<'a, T>,
    runs: [(u32, u32); 2],
    lists: Option<&'a Csr>,
    buckets: Option<&'a Csr>,
    count: Option<&'a CudaSlice<u64>>,
    tokens: Option<SlotTokens<'a>>,
    follow: Option<Followed<'a>>,
    cache: Option<CachedBuckets<'a, T>>,
}

impl<T> Rows<'_, T> {
    fn run_rows(&self) -> usize {
        self.runs[0].1 as usize + self.runs[1].1 as usize
    }

    /// Work items of the lists alone: chunks of `chunk` rows; for buckets, whose visits are
    /// chosen on the GPU, items that share the visited ids evenly, as many as chunks of the
    /// visits' expected size (visits of large buckets make longer items, never more of
    /// them: the launch stays one wave), and one for the followed ids.
    fn list_items(&self, chunk: usize) -> usize {
        match self.buckets {
            Some(_) => self.list_rows().div_ceil(chunk).max(1) + usize::from(self.follow.is_some()),
            None => self.lists.map_or(0, Csr::longest).div_ceil(chunk),
        }
    }

    /// The followed ids' arguments of a kernel: the ids, how many per KV head, the bucket
    /// map and the rows per head (zeros without; `check_rows` checked their shapes).
    fn follow_args(&self, gpu: &Gpu) -> (u64, u32, u64, u32) {
        match self.follow {
            Some(f) => (
                gpu.address(f.ids),
                (f.ids.len() / self.lists.map_or(1, Csr::lists).max(1)) as u32,
                gpu.address(&f.buckets.lists),
                f.buckets.rows as u32,
            ),
            None => (0, 0, 0, 0),
        }
    }

    /// The bucket cache's arguments of a kernel: its keys, values, each bucket's first row
    /// and each row's token (zeros without).
    fn cache_args(&self, gpu: &Gpu) -> (u64, u64, u64, u64) {
        match self.cache {
            Some(c) => (
                gpu.address(c.keys),
                gpu.address(c.values),
                gpu.address(c.slot_of),
                gpu.address(c.token_of),
            ),
            None => (0, 0, 0, 0),
        }
    }

    /// Rows a KV head's list part holds at most (a selection), or about (visited buckets of
    /// the mean size): what sizes a launch's chunks.
    fn list_rows(&self) -> usize {
        let longest = self.lists.map_or(0, Csr::longest);
        match self.buckets {
            Some(buckets) => longest * (buckets.total() / buckets.lists().max(1)).max(1),
            None => longest,
        }
    }
}

/// One launch's arguments after validation.
struct Launch<'a, T> {
    query: Query<'a, T>,
    dense: KvRows<'a, T>,
    runs: [(u32, u32); 2],
    list: Option<Rows<'a, T>>,
    kv_heads: usize,
}

/// Exact attention of one decode step over the first `len` tokens of every KV head of `kv`
/// (the flash-decoding baseline): split over the sequence into one work item per block,
/// merged by log-sum-exp. Writes `out` `[kv_heads, group, head_dim]` (f32).
pub fn flash_decode<T: KvElement>(
    gpu: &Gpu,
    workspace: &mut Workspace,
    query: Query<'_, T>,
    kv: &KvCache<T>,
    len: usize,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    if len > kv.tokens() {
        return Err(KernelError::OutOfRange {
            what: "flash_decode length",
            index: len as u64,
            len: kv.tokens() as u64,
        });
    }
    let all = 0..len as u32;
    let dense = Dense {
        kv,
        runs: std::slice::from_ref(&all),
    };
    dense_attention(gpu, workspace, query, dense, out)
}

/// Exact attention of one decode step over `dense` alone (up to two runs of rows of every KV
/// head: a prefix, as [`flash_decode`] takes, or a sliding window's rows of a ring, as
/// [`KvCache::rows_of`] gives them), split over blocks and merged as [`flash_decode`] does.
/// Writes `out` `[kv_heads, group, head_dim]` (f32).
pub fn dense_attention<T: KvElement>(
    gpu: &Gpu,
    workspace: &mut Workspace,
    query: Query<'_, T>,
    dense: Dense<'_, T>,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    launch(gpu, workspace, plan(query, dense, None)?, out, false)
}

/// Retrieval attention of one decode step: every query head over its KV head's dense part
/// and selected tokens, merged by log-sum-exp in the same launch. Writes `out`
/// `[kv_heads, group, head_dim]` (f32).
///
/// The selection must not repeat a token nor contain one of the dense part (the caller
/// dedups and clears them, as `kvdb-attention`'s `retrieval_attention` does).
pub fn retrieval_attention<T: KvElement>(
    gpu: &Gpu,
    workspace: &mut Workspace,
    query: Query<'_, T>,
    dense: Dense<'_, T>,
    selected: Selected<'_, T>,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    let plan = plan(query, dense, Some(ListPart::Selected(selected)))?;
    launch(gpu, workspace, plan, out, false)
}

/// Bucket attention of one decode step (SAAP / IVF with every key of the visited buckets):
/// one block attends to each visited bucket, skipping the ids inside `buckets.runs`, which
/// are attended whole; all merged with the dense part (another buffer's rows, such as a
/// query's own tail, or none) in the same launch. Writes `out` `[kv_heads, group, head_dim]`
/// (f32).
pub fn bucket_attention<T: KvElement>(
    gpu: &Gpu,
    workspace: &mut Workspace,
    query: Query<'_, T>,
    dense: Dense<'_, T>,
    buckets: Buckets<'_, T>,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    let plan = plan(query, dense, Some(ListPart::Buckets(buckets)))?;
    launch(gpu, workspace, plan, out, false)
}

/// [`bucket_attention`] launched right after the routing launch that wrote `buckets`'
/// visits ([`crate::Partition::route_and_attend`]): on Hopper, a programmatic dependent
/// launch whose blocks start while routing runs, only the bucket items waiting for it.
/// Everything else the launch reads must have been written before that routing launch.
pub(crate) fn bucket_attention_after_route<T: KvElement>(
    gpu: &Gpu,
    workspace: &mut Workspace,
    query: Query<'_, T>,
    dense: Dense<'_, T>,
    buckets: Buckets<'_, T>,
    out: &mut CudaViewMut<'_, f32>,
) -> Result<()> {
    let plan = plan(query, dense, Some(ListPart::Buckets(buckets)))?;
    launch(gpu, workspace, plan, out, true)
}

/// Adds to `mass[id]` the attention weight that row `id` of `part`'s buffer received in the
/// workspace's last launch, from the queries and log-sum-exp it kept (summed over each KV
/// head's query heads, and over the KV heads): the attention mass of stored tokens that
/// provenance ranks passages by. `part` must be the last launch's list part. `mass` holds one
/// weight per token of a KV head: for a resident [`KvCache`] the rows are the tokens; for a
/// [`crate::BlockCache::gather`] selection each slot's row is added to the token it holds, as
/// is each row a bucket launch reads from its [`crate::BucketCache`].
///
/// It reads nothing the caller may change after the launch but `part`'s buffers, so `gpu`
/// may be another stream's handle ([`Gpu::fork`]) that waits for the launch's event; the
/// workspace's next launch must then wait for this one.
pub fn attention_mass<T: KvElement>(
    gpu: &Gpu,
    workspace: &Workspace,
    part: ListPart<'_, T>,
    mass: &mut CudaSlice<f32>,
) -> Result<()> {
    let (rows, kv_heads) = weighed_rows(part)?;
    let (mass_ptr, slot_token, slot_shift) = mass_args(gpu, &rows, mass)?;
    let run_items = rows.run_rows().div_ceil(MASS_CHUNK);
    let items = run_items + rows.list_items(MASS_CHUNK);
    let Some(w) = weighing(gpu, workspace, "attention_mass", &rows, kv_heads, items)? else {
        return Ok(());
    };
    let args = PartArgs::new(gpu, &w, &rows, run_items as u32);
    let mut builder = gpu.stream().launch_builder(&w.function);
    args.push(&mut builder);
    builder
        .arg(&w.lse)
        .arg(&mass_ptr)
        .arg(&slot_token)
        .arg(&slot_shift);
    // Safety: the arguments match `attention_mass`'s signature in order and type; every
    // address is of a live buffer whose length was checked against the rows the kernel
    // reads, and `mass` holds one float per token (a row, or a slot's row through
    // `slot_token`, which the cache's fills wrote for every slot a row of the lists is in).
    unsafe { builder.launch(w.config) }.map_err(driver("launching attention_mass"))?;
    Ok(())
}

/// The mass arguments of `attention_mass` and `follow_weights`: the mass, and where
/// a block cache's slots map to tokens (zeros for rows read in place), once `mass` is checked
/// to hold a float per token.
fn mass_args<T>(gpu: &Gpu, rows: &Rows<'_, T>, mass: &CudaSlice<f32>) -> Result<(u64, u64, u32)> {
    length(
        "mass (one per token of a KV head)",
        rows.tokens.map_or(rows.rows.rows, |t| t.tokens),
        mass.len(),
    )?;
    let (slot_token, slot_shift) = rows
        .tokens
        .map_or((0, 0), |t| (gpu.address(t.first), t.shift));
    Ok((gpu.address(mass), slot_token, slot_shift))
}

/// Writes to `weights[i]` the attention weight that item `i` of `selected`'s lists (every KV
/// head's list, in order; `weights` holds at least one float per item) received in the
/// workspace's last launch, summed over its KV head's query heads: how much each retrieved
/// token mattered to the step, which a query that follows its most attended tokens ranks
/// them by. `selected` must be the last launch's list part; its runs are not weighed. Like
/// [`attention_mass`], it may run on another stream that waits for the launch.
pub fn attention_weights<T: KvElement>(
    gpu: &Gpu,
    workspace: &Workspace,
    selected: Selected<'_, T>,
    weights: &mut CudaSlice<f32>,
) -> Result<()> {
    let (rows, kv_heads) = weighed_rows(ListPart::Selected(selected))?;
    let lists = selected.lists;
    if weights.len() < lists.total() {
        return Err(KernelError::Length {
            what: "weights (at least one per list item)",
            expected: lists.total(),
            found: weights.len(),
        });
    }
    let items = lists.longest().div_ceil(MASS_CHUNK);
    let Some(w) = weighing(gpu, workspace, "attention_weights", &rows, kv_heads, items)? else {
        return Ok(());
    };
    let (list_off, list) = (gpu.address(&lists.offsets), gpu.address(&lists.items));
    let chunk = MASS_CHUNK as u32;
    let out = gpu.address(weights);
    let mut builder = gpu.stream().launch_builder(&w.function);
    builder
        .arg(&w.q)
        .arg(&w.scale_log2)
        .arg(&w.keys)
        .arg(&rows.rows.head_stride)
        .arg(&list_off)
        .arg(&list)
        .arg(&chunk)
        .arg(&w.lse)
        .arg(&out);
    // Safety: the arguments match `attention_weights`'s signature in order and type; every
    // address is of a live buffer whose length was checked against what the kernel reads
    // (the lists against the rows, `weights` against the lists' items).
    unsafe { builder.launch(w.config) }.map_err(driver("launching attention_weights"))?;
    Ok(())
}

/// Writes to `next` (`[kv_heads, count]`) what each KV head of a bucket launch follows at
/// its next step: the successors of the `count` tokens of `part` (its visited buckets' ids
/// and followed ids, not its runs) that received the most attention in the workspace's last
/// launch, summed over the head's group, ranked by weight with ties to the lower id as the
/// CPU session ranks them; [`NO_TOKEN`] where a successor is past the rows (the tail's,
/// attended densely anyway) or the candidates ran out. `part` must be the last launch's list
/// part, and `next` must not be its followed ids (they are read while `next` is written).
/// Like [`attention_mass`], it may run on another stream that waits for the launch. With
/// `mass` it also does what [`attention_mass`] does for `part` (runs included), weighing each
/// row once for both: one launch fewer for a step that counts towards provenance.
pub fn follow_most_attended<T: KvElement>(
    gpu: &Gpu,
    workspace: &Workspace,
    part: Buckets<'_, T>,
    scratch: &mut FollowScratch,
    next: &mut CudaSlice<u32>,
    mass: Option<&mut CudaSlice<f32>>,
) -> Result<()> {
    let (rows, kv_heads) = weighed_rows(ListPart::Buckets(part))?;
    let mass = mass.map(|m| mass_args(gpu, &rows, m)).transpose()?;
    if kv_heads == 0 || !next.len().is_multiple_of(kv_heads) {
        return Err(KernelError::Length {
            what: "next followed ids [kv_heads, count]",
            expected: kv_heads.max(1),
            found: next.len(),
        });
    }
    let count = next.len() / kv_heads;
    let followed = rows.follow_args(gpu).1;
    let tokens = rows.rows.rows;
    let too_large = |what, value| KernelError::TooLarge { what, value };
    let tokens_u32 = u32::try_from(tokens).map_err(|_| too_large("rows per KV head", tokens))?;
    let count_u32 = u32::try_from(count).map_err(|_| too_large("followed ids per head", count))?;
    let candidates = kv_heads * (tokens + followed as usize);
    if scratch.id.len() < candidates {
        scratch.weight = gpu.zeros(candidates)?;
        scratch.id = gpu.zeros(candidates)?;
    }
    // The ranking's slices: a block each, most of them past a head's candidates (the visits
    // are chosen on the GPU), which only count themselves done.
    let slices = (tokens + followed as usize)
        .div_ceil(FOLLOW_PICK_SLICE)
        .max(1);
    let slices_u32 = u32::try_from(slices).map_err(|_| too_large("ranking slices", slices))?;
    if scratch.slice_id.len() < kv_heads * slices * count {
        scratch.slice_weight = gpu.zeros(kv_heads * slices * count)?;
        scratch.slice_id = gpu.zeros(kv_heads * slices * count)?;
    }
    if scratch.counters.len() < kv_heads {
        scratch.counters = gpu.zeros(kv_heads)?;
    }
    // Only the mass weighs the runs; the candidates are the list part's rows.
    let run_items = match mass {
        Some(_) => rows.run_rows().div_ceil(MASS_CHUNK),
        None => 0,
    };
    let items = run_items + rows.list_items(MASS_CHUNK);
    let Some(w) = weighing(gpu, workspace, "follow_weights", &rows, kv_heads, items)? else {
        return Ok(());
    };
    // No mass: a null one, which the kernel adds nothing to.
    let (mass_ptr, slot_token, slot_shift) = mass.unwrap_or((0, 0, 0));
    // The candidates of a head start every `rows + followed`, followed ids or not
    // (`head_rows` is the bucket map's rows, none without).
    let mut args = PartArgs::new(gpu, &w, &rows, run_items as u32);
    args.head_rows = tokens_u32;
    let (weight, id) = (gpu.address(&scratch.weight), gpu.address(&scratch.id));
    let mut builder = gpu.stream().launch_builder(&w.function);
    args.push(&mut builder);
    builder
        .arg(&w.lse)
        .arg(&mass_ptr)
        .arg(&slot_token)
        .arg(&slot_shift)
        .arg(&weight)
        .arg(&id);
    // Safety: the arguments match `follow_weights`'s signature in order and type; every
    // address is of a live buffer whose length was checked against the rows the kernel
    // reads (the bucket map has `tokens` rows per head, checked by `check_rows`; a mass one
    // float per token, or null with no run items), and the scratch holds `tokens + followed`
    // candidates per KV head.
    unsafe { builder.launch(w.config) }.map_err(driver("launching follow_weights"))?;
    let pick = gpu.follow_kernel("follow_pick")?;
    let next_ptr = gpu.address(next);
    let (slice_weight, slice_id, counters) = (
        gpu.address(&scratch.slice_weight),
        gpu.address(&scratch.slice_id),
        gpu.address(&scratch.counters),
    );
    let mut builder = gpu.stream().launch_builder(&pick);
    builder
        .arg(&weight)
        .arg(&id)
        .arg(&tokens_u32)
        .arg(&args.follow_count)
        .arg(&args.list_off)
        .arg(&args.list)
        .arg(&args.bucket_off)
        .arg(&count_u32)
        .arg(&tokens_u32)
        .arg(&slice_weight)
        .arg(&slice_id)
        .arg(&counters)
        .arg(&next_ptr);
    let config = LaunchConfig {
        grid_dim: (slices_u32, heads_u32(kv_heads)?, 1),
        block_dim: (FOLLOW_PICK_THREADS, 1, 1),
        shared_mem_bytes: 0,
    };
    // Safety: the arguments match `follow_pick`'s signature in order and type; the scratch
    // holds what `follow_weights` wrote for each head and room for every slice's picks, its
    // counters are zero (as the last launch left them), the visits are checked against the
    // partition, and `next` holds `count` ids per KV head.
    unsafe { builder.launch(config) }.map_err(driver("launching follow_pick"))?;
    Ok(())
}

/// The arguments `attention_mass` and `follow_weights` begin with: the weighing's queries
/// and keys, then the list part (runs, `run_items` items of them, lists or buckets, followed
/// ids).
struct PartArgs {
    q: u64,
    scale_log2: f32,
    keys: u64,
    head_stride: u64,
    runs: [(u32, u32); 2],
    chunk: u32,
    run_items: u32,
    list_off: u64,
    list: u64,
    bucket_off: u64,
    bucket_ids: u64,
    follow: u64,
    follow_count: u32,
    bucket_of: u64,
    head_rows: u32,
    cache_keys: u64,
    slot_of: u64,
    token_of: u64,
}

impl PartArgs {
    fn new<T>(gpu: &Gpu, w: &Weighing, rows: &Rows<'_, T>, run_items: u32) -> Self {
        let (list_off, list) = rows
            .lists
            .map_or((0, 0), |l| (gpu.address(&l.offsets), gpu.address(&l.items)));
        let (bucket_off, bucket_ids) = rows
            .buckets
            .map_or((0, 0), |b| (gpu.address(&b.offsets), gpu.address(&b.items)));
        let (follow, follow_count, bucket_of, head_rows) = rows.follow_args(gpu);
        let (cache_keys, _, slot_of, token_of) = rows.cache_args(gpu);
        Self {
            q: w.q,
            scale_log2: w.scale_log2,
            keys: w.keys,
            head_stride: rows.rows.head_stride,
            runs: rows.runs,
            chunk: MASS_CHUNK as u32,
            run_items,
            list_off,
            list,
            bucket_off,
            bucket_ids,
            follow,
            follow_count,
            bucket_of,
            head_rows,
            cache_keys,
            slot_of,
            token_of,
        }
    }

    /// Pushes them in the kernels' order (the same chunk for runs and lists).
    fn push<'a>(&'a self, builder: &mut LaunchArgs<'a>) {
        builder
            .arg(&self.q)
            .arg(&self.scale_log2)
            .arg(&self.keys)
            .arg(&self.head_stride)
            .arg(&self.runs[0].0)
            .arg(&self.runs[0].1)
            .arg(&self.runs[1].0)
            .arg(&self.runs[1].1)
            .arg(&self.chunk)
            .arg(&self.run_items)
            .arg(&self.list_off)
            .arg(&self.list)
            .arg(&self.chunk)
            .arg(&self.bucket_off)
            .arg(&self.bucket_ids)
            .arg(&self.follow)
            .arg(&self.follow_count)
            .arg(&self.bucket_of)
            .arg(&self.head_rows)
            .arg(&self.cache_keys)
            .arg(&self.slot_of)
            .arg(&self.token_of);
    }
}

/// The list part a weighing reads, checked, and its KV heads (one per list).
fn weighed_rows<T>(part: ListPart<'_, T>) -> Result<(Rows<'_, T>, usize)> {
    let rows = list_rows(part)?;
    let kv_heads = rows.lists.map_or(0, Csr::lists);
    check_rows(&rows, kv_heads)?;
    Ok((rows, kv_heads))
}

/// What [`attention_mass`] and [`attention_weights`] launch with besides their own arguments:
/// the entry compiled for the workspace's last launch, a grid of work items per KV head, and
/// the queries, keys and log-sum-exp they read.
struct Weighing {
    function: CudaFunction,
    config: LaunchConfig,
    q: u64,
    keys: u64,
    lse: u64,
    scale_log2: f32,
}

/// The [`Weighing`] of `items` work items per KV head of `rows` by `entry`, `None` when there
/// are none; an error unless the workspace's last launch attended those rows' shape.
fn weighing<T: KvElement>(
    gpu: &Gpu,
    workspace: &Workspace,
    entry: &'static str,
    rows: &Rows<'_, T>,
    kv_heads: usize,
    items: usize,
) -> Result<Option<Weighing>> {
    let last = last_launch::<T>(workspace, kv_heads, rows.rows.head_dim)?;
    if items == 0 {
        return Ok(None);
    }
    let scalar = Variant {
        tensor_cores: false,
        ..last.variant
    };
    let items = u32::try_from(items).map_err(|_| KernelError::TooLarge {
        what: "weighing work items",
        value: items,
    })?;
    Ok(Some(Weighing {
        function: gpu.attend_source_kernel(scalar, entry)?,
        config: LaunchConfig {
            grid_dim: (items, heads_u32(kv_heads)?, 1),
            block_dim: (THREADS, 1, 1),
            shared_mem_bytes: 0,
        },
        q: gpu.address(&workspace.queries),
        keys: rows.rows.keys.address(gpu),
        lse: gpu.address(&workspace.lse),
        scale_log2: last.scale * std::f32::consts::LOG2_E,
    }))
}

/// The workspace's last launch, if it attended `kv_heads` heads of `head_dim` elements of
/// `T`: what [`attention_mass`] and [`attention_weights`] weigh.
fn last_launch<T: KvElement>(
    workspace: &Workspace,
    kv_heads: usize,
    head_dim: usize,
) -> Result<Launched> {
    workspace
        .last
        .filter(|l| {
            l.kv_heads == kv_heads && l.variant.head_dim == head_dim && l.variant.dtype == T::DTYPE
        })
        .ok_or_else(|| KernelError::NotLastLaunch {
            asked: format!("{kv_heads} KV heads of {head_dim} {:?}", T::DTYPE),
            last: workspace.last.map_or("none".into(), |l| {
                format!(
                    "{} KV heads of {} {:?}",
                    l.kv_heads, l.variant.head_dim, l.variant.dtype
                )
            }),
        })
}

fn heads_u32(kv_heads: usize) -> Result<u32> {
    u32::try_from(kv_heads)
        .ok()
        .filter(|&h| h <= 65_535)
        .ok_or(KernelError::TooLarge {
            what: "KV heads",
            value: kv_heads,
        })
}

/// Up to two disjoint runs of rows within `rows`.
fn runs_of(ranges: &[Range<u32>], rows: usize) -> Result<[(u32, u32); 2]> {
    if ranges.len() > 2 {
        return Err(KernelError::Unsupported {
            what: "number of dense runs",
            value: ranges.len(),
            supported: "0 to 2 (sinks and window)",
        });
    }
    let mut runs = [(0u32, 0u32); 2];
    for (run, range) in runs.iter_mut().zip(ranges) {
        if range.start > range.end || range.end as usize > rows {
            return Err(KernelError::OutOfRange {
                what: "run end",
                index: range.end.into(),
                len: rows as u64,
            });
        }
        *run = (range.start, range.end - range.start);
    }
    let len = runs[0].1 as usize + runs[1].1 as usize;
    let overlap =
        ranges.len() == 2 && ranges[0].start < ranges[1].end && ranges[1].start < ranges[0].end;
    if len > rows || overlap {
        return Err(KernelError::OutOfRange {
            what: "run rows (runs must be disjoint)",
            index: len as u64,
            len: rows as u64,
        });
    }
    Ok(runs)
}

/// A list part's rows, runs and lists, checked against its buffer.
fn list_rows<T>(part: ListPart<'_, T>) -> Result<Rows<'_, T>> {
    match part {
        ListPart::Selected(selected) => Ok(Rows {
            rows: selected.rows,
            runs: runs_of(selected.runs, selected.rows.rows)?,
            lists: Some(selected.lists),
            buckets: None,
            count: None,
            tokens: selected.tokens,
            follow: None,
            cache: None,
        }),
        ListPart::Buckets(b) => {
            b.ids.check("bucket token ids", b.ids.lists(), b.kv.rows)?;
            if b.visited.longest() > MAX_VISITED_BUCKETS {
                return Err(KernelError::Unsupported {
                    what: "buckets a KV head visits in one launch",
                    value: b.visited.longest(),
                    supported: "0 to MAX_VISITED_BUCKETS (128)",
                });
            }
            Ok(Rows {
                rows: b.kv,
                runs: runs_of(b.runs, b.kv.rows)?,
                lists: Some(b.visited),
                buckets: Some(b.ids),
                count: b.count,
                tokens: None,
                follow: b.follow,
                cache: b.cache,
            })
        }
    }
}

/// Checks that the list part has one list per KV head of `kv_heads`, each item a row of
/// its buffer or one of its buckets.
fn check_rows<T>(rows: &Rows<'_, T>, kv_heads: usize) -> Result<()> {
    if let Some(lists) = rows.lists {
        let bound = match rows.buckets {
            Some(buckets) => buckets.lists(),
            None => rows.rows.rows,
        };
        lists.check("selected rows or visited buckets", kv_heads, bound)?;
    }
    if let (Some(cache), Some(buckets)) = (rows.cache, rows.buckets) {
        // The cache's tables are its own (made by `BucketCache`); they must cover the
        // partition's lists.
        length(
            "bucket cache table (one entry per list)",
            buckets.lists(),
            cache.slot_of.len(),
        )?;
    }
    if let Some(follow) = rows.follow {
        length(
            "bucket map rows (the launch's rows)",
            rows.rows.rows,
            follow.buckets.rows,
        )?;
        if kv_heads == 0 || !follow.ids.len().is_multiple_of(kv_heads) {
            return Err(KernelError::Length {
                what: "followed ids [kv_heads, per head]",
                expected: kv_heads.max(1),
                found: follow.ids.len(),
            });
        }
        if follow.buckets.lists.len() < kv_heads * rows.rows.rows {
            return Err(KernelError::Length {
                what: "bucket map [kv_heads, rows]",
                expected: kv_heads * rows.rows.rows,
                found: follow.buckets.lists.len(),
            });
        }
        u32::try_from(rows.rows.rows).map_err(|_| KernelError::TooLarge {
            what: "rows per KV head",
            value: rows.rows.rows,
        })?;
        u32::try_from(follow.ids.len() / kv_heads).map_err(|_| KernelError::TooLarge {
            what: "followed ids per KV head",
            value: follow.ids.len() / kv_heads,
        })?;
    }
    Ok(())
}

/// Threads that share a row of `head_dim` in the decode kernels (attention and routing),
/// 8 dimensions each: a power of two within a warp.
pub(crate) fn lanes_of(head_dim: usize, what: &'static str) -> Result<usize> {
    let lanes = head_dim / 8;
    if !head_dim.is_multiple_of(8) || !lanes.is_power_of_two() || lanes > 32 {
        return Err(KernelError::Unsupported {
            what,
            value: head_dim,
            supported: "8, 16, 32, 64, 128, 256",
        });
    }
    Ok(lanes)
}

/// The GQA group of `query` over `kv_heads` heads of `head_dim`.
fn group_of<T>(query: Query<'_, T>, kv_heads: usize, head_dim: usize) -> Result<usize> {
    let per_group = kv_heads * head_dim;
    if per_group == 0 || !query.heads.len().is_multiple_of(per_group) {
        return Err(KernelError::Length {
            what: "queries [kv_heads, group, head_dim]",
            expected: per_group.max(1),
            found: query.heads.len(),
        });
    }
    let group = query.heads.len() / per_group;
    if !(1..=MAX_GROUP).contains(&group) {
        return Err(KernelError::Unsupported {
            what: "GQA group size",
            value: group,
            supported: "1 to 8",
        });
    }
    Ok(group)
}

/// Checks shapes and ranges.
fn plan<'a, T>(
    query: Query<'a, T>,
    dense: Dense<'a, T>,
    list: Option<ListPart<'a, T>>,
) -> Result<Launch<'a, T>> {
    let kv = dense.kv;
    let (kv_heads, head_dim) = (kv.kv_heads(), kv.head_dim());
    let runs = runs_of(dense.runs, kv.tokens())?;
    let list = list.map(list_rows).transpose()?;
    if let Some(rows) = &list {
        length("list row length (head_dim)", head_dim, rows.rows.head_dim)?;
        check_rows(rows, kv_heads)?;
    }
    group_of(query, kv_heads, head_dim)?;
    Ok(Launch {
        query,
        dense: dense.kv.into(),
        runs,
        list,
        kv_heads,
    })
}

/// Launches `attend`; `after_route` when the launch right before it on the stream is the
/// routing that wrote the visits and nothing else it reads changed since that launch began.
fn launch<T: KvElement>(
    gpu: &Gpu,
    workspace: &mut Workspace,
    launch: Launch<'_, T>,
    out: &mut CudaViewMut<'_, f32>,
    after_route: bool,
) -> Result<()> {
    let head_dim = launch.dense.head_dim;
    let group = group_of(launch.query, launch.kv_heads, head_dim)?;
    let lanes = lanes_of(head_dim, "head dimension")?;
    length(
        "out [kv_heads, group, head_dim]",
        launch.query.heads.len(),
        out.len(),
    )?;
    let mut variant = Variant {
        dtype: T::DTYPE,
        head_dim,
        group,
        tensor_cores: workspace.tensor_cores && Variant::TENSOR_CORE_HEAD_DIMS.contains(&head_dim),
    };

    // Work items: a chunk of rows each, sized so that one wave of blocks covers the step
    // (few partials to merge, no tail), but never less than two iterations of the block:
    // on the H100, fewer items of two iterations beat more of one (merging costs more).
    // An iteration of the tensor-core path is 16 rows a warp.
    let dense_len = launch.runs[0].1 as usize + launch.runs[1].1 as usize;
    let list_runs = launch.list.map_or(0, |l| l.run_rows());
    let list_rows = launch.list.map_or(0, |l| l.list_rows());
    let rows = launch.kv_heads * (dense_len + list_runs + list_rows);
    let sizing = |variant: Variant| -> Result<(AttendKernel, usize)> {
        let kernel = gpu.attend_kernel(variant)?;
        let step = if variant.tensor_cores {
            THREADS as usize / 32 * 16
        } else {
            (THREADS as usize / lanes) * UNROLL as usize
        };
        let wave = (gpu.multiprocessors() * kernel.blocks_per_sm) as usize;
        Ok((
            kernel,
            rows.div_ceil(wave).next_multiple_of(step).max(2 * step),
        ))
    };
    let (mut kernel, mut chunk) = sizing(variant)?;
    // The tensor-core path wins where each block attends few rows (a step's selection:
    // 21.5 against 28.7 µs at 128 rows an item) and loses a little on long dense runs (full
    // attention over 128K tokens, ~2,000 rows an item: 148 against 144 µs), both measured
    // on an H200 for the Llama shape: past TENSOR_CORE_MAX_CHUNK rows the scalar kernel runs.
    if variant.tensor_cores && chunk > TENSOR_CORE_MAX_CHUNK {
        variant.tensor_cores = false;
        (kernel, chunk) = sizing(variant)?;
    }
    let dense_items = dense_len.div_ceil(chunk);
    let list_run_items = list_runs.div_ceil(chunk);
    let list_items = launch.list.map_or(0, |l| l.list_items(chunk));
    // At least one item, so that every head's output is written.
    let items = (dense_items + list_run_items + list_items).max(1);
    let too_large = |what, value| KernelError::TooLarge { what, value };
    // A merge is one block reading partials on the critical path: up to SINGLE_MERGE items
    // it reads them all; past that in two levels, groups of about sqrt(items) items.
    let group_size = match items {
        0..=SINGLE_MERGE => items,
        _ => items.isqrt() + usize::from(items.isqrt().pow(2) < items),
    };
    let groups = items.div_ceil(group_size);
    if group_size > MAX_MERGE || groups > MAX_MERGE {
        return Err(too_large(
            "work items per head (dense chunks + selection chunks or buckets)",
            items,
        ));
    }
    let items_u32 = items as u32;
    let chunk_u32 = u32::try_from(chunk).map_err(|_| too_large("rows per work item", chunk))?;
    let heads_u32 = heads_u32(launch.kv_heads)?;
    // One partial: outputs, maxima and sums, padded to whole float4s (as in attend.cu).
    let partial = (group * (head_dim + 2)).next_multiple_of(4);
    workspace.reserve(
        gpu,
        launch.kv_heads * (items + groups) * partial,
        launch.kv_heads * (groups + 1),
        launch.kv_heads * group,
        launch.query.heads.len(),
    )?;
    workspace.last = Some(Launched {
        variant,
        kv_heads: launch.kv_heads,
        scale: launch.query.scale,
    });

    let address = |data: &CudaSlice<u32>| gpu.address(data);
    let none = Rows {
        rows: launch.dense,
        runs: [(0, 0); 2],
        lists: None,
        buckets: None,
        count: None,
        tokens: None,
        follow: None,
        cache: None,
    };
    let list = launch.list.unwrap_or(none);
    let (list_keys, list_values, list_stride) = match launch.list {
        Some(l) => (
            l.rows.keys.address(gpu),
            l.rows.values.address(gpu),
            l.rows.head_stride,
        ),
        None => (0, 0, 0),
    };
    let (list_off, list_items_ptr) = list
        .lists
        .map_or((0, 0), |l| (address(&l.offsets), address(&l.items)));
    let (bucket_off, bucket_ids) = list
        .buckets
        .map_or((0, 0), |b| (address(&b.offsets), address(&b.items)));
    let (follow, follow_count, bucket_of, head_rows) = list.follow_args(gpu);
    let (cache_keys, cache_values, slot_of, token_of) = list.cache_args(gpu);
    let args = Args {
        q: launch.query.heads.device_ptr(gpu.stream()).0,
        scale_log2: launch.query.scale * std::f32::consts::LOG2_E,
        dense_keys: launch.dense.keys.address(gpu),
        dense_values: launch.dense.values.address(gpu),
        dense_stride: launch.dense.head_stride,
        runs: launch.runs,
        dense_chunk: chunk_u32,
        dense_items: dense_items as u32,
        list_keys,
        list_values,
        list_stride,
        list_runs: list.runs,
        list_run_items: list_run_items as u32,
        list_off,
        list: list_items_ptr,
        list_chunk: chunk_u32,
        bucket_off,
        bucket_ids,
        follow,
        follow_count,
        bucket_of,
        head_rows,
        cache_keys,
        cache_values,
        slot_of,
        token_of,
        group_size: group_size as u32,
        partials: gpu.address(&workspace.partials),
        counters: gpu.address(&workspace.counters),
        out: out.device_ptr_mut(gpu.stream()).0,
        lse: gpu.address(&workspace.lse),
        bucket_rows: list.count.map_or(0, |c| gpu.address(c)),
        q_keep: gpu.address(&workspace.queries),
    };
    // A programmatic dependent launch where the device has them (compute capability 9.0
    // on): every block waits for the launch before, or, right after routing, only the
    // bucket items wait for it (the flag).
    let programmatic = gpu.programmatic_launch();
    let after_route_u32 = u32::from(after_route && programmatic);
    let mut params: [*mut std::ffi::c_void; 40] = [
        param(&args.q),
        param(&args.scale_log2),
        param(&args.dense_keys),
        param(&args.dense_values),
        param(&args.dense_stride),
        param(&args.runs[0].0),
        param(&args.runs[0].1),
        param(&args.runs[1].0),
        param(&args.runs[1].1),
        param(&args.dense_chunk),
        param(&args.dense_items),
        param(&args.list_keys),
        param(&args.list_values),
        param(&args.list_stride),
        param(&args.list_runs[0].0),
        param(&args.list_runs[0].1),
        param(&args.list_runs[1].0),
        param(&args.list_runs[1].1),
        param(&args.list_run_items),
        param(&args.list_off),
        param(&args.list),
        param(&args.list_chunk),
        param(&args.bucket_off),
        param(&args.bucket_ids),
        param(&args.follow),
        param(&args.follow_count),
        param(&args.bucket_of),
        param(&args.head_rows),
        param(&args.cache_keys),
        param(&args.cache_values),
        param(&args.slot_of),
        param(&args.token_of),
        param(&args.group_size),
        param(&args.partials),
        param(&args.counters),
        param(&args.out),
        param(&args.lse),
        param(&args.bucket_rows),
        param(&args.q_keep),
        param(&after_route_u32),
    ];
    // Grid (KV heads, items): blocks are dispatched item by item across the heads.
    // Safety: `params` points at one value for each of `attend`'s parameters, in order and
    // of its types, all alive until the call returns; every address is of a live buffer
    // whose length was checked against the rows the kernel reads.
    unsafe {
        gpu.launch_raw(
            &kernel.function,
            ((heads_u32, items_u32), THREADS, 0),
            &mut params,
            programmatic,
            "launching attend",
        )
    }?;
    Ok(())
}

/// `attend`'s arguments, named (pointers as device addresses, 0 for none).
struct Args {
    q: u64,
    scale_log2: f32,
    dense_keys: u64,
    dense_values: u64,
    dense_stride: u64,
    runs: [(u32, u32); 2],
    dense_chunk: u32,
    dense_items: u32,
    list_keys: u64,
    list_values: u64,
    list_stride: u64,
    list_runs: [(u32, u32); 2],
    list_run_items: u32,
    list_off: u64,
    list: u64,
    list_chunk: u32,
    bucket_off: u64,
    bucket_ids: u64,
    follow: u64,
    follow_count: u32,
    bucket_of: u64,
    head_rows: u32,
    cache_keys: u64,
    cache_values: u64,
    slot_of: u64,
    token_of: u64,
    group_size: u32,
    partials: u64,
    counters: u64,
    out: u64,
    lse: u64,
    bucket_rows: u64,
    q_keep: u64,
}
