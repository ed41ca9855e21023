//! The GPU kernels against `kvdb-attention`'s exact f64 reference, on fresh random inputs.
//!
//! Every test needs a GPU: on a machine without one (CI), or built without feature `gpu`,
//! each says on stderr that it skipped, and passes.

mod common;

#[cfg(not(feature = "gpu"))]
#[test]
fn gpu_tests() {
    common::skip("gpu_tests", "built without feature `gpu`");
}

#[cfg(feature = "gpu")]
mod on_gpu {
    use std::ops::Range;

    use anyhow::{ensure, Result};
    use kvdb_attention::reference::attention_over_f64;
    use kvdb_attention::DensePolicy;
    use kvdb_kernels::cudarc::driver::{CudaSlice, CudaView, CudaViewMut};
    use kvdb_kernels::ops::RopePairs;
    use kvdb_kernels::{
        attention_mass, attention_weights, bucket_attention, flash_decode, follow_most_attended,
        retrieval_attention, BlockCache, BucketCache, BucketOf, Buckets, ClassifierHead, Csr,
        Dense, FollowScratch, Followed, Gpu, HostKv, KernelError, KvCache, KvElement, ListPart,
        Partition, Query, RouteRope, RouteStep, Selected, Workspace, MAX_ROUTED_BUCKETS,
        MAX_VISITED_BUCKETS, NO_TOKEN,
    };
    use kvdb_model::{Rope, RopeConfig, RopeScaling, RopeStyle};
    use rand::rngs::StdRng;
    use rand::seq::SliceRandom;
    use rand::Rng;

    use super::common::start;

    /// The relative L2 error allowed against the f64 reference.
    const TOLERANCE: f64 = 1e-3;

    /// (kv_heads, group, head_dim, tokens).
    type Shape = (usize, usize, usize, usize);

    /// A test case on one shape, for one element type.
    type Case = fn(&Gpu, &mut StdRng, Shape) -> Result<()>;

    /// Runs a case on every shape of [`SHAPES`], in f16 and in bf16.
    fn every_shape(test: &str, f16: Case, bf16: Case) -> Result<()> {
        let Some((gpu, mut rng)) = start(test) else {
            return Ok(());
        };
        for shape in SHAPES {
            f16(&gpu, &mut rng, shape)?;
            bf16(&gpu, &mut rng, shape)?;
        }
        Ok(())
    }

    /// A layer's cache and queries on the GPU, and a workspace.
    struct OnGpu<T> {
        kv: KvCache<T>,
        queries: CudaSlice<T>,
        workspace: Workspace,
    }

    /// One layer's random inputs, rounded to `T`, with their exact f32 values.
    struct Layer<T> {
        kv_heads: usize,
        group: usize,
        head_dim: usize,
        tokens: usize,
        keys: Vec<T>,
        values: Vec<T>,
        queries: Vec<T>,
        keys_f32: Vec<f32>,
        values_f32: Vec<f32>,
        queries_f32: Vec<f32>,
        scale: f32,
    }

    fn random<T: KvElement>(rng: &mut StdRng, len: usize, amplitude: f32) -> (Vec<T>, Vec<f32>) {
        let rounded: Vec<T> = (0..len)
            .map(|_| T::from_f32(rng.random_range(-amplitude..amplitude)))
            .collect();
        let exact = rounded.iter().map(|x| x.to_f32()).collect();
        (rounded, exact)
    }

    impl<T: KvElement> Layer<T> {
        fn new(rng: &mut StdRng, (kv_heads, group, head_dim, tokens): Shape) -> Self {
            let n = kv_heads * tokens * head_dim;
            let (keys, keys_f32) = random(rng, n, 1.0);
            let (values, values_f32) = random(rng, n, 1.0);
            // Queries of varied size, so that some heads' attention is sharp and some flat.
            let amplitude = rng.random_range(0.5..6.0);
            let (queries, queries_f32) = random(rng, kv_heads * group * head_dim, amplitude);
            Self {
                kv_heads,
                group,
                head_dim,
                tokens,
                keys,
                values,
                queries,
                keys_f32,
                values_f32,
                queries_f32,
                scale: 1.0 / (head_dim as f32).sqrt(),
            }
        }

        /// The exact attention of every query head over `ids[h]` (any order), `[kv_heads,
        /// group, head_dim]`.
        fn reference(&self, ids: &[Vec<u32>]) -> Result<Vec<f64>> {
            let d = self.head_dim;
            // Keys are given rotated, so the reference rotates with RoPE of zero frequency.
            let config = RopeConfig {
                base: 10_000.0,
                style: RopeStyle::Halves,
                scaling: RopeScaling::Linear {
                    factor: f32::INFINITY,
                },
            };
            let rope = Rope::new(&config, d, None);
            let mut out = Vec::with_capacity(self.queries.len());
            for (h, ids) in ids.iter().enumerate() {
                let head = |data: &[f32]| -> Vec<f32> {
                    let rows = &data[h * self.tokens * d..(h + 1) * self.tokens * d];
                    ids.iter()
                        .flat_map(|&id| &rows[id as usize * d..(id as usize + 1) * d])
                        .copied()
                        .collect()
                };
                let queries = &self.queries_f32[h * self.group * d..(h + 1) * self.group * d];
                let position = ids.iter().copied().max().unwrap_or(0) as usize;
                let (keys, values) = (head(&self.keys_f32), head(&self.values_f32));
                let exact =
                    attention_over_f64(queries, &keys, &values, ids, position, &rope, self.scale)?;
                out.extend(exact.output);
            }
            Ok(out)
        }

        /// The attention weight each of `ids` received from KV head `h`'s query heads over
        /// them, summed over the group (exact, f64): what `attention_weights` writes.
        fn head_weights(&self, h: usize, ids: &[u32]) -> Vec<f64> {
            let d = self.head_dim;
            let key = |id: u32| &self.keys_f32[(h * self.tokens + id as usize) * d..][..d];
            let mut weights = vec![0f64; ids.len()];
            for g in 0..self.group {
                let q = &self.queries_f32[(h * self.group + g) * d..][..d];
                let logits: Vec<f64> = ids
                    .iter()
                    .map(|&id| {
                        let dot: f64 = q.iter().zip(key(id)).map(|(a, b)| f64::from(a * b)).sum();
                        dot * f64::from(self.scale)
                    })
                    .collect();
                let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = logits.iter().map(|l| (l - max).exp()).sum();
                for (w, l) in weights.iter_mut().zip(&logits) {
                    *w += (l - max).exp() / sum;
                }
            }
            weights
        }

        /// The attention weight each of the first `n` rows received from every query head
        /// over `ids[h]`, summed over the heads (exact, f64): what `attention_mass` adds up.
        fn mass(&self, ids: &[Vec<u32>], n: usize) -> Result<Vec<f64>> {
            let mut mass = vec![0f64; n];
            for (h, ids) in ids.iter().enumerate() {
                for (&id, w) in ids.iter().zip(self.head_weights(h, ids)) {
                    if (id as usize) < n {
                        mass[id as usize] += w;
                    }
                }
            }
            Ok(mass)
        }

        /// The layer on the GPU, with a workspace that takes the tensor-core path where one
        /// exists when `tensor_cores`.
        fn upload(&self, gpu: &Gpu, tensor_cores: bool) -> Result<OnGpu<T>> {
            Ok(OnGpu {
                kv: KvCache::upload(gpu, &self.keys, &self.values, self.kv_heads, self.head_dim)?,
                queries: gpu.upload(&self.queries)?,
                workspace: Workspace::new(gpu)?.with_tensor_cores(tensor_cores),
            })
        }

        /// Every query zero: all logits tie, and every head's attention is flat.
        fn zero_queries(&mut self) {
            self.queries.fill(T::from_f32(0.0));
            self.queries_f32.fill(0.0);
        }

        /// Every KV head's keys repeat its first `distinct` rows: many logits tie at the
        /// maximum.
        fn repeat_keys(&mut self, distinct: usize) {
            let d = self.head_dim;
            for h in 0..self.kv_heads {
                for row in distinct..self.tokens {
                    let (to, from) = (
                        (h * self.tokens + row) * d,
                        (h * self.tokens + row % distinct) * d,
                    );
                    self.keys.copy_within(from..from + d, to);
                    self.keys_f32.copy_within(from..from + d, to);
                }
            }
        }

        /// The queries on the GPU with this layer's scale.
        fn query<'a>(&self, queries: &'a CudaView<'a, T>) -> Query<'a, T> {
            Query {
                heads: queries,
                scale: self.scale,
            }
        }
    }

    /// An output buffer full of NaN, so that an element the kernel does not write shows.
    fn poisoned(gpu: &Gpu, len: usize) -> Result<CudaSlice<f32>> {
        Ok(gpu.upload(&vec![f32::NAN; len])?)
    }

    /// Downloads `out`, checks that every element was written, and returns it.
    fn written(gpu: &Gpu, out: &CudaSlice<f32>) -> Result<Vec<f32>> {
        let got = gpu.download(out)?;
        let unwritten = got.iter().filter(|x| !x.is_finite()).count();
        ensure!(
            unwritten == 0,
            "{unwritten} of {} outputs not written",
            got.len()
        );
        Ok(got)
    }

    fn rel_l2(got: &[f32], want: &[f64]) -> f64 {
        let diff: f64 = got
            .iter()
            .zip(want)
            .map(|(g, w)| (*g as f64 - w).powi(2))
            .sum();
        let norm: f64 = want.iter().map(|w| w * w).sum();
        (diff / norm.max(f64::MIN_POSITIVE)).sqrt()
    }

    fn close(what: &str, got: &[f32], want: &[f64], tolerance: f64) -> Result<()> {
        let error = rel_l2(got, want);
        println!("{what}: rel L2 {error:.2e}");
        ensure!(
            error <= tolerance,
            "{what}: rel L2 {error:.3e} > {tolerance:.0e}"
        );
        Ok(())
    }

