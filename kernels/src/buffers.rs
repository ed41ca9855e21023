//! Device buffers: a layer's keys and values ([`KvCache`]) and per-head or per-bucket lists
//! of ids ([`Csr`]).

use std::ops::Range;

use cudarc::driver::CudaSlice;

use crate::error::{driver, length, KernelError, Result};
use crate::gpu::{Float, Gpu, KvElement};

/// Keys and values of one layer on the GPU, `[kv_heads, tokens, head_dim]` each: token `i`
/// of KV head `h` is row `h * tokens + i`. Keys are stored as attended, i.e. already rotated
/// by RoPE.
pub struct KvCache<T> {
    pub(crate) keys: CudaSlice<T>,
    pub(crate) values: CudaSlice<T>,
    kv_heads: usize,
    tokens: usize,
    head_dim: usize,
}

impl<T> std::fmt::Debug for KvCache<T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("kv_heads", &self.kv_heads)
            .field("tokens", &self.tokens)
            .field("head_dim", &self.head_dim)
            .finish_non_exhaustive()
    }
}

impl<T: KvElement> KvCache<T> {
    /// Copies keys and values `[kv_heads, tokens, head_dim]` to the GPU; `tokens` follows
    /// from their length.
    pub fn upload(
        gpu: &Gpu,
        keys: &[T],
        values: &[T],
        kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self> {
        let row = kv_heads * head_dim;
        if row == 0 || !keys.len().is_multiple_of(row) {
            return Err(KernelError::Length {
                what: "keys (whole [kv_heads, tokens, head_dim])",
                expected: keys.len().next_multiple_of(row.max(1)),
                found: keys.len(),
            });
        }
        length("values", keys.len(), values.len())?;
        let tokens = keys.len() / row;
        if u32::try_from(tokens).is_err() {
            return Err(KernelError::TooLarge {
                what: "tokens",
                value: tokens,
            });
        }
        Ok(Self {
            keys: gpu.upload(keys)?,
            values: gpu.upload(values)?,
            kv_heads,
            tokens,
            head_dim,
        })
    }
}

impl<T: Float> KvCache<T> {
    /// A buffer of `capacity` zero rows per KV head, which the model's prefill fills in
    /// place (`crate::ops::append_kv` writes token positions to rows, wrapping around as a
    /// ring when a sliding-window layer's capacity is smaller than the sequence).
    pub fn zeros(gpu: &Gpu, kv_heads: usize, capacity: usize, head_dim: usize) -> Result<Self> {
        let len = kv_heads
            .checked_mul(capacity)
            .and_then(|n| n.checked_mul(head_dim))
            .filter(|_| u32::try_from(capacity).is_ok())
            .ok_or(KernelError::TooLarge {
                what: "KV buffer rows",
                value: capacity,
            })?;
        Ok(Self {
            keys: gpu.zeros(len)?,
            values: gpu.zeros(len)?,
            kv_heads,
            tokens: capacity,
            head_dim,
        })
    }
}

impl<T: Float> KvCache<T> {
    /// Grows the buffer to `capacity` rows per KV head, keeping rows `0..kept` of every head
    /// (a buffer whose rows are token positions, not a ring). Queued on the stream.
    pub fn grow(&mut self, gpu: &Gpu, capacity: usize, kept: usize) -> Result<()> {
        if capacity <= self.tokens {
            return Ok(());
        }
        if kept > self.tokens {
            return Err(KernelError::OutOfRange {
                what: "rows kept when growing",
                index: kept as u64,
                len: self.tokens as u64,
            });
        }
        let mut grown = Self::zeros(gpu, self.kv_heads, capacity, self.head_dim)?;
        let d = self.head_dim;
        for h in 0..self.kv_heads {
            let (from, to) = (h * self.tokens * d, h * capacity * d);
            for (old, new) in [
                (&self.keys, &mut grown.keys),
                (&self.values, &mut grown.values),
            ] {
                gpu.stream()
                    .memcpy_dtod(
                        &old.slice(from..from + kept * d),
                        &mut new.slice_mut(to..to + kept * d),
                    )
                    .map_err(driver("copying a KV buffer"))?;
            }
        }
        *self = grown;
        Ok(())
    }
}

impl<T> KvCache<T> {
    /// Number of KV heads.
    pub fn kv_heads(&self) -> usize {
        self.kv_heads
    }

