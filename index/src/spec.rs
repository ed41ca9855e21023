//! [`IndexSpec`]: the typed form of an index spec string, parsed once and printed in one
//! canonical spelling (`Display` round-trips through `FromStr`).

use std::fmt;
use std::str::FromStr;

use crate::IndexError;

/// The grammar shown with every spec error.
pub const GRAMMAR: &str = "\
index specs:
  flat                                   exact top-k over every key
  ivf<C>,np<P>[,norope][,all]            faiss IVF-Flat, C lists, P probed; norope: partition on
                                         de-roped keys; all: attend every key of the probed lists
  hnsw<M>,ef<E>[,efc<C>]                 hnsw_rs graph, M links, ef_search E, ef_construction C
  lsh:L=<tables>,K=<bits>[,min=<n>][,seed=<s>]
                                         sign random projections, keys colliding in >= n tables
  saap<C>,l<P>                           SAAP: C k-means buckets, the top-P buckets attended
  hip:k<K>,bq<B>,bk<B>                   HiP hierarchical top-k, K keys, query/key blocks
  ihip:<preset> | ihip:lc=256/32/8,k=<k1>/<k2>/<k3>,refresh=16/8/4
                                         InfiniteHiP multi-stage chunk pruning (presets: paper,
                                         <N>k for a final budget of N*1024 keys)";

/// `ivf<C>,np<P>[,norope][,all]`: faiss IndexIVFFlat with inner product.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IvfSpec {
    /// Inverted lists (k-means centroids).
    pub lists: usize,
    /// Lists probed per search.
    pub probes: usize,
    /// Train and assign the partition on de-roped (pre-RoPE) keys and queries.
    pub norope: bool,
    /// Attend every key of the probed lists instead of their top-k.
    pub all: bool,
}

/// `hnsw<M>,ef<E>[,efc<C>]`: an hnsw_rs graph over augmented keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HnswSpec {
    /// Links per node.
    pub m: usize,
    /// Candidate list size while searching.
    pub ef_search: usize,
    /// Candidate list size while inserting.
    pub ef_construction: usize,
}

/// `lsh:L=<tables>,K=<bits>[,min=<n>][,seed=<s>]`: sign-random-projection hashing.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LshSpec {
    /// Hash tables.
    pub tables: usize,
    /// Bits (random hyperplanes) per table.
    pub bits: usize,
    /// A key is a candidate when it collides with a query in at least this many tables.
    pub min_collisions: usize,
    /// Seed of the random hyperplanes.
    pub seed: u64,
}

/// `saap<C>,l<P>`: SAAP's asymmetric partitions.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SaapSpec {
    /// Buckets (k-means centroids on de-roped keys).
    pub centroids: usize,
    /// Buckets visited per search (the top ℓ of the summed classifier outputs, among those
    /// that hold candidate keys).
    pub probes: usize,
}

/// `hip:k<K>,bq<B>,bk<B>`: HiP's hierarchical top-k.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct HipSpec {
    /// Keys selected (the default budget).
    pub k: usize,
    /// Query block size (queries of a block share one search in prefill; 1 when decoding).
    pub block_q: usize,
    /// Key block size: the unit of the tree's leaves.
    pub block_k: usize,
}

/// InfiniteHiP's multi-stage pruning: one entry per stage, coarse to fine.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct IhipSpec {
    /// Chunk size of each stage, in tokens (each a multiple of the next).
    pub chunks: Vec<usize>,
    /// Tokens kept by each stage (non-increasing; the last is the default budget).
    pub budgets: Vec<usize>,
    /// Each stage is recomputed every this many decode steps.
    pub refresh: Vec<usize>,
}

impl IhipSpec {
    /// The paper's configuration: chunks 256/32/8, budgets 32K/8K/2K, refresh 16/8/4.
    pub fn paper() -> Self {
        Self::final_budget(2048)
    }