    /// Ids of `ranges`, in order.
    fn ids_of(ranges: &[Range<u32>]) -> Vec<u32> {
        ranges.iter().cloned().flatten().collect()
    }

    /// (kv_heads, group, head_dim, tokens): head dims 64/128/256, GQA 1/4/8, from 1 token up.
    const SHAPES: [Shape; 9] = [
        (2, 1, 64, 1),
        (2, 4, 64, 1000),
        (1, 8, 64, 33_333),
        (2, 4, 128, 4097),
        (1, 8, 128, 70_001),
        (3, 1, 128, 130_000),
        (1, 1, 256, 333),
        (2, 4, 256, 20_000),
        (1, 8, 256, 5000),
    ];

    fn flash_case<T: KvElement, const TC: bool>(
        gpu: &Gpu,
        rng: &mut StdRng,
        shape: Shape,
    ) -> Result<()> {
        let (kv_heads, _, _, tokens) = shape;
        let layer = Layer::<T>::new(rng, shape);
        let OnGpu {
            kv,
            queries,
            mut workspace,
        } = layer.upload(gpu, TC)?;
        let queries = queries.as_view();
        let query = layer.query(&queries);
        // The whole cache and a random prefix of it.
        for len in [tokens, rng.random_range(1..=tokens)] {
            let mut out = poisoned(gpu, layer.queries.len())?;
            flash_decode(gpu, &mut workspace, query, &kv, len, &mut out.as_view_mut())?;
            let want = layer.reference(&vec![(0..len as u32).collect(); kv_heads])?;
            close(
                &format!(
                    "flash_decode {:?} {shape:?} len {len} tensor cores {TC}",
                    T::DTYPE
                ),
                &written(gpu, &out)?,
                &want,
                TOLERANCE,
            )?;
        }
        Ok(())
    }

    #[test]
    fn flash_decode_matches_reference() -> Result<()> {
        every_shape(
            "flash_decode_matches_reference",
            flash_case::<half::f16, true>,
            flash_case::<half::bf16, true>,
        )
    }

    /// The scalar kernel, which the tensor-core path replaces at head dims 64 and 128.
    #[test]
    fn flash_decode_on_the_scalar_path_matches_reference() -> Result<()> {
        every_shape(
            "flash_decode_on_the_scalar_path_matches_reference",
            flash_case::<half::f16, false>,
            flash_case::<half::bf16, false>,
        )
    }

    #[test]
    fn flash_decode_at_a_million_tokens() -> Result<()> {
        let Some((gpu, mut rng)) = start("flash_decode_at_a_million_tokens") else {
            return Ok(());
        };
        flash_case::<half::bf16, true>(&gpu, &mut rng, (1, 4, 128, 1 << 20))?;
        flash_case::<half::f16, true>(&gpu, &mut rng, (1, 8, 64, 1_000_000))?;
        flash_case::<half::bf16, false>(&gpu, &mut rng, (1, 4, 128, 1 << 20))
    }

    /// A random dense policy and, per KV head, a random selection of `fraction` of the
    /// candidates (deduplicated, outside the dense part), at the last position.
    fn selection(
        rng: &mut StdRng,
        kv_heads: usize,
        tokens: usize,
        fraction: f64,
    ) -> (Vec<Range<u32>>, Vec<Vec<u32>>) {
        let policy = DensePolicy {
            sink: [0, 1, 4][rng.random_range(0..3)],
            window: [1, 16, 2048][rng.random_range(0..3)],
        };
        let position = tokens - 1;
        let candidates: Vec<u32> = policy.candidates(position).collect();
        let take = (candidates.len() as f64 * fraction).round() as usize;
        let lists = (0..kv_heads)
            .map(|_| {
                let mut ids = candidates.clone();
                ids.shuffle(rng);
                ids.truncate(take);
                ids
            })
            .collect();
        (policy.dense_ranges(position), lists)
    }

    fn retrieval_case<T: KvElement, const TC: bool>(
        gpu: &Gpu,
        rng: &mut StdRng,
        shape: Shape,
    ) -> Result<()> {
        let (kv_heads, _, _, tokens) = shape;
        let layer = Layer::<T>::new(rng, shape);
        let OnGpu {
            kv,
            queries,
            mut workspace,
        } = layer.upload(gpu, TC)?;
        let queries = queries.as_view();
        let query = layer.query(&queries);
        let mut full = poisoned(gpu, layer.queries.len())?;
        flash_decode(
            gpu,
            &mut workspace,
            query,
            &kv,
            tokens,
            &mut full.as_view_mut(),
        )?;
        let full = written(gpu, &full)?;
        // Empty, partial (one head may differ from another) and full selections.
        for fraction in [0.0, rng.random_range(0.0..0.2), 1.0] {
            let (runs, lists) = selection(rng, kv_heads, tokens, fraction);
            let ids = Csr::from_lists(gpu, &lists)?;
            let mut out = poisoned(gpu, layer.queries.len())?;
            let dense = Dense {
                kv: &kv,
                runs: &runs,
            };
            retrieval_attention(
                gpu,
                &mut workspace,
                query,
                dense,
                Selected::resident(&kv, &ids),
                &mut out.as_view_mut(),
            )?;
            let got = written(gpu, &out)?;
            let attended: Vec<Vec<u32>> = lists
                .iter()
                .map(|l| [ids_of(&runs), l.clone()].concat())
                .collect();
            let what = format!(
                "retrieval {:?} {shape:?} runs {runs:?} selected {} tensor cores {TC}",
                T::DTYPE,
                lists[0].len()
            );
            close(&what, &got, &layer.reference(&attended)?, TOLERANCE)?;
            let mut mass = gpu.zeros::<f32>(tokens)?;
            let part = ListPart::Selected(Selected::resident(&kv, &ids));
            attention_mass(gpu, &workspace, part, &mut mass)?;
            // The mass of the selected rows alone: the dense runs are not the list part.
            let mut want = layer.mass(&attended, tokens)?;
            ids_of(&runs)
                .into_iter()
                .for_each(|id| want[id as usize] = 0.0);
            close(
                &format!("{what}: mass"),
                &gpu.download(&mass)?,
                &want,
                TOLERANCE,
            )?;
            // Each selected row's weight at its place in the lists (the runs' rows left out).
            let mut weights = gpu.zeros::<f32>(ids.total().max(1))?;
            attention_weights(gpu, &workspace, Selected::resident(&kv, &ids), &mut weights)?;
            let want: Vec<f64> = attended
                .iter()
                .enumerate()
                .flat_map(|(h, ids)| {
                    let runs = ids.len() - lists[h].len();
                    layer.head_weights(h, ids).split_off(runs)
                })
                .collect();
            close(
                &format!("{what}: weights"),
                &gpu.download(&weights)?[..ids.total()],
                &want,
                TOLERANCE,
            )?;
            if fraction == 1.0 {
                let full: Vec<f64> = full.iter().map(|&x| x.into()).collect();
                close(
                    &format!("{what}: all tokens == flash_decode"),
                    &got,
                    &full,
                    1e-5,
                )?;
            }
        }
        Ok(())
    }

    #[test]
    fn retrieval_attention_matches_reference() -> Result<()> {
        let test = "retrieval_attention_matches_reference";
        every_shape(
            test,
            retrieval_case::<half::f16, true>,
            retrieval_case::<half::bf16, true>,
        )?;
        let Some((gpu, mut rng)) = start(test) else {
            return Ok(());
        };
        retrieval_case::<half::bf16, true>(&gpu, &mut rng, (1, 4, 128, 1 << 20))
    }

    #[test]
    fn retrieval_attention_on_the_scalar_path_matches_reference() -> Result<()> {
        every_shape(
            "retrieval_attention_on_the_scalar_path_matches_reference",
            retrieval_case::<half::f16, false>,
            retrieval_case::<half::bf16, false>,
        )
    }

    /// Every token of the first `tokens` in one of `buckets` random buckets per KV head
    /// (numbered together, head h's bucket b is h * buckets + b), as CSR.
    fn random_buckets(
        rng: &mut StdRng,
        kv_heads: usize,
        tokens: usize,
        buckets: usize,
    ) -> Vec<Vec<u32>> {
        // Half the ids in each head's first bucket, as a skewed k-means leaves one: a bucket
        // many work items long beside short ones.
        let mut lists = vec![Vec::new(); kv_heads * buckets];
        for h in 0..kv_heads {
            for id in 0..tokens as u32 {
                let b = if rng.random_bool(0.5) {
                    0
                } else {
                    rng.random_range(0..buckets)
                };
                lists[h * buckets + b].push(id);
            }
        }
        lists
    }

    /// Rows `rows` of every KV head of `layer` as a cache of their own.
    fn cache_of<T: KvElement>(
        gpu: &Gpu,
        layer: &Layer<T>,
        rows: Range<usize>,
    ) -> Result<KvCache<T>> {
        let d = layer.head_dim;
        let part = |data: &[T]| -> Vec<T> {
            (0..layer.kv_heads)
                .flat_map(|h| {
                    &data[(h * layer.tokens + rows.start) * d..(h * layer.tokens + rows.end) * d]
                })
                .copied()
                .collect()
        };
        Ok(KvCache::upload(
            gpu,
            &part(&layer.keys),
            &part(&layer.values),
            layer.kv_heads,
            d,
        )?)
    }

    /// Ids a KV head follows, `count` of them, distinct: none, inside `runs`, inside a
    /// visited bucket, past the `n` rows, or fresh (the only ones attended).
    fn followed_ids(
        rng: &mut StdRng,
        count: usize,
        n: usize,
        runs: &[Range<u32>],
        visited_ids: &[u32],
    ) -> Vec<u32> {
        let mut ids = Vec::with_capacity(count);
        for _ in 0..count {
            let id = match rng.random_range(0..5) {
                0 => NO_TOKEN,
                1 if !runs.is_empty() && n > 0 => {
                    let run = &runs[rng.random_range(0..runs.len())];
                    if run.is_empty() {
                        NO_TOKEN
                    } else {
                        rng.random_range(run.clone())
                    }
                }
                2 if !visited_ids.is_empty() => visited_ids[rng.random_range(0..visited_ids.len())],
                3 => n as u32 + rng.random_range(0..3),
                _ if n > 0 => rng.random_range(0..n as u32),
                _ => NO_TOKEN,
            };
            ids.push(if id != NO_TOKEN && ids.contains(&id) {
                NO_TOKEN
            } else {
                id
            });
        }
        ids
    }