    /// Tokens held per KV head.
    pub fn tokens(&self) -> usize {
        self.tokens
    }

    /// Length of each key and value row.
    pub fn head_dim(&self) -> usize {
        self.head_dim
    }

    /// The rows that hold token `positions` where position `p` is row `p % tokens` (a ring,
    /// as a sliding-window layer's buffer is; a buffer whose rows are positions gives
    /// `positions` itself), as at most two runs of rows. Of more positions than the buffer
    /// has rows, the ring holds the last ones: their rows.
    pub fn rows_of(&self, positions: Range<usize>) -> impl Iterator<Item = Range<u32>> {
        ring_runs(positions, self.tokens)
    }
}

/// [`KvCache::rows_of`] for a buffer of `capacity` rows.
fn ring_runs(positions: Range<usize>, capacity: usize) -> impl Iterator<Item = Range<u32>> {
    let capacity = capacity.max(1);
    let kept = positions.start.max(positions.end.saturating_sub(capacity));
    let start = kept % capacity;
    let len = positions.end.saturating_sub(kept);
    let first = start..(start + len).min(capacity);
    let wrapped = 0..(start + len).saturating_sub(capacity);
    [first, wrapped]
        .into_iter()
        .filter(|r| !r.is_empty())
        .map(|r| r.start as u32..r.end as u32)
}

/// Lists of `u32` on the GPU in CSR form: list `r` is `items[offsets[r]..offsets[r + 1]]`.
///
/// One list per KV head holds the token ids a step selects ([`crate::retrieval_attention`])
/// or the buckets it visits ([`crate::bucket_attention`]); one list per bucket holds a
/// bucket index's token ids.
pub struct Csr {
    pub(crate) offsets: CudaSlice<u32>,
    pub(crate) items: CudaSlice<u32>,
    lists: usize,
    longest: usize,
    /// Items over all lists.
    total: usize,
    /// The largest item, `None` when there is none.
    max_item: Option<u32>,
}

impl std::fmt::Debug for Csr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Csr")
            .field("lists", &self.lists)
            .field("longest", &self.longest)
            .field("max_item", &self.max_item)
            .finish_non_exhaustive()
    }
}

impl Csr {
    /// Bytes of GPU memory the lists take.
    pub fn bytes(&self) -> usize {
        (self.offsets.len() + self.items.len()) * size_of::<u32>()
    }

    /// Uploads one list per entry of `lists`.
    pub fn from_lists<L: AsRef<[u32]>>(gpu: &Gpu, lists: &[L]) -> Result<Self> {
        let (offsets, items) = flatten(lists)?;
        Self::from_csr(gpu, &offsets, &items)
    }

    /// Uploads lists already in CSR form: `offsets` rise from 0 to `items.len()`.
    pub fn from_csr(gpu: &Gpu, offsets: &[u32], items: &[u32]) -> Result<Self> {
        let bad = KernelError::Offsets {
            what: "csr",
            items: items.len(),
        };
        let (Some(&first), Some(&last)) = (offsets.first(), offsets.last()) else {
            return Err(bad);
        };
        if first != 0 || last as usize != items.len() || offsets.windows(2).any(|w| w[0] > w[1]) {
            return Err(bad);
        }
        Ok(Self {
            offsets: gpu.upload(offsets)?,
            items: gpu.upload(items)?,
            lists: offsets.len() - 1,
            longest: offsets
                .windows(2)
                .map(|w| (w[1] - w[0]) as usize)
                .max()
                .unwrap_or(0),
            total: items.len(),
            max_item: items.iter().copied().max(),
        })
    }

    /// `lists` lists of `per_list` items each, which a kernel writes (zeros until then), all
    /// below `bound`.
    pub(crate) fn uniform(gpu: &Gpu, lists: usize, per_list: usize, bound: u32) -> Result<Self> {
        let total = lists
            .checked_mul(per_list)
            .filter(|&t| u32::try_from(t).is_ok())
            .ok_or(KernelError::TooLarge {
                what: "list items",
                value: lists.saturating_mul(per_list),
            })?;
        let offsets: Vec<u32> = (0..=lists).map(|r| (r * per_list) as u32).collect();
        Ok(Self {
            offsets: gpu.upload(&offsets)?,
            items: gpu.zeros(total.max(1))?,
            lists,
            longest: per_list,
            total,
            max_item: (total > 0).then(|| bound.saturating_sub(1)),
        })
    }