    /// The paper's stages with the budgets scaled so the last keeps `keys` (ratios 16:4:1).
    pub fn final_budget(keys: usize) -> Self {
        Self {
            chunks: vec![256, 32, 8],
            budgets: vec![16 * keys, 4 * keys, keys],
            refresh: vec![16, 8, 4],
        }
    }
}

/// A parsed index spec: which index and its build-time parameters.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum IndexSpec {
    /// `flat`
    Flat,
    /// `ivf<C>,np<P>[,norope][,all]`
    Ivf(IvfSpec),
    /// `hnsw<M>,ef<E>[,efc<C>]`
    Hnsw(HnswSpec),
    /// `lsh:L=..,K=..[,min=..][,seed=..]`
    Lsh(LshSpec),
    /// `saap<C>,l<P>`
    Saap(SaapSpec),
    /// `hip:k..,bq..,bk..`
    Hip(HipSpec),
    /// `ihip:...`
    Ihip(IhipSpec),
}

/// Defaults of the optional fields.
const DEFAULT_EF_CONSTRUCTION: usize = 200;
const DEFAULT_MIN_COLLISIONS: usize = 2;

impl IndexSpec {
    /// The keys a query attends to when the caller names no budget: the spec's own budget
    /// for hip and ihip, `None` for the others (the engine's `k`; bucket indexes visiting
    /// whole buckets ignore it).
    pub fn default_k(&self) -> Option<usize> {
        match self {
            Self::Hip(h) => Some(h.k),
            Self::Ihip(i) => i.budgets.last().copied(),
            _ => None,
        }
    }

    /// Whether searches return whole buckets (and so ignore `k`).
    pub fn attends_whole_buckets(&self) -> bool {
        matches!(self, Self::Saap(_) | Self::Ivf(IvfSpec { all: true, .. }))
    }

    /// The spec's search breadth, which [`crate::SearchParams::breadth`] overrides per search:
    /// its name in the spec (`np`, `l`, `ef`) and value. `None` for the indexes without one.
    pub fn breadth(&self) -> Option<(&'static str, usize)> {
        match self {
            Self::Ivf(i) => Some(("np", i.probes)),
            Self::Saap(s) => Some(("l", s.probes)),
            Self::Hnsw(h) => Some(("ef", h.ef_search)),
            _ => None,
        }
    }

    /// The name of the index kind (`flat`, `ivf`, ...).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Flat => "flat",
            Self::Ivf(_) => "ivf",
            Self::Hnsw(_) => "hnsw",
            Self::Lsh(_) => "lsh",
            Self::Saap(_) => "saap",
            Self::Hip(_) => "hip",
            Self::Ihip(_) => "ihip",
        }
    }
}

impl fmt::Display for IndexSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let slashed = |v: &[usize]| v.iter().map(usize::to_string).collect::<Vec<_>>().join("/");
        match self {
            Self::Flat => write!(f, "flat"),
            Self::Ivf(s) => {
                write!(f, "ivf{},np{}", s.lists, s.probes)?;
                if s.norope {
                    write!(f, ",norope")?;
                }
                if s.all {
                    write!(f, ",all")?;
                }
                Ok(())
            }
            Self::Hnsw(s) => write!(f, "hnsw{},ef{},efc{}", s.m, s.ef_search, s.ef_construction),
            Self::Lsh(s) => write!(
                f,
                "lsh:L={},K={},min={},seed={}",
                s.tables, s.bits, s.min_collisions, s.seed
            ),
            Self::Saap(s) => write!(f, "saap{},l{}", s.centroids, s.probes),
            Self::Hip(s) => write!(f, "hip:k{},bq{},bk{}", s.k, s.block_q, s.block_k),
            Self::Ihip(s) => write!(
                f,
                "ihip:lc={},k={},refresh={}",
                slashed(&s.chunks),
                slashed(&s.budgets),
                slashed(&s.refresh)
            ),
        }
    }
}

/// Parses the fields of one spec, naming the bad token in its errors.
struct Fields<'a> {
    spec: &'a str,
}