    /// What `follow_most_attended` writes for one KV head: the successors (inside `n`) of
    /// the `count` candidates (id and exact weight) of most weight, ties to the lower id.
    fn want_followed(mut candidates: Vec<(f64, u32)>, count: usize, n: usize) -> Vec<(u32, f64)> {
        candidates.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        (0..count)
            .map(|r| match candidates.get(r) {
                Some(&(w, id)) if (id as usize + 1) < n => (id + 1, w),
                Some(&(w, _)) => (NO_TOKEN, w),
                None => (NO_TOKEN, -1.0),
            })
            .collect()
    }

    /// Bucket attention over a stored corpus (the first `tokens - tail` rows: its runs and
    /// visited buckets, and in some launches ids followed besides them) and a query's own
    /// tail in another buffer (the last rows, as a ring whose runs may wrap), against the
    /// reference over the same ids; then the attention mass each corpus row received against
    /// the reference's weights, and what a following launch would follow next. Each launch
    /// twice: over the corpus resident on the GPU, and over it in host memory behind a
    /// bucket cache that holds about half of the visited buckets (the rest read in place).
    fn bucket_case<T: KvElement, const TC: bool>(
        gpu: &Gpu,
        rng: &mut StdRng,
        shape: Shape,
    ) -> Result<()> {
        let (kv_heads, _, _, tokens) = shape;
        let layer = Layer::<T>::new(rng, shape);
        let tail = rng.random_range(0..=tokens.min(40));
        let n = tokens - tail;
        let corpus = cache_of(gpu, &layer, 0..n)?;
        let ring = cache_of(gpu, &layer, n..tokens)?;
        let queries = gpu.upload(&layer.queries)?;
        let queries = queries.as_view();
        let query = layer.query(&queries);
        let mut workspace = Workspace::new(gpu)?.with_tensor_cores(TC);
        let count = rng.random_range(1..=64);
        let bucket_lists = random_buckets(rng, kv_heads, n, count);
        let buckets = Csr::from_lists(gpu, &bucket_lists)?;
        let (runs, _) = if n > 0 {
            selection(rng, kv_heads, n, 0.0)
        } else {
            (Vec::new(), Vec::new())
        };
        // The tail's rows as a ring's two runs: its second half first.
        let split = rng.random_range(0..=tail) as u32;
        let tail_runs: Vec<Range<u32>> = [split..tail as u32, 0..split]
            .into_iter()
            .filter(|r| !r.is_empty())
            .collect();
        let dense_ids: Vec<u32> = ids_of(&runs)
            .into_iter()
            .chain(ids_of(&tail_runs).into_iter().map(|r| n as u32 + r))
            .collect();
        let bucket_of = BucketOf::new(gpu, &buckets, kv_heads, count, n)?;
        let mut scratch = FollowScratch::new(gpu)?;
        // The corpus in host memory, and its partition (the same lists, one empty list after
        // them) with a cache of every row.
        let mut on_host = match n {
            0 => None,
            _ => {
                let host = HostKv::from_device(gpu, &corpus, 16)?;
                let zeros = vec![0f32; kv_heads * count * layer.head_dim];
                let partition =
                    Partition::new(gpu, &zeros, &bucket_lists, &[], kv_heads, layer.head_dim)?;
                let row_bytes = 2 * layer.head_dim * size_of::<T>();
                let cache = BucketCache::new(gpu, &partition, &host, kv_heads * n * row_bytes)?;
                Some((host, partition, cache))
            }
        };
        // No bucket, some, and all of them.
        for fraction in [0.0, rng.random_range(0.0..0.5), 1.0] {
            let visited: Vec<Vec<u32>> = (0..kv_heads)
                .map(|h| {
                    let mut b: Vec<u32> =
                        (0..count as u32).map(|b| (h * count) as u32 + b).collect();
                    b.shuffle(rng);
                    b.truncate((count as f64 * fraction).round() as usize);
                    b
                })
                .collect();
            let visited_csr = Csr::from_lists(gpu, &visited)?;
            let mut out = poisoned(gpu, layer.queries.len())?;
            let dense = Dense {
                kv: &ring,
                runs: &tail_runs,
            };
            let visited_ids: Vec<Vec<u32>> = visited
                .iter()
                .map(|bs| {
                    bs.iter()
                        .flat_map(|&b| bucket_lists[b as usize].clone())
                        .collect()
                })
                .collect();
            // Half the launches follow ids besides their buckets.
            let per_head = rng.random_range(1..=12);
            let followed: Option<Vec<Vec<u32>>> = rng.random_bool(0.5).then(|| {
                visited_ids
                    .iter()
                    .map(|ids| followed_ids(rng, per_head, n, &runs, ids))
                    .collect()
            });
            let follow_ids: Option<CudaSlice<u32>> = followed
                .as_ref()
                .map(|f| gpu.upload(&f.concat()))
                .transpose()?;
            if let Some((host, partition, cache)) = on_host.as_mut() {
                // Other buckets first, so that those of this launch lie past the first rows.
                let (half, others): (Vec<u32>, Vec<u32>) =
                    (0..(kv_heads * count) as u32).partition(|_| rng.random_bool(0.5));
                cache.fill(gpu, partition, host, &others)?;
                cache.fill(gpu, partition, host, &half)?;
            }
            for placement in ["resident", "host memory, half cached"] {
                let counted: CudaSlice<u64> = gpu.upload(&[7])?;
                let resident = Buckets {
                    kv: (&corpus).into(),
                    runs: &runs,
                    ids: &buckets,
                    visited: &visited_csr,
                    count: Some(&counted),
                    follow: follow_ids.as_ref().map(|ids| Followed {
                        ids,
                        buckets: &bucket_of,
                    }),
                    cache: None,
                };
                let part = match (placement, &on_host) {
                    ("resident", _) | (_, None) => resident,
                    (_, Some((host, partition, cache))) => Buckets {
                        kv: host.into(),
                        ids: partition.ids(),
                        cache: Some(cache.cached()),
                        ..resident
                    },
                };
                bucket_attention(
                    gpu,
                    &mut workspace,
                    query,
                    dense,
                    part,
                    &mut out.as_view_mut(),
                )?;
                let got = written(gpu, &out)?;
                let in_runs = |id: &u32| runs.iter().any(|r| r.contains(id));
                let attended: Vec<Vec<u32>> = visited_ids
                    .iter()
                    .enumerate()
                    .map(|(h, bucket_ids)| {
                        let mut ids = dense_ids.clone();
                        ids.extend(bucket_ids.iter().filter(|id| !in_runs(id)));
                        if let Some(followed) = &followed {
                            ids.extend(followed[h].iter().filter(|&&id| {
                                (id as usize) < n && !in_runs(&id) && !bucket_ids.contains(&id)
                            }));
                        }
                        ids
                    })
                    .collect();
                let what = format!(
                "buckets {:?} {shape:?} tail {tail} {count} buckets, visited {}, following {}, \
                 tensor cores {TC}, {placement}",
                T::DTYPE,
                visited[0].len(),
                followed.as_ref().map_or(0, |_| per_head),
            );
                close(&what, &got, &layer.reference(&attended)?, TOLERANCE)?;
                // The launch added the bucket ids it attended to the count.
                let from_buckets = attended.iter().map(|ids| ids.len() - dense_ids.len());
                let want = 7 + from_buckets.sum::<usize>() as u64;
                let count = gpu.download(&counted)?[0];
                ensure!(
                    count == want,
                    "{what}: counted {count} bucket ids, want {want}"
                );
                let mut mass = gpu.zeros::<f32>(n.max(1))?;
                if n > 0 {
                    attention_mass(gpu, &workspace, ListPart::Buckets(part), &mut mass)?;
                }
                let want = layer.mass(&attended, n)?;
                close(
                    &format!("{what}: mass"),
                    &gpu.download(&mass)?[..n],
                    &want,
                    TOLERANCE,
                )?;
                // What the next step follows: the successors of the most weighed of the bucket
                // and followed ids (not the runs nor the tail).
                let next_count = rng.random_range(1..=10);
                let mut next = gpu.upload(&vec![5u32; kv_heads * next_count])?;
                follow_most_attended(gpu, &workspace, part, &mut scratch, &mut next, None)?;
                let got = gpu.download(&next)?;
                for (h, ids) in attended.iter().enumerate() {
                    let weights = layer.head_weights(h, ids);
                    let candidates: Vec<(f64, u32)> = ids
                        .iter()
                        .zip(&weights)
                        .skip(dense_ids.len())
                        .map(|(&id, &w)| (w, id))
                        .collect();
                    let weight_of = |id: u32| candidates.iter().find(|c| c.1 == id).map(|c| c.0);
                    let want = want_followed(candidates.clone(), next_count, n);
                    for (r, (&got, &(want, want_w))) in got[h * next_count..][..next_count]
                        .iter()
                        .zip(&want)
                        .enumerate()
                    {
                        // A near tie may rank the other way in f32: the weights must agree.
                        let got_w = match got {
                            NO_TOKEN if want == NO_TOKEN => want_w,
                            NO_TOKEN => weight_of(n as u32 - 1).unwrap_or(-1.0),
                            id => weight_of(id - 1).unwrap_or(-2.0),
                        };
                        ensure!(
                            got == want || (got_w - want_w).abs() <= 1e-5,
                            "{what}: head {h} follows {got} at rank {r} (weight {got_w:.6}), \
                         want {want} (weight {want_w:.6})"
                        );
                    }
                }
                // A step that counts towards provenance ranks and adds the mass in one launch:
                // the same picks (each row weighed as alone) and the same mass.
                if n > 0 {
                    let mut both = gpu.zeros::<f32>(n)?;
                    let mut fused = gpu.upload(&vec![5u32; kv_heads * next_count])?;
                    let mass = Some(&mut both);
                    follow_most_attended(gpu, &workspace, part, &mut scratch, &mut fused, mass)?;
                    ensure!(
                        gpu.download(&fused)? == got,
                        "{what}: following with the mass picks otherwise"
                    );
                    let got_mass = gpu.download(&both)?;
                    close(
                        &format!("{what}: mass beside following"),
                        &got_mass,
                        &want,
                        TOLERANCE,
                    )?;
                }
            }
        }
        Ok(())
    }