    /// Replaces the lists with `lists`, reusing the device buffers when they are large
    /// enough (a decode step's selection, rewritten every step without an allocation). The
    /// copies are queued behind the launches that read the previous lists.
    pub fn write_lists<L: AsRef<[u32]>>(&mut self, gpu: &Gpu, lists: &[L]) -> Result<()> {
        let (offsets, items) = flatten(lists)?;
        self.rewrite(gpu, &offsets, &items)
    }

    /// Replaces the lists, reusing the device buffers when they are large enough.
    pub(crate) fn rewrite(&mut self, gpu: &Gpu, offsets: &[u32], items: &[u32]) -> Result<()> {
        write_into(gpu, &mut self.offsets, offsets)?;
        write_into(gpu, &mut self.items, items)?;
        self.lists = offsets.len().saturating_sub(1);
        self.longest = offsets
            .windows(2)
            .map(|w| (w[1] - w[0]) as usize)
            .max()
            .unwrap_or(0);
        self.total = items.len();
        self.max_item = items.iter().copied().max();
        Ok(())
    }

    /// The lists, copied to the host (waits for the stream).
    pub fn to_lists(&self, gpu: &Gpu) -> Result<Vec<Vec<u32>>> {
        let offsets = gpu.download(&self.offsets)?;
        let items = gpu.download(&self.items)?;
        Ok(offsets
            .windows(2)
            .take(self.lists)
            .map(|w| items[w[0] as usize..w[1] as usize].to_vec())
            .collect())
    }

    /// Number of lists.
    pub fn lists(&self) -> usize {
        self.lists
    }

    /// Length of the longest list.
    pub fn longest(&self) -> usize {
        self.longest
    }

    /// Items over all lists.
    pub fn total(&self) -> usize {
        self.total
    }

    /// An error unless there are `lists` lists whose items are all below `bound`.
    pub(crate) fn check(&self, what: &'static str, lists: usize, bound: usize) -> Result<()> {
        length(what, lists, self.lists)?;
        match self.max_item {
            Some(item) if item as usize >= bound => Err(KernelError::OutOfRange {
                what,
                index: item.into(),
                len: bound as u64,
            }),
            _ => Ok(()),
        }
    }
}

/// CSR offsets and items of `lists`.
fn flatten<L: AsRef<[u32]>>(lists: &[L]) -> Result<(Vec<u32>, Vec<u32>)> {
    let total: usize = lists.iter().map(|l| l.as_ref().len()).sum();
    if u32::try_from(total).is_err() {
        return Err(KernelError::TooLarge {
            what: "list items",
            value: total,
        });
    }
    let mut offsets = Vec::with_capacity(lists.len() + 1);
    let mut items = Vec::with_capacity(total);
    offsets.push(0);
    for list in lists {
        items.extend_from_slice(list.as_ref());
        offsets.push(items.len() as u32);
    }
    Ok((offsets, items))
}

/// Copies `data` into the front of `buffer`, first growing it when it is too short.
pub(crate) fn write_into(gpu: &Gpu, buffer: &mut CudaSlice<u32>, data: &[u32]) -> Result<()> {
    if data.is_empty() {
        return Ok(());
    }
    if buffer.len() < data.len() {
        *buffer = gpu.zeros(data.len().next_power_of_two())?;
    }
    gpu.stream()
        .memcpy_htod(data, &mut buffer.slice_mut(..data.len()))
        .map_err(driver("copying lists to the device"))
}

#[cfg(test)]
mod tests {
    use super::ring_runs;

    #[test]
    fn ring_runs_wrap_around_the_ring() {
        let rows = |p: std::ops::Range<usize>, c| ring_runs(p, c).collect::<Vec<_>>();
        assert_eq!(rows(100..101, 8), vec![4..5]);
        assert_eq!(rows(100..104, 8), vec![4..8]);
        assert_eq!(rows(100..106, 8), vec![4..8, 0..2]);
        assert_eq!(rows(96..104, 8), vec![0..8]);
        assert_eq!(rows(5..5, 8), Vec::<std::ops::Range<u32>>::new());
        // A buffer whose rows are positions: the positions themselves.
        assert_eq!(rows(0..37, 64), vec![0..37]);
        // More positions than rows: the last 8 (96..104), all of them.
        assert_eq!(rows(90..104, 8), vec![0..8]);
        assert_eq!(rows(91..102, 8), vec![6..8, 0..6]);
    }
}