impl<'a> Fields<'a> {
    fn error(&self, token: &str, problem: impl Into<String>) -> IndexError {
        IndexError::Spec {
            spec: self.spec.to_string(),
            token: token.to_string(),
            problem: problem.into(),
        }
    }

    /// `token` with `prefix` stripped, parsed as a positive integer.
    fn number(&self, token: &'a str, prefix: &str) -> Result<usize, IndexError> {
        let digits = token
            .strip_prefix(prefix)
            .ok_or_else(|| self.error(token, format!("expected `{prefix}<number>`")))?;
        match digits.parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(self.error(token, format!("`{digits}` is not a positive integer"))),
        }
    }

    /// `a/b/c` as positive integers.
    fn list(&self, token: &'a str, value: &str) -> Result<Vec<usize>, IndexError> {
        value
            .split('/')
            .map(|v| match v.parse::<usize>() {
                Ok(n) if n > 0 => Ok(n),
                _ => Err(self.error(token, format!("`{v}` is not a positive integer"))),
            })
            .collect()
    }

    /// Splits `key=value` tokens.
    fn pairs(&self, body: &'a str) -> Result<Vec<(&'a str, &'a str, &'a str)>, IndexError> {
        body.split(',')
            .map(|token| {
                token
                    .split_once('=')
                    .map(|(k, v)| (token, k, v))
                    .ok_or_else(|| self.error(token, "expected `name=value`"))
            })
            .collect()
    }

    fn ivf(&self, body: &'a str) -> Result<IndexSpec, IndexError> {
        let mut tokens = body.split(',');
        let lists = self.number(tokens.next().unwrap_or(""), "ivf")?;
        let probes_token = tokens
            .next()
            .ok_or_else(|| self.error(body, "missing `np<P>`"))?;
        let probes = self.number(probes_token, "np")?;
        let (mut norope, mut all) = (false, false);
        for token in tokens {
            let flag = match token {
                "norope" => &mut norope,
                "all" => &mut all,
                _ => return Err(self.error(token, "expected `norope` or `all`")),
            };
            if *flag {
                return Err(self.error(token, "given twice"));
            }
            *flag = true;
        }
        if probes > lists {
            return Err(self.error(probes_token, format!("probes more lists than the {lists}")));
        }
        Ok(IndexSpec::Ivf(IvfSpec {
            lists,
            probes,
            norope,
            all,
        }))
    }

    fn hnsw(&self, body: &'a str) -> Result<IndexSpec, IndexError> {
        let tokens: Vec<&str> = body.split(',').collect();
        let (m, ef, efc) = match tokens.as_slice() {
            [m, ef] => (*m, *ef, None),
            [m, ef, efc] => (*m, *ef, Some(*efc)),
            _ => return Err(self.error(body, "expected `hnsw<M>,ef<E>[,efc<C>]`")),
        };
        Ok(IndexSpec::Hnsw(HnswSpec {
            m: self.number(m, "hnsw")?,
            ef_search: self.number(ef, "ef")?,
            ef_construction: match efc {
                Some(t) => self.number(t, "efc")?,
                None => DEFAULT_EF_CONSTRUCTION,
            },
        }))
    }

    fn lsh(&self, body: &'a str) -> Result<IndexSpec, IndexError> {
        let (mut tables, mut bits) = (None, None);
        let (mut min_collisions, mut seed) = (DEFAULT_MIN_COLLISIONS, 0u64);
        for (token, key, value) in self.pairs(body)? {
            let n = || {
                self.number(value, "")
                    .map_err(|_| self.error(token, "not a positive integer"))
            };
            match key {
                "L" => tables = Some(n()?),
                "K" => bits = Some(n()?),
                "min" => min_collisions = n()?,
                "seed" => {
                    seed = value
                        .parse()
                        .map_err(|_| self.error(token, "not an unsigned integer"))?
                }
                _ => return Err(self.error(token, "expected `L=`, `K=`, `min=` or `seed=`")),
            }
        }
        let tables = tables.ok_or_else(|| self.error(body, "missing `L=<tables>`"))?;
        let bits = bits.ok_or_else(|| self.error(body, "missing `K=<bits>`"))?;
        if bits > 32 {
            return Err(self.error(body, "K is at most 32 bits per table"));
        }
        if min_collisions > tables {
            return Err(self.error(body, "min is more than the number of tables"));
        }
        Ok(IndexSpec::Lsh(LshSpec {
            tables,
            bits,
            min_collisions,
            seed,
        }))
    }

    fn saap(&self, body: &'a str) -> Result<IndexSpec, IndexError> {
        let tokens: Vec<&str> = body.split(',').collect();
        let [c, l] = tokens.as_slice() else {
            return Err(self.error(body, "expected `saap<C>,l<P>`"));
        };
        let (centroids, probes) = (self.number(c, "saap")?, self.number(l, "l")?);
        if probes > centroids {
            return Err(self.error(l, format!("visits more buckets than the {centroids}")));
        }
        Ok(IndexSpec::Saap(SaapSpec { centroids, probes }))
    }

    fn hip(&self, body: &'a str) -> Result<IndexSpec, IndexError> {
        let tokens: Vec<&str> = body.split(',').collect();
        let [k, bq, bk] = tokens.as_slice() else {
            return Err(self.error(body, "expected `hip:k<K>,bq<B>,bk<B>`"));
        };
        let spec = HipSpec {
            k: self.number(k, "k")?,
            block_q: self.number(bq, "bq")?,
            block_k: self.number(bk, "bk")?,
        };
        if !spec.k.is_multiple_of(spec.block_k) {
            return Err(self.error(k, "k must be a multiple of the key block size"));
        }
        Ok(IndexSpec::Hip(spec))
    }

    fn ihip(&self, body: &'a str) -> Result<IndexSpec, IndexError> {
        if body == "paper" {
            return Ok(IndexSpec::Ihip(IhipSpec::paper()));
        }
        if let Some(n) = body.strip_suffix('k') {
            let n = self.number(n, "")?;
            return Ok(IndexSpec::Ihip(IhipSpec::final_budget(n * 1024)));
        }
        let mut spec = IhipSpec::paper();
        let mut budgets = None;
        for (token, key, value) in self.pairs(body)? {
            match key {
                "lc" => spec.chunks = self.list(token, value)?,
                "k" => budgets = Some(self.list(token, value)?),
                "refresh" => spec.refresh = self.list(token, value)?,
                _ => {
                    return Err(
                        self.error(token, "expected `lc=`, `k=` or `refresh=` (or a preset)")
                    )
                }
            }
        }
        spec.budgets = budgets.ok_or_else(|| self.error(body, "missing `k=<k1>/<k2>/...`"))?;
        let stages = spec.chunks.len();
        if spec.budgets.len() != stages || spec.refresh.len() != stages {
            return Err(self.error(body, "lc, k and refresh need one entry per stage"));
        }
        if spec.chunks.windows(2).any(|w| w[0] % w[1] != 0) {
            return Err(self.error(body, "each chunk size must be a multiple of the next"));
        }
        if spec.budgets.windows(2).any(|w| w[0] < w[1]) {
            return Err(self.error(body, "stage budgets must not grow"));
        }
        Ok(IndexSpec::Ihip(spec))
    }
}