    #[test]
    fn bucket_attention_matches_reference() -> Result<()> {
        every_shape(
            "bucket_attention_matches_reference",
            bucket_case::<half::f16, true>,
            bucket_case::<half::bf16, true>,
        )
    }

    #[test]
    fn bucket_attention_on_the_scalar_path_matches_reference() -> Result<()> {
        every_shape(
            "bucket_attention_on_the_scalar_path_matches_reference",
            bucket_case::<half::f16, false>,
            bucket_case::<half::bf16, false>,
        )
    }

    /// Bucket attention (ragged buckets, sinks and window) and flash decoding on the
    /// tensor-core path and on the scalar path, each against the reference and the two
    /// against each other (both accumulate in f32: the tensor-core path's weights go in as
    /// several 16-bit terms); GQA groups 1, 4, 7 and 8 at head dims 64 and 128, three fresh
    /// layers each: random, every query zero (all logits tie) and keys repeating three rows
    /// (ties at the maximum).
    #[test]
    fn tensor_cores_agree_with_the_scalar_path() -> Result<()> {
        let Some((gpu, mut rng)) = start("tensor_cores_agree_with_the_scalar_path") else {
            return Ok(());
        };
        for head_dim in [64, 128] {
            for group in [1, 4, 7, 8] {
                for ties in [Ties::None, Ties::ZeroQueries, Ties::RepeatedKeys] {
                    let kv_heads = rng.random_range(1..=3);
                    let tokens = rng.random_range(1..=20_000);
                    let shape = (kv_heads, group, head_dim, tokens);
                    paths_case::<half::f16>(&gpu, &mut rng, shape, ties)?;
                    paths_case::<half::bf16>(&gpu, &mut rng, shape, ties)?;
                }
            }
        }
        Ok(())
    }

    /// How a layer of [`paths_case`] makes logits tie.
    #[derive(Debug, Clone, Copy)]
    enum Ties {
        None,
        ZeroQueries,
        RepeatedKeys,
    }

    fn paths_case<T: KvElement>(
        gpu: &Gpu,
        rng: &mut StdRng,
        shape: Shape,
        ties: Ties,
    ) -> Result<()> {
        let (kv_heads, _, _, tokens) = shape;
        let mut layer = Layer::<T>::new(rng, shape);
        match ties {
            Ties::None => {}
            Ties::ZeroQueries => layer.zero_queries(),
            Ties::RepeatedKeys => layer.repeat_keys(3.min(tokens)),
        }
        let kv = KvCache::upload(gpu, &layer.keys, &layer.values, kv_heads, layer.head_dim)?;
        let queries = gpu.upload(&layer.queries)?;
        let queries = queries.as_view();
        let query = layer.query(&queries);
        let count = rng.random_range(1..=64);
        let bucket_lists = random_buckets(rng, kv_heads, tokens, count);
        let buckets = Csr::from_lists(gpu, &bucket_lists)?;
        let (runs, _) = selection(rng, kv_heads, tokens, 0.0);
        let fraction = rng.random_range(0.05..=1.0);
        let visited: Vec<Vec<u32>> = (0..kv_heads)
            .map(|h| {
                let mut b: Vec<u32> = (0..count as u32).map(|b| (h * count) as u32 + b).collect();
                b.shuffle(rng);
                b.truncate(((count as f64 * fraction).round() as usize).max(1));
                b
            })
            .collect();
        let visited_csr = Csr::from_lists(gpu, &visited)?;
        let attended: Vec<Vec<u32>> = visited
            .iter()
            .map(|bs| {
                let mut ids = ids_of(&runs);
                let bucket_ids = bs.iter().flat_map(|&b| &bucket_lists[b as usize]);
                ids.extend(bucket_ids.filter(|id| !runs.iter().any(|r| r.contains(id))));
                ids
            })
            .collect();
        let want_buckets = layer.reference(&attended)?;
        let want_full = layer.reference(&vec![(0..tokens as u32).collect(); kv_heads])?;
        let what = format!(
            "{:?} {shape:?} {ties:?} runs {runs:?} {count} buckets, visited {}",
            T::DTYPE,
            visited[0].len()
        );
        let mut outputs = Vec::new();
        for tensor_cores in [true, false] {
            let mut workspace = Workspace::new(gpu)?.with_tensor_cores(tensor_cores);
            let mut out = poisoned(gpu, layer.queries.len())?;
            let part = Buckets {
                kv: (&kv).into(),
                runs: &runs,
                ids: &buckets,
                visited: &visited_csr,
                count: None,
                follow: None,
                cache: None,
            };
            let dense = Dense { kv: &kv, runs: &[] };
            bucket_attention(
                gpu,
                &mut workspace,
                query,
                dense,
                part,
                &mut out.as_view_mut(),
            )?;
            let got = written(gpu, &out)?;
            let path = if tensor_cores {
                "tensor cores"
            } else {
                "scalar"
            };
            close(
                &format!("buckets {what} {path}"),
                &got,
                &want_buckets,
                TOLERANCE,
            )?;
            let mut full = poisoned(gpu, layer.queries.len())?;
            flash_decode(
                gpu,
                &mut workspace,
                query,
                &kv,
                tokens,
                &mut full.as_view_mut(),
            )?;
            let full = written(gpu, &full)?;
            close(
                &format!("flash {what} {path}"),
                &full,
                &want_full,
                TOLERANCE,
            )?;
            outputs.push((got, full));
        }
        let f64s = |x: &[f32]| -> Vec<f64> { x.iter().map(|&x| x.into()).collect() };
        let (tc, scalar) = (&outputs[0], &outputs[1]);
        close(
            &format!("buckets {what}: tensor cores == scalar"),
            &tc.0,
            &f64s(&scalar.0),
            1e-5,
        )?;
        close(
            &format!("flash {what}: tensor cores == scalar"),
            &tc.1,
            &f64s(&scalar.1),
            1e-5,
        )
    }

    /// Checks that the buckets `mine` visited are the best of `all` by `score`: none left out
    /// scores more than `tolerance` above the worst visited (float ties may go either way).
    fn visits_are_best(
        mine: &[usize],
        all: impl Iterator<Item = usize>,
        score: impl Fn(usize) -> f64,
        tolerance: f64,
        what: &str,
    ) -> Result<()> {
        let worst_in = mine.iter().map(|&b| score(b)).fold(f64::INFINITY, f64::min);
        let best_out = all
            .filter(|b| !mine.contains(b))
            .map(&score)
            .fold(f64::NEG_INFINITY, f64::max);
        ensure!(
            worst_in >= best_out - tolerance,
            "{what}: visited down to {worst_in}, left {best_out}"
        );
        Ok(())
    }

