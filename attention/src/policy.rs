//! [`DensePolicy`]: which tokens a query attends to densely, whatever the index returns.

use std::ops::Range;

/// The dense part of retrieval attention: the first `sink` tokens (attention sinks) and the
/// last `window` tokens up to and including the query's own token.
///
/// For a query at `position` the dense ids are `[0, min(sink, position + 1))` ∪
/// `[position + 1 - min(window, position + 1), position + 1)`; `window >= 1` makes a token
/// attend to itself. The ids strictly between the two are the [`candidates`](Self::candidates)
/// an index may usefully return.
///
/// ```
/// use kvdb_attention::DensePolicy;
/// let policy = DensePolicy { sink: 4, window: 3 };
/// assert_eq!(policy.dense_ranges(99), vec![0..4, 97..100]);
/// assert_eq!(policy.candidates(99), 4..97);
/// assert_eq!(policy.dense_ranges(5), vec![0..6]);
/// assert!(policy.candidates(5).is_empty());
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DensePolicy {
    /// Number of leading tokens always attended (StreamingLLM's attention sinks).
    pub sink: usize,
    /// Number of most recent tokens always attended, the query's own token included.
    pub window: usize,
}

impl Default for DensePolicy {
    /// Four sink tokens and a window of 256 recent tokens.
    fn default() -> Self {
        Self {
            sink: 4,
            window: 256,
        }
    }
}

impl DensePolicy {
    /// End of the sink and start of the window for a query at `position`, as ids, with the
    /// exclusive end `position + 1` (saturated at `u32::MAX`).
    fn bounds(&self, position: usize) -> (u32, u32, u32) {
        let end = u32::try_from(position.saturating_add(1)).unwrap_or(u32::MAX);
        let clamp = |n: usize| u32::try_from(n).unwrap_or(u32::MAX).min(end);
        (clamp(self.sink), end - clamp(self.window), end)
    }

    /// The dense ids of a query at `position` as disjoint ascending ranges, merged into one
    /// when the sink and the window touch or overlap; empty ranges are left out.
    pub fn dense_ranges(&self, position: usize) -> Vec<Range<u32>> {
        let (sink_end, window_start, end) = self.bounds(position);
        if window_start <= sink_end {
            return std::iter::once(0..end).collect();
        }
        let sink = (sink_end > 0).then_some(0..sink_end);
        let window = (window_start < end).then_some(window_start..end);
        sink.into_iter().chain(window).collect()
    }

    /// The ids strictly between the sink and the window of a query at `position`: the only
    /// ones an index may usefully return (an empty range when there are none).
    pub fn candidates(&self, position: usize) -> Range<u32> {
        let (sink_end, window_start, _) = self.bounds(position);
        sink_end..window_start.max(sink_end)
    }

    /// The ids of `selection` a query at `position` attends to besides the dense part: its
    /// candidates (the dense ids and later ones are dropped, so no token counts twice). The
    /// one filter of the CPU and GPU paths.
    pub fn retrieved<'s>(
        &self,
        position: usize,
        selection: &'s [u32],
    ) -> impl Iterator<Item = u32> + 's {
        let candidates = self.candidates(position);
        selection
            .iter()
            .copied()
            .filter(move |id| candidates.contains(id))
    }
}

#[cfg(test)]
mod tests {
    use super::DensePolicy;

    #[test]
    fn ranges_and_candidates() {
        let p = |sink, window| DensePolicy { sink, window };
        assert_eq!(p(4, 256).dense_ranges(0), vec![0..1]);
        assert_eq!(p(4, 256).dense_ranges(1000), vec![0..4, 745..1001]);
        assert_eq!(p(4, 256).candidates(1000), 4..745);
        let picked: Vec<u32> = p(4, 256)
            .retrieved(1000, &[0, 3, 4, 500, 744, 745, 1000, 2000])
            .collect();
        assert_eq!(picked, vec![4, 500, 744]);
        // Touching ranges merge.
        assert_eq!(p(4, 3).dense_ranges(6), vec![0..7]);
        assert_eq!(p(4, 3).candidates(6), 4..4);
        assert_eq!(p(4, 3).dense_ranges(7), vec![0..4, 5..8]);
        assert_eq!(p(4, 3).candidates(7), 4..5);
        // No sink, a window of one: the token itself.
        assert_eq!(p(0, 1).dense_ranges(9), vec![9..10]);
        assert_eq!(p(0, 1).candidates(9), 0..9);
        // No window: the token itself is a candidate.
        assert_eq!(p(2, 0).dense_ranges(9), vec![0..2]);
        assert_eq!(p(2, 0).candidates(9), 2..10);
        assert_eq!(p(0, 0).dense_ranges(9), vec![]);
        assert_eq!(p(0, 0).candidates(9), 0..10);
        // Huge positions and sizes saturate instead of overflowing.
        assert_eq!(p(usize::MAX, 0).dense_ranges(usize::MAX), vec![0..u32::MAX]);
        assert!(p(usize::MAX, usize::MAX).candidates(usize::MAX).is_empty());
    }
}
