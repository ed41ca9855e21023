//! [`Selection`]: the token ids a query group attends to beyond its dense part.

/// The token ids one KV head's query group attends to beyond the dense part (sinks and recent
/// window): sorted ascending, no duplicates.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct Selection {
    ids: Vec<u32>,
}

impl Selection {
    /// A selection of `ids` in any order; sorts them and drops duplicates.
    ///
    /// ```
    /// let s = kvdb_index::Selection::new(vec![7, 3, 7, 1]);
    /// assert_eq!(s.ids(), &[1, 3, 7]);
    /// ```
    pub fn new(mut ids: Vec<u32>) -> Self {
        ids.sort_unstable();
        ids.dedup();
        Self { ids }
    }

    /// The ids, ascending.
    pub fn ids(&self) -> &[u32] {
        &self.ids
    }

    /// Number of ids.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether there are no ids.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Whether `id` is selected (binary search).
    pub fn contains(&self, id: u32) -> bool {
        self.ids.binary_search(&id).is_ok()
    }

    /// Adds `id` where it sorts, unless it is there already (whether it was added): a few
    /// ids joining a large selection without sorting it again.
    ///
    /// ```
    /// let mut s = kvdb_index::Selection::new(vec![9, 3]);
    /// assert!(s.insert(5) && !s.insert(9));
    /// assert_eq!(s.ids(), &[3, 5, 9]);
    /// ```
    pub fn insert(&mut self, id: u32) -> bool {
        match self.ids.binary_search(&id) {
            Ok(_) => false,
            Err(at) => {
                self.ids.insert(at, id);
                true
            }
        }
    }

    /// The ids, ascending, as a vector.
    pub fn into_ids(self) -> Vec<u32> {
        self.ids
    }
}

impl FromIterator<u32> for Selection {
    fn from_iter<I: IntoIterator<Item = u32>>(iter: I) -> Self {
        Self::new(iter.into_iter().collect())
    }
}

#[cfg(test)]
mod tests {
    use super::Selection;

    #[test]
    fn sorted_and_deduplicated() {
        let s: Selection = [5, 1, 5, 9, 0, 1].into_iter().collect();
        assert_eq!(s.ids(), &[0, 1, 5, 9]);
        assert_eq!(s.len(), 4);
        assert!(s.contains(9) && !s.contains(2));
        assert_eq!(s.clone().into_ids(), vec![0, 1, 5, 9]);
        assert!(Selection::default().is_empty());
        assert_eq!(Selection::new(vec![]), Selection::default());
    }
}