    /// GPU routing visits the buckets of best group score (the CPU's choice, up to float
    /// ties) and, where the partition has them, each head's ids every search visits; the
    /// bucket attention over its visits counts the visited ids outside its runs (those of
    /// an eligible range) across steps, each id once.
    #[test]
    fn routing_matches_reference() -> Result<()> {
        let Some((gpu, mut rng)) = start("routing_matches_reference") else {
            return Ok(());
        };
        // The last: ids per head every search visits (some in the buckets too).
        for (kv_heads, group, head_dim, tokens, buckets, hot) in [
            (2, 4, 64, 5000, 64, 50),
            (1, 8, 128, 20_000, 1024, 0),
            (3, 1, 256, 300, 7, 30),
            // Buckets that are not a whole number of the kernel's passes, a group of 7.
            (2, 7, 32, 3000, 100, 0),
        ] {
            let mut floats = |len: usize| -> Vec<f32> {
                (0..len).map(|_| rng.random_range(-1.0..1.0)).collect()
            };
            let centroids = floats(kv_heads * buckets * head_dim);
            let queries = floats(kv_heads * group * head_dim);
            let lists = random_buckets(&mut rng, kv_heads, tokens, buckets);
            let always: Vec<Vec<u32>> = (0..kv_heads * usize::from(hot > 0))
                .map(|_| {
                    let mut ids: Vec<u32> = (0..hot)
                        .map(|_| rng.random_range(0..tokens as u32))
                        .collect();
                    ids.sort_unstable();
                    ids.dedup();
                    ids
                })
                .collect();
            let partition = Partition::new(&gpu, &centroids, &lists, &always, kv_heads, head_dim)?;
            let extra = usize::from(hot > 0);
            let per_head = buckets + extra;
            ensure!(partition.lists_per_head() == per_head);
            let probes = rng.random_range(1..=buckets.min(MAX_VISITED_BUCKETS - extra));
            let mut visits = partition.visits(&gpu, probes)?;
            let on_gpu = gpu.upload(&queries)?;
            let lo = rng.random_range(0..tokens as u32);
            let eligible = lo..rng.random_range(lo..=tokens as u32);
            let runs = [0..eligible.start, eligible.end..tokens as u32];
            let step = RouteStep {
                position: tokens,
                candidates: eligible.clone(),
            };
            // The attention reads keys and values (zeros here) and attended queries.
            let zeros = vec![half::f16::ZERO; kv_heads * tokens * head_dim];
            let kv = KvCache::upload(&gpu, &zeros, &zeros, kv_heads, head_dim)?;
            let heads = gpu.upload(&vec![half::f16::ONE; queries.len()])?;
            let heads = heads.as_view();
            let query = Query {
                heads: &heads,
                scale: 1.0,
            };
            let (mut workspace, mut out) = (Workspace::new(&gpu)?, gpu.zeros(queries.len())?);
            // Twice: the count adds up over steps.
            for _ in 0..2 {
                partition.route(&gpu, &on_gpu.as_view(), &step, &mut visits)?;
                let part = partition.list_part(&visits, &kv, &runs);
                let dense = Dense { kv: &kv, runs: &[] };
                let mut out = out.as_view_mut();
                bucket_attention(&gpu, &mut workspace, query, dense, part, &mut out)?;
            }
            let visited: Vec<u32> = visits.visited().to_lists(&gpu)?.concat();
            let mut selected = 0u64;
            for h in 0..kv_heads {
                let score = |b: usize| -> f64 {
                    let c = &centroids[(h * buckets + b) * head_dim..][..head_dim];
                    (0..group)
                        .map(|g| {
                            let q = &queries[(h * group + g) * head_dim..][..head_dim];
                            q.iter().zip(c).map(|(a, b)| f64::from(a * b)).sum::<f64>()
                        })
                        .fold(f64::NEG_INFINITY, f64::max)
                };
                let stride = probes + extra;
                let mine: Vec<usize> = visited[h * stride..h * stride + probes]
                    .iter()
                    .map(|&l| l as usize - h * per_head)
                    .collect();
                ensure!(
                    extra == 0 || visited[h * stride + probes] as usize == h * per_head + buckets,
                    "head {h}: the always-visited list is not visited: {:?}",
                    &visited[h * stride..(h + 1) * stride]
                );
                let mut seen = mine.clone();
                seen.sort_unstable();
                seen.dedup();
                ensure!(
                    seen.len() == probes && seen.iter().all(|&b| b < buckets),
                    "head {h}: {mine:?}"
                );
                visits_are_best(&mine, 0..buckets, score, 1e-4, &format!("head {h}"))?;
                let always = always.get(h).map_or(&[][..], Vec::as_slice);
                let mut ids: Vec<u32> = mine
                    .iter()
                    .flat_map(|&b| &lists[h * buckets + b])
                    .chain(always)
                    .copied()
                    .filter(|id| eligible.contains(id))
                    .collect();
                ids.sort_unstable();
                ids.dedup();
                selected += ids.len() as u64;
            }
            ensure!(
                visits.selected(&gpu)? == 2 * selected,
                "selected {} of {}",
                visits.selected(&gpu)?,
                2 * selected
            );
        }
        // Equal scores (every centroid the same): the lowest buckets, in order, as the CPU
        // breaks ties.
        let (kv_heads, buckets, head_dim, probes) = (2, 40, 32, 5);
        let centroids = vec![0.5f32; kv_heads * buckets * head_dim];
        let lists = random_buckets(&mut rng, kv_heads, 1000, buckets);
        let partition = Partition::new(&gpu, &centroids, &lists, &[], kv_heads, head_dim)?;
        let mut visits = partition.visits(&gpu, probes)?;
        let queries = gpu.upload(&vec![1.0f32; kv_heads * 4 * head_dim])?;
        partition.route(&gpu, &queries.as_view(), &anywhere(), &mut visits)?;
        let visited: Vec<u32> = visits.visited().to_lists(&gpu)?.concat();
        let want: Vec<u32> = (0..kv_heads as u32)
            .flat_map(|h| (0..probes as u32).map(move |b| h * buckets as u32 + b))
            .collect();
        ensure!(visited == want, "ties visited {visited:?}, want {want:?}");
        Ok(())
    }

    /// A step that may select any id (centroid routing ignores the step).
    fn anywhere() -> RouteStep {
        RouteStep {
            position: 0,
            candidates: 0..u32::MAX,
        }
    }

    /// One KV head's classifier partition (saap), owned.
    struct Head {
        centroids: Vec<f32>,
        w1: Vec<f32>,
        b1: Vec<f32>,
        w2: Vec<f32>,
        b2: Vec<f32>,
        prior: f32,
        mean_keys: Vec<f32>,
        share: f32,
    }

    impl Head {
        fn random(rng: &mut StdRng, buckets: usize, hidden: usize, head_dim: usize) -> Self {
            let mut floats = |len: usize, bound: f32| -> Vec<f32> {
                (0..len).map(|_| rng.random_range(-bound..bound)).collect()
            };
            let amplitude = 1.0 / (head_dim as f32).sqrt();
            let (centroids, w1, b1) = (
                floats(buckets * head_dim, 1.0),
                floats(hidden * head_dim, amplitude),
                floats(hidden, 0.1),
            );
            let (w2, b2) = (floats(buckets * hidden, 0.5), floats(buckets, 0.5));
            let mean_keys = floats(buckets * head_dim, 1.0);
            // A head trained without the prior routes by its classifier alone.
            let prior = if rng.random_bool(0.25) {
                0.0
            } else {
                rng.random_range(0.1..1.0)
            };
            let share = if prior == 0.0 { 0.0 } else { 0.5 };
            Self {
                centroids,
                w1,
                b1,
                w2,
                b2,
                prior,
                mean_keys,
                share,
            }
        }

        fn view(&self) -> ClassifierHead<'_> {
            ClassifierHead {
                centroids: &self.centroids,
                w1: &self.w1,
                b1: &self.b1,
                w2: &self.w2,
                b2: &self.b2,
                prior: self.prior,
                mean_keys: &self.mean_keys,
                share: self.share,
            }
        }

