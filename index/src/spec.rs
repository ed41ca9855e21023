//! [`IndexSpec`]: the typed form of an index spec string, parsed once and printed in one
//! canonical spelling (`Display` round-trips through `FromStr`).

use std::fmt;
use std::str::FromStr;

use crate::IndexError;

/// The grammar shown with every spec error.
pub const GRAMMAR: &str = "\
index specs:
  flat                                   exact top-k over every key
  ivf<C>,np<P>[,hp<H>][,hot<N>][,norope][,all][,fit]
                                         faiss IVF-Flat, C lists, P probed (+H, each head's own);
                                         hot: +N per mille most attended keys; norope: de-roped
                                         keys; all: attend whole lists; fit: route by the
                                         corpus's queries (needs norope)
  hnsw<M>,ef<E>[,efc<C>]                 hnsw_rs graph, M links, ef_search E, ef_construction C
  qgraph<M>,ef<E>                        attention-aware graph (experimental, no default yet): M
                                         links per key from k-means cells and the corpus's
                                         queries, searched with a list of E
  lsh:L=<tables>,K=<bits>[,min=<n>][,seed=<s>]
                                         sign random projections, keys colliding in >= n tables
  saap<C>,l<P>                           SAAP: C k-means buckets, the top-P buckets attended
  hip:k<K>,bq<B>,bk<B>                   HiP hierarchical top-k, K keys, query/key blocks
  ihip:<preset> | ihip:lc=256/32/8,k=<k1>/<k2>/<k3>,refresh=16/8/4
                                         InfiniteHiP multi-stage chunk pruning (presets: paper,
                                         <N>k for a final budget of N*1024 keys)
a kind alone means its default (measured in docs/benchmarks.md, \"Default specs\"):
  ivf = ivf256,np8,hot8,norope,all       hnsw = hnsw16,ef64,efc200
  lsh = lsh:L=64,K=4,min=3,seed=0        saap = saap256,l10
  hip = hip:k256,bq1,bk1                 ihip = ihip:lc=64/16/4,k=1024/256/64,refresh=16/8/4";

/// Every index kind that has a default spec, as a spec names it (and as [`IndexSpec::kind`]
/// returns it). `qgraph` is not among them yet: it has no default that answers the CI needle.
pub const KINDS: [&str; 7] = ["flat", "ivf", "hnsw", "lsh", "saap", "hip", "ihip"];

/// `ivf<C>,np<P>[,hp<H>][,hot<N>][,norope][,all][,fit]`: inverted lists over faiss's flat quantizer, probed
/// by inner product.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct IvfSpec {
    /// Inverted lists (k-means centroids).
    pub lists: usize,
    /// Lists probed per search.
    pub probes: usize,
    /// Lists probed beyond `probes`: each query head's best by its own logit, not probed
    /// yet, taken head by head in turn. The `probes` go to the lists of the group's best
    /// head, so a head whose logits are smaller than another's gets its own lists only so.
    pub head_probes: usize,
    /// Keys taken at every search beside the probed lists, in per mille of the keys: those
    /// the corpus's sampled queries attended most in total ([`crate::QuerySample`]; 0 for
    /// none). Scored with the lists' keys, or with `all` attended beside the whole lists (on
    /// the GPU, one more bucket that every search visits).
    pub hot_permille: usize,
    /// Train and assign the partition on de-roped (pre-RoPE) keys and queries.
    pub norope: bool,
    /// Attend every key of the probed lists instead of their top-k.
    pub all: bool,
    /// Rank the lists by a routing fitted on the corpus's sampled queries (where the
    /// queries' attention mass fell) instead of by centroid; needs `norope`.
    pub fit: bool,
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

/// `qgraph<M>,ef<E>`: an attention-aware graph whose shortcuts come from the corpus's
/// sampled queries ([`crate::QgraphIndex`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct QgraphSpec {
    /// Out-links per key: half to the nearest keys of its cell, the rest query shortcuts.
    pub links: usize,
    /// Result list size while searching (the walk's breadth).
    pub ef_search: usize,
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

impl SaapSpec {
    /// What `saap` alone means ([`IndexSpec::default_of`]); `kvdb saap train` trains
    /// artifacts of its buckets unless told otherwise.
    pub const DEFAULT: Self = Self {
        centroids: 256,
        probes: 10,
    };
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
    /// `ivf<C>,np<P>[,hp<H>][,hot<N>][,norope][,all][,fit]`
    Ivf(IvfSpec),
    /// `hnsw<M>,ef<E>[,efc<C>]`
    Hnsw(HnswSpec),
    /// `qgraph<M>,ef<E>`
    Qgraph(QgraphSpec),
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

/// Upper bounds of every spec field. A spec is a user's string, saved in the manifest and
/// re-parsed on every open: a value past these would either wrap in arithmetic, exhaust
/// memory while building, or be refused by the library underneath (hnsw_rs exits the
/// process above 256 links), so the parser refuses it before anything is saved. Each bound
/// is far above any useful setting.
pub mod limits {
    /// IVF lists and SAAP buckets (k-means centroids).
    pub const MAX_LISTS: usize = 1 << 16;
    /// hnsw links per node: hnsw_rs's own maximum.
    pub const MAX_LINKS: usize = 256;
    /// hnsw candidate lists (`ef`, `efc`).
    pub const MAX_EF: usize = 1 << 16;
    /// LSH tables: each costs 4 bytes per key and one code per search.
    pub const MAX_TABLES: usize = 256;
    /// LSH bits per table (a table's code is a `u32`).
    pub const MAX_BITS: usize = 32;
    /// Keys a hip/ihip stage keeps: 16M, beyond any model's context.
    pub const MAX_BUDGET: usize = 1 << 24;
    /// hip block sizes and ihip chunk sizes, in tokens.
    pub const MAX_BLOCK: usize = 1 << 16;
    /// ihip stages and refresh periods (decode steps).
    pub const MAX_STAGES: usize = 8;
    /// ihip refresh period in decode steps.
    pub const MAX_REFRESH: usize = 1 << 16;
}
use limits::*;

/// What is wrong with a spec: the field as the spec spells it (`np`, `L`, `k`, ...) and the
/// problem.
type Problem = (&'static str, String);

/// `Some(problem)` when `value` is outside `range`.
fn outside(
    field: &'static str,
    value: usize,
    range: std::ops::RangeInclusive<usize>,
) -> Option<Problem> {
    (!range.contains(&value)).then(|| {
        (
            field,
            format!("{value} is not in {}..={}", range.start(), range.end()),
        )
    })
}

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

    /// What an index kind named alone means (`--index ivf`), `None` for an unknown kind.
    ///
    /// Each default was chosen from `kvdb bench` on the default model at 16K and 32K tokens
    /// of text no index was tuned on (docs/benchmarks.md, "Default specs"): the cheapest
    /// setting measured that still answers the CI needle test (not all of them are cheap:
    /// hnsw, lsh and hip score more than 5% of the keys). The parser expands a kind alone to its
    /// default, so a manifest always records the concrete spec a corpus was built with, and a
    /// later change of a default leaves built indexes as they are.
    ///
    /// ```
    /// use kvdb_index::IndexSpec;
    /// let ivf: IndexSpec = "ivf".parse().unwrap();
    /// assert_eq!(Some(ivf.clone()), IndexSpec::default_of("ivf"));
    /// assert_eq!(ivf.to_string().parse::<IndexSpec>().unwrap(), ivf);
    /// ```
    pub fn default_of(kind: &str) -> Option<IndexSpec> {
        Some(match kind {
            "flat" => Self::Flat,
            "ivf" => Self::Ivf(IvfSpec {
                lists: 256,
                probes: 8,
                head_probes: 0,
                hot_permille: 8,
                norope: true,
                all: true,
                fit: false,
            }),
            "hnsw" => Self::Hnsw(HnswSpec {
                m: 16,
                ef_search: 64,
                ef_construction: DEFAULT_EF_CONSTRUCTION,
            }),
            "lsh" => Self::Lsh(LshSpec {
                tables: 64,
                bits: 4,
                min_collisions: 3,
                seed: 0,
            }),
            "saap" => Self::Saap(SaapSpec::DEFAULT),
            "hip" => Self::Hip(HipSpec {
                k: 256,
                block_q: 1,
                block_k: 1,
            }),
            "ihip" => Self::Ihip(IhipSpec {
                chunks: vec![64, 16, 4],
                budgets: vec![1024, 256, 64],
                refresh: vec![16, 8, 4],
            }),
            _ => return None,
        })
    }

    /// Whether a build learns from the corpus's sampled queries ([`crate::QuerySample`]),
    /// which the caller then reads from the store.
    pub fn learns_from_queries(&self) -> bool {
        match self {
            Self::Qgraph(_) => true,
            Self::Ivf(s) => s.fit || s.hot_permille > 0,
            _ => false,
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
            Self::Qgraph(g) => Some(("ef", g.ef_search)),
            _ => None,
        }
    }

    /// Checks every field against its bounds and the others, so that whatever this returns
    /// `Ok` for builds (the parser calls it, and so does every index's constructor, since
    /// the fields are public). The error names the field as the spec spells it.
    pub fn validate(&self) -> Result<(), IndexError> {
        match self.problem() {
            None => Ok(()),
            Some((field, problem)) => Err(IndexError::Spec {
                spec: echoed(&self.to_string()),
                token: field.to_string(),
                problem,
            }),
        }
    }

    fn problem(&self) -> Option<Problem> {
        match self {
            Self::Flat => None,
            Self::Ivf(s) => outside("ivf", s.lists, 1..=MAX_LISTS)
                .or_else(|| {
                    (!(1..=s.lists).contains(&s.probes)).then(|| {
                        (
                            "np",
                            format!("probes {} of the {} lists", s.probes, s.lists),
                        )
                    })
                })
                .or_else(|| {
                    (s.probes + s.head_probes > s.lists).then(|| {
                        (
                            "hp",
                            format!(
                                "probes {} more beside {} of the {} lists",
                                s.head_probes, s.probes, s.lists
                            ),
                        )
                    })
                })
                .or_else(|| {
                    (s.hot_permille > 1000)
                        .then(|| ("hot", format!("{} per mille of the keys", s.hot_permille)))
                }),
            Self::Hnsw(s) => outside("hnsw", s.m, 2..=MAX_LINKS)
                .or_else(|| outside("ef", s.ef_search, 1..=MAX_EF))
                .or_else(|| outside("efc", s.ef_construction, 1..=MAX_EF)),
            Self::Qgraph(s) => outside("qgraph", s.links, 2..=MAX_LINKS)
                .or_else(|| outside("ef", s.ef_search, 1..=MAX_EF)),
            Self::Lsh(s) => outside("L", s.tables, 1..=MAX_TABLES)
                .or_else(|| outside("K", s.bits, 1..=MAX_BITS))
                .or_else(|| {
                    (!(1..=s.tables).contains(&s.min_collisions)).then(|| {
                        (
                            "min",
                            format!(
                                "{} is not between 1 and the number of tables ({})",
                                s.min_collisions, s.tables
                            ),
                        )
                    })
                }),
            Self::Saap(s) => outside("saap", s.centroids, 2..=MAX_LISTS).or_else(|| {
                (!(1..=s.centroids).contains(&s.probes)).then(|| {
                    (
                        "l",
                        format!("visits {} of the {} buckets", s.probes, s.centroids),
                    )
                })
            }),
            Self::Hip(s) => outside("k", s.k, 1..=MAX_BUDGET)
                .or_else(|| outside("bq", s.block_q, 1..=MAX_BLOCK))
                .or_else(|| outside("bk", s.block_k, 1..=MAX_BLOCK))
                .or_else(|| {
                    (!s.k.is_multiple_of(s.block_k)).then(|| {
                        (
                            "k",
                            "k must be a multiple of the key block size".to_string(),
                        )
                    })
                }),
            Self::Ihip(s) => {
                let stages = s.chunks.len();
                let each = |field, values: &[usize], most| {
                    values.iter().find_map(|&v| outside(field, v, 1..=most))
                };
                outside("lc", stages, 1..=MAX_STAGES)
                    .or_else(|| {
                        (s.budgets.len() != stages || s.refresh.len() != stages).then(|| {
                            (
                                "lc",
                                "lc, k and refresh need one entry per stage".to_string(),
                            )
                        })
                    })
                    .or_else(|| each("lc", &s.chunks, MAX_BLOCK))
                    .or_else(|| each("k", &s.budgets, MAX_BUDGET))
                    .or_else(|| each("refresh", &s.refresh, MAX_REFRESH))
                    .or_else(|| {
                        s.chunks.windows(2).any(|w| w[0] % w[1] != 0).then(|| {
                            (
                                "lc",
                                "each chunk size must be a multiple of the next".to_string(),
                            )
                        })
                    })
                    .or_else(|| {
                        s.budgets
                            .windows(2)
                            .any(|w| w[0] < w[1])
                            .then(|| ("k", "stage budgets must not grow".to_string()))
                    })
            }
        }
    }

    /// The name of the index kind (`flat`, `ivf`, ...).
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Flat => "flat",
            Self::Ivf(_) => "ivf",
            Self::Hnsw(_) => "hnsw",
            Self::Qgraph(_) => "qgraph",
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
                if s.head_probes > 0 {
                    write!(f, ",hp{}", s.head_probes)?;
                }
                if s.hot_permille > 0 {
                    write!(f, ",hot{}", s.hot_permille)?;
                }
                if s.norope {
                    write!(f, ",norope")?;
                }
                if s.all {
                    write!(f, ",all")?;
                }
                if s.fit {
                    write!(f, ",fit")?;
                }
                Ok(())
            }
            Self::Hnsw(s) => write!(f, "hnsw{},ef{},efc{}", s.m, s.ef_search, s.ef_construction),
            Self::Qgraph(s) => write!(f, "qgraph{},ef{}", s.links, s.ef_search),
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

/// Most characters of a user's spec or token repeated in an error: a spec is user input,
/// and an error must not echo a 100 KB string back.
const ECHOED_CHARS: usize = 80;

/// `text`, cut to [`ECHOED_CHARS`] characters with a note of its length when longer.
fn echoed(text: &str) -> String {
    if text.chars().count() <= ECHOED_CHARS {
        return text.to_string();
    }
    let head: String = text.chars().take(ECHOED_CHARS).collect();
    format!("{head}… ({} bytes)", text.len())
}

/// Parses the fields of one spec, naming the bad token in its errors.
struct Fields<'a> {
    spec: &'a str,
}

impl<'a> Fields<'a> {
    fn error(&self, token: &str, problem: impl Into<String>) -> IndexError {
        IndexError::Spec {
            spec: echoed(self.spec),
            token: echoed(token),
            problem: problem.into(),
        }
    }

    /// `spec` after [`IndexSpec::validate`]'s checks, an error naming the token that spells
    /// the bad field (`tokens` pairs fields with their tokens; `whole` names the rest).
    fn checked(
        &self,
        spec: IndexSpec,
        whole: &str,
        tokens: &[(&'static str, &str)],
    ) -> Result<IndexSpec, IndexError> {
        match spec.problem() {
            None => Ok(spec),
            Some((field, problem)) => {
                let token = tokens
                    .iter()
                    .find(|(f, _)| *f == field)
                    .map_or(whole, |(_, t)| *t);
                Err(self.error(token, problem))
            }
        }
    }

    /// `token` with `prefix` stripped, parsed as a positive integer.
    fn number(&self, token: &'a str, prefix: &str) -> Result<usize, IndexError> {
        let digits = token
            .strip_prefix(prefix)
            .ok_or_else(|| self.error(token, format!("expected `{prefix}<number>`")))?;
        self.positive(token, digits)
    }

    /// `digits` as a positive integer (too large for a `usize` is an error too).
    fn positive(&self, token: &str, digits: &str) -> Result<usize, IndexError> {
        match digits.parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => Err(self.error(
                token,
                format!("`{}` is not a positive integer", echoed(digits)),
            )),
        }
    }

    /// `a/b/c` as positive integers.
    fn list(&self, token: &'a str, value: &str) -> Result<Vec<usize>, IndexError> {
        value.split('/').map(|v| self.positive(token, v)).collect()
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
        let lists_token = tokens.next().unwrap_or("");
        let lists = self.number(lists_token, "ivf")?;
        let probes_token = tokens
            .next()
            .ok_or_else(|| self.error(body, "missing `np<P>`"))?;
        let probes = self.number(probes_token, "np")?;
        let (mut norope, mut all, mut fit) = (false, false, false);
        let (mut head_probes, mut hot) = (None, None);
        for token in tokens {
            let numbered = match token {
                t if t.starts_with("hp") => Some((&mut head_probes, "hp")),
                t if t.starts_with("hot") => Some((&mut hot, "hot")),
                _ => None,
            };
            if let Some((slot, prefix)) = numbered {
                if slot.is_some() {
                    return Err(self.error(token, "given twice"));
                }
                *slot = Some((token, self.number(token, prefix)?));
                continue;
            }
            let flag = match token {
                "norope" => &mut norope,
                "all" => &mut all,
                "fit" => &mut fit,
                _ => {
                    return Err(self.error(
                        token,
                        "expected `hp<H>`, `hot<N>`, `norope`, `all` or `fit`",
                    ))
                }
            };
            if *flag {
                return Err(self.error(token, "given twice"));
            }
            *flag = true;
        }
        if fit && !norope {
            return Err(self.error(
                "fit",
                "needs `norope` (routing is fitted on pre-RoPE queries)",
            ));
        }
        if let Some((token, _)) = head_probes.filter(|_| all || fit) {
            return Err(self.error(
                token,
                "ranks lists by each head's logit: not with `all` (routed on the GPU by the \
                 group) or `fit`",
            ));
        }
        let (hp_token, head_probes) = head_probes.unwrap_or(("", 0));
        let (hot_token, hot_permille) = hot.unwrap_or(("", 0));
        let spec = IndexSpec::Ivf(IvfSpec {
            lists,
            probes,
            head_probes,
            hot_permille,
            norope,
            all,
            fit,
        });
        self.checked(
            spec,
            body,
            &[
                ("ivf", lists_token),
                ("np", probes_token),
                ("hp", hp_token),
                ("hot", hot_token),
            ],
        )
    }

    fn hnsw(&self, body: &'a str) -> Result<IndexSpec, IndexError> {
        let tokens: Vec<&str> = body.split(',').collect();
        let (m, ef, efc) = match tokens.as_slice() {
            [m, ef] => (*m, *ef, None),
            [m, ef, efc] => (*m, *ef, Some(*efc)),
            _ => return Err(self.error(body, "expected `hnsw<M>,ef<E>[,efc<C>]`")),
        };
        let spec = IndexSpec::Hnsw(HnswSpec {
            m: self.number(m, "hnsw")?,
            ef_search: self.number(ef, "ef")?,
            ef_construction: match efc {
                Some(t) => self.number(t, "efc")?,
                None => DEFAULT_EF_CONSTRUCTION,
            },
        });
        self.checked(
            spec,
            body,
            &[("hnsw", m), ("ef", ef), ("efc", efc.unwrap_or(body))],
        )
    }

    fn qgraph(&self, body: &'a str) -> Result<IndexSpec, IndexError> {
        let tokens: Vec<&str> = body.split(',').collect();
        let [m, ef] = tokens.as_slice() else {
            return Err(self.error(body, "expected `qgraph<M>,ef<E>`"));
        };
        let spec = IndexSpec::Qgraph(QgraphSpec {
            links: self.number(m, "qgraph")?,
            ef_search: self.number(ef, "ef")?,
        });
        self.checked(spec, body, &[("qgraph", m), ("ef", ef)])
    }

    fn lsh(&self, body: &'a str) -> Result<IndexSpec, IndexError> {
        let (mut tables, mut bits) = (None, None);
        let (mut min_collisions, mut seed) = (DEFAULT_MIN_COLLISIONS, 0u64);
        let mut tokens = Vec::new();
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
            tokens.push((token, key));
        }
        let spec = IndexSpec::Lsh(LshSpec {
            tables: tables.ok_or_else(|| self.error(body, "missing `L=<tables>`"))?,
            bits: bits.ok_or_else(|| self.error(body, "missing `K=<bits>`"))?,
            min_collisions,
            seed,
        });
        let named = |field: &'static str| {
            let token = tokens.iter().find(|(_, k)| *k == field).map(|(t, _)| *t);
            (field, token.unwrap_or(body))
        };
        self.checked(spec, body, &[named("L"), named("K"), named("min")])
    }

    fn saap(&self, body: &'a str) -> Result<IndexSpec, IndexError> {
        let tokens: Vec<&str> = body.split(',').collect();
        let [c, l] = tokens.as_slice() else {
            return Err(self.error(body, "expected `saap<C>,l<P>`"));
        };
        let spec = IndexSpec::Saap(SaapSpec {
            centroids: self.number(c, "saap")?,
            probes: self.number(l, "l")?,
        });
        self.checked(spec, body, &[("saap", c), ("l", l)])
    }

    fn hip(&self, body: &'a str) -> Result<IndexSpec, IndexError> {
        let tokens: Vec<&str> = body.split(',').collect();
        let [k, bq, bk] = tokens.as_slice() else {
            return Err(self.error(body, "expected `hip:k<K>,bq<B>,bk<B>`"));
        };
        let spec = IndexSpec::Hip(HipSpec {
            k: self.number(k, "k")?,
            block_q: self.number(bq, "bq")?,
            block_k: self.number(bk, "bk")?,
        });
        self.checked(spec, body, &[("k", k), ("bq", bq), ("bk", bk)])
    }

    fn ihip(&self, body: &'a str) -> Result<IndexSpec, IndexError> {
        if body == "paper" {
            return Ok(IndexSpec::Ihip(IhipSpec::paper()));
        }
        if let Some(n) = body.strip_suffix('k') {
            let n = self.number(n, "")?;
            // The first stage keeps 16 times the final budget (`final_budget`).
            let most = MAX_BUDGET / 16 / 1024;
            if n > most {
                return Err(self.error(body, format!("{n}k is more than {most}k")));
            }
            return Ok(IndexSpec::Ihip(IhipSpec::final_budget(n * 1024)));
        }
        let mut spec = IhipSpec::paper();
        let mut budgets = None;
        let mut tokens = Vec::new();
        for (token, key, value) in self.pairs(body)? {
            let field = match key {
                "lc" => {
                    spec.chunks = self.list(token, value)?;
                    "lc"
                }
                "k" => {
                    budgets = Some(self.list(token, value)?);
                    "k"
                }
                "refresh" => {
                    spec.refresh = self.list(token, value)?;
                    "refresh"
                }
                _ => {
                    return Err(
                        self.error(token, "expected `lc=`, `k=` or `refresh=` (or a preset)")
                    )
                }
            };
            tokens.push((field, token));
        }
        spec.budgets = budgets.ok_or_else(|| self.error(body, "missing `k=<k1>/<k2>/...`"))?;
        self.checked(IndexSpec::Ihip(spec), body, &tokens)
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
        if let Some(default) = Self::default_of(s) {
            Ok(default)
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
        } else if s.starts_with("qgraph") {
            fields.qgraph(s)
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
            ("ivf256,np8,norope,all,hot10", "ivf256,np8,hot10,norope,all"),
            ("ivf256,np8,all", "ivf256,np8,all"),
            ("ivf256,np8,fit,all,norope", "ivf256,np8,norope,all,fit"),
            ("ivf256,np5,norope,hp2", "ivf256,np5,hp2,norope"),
            ("ivf256,np5,norope,hot10", "ivf256,np5,hot10,norope"),
            ("ivf256,np5,fit,hot10,norope", "ivf256,np5,hot10,norope,fit"),
            ("ivf256,np5,hot10,hp2,norope", "ivf256,np5,hp2,hot10,norope"),
            ("hnsw32,ef128", "hnsw32,ef128,efc200"),
            ("hnsw16,ef64,efc100", "hnsw16,ef64,efc100"),
            ("qgraph16,ef32", "qgraph16,ef32"),
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

    /// Each kind alone means its default: a valid spec of that kind, printed in full (so
    /// the manifest records it) and read back as itself.
    #[test]
    fn kinds_alone_mean_their_defaults() {
        for kind in KINDS {
            let spec: IndexSpec = kind.parse().unwrap_or_else(|e| panic!("{kind}: {e}"));
            assert_eq!(spec.kind(), kind);
            assert_eq!(Some(spec.clone()), IndexSpec::default_of(kind));
            spec.validate().unwrap();
            assert_eq!(spec.to_string().parse::<IndexSpec>().unwrap(), spec);
            assert_eq!(format!(" {kind} ").parse::<IndexSpec>().unwrap(), spec);
        }
        for kind in &KINDS[1..] {
            let default = IndexSpec::default_of(kind).unwrap();
            let line = format!("{kind} = {default}");
            assert!(GRAMMAR.contains(&line), "the grammar lacks `{line}`");
        }
        assert_eq!(IndexSpec::default_of("pq"), None);
        assert!("ivf ".repeat(2).parse::<IndexSpec>().is_err());
    }

    /// Every bad spec is an error naming the bad token and showing the grammar.
    #[test]
    fn errors_name_the_token() {
        for (bad, token) in [
            ("", ""),
            ("ivf,np4", "ivf"),
            ("ivf0,np1", "ivf0"),
            ("ivf16", "ivf16"),
            ("ivf16,np32", "np32"),
            ("ivf16,np4,fast", "fast"),
            ("ivf16,np4,all,all", "all"),
            ("ivf16,np4,all,fit", "fit"),
            ("ivf16,np4,hp0", "hp0"),
            ("ivf16,np4,hp2,hp2", "hp2"),
            ("ivf16,np14,hp3", "hp3"),
            ("ivf16,np4,hp2,norope,all", "hp2"),
            ("ivf16,np4,norope,fit,hp2", "hp2"),
            ("ivf16,np4,hot0", "hot0"),
            ("ivf16,np4,hot5,hot5", "hot5"),
            ("ivf16,np4,hot1001", "hot1001"),
            ("hnsw32", "hnsw32"),
            ("hnsw32,ef", "ef"),
            ("lsh:L=4", "L=4"),
            ("lsh:L=4,K=x", "K=x"),
            ("lsh:L=4,K=40", "K=40"),
            ("lsh:L=4,K=8,min=5", "min=5"),
            ("saap8,l9", "l9"),
            ("hip:k500,bq32,bk64", "k500"),
            ("ihip:lc=256/32,k=1/2,refresh=1/1", "k=1/2"),
            ("ihip:lc=256/30,k=8/2,refresh=1/1", "lc=256/30"),
            ("ihip:lc=256/32,k=8/2,refresh=1", "lc=256/32"),
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

    /// Values that wrapped or built for minutes before the bounds: each is refused by the
    /// parser, naming its token, so no such spec reaches a manifest.
    #[test]
    fn out_of_bounds_values_are_refused() {
        for (bad, token) in [
            ("ihip:99999999999999999k", "99999999999999999k"),
            ("ihip:18014398509481984k", "18014398509481984k"),
            ("ihip:1025k", "1025k"),
            (
                "ihip:lc=256/32,k=99999999999/8,refresh=1/1",
                "k=99999999999/8",
            ),
            (
                "ihip:lc=8/8/8/8/8/8/8/8/8,k=1/1/1/1/1/1/1/1/1,refresh=1/1/1/1/1/1/1/1/1",
                "lc=8/8/8/8/8/8/8/8/8",
            ),
            (
                "ivf99999999999999999999999,np1",
                "ivf99999999999999999999999",
            ),
            ("ivf65537,np1", "ivf65537"),
            ("hnsw1,ef1", "hnsw1"),
            ("qgraph1,ef8", "qgraph1"),
            ("qgraph16", "qgraph16"),
            ("hnsw257,ef1", "hnsw257"),
            ("hnsw16,ef99999999", "ef99999999"),
            ("hnsw16,ef64,efc99999999", "efc99999999"),
            ("lsh:L=99999,K=8", "L=99999"),
            (
                "lsh:L=8,K=8,seed=99999999999999999999999",
                "seed=99999999999999999999999",
            ),
            ("saap1,l1", "saap1"),
            ("hip:k99999999999,bq1,bk1", "k99999999999"),
            ("hip:k65536,bq99999999,bk1", "bq99999999"),
        ] {
            let err = bad.parse::<IndexSpec>().expect_err(bad);
            let IndexError::Spec { token: t, .. } = &err else {
                panic!("{bad}: {err:?}");
            };
            assert_eq!(t, token, "{bad}: {err}");
        }
        // The largest values allowed still parse and round-trip.
        for good in [
            "ihip:1024k",
            "ivf65536,np65536",
            "hnsw256,ef65536,efc65536",
            "lsh:L=256,K=32,min=256,seed=18446744073709551615",
            "hip:k16777216,bq65536,bk65536",
        ] {
            let spec: IndexSpec = good.parse().unwrap_or_else(|e| panic!("{good}: {e}"));
            assert_eq!(spec.to_string().parse::<IndexSpec>().unwrap(), spec);
            spec.validate().unwrap();
        }
    }

    /// A spec built in code is held to the same bounds as a parsed one.
    #[test]
    fn validate_checks_specs_built_in_code() {
        let bad = IndexSpec::Ihip(IhipSpec::final_budget(MAX_BUDGET));
        assert!(bad.validate().is_err());
        let bad = IndexSpec::Lsh(LshSpec {
            tables: 4,
            bits: 8,
            min_collisions: 0,
            seed: 0,
        });
        assert!(bad.validate().is_err());
        assert!(IndexSpec::Ihip(IhipSpec::paper()).validate().is_ok());
    }

    /// An error repeats at most a bounded prefix of what the user typed.
    #[test]
    fn errors_do_not_echo_huge_specs() {
        // Beside the grammar every error shows.
        let most = GRAMMAR.len() + 500;
        let huge = format!("ivf{}", "9".repeat(100_000));
        let err = huge.parse::<IndexSpec>().unwrap_err().to_string();
        assert!(err.len() < most, "{} bytes", err.len());
        let huge = "x".repeat(100_000);
        assert!(huge.parse::<IndexSpec>().unwrap_err().to_string().len() < most);
    }
}