impl FromStr for IndexSpec {
    type Err = IndexError;

    /// Parses a spec string (see [`GRAMMAR`]).
    ///
    /// ```
    /// use kvdb_index::IndexSpec;
    /// let spec: IndexSpec = "ivf1024,np32,norope".parse().unwrap();
    /// assert_eq!(spec.to_string(), "ivf1024,np32,norope");
    /// assert!("ivf1024".parse::<IndexSpec>().unwrap_err().to_string().contains("np<P>"));
    /// ```
    fn from_str(spec: &str) -> Result<Self, Self::Err> {
        let fields = Fields { spec };
        let s = spec.trim();
        if s == "flat" {
            Ok(Self::Flat)
        } else if let Some(body) = s.strip_prefix("lsh:") {
            fields.lsh(body)
        } else if let Some(body) = s.strip_prefix("hip:") {
            fields.hip(body)
        } else if let Some(body) = s.strip_prefix("ihip:") {
            fields.ihip(body)
        } else if s.starts_with("ivf") {
            fields.ivf(s)
        } else if s.starts_with("hnsw") {
            fields.hnsw(s)
        } else if s.starts_with("saap") {
            fields.saap(s)
        } else {
            Err(fields.error(s, "unknown index kind"))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Canonical spellings round-trip; short forms gain their defaults.
    #[test]
    fn round_trips() {
        for (input, canonical) in [
            ("flat", "flat"),
            ("ivf1024,np32", "ivf1024,np32"),
            ("ivf256,np8,norope,all", "ivf256,np8,norope,all"),
            ("ivf256,np8,all", "ivf256,np8,all"),
            ("hnsw32,ef128", "hnsw32,ef128,efc200"),
            ("hnsw16,ef64,efc100", "hnsw16,ef64,efc100"),
            ("lsh:L=64,K=10", "lsh:L=64,K=10,min=2,seed=0"),
            ("lsh:K=8,L=16,min=3,seed=7", "lsh:L=16,K=8,min=3,seed=7"),
            ("saap1024,l32", "saap1024,l32"),
            ("hip:k512,bq32,bk2", "hip:k512,bq32,bk2"),
            (
                "ihip:paper",
                "ihip:lc=256/32/8,k=32768/8192/2048,refresh=16/8/4",
            ),
            (
                "ihip:3k",
                "ihip:lc=256/32/8,k=49152/12288/3072,refresh=16/8/4",
            ),
            (
                "ihip:lc=64/8,k=1024/256,refresh=8/4",
                "ihip:lc=64/8,k=1024/256,refresh=8/4",
            ),
        ] {
            let spec: IndexSpec = input.parse().unwrap_or_else(|e| panic!("{input}: {e}"));
            assert_eq!(spec.to_string(), canonical, "{input}");
            assert_eq!(canonical.parse::<IndexSpec>().unwrap(), spec, "{canonical}");
        }
    }

    /// Every bad spec is an error naming the bad token and showing the grammar.
    #[test]
    fn errors_name_the_token() {
        for (bad, token) in [
            ("", ""),
            ("ivf", "ivf"),
            ("ivf0,np1", "ivf0"),
            ("ivf16", "ivf16"),
            ("ivf16,np32", "np32"),
            ("ivf16,np4,fast", "fast"),
            ("ivf16,np4,all,all", "all"),
            ("hnsw32", "hnsw32"),
            ("hnsw32,ef", "ef"),
            ("lsh:L=4", "L=4"),
            ("lsh:L=4,K=x", "K=x"),
            ("lsh:L=4,K=40", "L=4,K=40"),
            ("lsh:L=4,K=8,min=5", "L=4,K=8,min=5"),
            ("saap8,l9", "l9"),
            ("hip:k500,bq32,bk64", "k500"),
            (
                "ihip:lc=256/32,k=1/2,refresh=1/1",
                "lc=256/32,k=1/2,refresh=1/1",
            ),
            (
                "ihip:lc=256/30,k=8/2,refresh=1/1",
                "lc=256/30,k=8/2,refresh=1/1",
            ),
            ("ihip:nope", "nope"),
            ("pq16", "pq16"),
        ] {
            let err = bad.parse::<IndexSpec>().expect_err(bad);
            let IndexError::Spec { token: t, .. } = &err else {
                panic!("{bad}: {err:?}");
            };
            assert_eq!(t, token, "{bad}");
            assert!(err.to_string().contains("ivf<C>,np<P>"), "{bad}: {err}");
        }
    }
}