        /// The group's summed routing distribution over the buckets (f64; zero where
        /// `held` is false), saap's search: `queries` de-roped, rotated by `rope` at
        /// `position` for the geometric expert.
        fn routed(&self, queries: &[f32], rope: &Rope, position: usize, held: &[bool]) -> Vec<f64> {
            let d = rope.head_dim();
            let dot = |a: &[f32], b: &[f32]| -> f64 {
                a.iter()
                    .zip(b)
                    .map(|(&x, &y)| f64::from(x) * f64::from(y))
                    .sum()
            };
            let softmax = |logits: Vec<f64>| -> Vec<f64> {
                let max = (0..logits.len())
                    .filter(|&b| held[b])
                    .map(|b| logits[b])
                    .fold(f64::NEG_INFINITY, f64::max);
                let exp: Vec<f64> = (0..logits.len())
                    .map(|b| {
                        if held[b] {
                            (logits[b] - max).exp()
                        } else {
                            0.0
                        }
                    })
                    .collect();
                let sum: f64 = exp.iter().sum();
                exp.into_iter().map(|e| e / sum).collect()
            };
            let mut summed = vec![0.0; held.len()];
            for q in queries.chunks_exact(d) {
                let hidden: Vec<f32> = self
                    .w1
                    .chunks_exact(d)
                    .zip(&self.b1)
                    .map(|(w, &b)| (dot(w, q) + f64::from(b)).max(0.0) as f32)
                    .collect();
                let logits = self
                    .w2
                    .chunks_exact(hidden.len())
                    .zip(&self.b2)
                    .zip(self.centroids.chunks_exact(d))
                    .map(|((w, &b), c)| {
                        dot(w, &hidden) + f64::from(b) + f64::from(self.prior) * dot(q, c)
                    })
                    .collect();
                let classifier = softmax(logits);
                let mut rotated = q.to_vec();
                rope.rotate(&mut rotated, position);
                let expert = self
                    .mean_keys
                    .chunks_exact(d)
                    .map(|m| f64::from(self.prior) * dot(&rotated, m))
                    .collect();
                let expert = softmax(expert);
                let share = f64::from(self.share);
                for (b, s) in summed.iter_mut().enumerate() {
                    *s += (1.0 - share) * classifier[b] + share * expert[b];
                }
            }
            summed
        }
    }

    /// Classifier routing (saap) visits, per KV head, the buckets of best summed routing
    /// distribution among those holding a candidate id (the f64 reference's choice, up to
    /// float ties), the empty list for visits past them; a bucket attention launched behind
    /// it counts the ids it attends. Group 1/4/7/8, head dims 32 to 256, either RoPE pairing,
    /// heads with and without the prior, empty buckets, two steps on the same visits.
    #[test]
    fn classifier_routing_matches_reference() -> Result<()> {
        let Some((gpu, mut rng)) = start("classifier_routing_matches_reference") else {
            return Ok(());
        };
        for (kv_heads, group, head_dim, tokens, buckets, hidden) in [
            (2, 4, 128, 5000, 64, 96),
            (1, 8, 64, 3000, 100, 200),
            (3, 1, 256, 2000, 7, 33),
            (2, 7, 32, 1500, 40, 1024),
        ] {
            let heads: Vec<Head> = (0..kv_heads)
                .map(|_| Head::random(&mut rng, buckets, hidden, head_dim))
                .collect();
            let mut lists = random_buckets(&mut rng, kv_heads, tokens, buckets);
            // Empty buckets (a partition trained on other text leaves many): never visited.
            for list in lists.iter_mut().skip(1).step_by(5) {
                list.clear();
            }
            let style = if rng.random_bool(0.5) {
                RopeStyle::Halves
            } else {
                RopeStyle::Interleaved
            };
            let config = RopeConfig {
                base: 10_000.0,
                style,
                scaling: RopeScaling::None,
            };
            let rope = Rope::new(&config, head_dim, None);
            let pairs = match style {
                RopeStyle::Halves => RopePairs::Halves,
                RopeStyle::Interleaved => RopePairs::Interleaved,
            };
            let views: Vec<ClassifierHead<'_>> = heads.iter().map(Head::view).collect();
            let route_rope = RouteRope {
                inv_freq: rope.inv_freq(),
                pairs,
            };
            let partition =
                Partition::classifier(&gpu, &views, &lists, head_dim, group, route_rope)?;
            let probes = rng.random_range(1..=buckets.min(MAX_VISITED_BUCKETS));
            let mut visits = partition.visits(&gpu, probes)?;
            let zeros = vec![half::f16::ZERO; kv_heads * tokens * head_dim];
            let kv = KvCache::upload(&gpu, &zeros, &zeros, kv_heads, head_dim)?;
            let heads_q = gpu.upload(&vec![half::f16::ONE; kv_heads * group * head_dim])?;
            let heads_q = heads_q.as_view();
            let query = Query {
                heads: &heads_q,
                scale: 1.0,
            };
            let mut workspace = Workspace::new(&gpu)?;
            let mut out = gpu.zeros(kv_heads * group * head_dim)?;
            let mut selected = 0u64;
            for step in 0..2 {
                let queries: Vec<f32> = (0..kv_heads * group * head_dim)
                    .map(|_| rng.random_range(-1.0..1.0))
                    .collect();
                let position = rng.random_range(tokens..4 * tokens);
                let lo = rng.random_range(0..tokens as u32);
                let candidates = lo..rng.random_range(lo..=tokens as u32);
                let runs = [0..candidates.start, candidates.end..tokens as u32];
                let route_step = RouteStep {
                    position,
                    candidates: candidates.clone(),
                };
                let on_gpu = gpu.upload(&queries)?;
                let dense = Dense { kv: &kv, runs: &[] };
                partition.route_and_attend(
                    &gpu,
                    &on_gpu.as_view(),
                    &route_step,
                    &mut visits,
                    &mut workspace,
                    query,
                    dense,
                    &kv,
                    &runs,
                    None,
                    &mut out.as_view_mut(),
                )?;
                let visited: Vec<u32> = visits.visited().to_lists(&gpu)?.concat();
                for (h, head) in heads.iter().enumerate() {
                    let what = format!(
                        "{kv_heads}x{group} heads, d {head_dim}, {buckets} buckets of {hidden} hidden, {probes} probed, {style:?}, step {step}, head {h}"
                    );
                    let list = |b: usize| &lists[h * buckets + b];
                    let held: Vec<bool> = (0..buckets).map(|b| !list(b).is_empty()).collect();
                    let eligible = |b: usize| list(b).iter().any(|id| candidates.contains(id));
                    let score = head.routed(
                        &queries[h * group * head_dim..(h + 1) * group * head_dim],
                        &rope,
                        position,
                        &held,
                    );
                    let count = (0..buckets).filter(|&b| eligible(b)).count().min(probes);
                    let mine = &visited[h * probes..(h + 1) * probes];
                    let empty = (kv_heads * buckets) as u32;
                    ensure!(
                        mine[count..].iter().all(|&l| l == empty),
                        "{what}: visits past the {count} eligible buckets: {mine:?}"
                    );
                    let mine: Vec<usize> = mine[..count]
                        .iter()
                        .map(|&l| (l as usize).wrapping_sub(h * buckets))
                        .collect();
                    let mut seen = mine.clone();
                    seen.sort_unstable();
                    seen.dedup();
                    ensure!(
                        seen.len() == count && seen.iter().all(|&b| b < buckets && eligible(b)),
                        "{what}: visited {mine:?}"
                    );
                    let eligible_buckets = (0..buckets).filter(|&b| eligible(b));
                    visits_are_best(&mine, eligible_buckets, |b| score[b], 1e-5, &what)?;
                    selected += mine
                        .iter()
                        .flat_map(|&b| list(b))
                        .filter(|id| candidates.contains(id))
                        .count() as u64;
                }
                ensure!(
                    visits.selected(&gpu)? == selected,
                    "step {step}: counted {} selected ids of {selected}",
                    visits.selected(&gpu)?
                );
            }
        }
        Ok(())
    }

    /// `Partition::route_and_attend` (routing, then the attention launched to overlap it on
    /// Hopper) over the corpus in pinned host memory (read in place, over PCIe) gives the
    /// outputs, visits and count of `route` then `bucket_attention` over the resident
    /// corpus, bit for bit, its attention mass (added up in any order), and the reference's
    /// attention over what it visited: GQA groups 1/4/7/8, head dims 64/128 (tensor cores)
    /// and 256 (scalar), f16 and bf16, ragged buckets, a query's tail in another buffer, two
    /// steps in a row on the same workspace.
    #[test]
    fn route_and_attend_matches_route_then_attend() -> Result<()> {
        let Some((gpu, mut rng)) = start("route_and_attend_matches_route_then_attend") else {
            return Ok(());
        };
        for (kv_heads, group, head_dim, tokens, buckets) in [
            (2, 4, 128, 20_000, 64),
            (1, 8, 128, 9000, 100),
            (3, 7, 64, 5000, 33),
            (2, 1, 64, 3000, 16),
            (1, 4, 256, 4000, 20),
        ] {
            let shape = (kv_heads, group, head_dim, tokens);
            route_and_attend_case::<half::f16>(&gpu, &mut rng, shape, buckets)?;
            route_and_attend_case::<half::bf16>(&gpu, &mut rng, shape, buckets)?;
        }
        Ok(())
    }

    fn floats(rng: &mut StdRng, len: usize) -> Vec<f32> {
        (0..len).map(|_| rng.random_range(-1.0..1.0)).collect()
    }

    fn route_and_attend_case<T: KvElement>(
        gpu: &Gpu,
        rng: &mut StdRng,
        shape: Shape,
        buckets: usize,
    ) -> Result<()> {
        let (kv_heads, group, head_dim, tokens) = shape;
        let layer = Layer::<T>::new(rng, shape);
        let tail = rng.random_range(0..=40.min(tokens - 1));
        let n = tokens - tail;
        let corpus = cache_of(gpu, &layer, 0..n)?;
        // Blocks of 16 tokens: the host rows' head stride is the padded length, not `n`.
        let host = HostKv::from_device(gpu, &corpus, 16)?;
        let ring = cache_of(gpu, &layer, n..tokens)?;
        let tail_runs: Vec<Range<u32>> = std::iter::once(0..tail as u32)
            .filter(|r| !r.is_empty())
            .collect();
        let queries = gpu.upload(&layer.queries)?;
        let queries = queries.as_view();
        let query = layer.query(&queries);
        let centroids = floats(rng, kv_heads * buckets * head_dim);
        let lists = random_buckets(rng, kv_heads, n, buckets);
        let partition = Partition::new(gpu, &centroids, &lists, &[], kv_heads, head_dim)?;
        let probes = rng.random_range(1..=buckets.min(16));
        let (runs, _) = selection(rng, kv_heads, n, 0.0);
        let (mut visits_a, mut visits_b) = (
            partition.visits(gpu, probes)?,
            partition.visits(gpu, probes)?,
        );
        let mut ws_a = Workspace::new(gpu)?;
        let mut ws_b = Workspace::new(gpu)?;
        for step in 0..2 {
            let route_queries = gpu.upload(&floats(rng, kv_heads * group * head_dim))?;
            let route_queries = route_queries.as_view();
            let dense = Dense {
                kv: &ring,
                runs: &tail_runs,
            };
            let mut out_a = poisoned(gpu, layer.queries.len())?;
            let route_step = RouteStep {
                position: tokens,
                candidates: 0..n as u32,
            };
            partition.route(gpu, &route_queries, &route_step, &mut visits_a)?;
            let part = partition.list_part(&visits_a, &corpus, &runs);
            bucket_attention(gpu, &mut ws_a, query, dense, part, &mut out_a.as_view_mut())?;
            let mut out_b = poisoned(gpu, layer.queries.len())?;
            partition.route_and_attend(
                gpu,
                &route_queries,
                &route_step,
                &mut visits_b,
                &mut ws_b,
                query,
                dense,
                &host,
                &runs,
                None,
                &mut out_b.as_view_mut(),
            )?;
            // The visits on the host (what a bucket cache fills from).
            let visited = visits_b.visited().to_lists(gpu)?.concat();
            let on_host = visits_b.on_host(gpu)?.to_vec();
            ensure!(
                on_host == visited,
                "visits on the host {on_host:?}, on the GPU {visited:?}"
            );
            let (got_a, got_b) = (written(gpu, &out_a)?, written(gpu, &out_b)?);
            let (mut mass_a, mut mass_b) = (gpu.zeros::<f32>(n)?, gpu.zeros::<f32>(n)?);
            let part = partition.list_part(&visits_a, &corpus, &runs);
            attention_mass(gpu, &ws_a, ListPart::Buckets(part), &mut mass_a)?;
            let part = partition.list_part(&visits_b, &host, &runs);
            attention_mass(gpu, &ws_b, ListPart::Buckets(part), &mut mass_b)?;
            let what = format!("route_and_attend {:?} {shape:?} {buckets} buckets, {probes} probed, tail {tail}, step {step}", T::DTYPE);
            let visited = visits_b.visited().to_lists(gpu)?;
            ensure!(
                visits_a.visited().to_lists(gpu)? == visited,
                "{what}: visits differ"
            );
            ensure!(
                visits_a.selected(gpu)? == visits_b.selected(gpu)?,
                "{what}: counted {} and {} ids",
                visits_a.selected(gpu)?,
                visits_b.selected(gpu)?
            );
            let same = got_a
                .iter()
                .zip(&got_b)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            ensure!(
                same,
                "{what}: outputs differ from route then bucket_attention"
            );
            // The KV heads add to a token's mass in any order.
            let mass_a: Vec<f64> = gpu.download(&mass_a)?.iter().map(|&m| m.into()).collect();
            let mass = format!("{what}: mass from host memory");
            close(&mass, &gpu.download(&mass_b)?, &mass_a, 1e-6)?;
            let attended: Vec<Vec<u32>> = visited
                .iter()
                .map(|bs| {
                    let mut ids = ids_of(&runs);
                    ids.extend(tail_runs.iter().cloned().flatten().map(|r| n as u32 + r));
                    let bucket_ids = bs.iter().flat_map(|&b| &lists[b as usize]);
                    ids.extend(bucket_ids.filter(|id| !runs.iter().any(|r| r.contains(id))));
                    ids
                })
                .collect();
            close(&what, &got_b, &layer.reference(&attended)?, TOLERANCE)?;
        }
        Ok(())
    }

    /// Through the pinned-host block cache, and reading the host rows in place, the outputs
    /// and the attention mass equal the resident ones; a repeated step hits every block in
    /// the cache, and evictions keep it right: with the
    /// host memory copied from host slices (blocks of 64 tokens) and from the GPU (blocks of
    /// 16).
    #[test]
    fn block_cache_matches_resident() -> Result<()> {
        let Some((gpu, mut rng)) = start("block_cache_matches_resident") else {
            return Ok(());
        };
        let (kv_heads, head_dim, tokens) = (2, 128, 50_000);
        let layer = Layer::<half::bf16>::new(&mut rng, (kv_heads, 4, head_dim, tokens));
        let OnGpu {
            kv,
            queries,
            mut workspace,
        } = layer.upload(&gpu, true)?;
        let queries = queries.as_view();
        let query = layer.query(&queries);
        for (source, block) in [("host slices", 64), ("the GPU", 16)] {
            let host = match source {
                "host slices" => {
                    HostKv::new(&gpu, &layer.keys, &layer.values, kv_heads, head_dim, block)?
                }
                _ => HostKv::from_device(&gpu, &kv, block)?,
            };
            let padded = tokens.div_ceil(block) * block;
            ensure!(
                host.bytes() == 2 * kv_heads * padded * head_dim * 2,
                "{source}: {} host bytes",
                host.bytes()
            );
            let block_bytes = 2 * block * head_dim * 2;
            let mut cache = BlockCache::new(&gpu, host, 300 * block_bytes)?;
            ensure!(cache.slots() == 300, "{} slots", cache.slots());
            ensure!(
                cache.bytes() == 300 * block_bytes,
                "{} bytes",
                cache.bytes()
            );
            let runs = DensePolicy {
                sink: 1,
                window: 256,
            }
            .dense_ranges(tokens - 1);
            for step in 0..6 {
                // At most 100 blocks per head: with 2 heads the cache evicts from step 2 on.
                let lists: Vec<Vec<u32>> = (0..kv_heads)
                    .map(|_| {
                        let mut ids: Vec<u32> = (1..tokens as u32 - 256).collect();
                        ids.shuffle(&mut rng);
                        ids.truncate(100);
                        ids
                    })
                    .collect();
                let ids = Csr::from_lists(&gpu, &lists)?;
                let mut want = poisoned(&gpu, layer.queries.len())?;
                let dense = Dense {
                    kv: &kv,
                    runs: &runs,
                };
                let resident = Selected::resident(&kv, &ids);
                retrieval_attention(
                    &gpu,
                    &mut workspace,
                    query,
                    dense,
                    resident,
                    &mut want.as_view_mut(),
                )?;
                let want: Vec<f64> = written(&gpu, &want)?.iter().map(|&x| x.into()).collect();
                let mut want_mass = gpu.zeros::<f32>(tokens)?;
                attention_mass(
                    &gpu,
                    &workspace,
                    ListPart::Selected(resident),
                    &mut want_mass,
                )?;
                let want_mass: Vec<f64> = gpu
                    .download(&want_mass)?
                    .iter()
                    .map(|&x| x.into())
                    .collect();
                // The host rows read in place, without the cache.
                let what = format!("{source} in place, step {step}");
                let in_place = Selected::resident(cache.host(), &ids);
                let mut got = poisoned(&gpu, layer.queries.len())?;
                let mut out = got.as_view_mut();
                retrieval_attention(&gpu, &mut workspace, query, dense, in_place, &mut out)?;
                close(&what, &written(&gpu, &got)?, &want, 1e-6)?;
                let mut mass = gpu.zeros::<f32>(tokens)?;
                attention_mass(&gpu, &workspace, ListPart::Selected(in_place), &mut mass)?;
                close(&what, &gpu.download(&mass)?, &want_mass, 1e-6)?;
                for pass in ["cold", "warm"] {
                    let what = format!("block cache from {source}, step {step} {pass}");
                    let before = cache.stats();
                    let selected = cache.gather(&gpu, &lists)?;
                    let mut got = poisoned(&gpu, layer.queries.len())?;
                    retrieval_attention(
                        &gpu,
                        &mut workspace,
                        query,
                        dense,
                        selected,
                        &mut got.as_view_mut(),
                    )?;
                    close(&what, &written(&gpu, &got)?, &want, 1e-6)?;
                    // The mass lands on the selected tokens, not on the slots' rows.
                    let mut mass = gpu.zeros::<f32>(tokens)?;
                    attention_mass(&gpu, &workspace, ListPart::Selected(selected), &mut mass)?;
                    close(
                        &format!("{what}: mass"),
                        &gpu.download(&mass)?,
                        &want_mass,
                        1e-6,
                    )?;
                    let after = cache.stats();
                    if pass == "warm" {
                        ensure!(
                            after.misses == before.misses,
                            "a repeated step missed: {after:?}"
                        );
                        ensure!(after.hits > before.hits, "no hits counted: {after:?}");
                    }
                }
            }
            println!(
                "block cache from {source}: {:?}, hit ratio {:.3}",
                cache.stats(),
                cache.stats().hit_ratio()
            );
            // A step needing more blocks than the cache holds fails cleanly, and the cache
            // works on.
            let every: Vec<Vec<u32>> = vec![(0..tokens as u32).step_by(block).collect(); kv_heads];
            let too_many = cache.gather(&gpu, &every);
            ensure!(
                matches!(too_many, Err(KernelError::CacheTooSmall { needed, slots: 300 }) if needed == 2 * tokens.div_ceil(block)),
                "{too_many:?}"
            );
            cache.clear();
            let selected = cache.gather(&gpu, &[vec![5u32], vec![7u32]])?;
            // A mass of another length than the host's tokens is refused.
            let mut short = gpu.zeros::<f32>(tokens - 1)?;
            let refused =
                attention_mass(&gpu, &workspace, ListPart::Selected(selected), &mut short);
            ensure!(
                matches!(refused, Err(KernelError::Length { .. })),
                "{refused:?}"
            );
        }
        Ok(())
    }

    /// Bad arguments are typed errors, never panics.
    #[test]
    fn bad_arguments_are_errors() -> Result<()> {
        let Some((gpu, mut rng)) = start("bad_arguments_are_errors") else {
            return Ok(());
        };
        ensure!(matches!(Gpu::new(4096), Err(KernelError::Driver { .. })));
        let layer = Layer::<half::f16>::new(&mut rng, (2, 4, 64, 100));
        let OnGpu {
            kv,
            queries,
            workspace: mut ws,
        } = layer.upload(&gpu, true)?;
        let queries = queries.as_view();
        let query = layer.query(&queries);
        let mut out = poisoned(&gpu, layer.queries.len())?;
        let mut short = poisoned(&gpu, 3)?;
        let unsupported =
            |r: kvdb_kernels::Result<()>| matches!(r, Err(KernelError::Unsupported { .. }));
        let out_of_range =
            |r: kvdb_kernels::Result<()>| matches!(r, Err(KernelError::OutOfRange { .. }));
        let wrong_length =
            |r: kvdb_kernels::Result<()>| matches!(r, Err(KernelError::Length { .. }));
        ensure!(out_of_range(flash_decode(
            &gpu,
            &mut ws,
            query,
            &kv,
            101,
            &mut out.as_view_mut()
        )));
        ensure!(wrong_length(flash_decode(
            &gpu,
            &mut ws,
            query,
            &kv,
            100,
            &mut short.as_view_mut()
        )));
        // Nine query heads per KV head: no kernel for that group size.
        let nine = gpu.upload(&vec![half::f16::ZERO; 2 * 9 * 64])?;
        let mut nine_out = poisoned(&gpu, 2 * 9 * 64)?;
        let nine = nine.as_view();
        let nine = Query {
            heads: &nine,
            scale: 0.125,
        };
        ensure!(unsupported(flash_decode(
            &gpu,
            &mut ws,
            nine,
            &kv,
            100,
            &mut nine_out.as_view_mut()
        )));
        let runs = [0..1, 50..100, 10..20];
        ensure!(unsupported(flash_or_dense(
            &gpu,
            &mut ws,
            query,
            &kv,
            &runs,
            &mut out.as_view_mut()
        )));
        let past_end = 0..101;
        let past_end = std::slice::from_ref(&past_end);
        ensure!(out_of_range(flash_or_dense(
            &gpu,
            &mut ws,
            query,
            &kv,
            past_end,
            &mut out.as_view_mut()
        )));
        let ids = Csr::from_lists(&gpu, &[vec![1u32, 100], vec![]])?;
        let dense = Dense { kv: &kv, runs: &[] };
        ensure!(out_of_range(retrieval_attention(
            &gpu,
            &mut ws,
            query,
            dense,
            Selected::resident(&kv, &ids),
            &mut out.as_view_mut()
        )));
        let one_head = Csr::from_lists(&gpu, &[vec![1u32]])?;
        ensure!(wrong_length(retrieval_attention(
            &gpu,
            &mut ws,
            query,
            dense,
            Selected::resident(&kv, &one_head),
            &mut out.as_view_mut()
        )));
        ensure!(matches!(
            Csr::from_csr(&gpu, &[0, 2, 1], &[1, 2]),
            Err(KernelError::Offsets { .. })
        ));
        ensure!(matches!(
            Csr::from_csr(&gpu, &[], &[]),
            Err(KernelError::Offsets { .. })
        ));
        let buckets = Csr::from_lists(&gpu, &[vec![1u32, 2], vec![3]])?;
        let visited = Csr::from_lists(&gpu, &[vec![0u32], vec![2]])?;
        let part = Buckets {
            kv: (&kv).into(),
            runs: &[],
            ids: &buckets,
            visited: &visited,
            count: None,
            follow: None,
            cache: None,
        };
        ensure!(out_of_range(bucket_attention(
            &gpu,
            &mut ws,
            query,
            dense,
            part,
            &mut out.as_view_mut()
        )));
        let many = MAX_VISITED_BUCKETS + 1;
        let singles: Vec<Vec<u32>> = (0..many as u32).map(|b| vec![b % 100]).collect();
        let buckets = Csr::from_lists(&gpu, &singles)?;
        let visited = Csr::from_lists(&gpu, &[(0..many as u32).collect(), vec![]])?;
        ensure!(unsupported(bucket_attention(
            &gpu,
            &mut ws,
            query,
            dense,
            Buckets {
                kv: (&kv).into(),
                runs: &[],
                ids: &buckets,
                visited: &visited,
                count: None,
                follow: None,
                cache: None,
            },
            &mut out.as_view_mut()
        )));
        let none = Csr::from_lists(&gpu, &[Vec::<u32>::new(), vec![]])?;
        let overlapping = [0..10, 5..20];
        ensure!(out_of_range(retrieval_attention(
            &gpu,
            &mut ws,
            query,
            dense,
            Selected::resident(&kv, &none).with_runs(&overlapping),
            &mut out.as_view_mut()
        )));
        let mut mass = gpu.zeros::<f32>(99)?;
        ensure!(wrong_length(attention_mass(
            &gpu,
            &ws,
            ListPart::Selected(Selected::resident(&kv, &none)),
            &mut mass
        )));
        // The mass weighs the rows of the workspace's last launch: there was none, then one
        // of f16 rows, not bf16 ones.
        let not_last =
            |r: kvdb_kernels::Result<()>| matches!(r, Err(KernelError::NotLastLaunch { .. }));
        let (mut fresh, mut mass) = (Workspace::new(&gpu)?, gpu.zeros::<f32>(100)?);
        let two = Csr::from_lists(&gpu, &[vec![1u32], vec![2]])?;
        let part = ListPart::Selected(Selected::resident(&kv, &two));
        ensure!(not_last(attention_mass(&gpu, &fresh, part, &mut mass)));
        // So do the weights, which also need a float per list item.
        let mut weights = gpu.zeros::<f32>(2)?;
        let selected = Selected::resident(&kv, &two);
        ensure!(not_last(attention_weights(
            &gpu,
            &fresh,
            selected,
            &mut weights
        )));
        flash_decode(&gpu, &mut fresh, query, &kv, 100, &mut out.as_view_mut())?;
        attention_mass(&gpu, &fresh, part, &mut mass)?;
        attention_weights(&gpu, &fresh, selected, &mut weights)?;
        let mut short = gpu.zeros::<f32>(1)?;
        ensure!(wrong_length(attention_weights(
            &gpu, &fresh, selected, &mut short
        )));
        let zeros = vec![half::bf16::ZERO; 2 * 100 * 64];
        let bf16 = KvCache::upload(&gpu, &zeros, &zeros, 2, 64)?;
        let part = ListPart::Selected(Selected::resident(&bf16, &two));
        ensure!(not_last(attention_mass(&gpu, &fresh, part, &mut mass)));
        let partition = Partition::new(&gpu, &[0.0; 2 * 3 * 64], &vec![vec![0u32]; 6], &[], 2, 64);
        ensure!(unsupported(partition?.visits(&gpu, 4).map(|_| ())));
        let unsorted = Partition::new(&gpu, &[0.0; 2 * 64], &[vec![2u32, 1], vec![]], &[], 2, 64);
        ensure!(matches!(unsorted, Err(KernelError::Offsets { .. })));
        // Ids every search visits: one list per KV head, ascending, and with them no more
        // visits than a bucket launch takes.
        let lists = vec![vec![0u32]; 2 * 200];
        let centroids = vec![0.0; 2 * 200 * 8];
        let one_head = Partition::new(&gpu, &centroids, &lists, &[vec![1u32]], 2, 8);
        ensure!(wrong_length(one_head.map(|_| ())));
        let unsorted = Partition::new(&gpu, &centroids, &lists, &[vec![3u32, 1], vec![]], 2, 8);
        ensure!(matches!(unsorted, Err(KernelError::Offsets { .. })));
        let hot = Partition::new(&gpu, &centroids, &lists, &[vec![1u32], vec![]], 2, 8)?;
        ensure!(hot.visits(&gpu, MAX_VISITED_BUCKETS - 1).is_ok());
        ensure!(unsupported(
            hot.visits(&gpu, MAX_VISITED_BUCKETS).map(|_| ())
        ));
        let many = MAX_ROUTED_BUCKETS + 1;
        let too_many = Partition::new(&gpu, &vec![0.0; many * 8], &vec![vec![]; many], &[], 1, 8);
        ensure!(unsupported(too_many.map(|_| ())));
        // Seventeen query heads per KV head: more than a routing thread's running sums.
        let partition = Partition::new(&gpu, &[0.0; 2 * 8], &[vec![0u32], vec![1]], &[], 1, 8)?;
        let mut visits = partition.visits(&gpu, 1)?;
        let seventeen = gpu.upload(&[0.0f32; 17 * 8])?;
        ensure!(unsupported(partition.route(
            &gpu,
            &seventeen.as_view(),
            &anywhere(),
            &mut visits
        )));
        // Classifier partitions: a first layer of the wrong shape, a group past 16, more
        // buckets than a ranking block holds, the queries of another group, and visits of a
        // centroid partition or of another classifier's shape.
        let head = Head::random(&mut rng, 2, 16, 8);
        let rope = RouteRope {
            inv_freq: &[1.0; 4],
            pairs: RopePairs::Halves,
        };
        let lists = [vec![0u32], vec![1]];
        let short = ClassifierHead {
            w1: &head.w1[1..],
            ..head.view()
        };
        let wrong = Partition::classifier(&gpu, &[short], &lists, 8, 4, rope);
        ensure!(
            matches!(wrong, Err(KernelError::Length { .. })),
            "{wrong:?}"
        );
        let wide = Partition::classifier(&gpu, &[head.view()], &lists, 8, 17, rope);
        ensure!(unsupported(wide.map(|_| ())));
        let many = 2000;
        let big = Head::random(&mut rng, many, 16, 8);
        let lists_many: Vec<Vec<u32>> = (0..many as u32).map(|id| vec![id]).collect();
        let big = Partition::classifier(&gpu, &[big.view()], &lists_many, 8, 4, rope);
        ensure!(unsupported(big.map(|_| ())));
        let classifier = Partition::classifier(&gpu, &[head.view()], &lists, 8, 4, rope)?;
        let (four, two) = (gpu.upload(&[0.5f32; 4 * 8])?, gpu.upload(&[0.5f32; 2 * 8])?);
        let mut own = classifier.visits(&gpu, 1)?;
        ensure!(matches!(
            classifier.route(&gpu, &two.as_view(), &anywhere(), &mut own),
            Err(KernelError::Length { .. })
        ));
        let mut centroid_visits = partition.visits(&gpu, 1)?;
        ensure!(unsupported(classifier.route(
            &gpu,
            &four.as_view(),
            &anywhere(),
            &mut centroid_visits
        )));
        let other = Partition::classifier(&gpu, &[head.view()], &lists, 8, 2, rope)?;
        let mut others = other.visits(&gpu, 1)?;
        ensure!(matches!(
            classifier.route(&gpu, &four.as_view(), &anywhere(), &mut others),
            Err(KernelError::Length { .. })
        ));
        classifier.route(&gpu, &four.as_view(), &anywhere(), &mut own)?;
        // Head dims whose rows are not 8 dimensions for each of a power of two of threads.
        for head_dim in [40, 512] {
            let odd = Partition::new(&gpu, &vec![0.0; head_dim], &[vec![0u32]], &[], 1, head_dim);
            ensure!(unsupported(odd.map(|_| ())));
        }
        // More probes than a bucket launch visits, and a launch visiting that many.
        let many = MAX_VISITED_BUCKETS + 1;
        let lists: Vec<Vec<u32>> = (0..many as u32).map(|id| vec![id]).collect();
        let partition = Partition::new(&gpu, &vec![0.0; many * 8], &lists, &[], 1, 8)?;
        ensure!(unsupported(partition.visits(&gpu, many).map(|_| ())));
        let host = HostKv::new(&gpu, &layer.keys, &layer.values, 2, 64, 64)?;
        let no_cache = BlockCache::new(&gpu, host, 10);
        ensure!(matches!(no_cache, Err(KernelError::TooLarge { .. })));
        // Blocks of one token of 4 dimensions: 8 bytes, not whole 16-byte vectors; and
        // blocks of 48 tokens, not a power of two.
        for (head_dim, block_tokens) in [(4, 1), (64, 48)] {
            let odd = HostKv::new(&gpu, &layer.keys, &layer.values, 2, head_dim, block_tokens);
            ensure!(
                matches!(odd, Err(KernelError::Unsupported { .. })),
                "{odd:?}"
            );
        }
        // Nothing to attend to: zeros, every output written.
        flash_decode(&gpu, &mut ws, query, &kv, 0, &mut out.as_view_mut())?;
        ensure!(written(&gpu, &out)?.iter().all(|&x| x == 0.0));
        Ok(())
    }

    /// Retrieval attention over `runs` alone (an empty selection).
    fn flash_or_dense(
        gpu: &Gpu,
        ws: &mut Workspace,
        query: Query<'_, half::f16>,
        kv: &KvCache<half::f16>,
        runs: &[Range<u32>],
        out: &mut CudaViewMut<'_, f32>,
    ) -> kvdb_kernels::Result<()> {
        let none = Csr::from_lists(gpu, &vec![Vec::<u32>::new(); kv.kv_heads()])?;
        let dense = Dense { kv, runs };
        retrieval_attention(gpu, ws, query, dense, Selected::resident(kv, &none), out)
    }
}
