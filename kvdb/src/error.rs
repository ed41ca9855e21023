//! The engine's typed errors: each says what went wrong with which corpus, file or store, and
//! what to do about it where there is something to do.

use std::path::PathBuf;

/// Errors of the store, ingest and queries.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// No store at this path (readers never create one).
    #[error("no kvdb store at {path}: create one with `kvdb ingest --store {path} ...`")]
    StoreMissing {
        /// The path given.
        path: PathBuf,
    },
    /// Another process holds the store for writing.
    #[error(
        "the store {path} is in use by another kvdb process (an ingest or a server); \
         readers such as `kvdb ask` still work, writers must wait until it finishes"
    )]
    StoreBusy {
        /// The store.
        path: PathBuf,
    },
    /// A long-running owner (a `kvdb serve`) holds the store for writing and said so.
    #[error(
        "the store {path} is owned by {owner}: write to it through that server's HTTP API \
         (or stop the server first); readers such as `kvdb ask` still work"
    )]
    StoreOwned {
        /// The store.
        path: PathBuf,
        /// Who owns it, as the owner described itself.
        owner: String,
    },
    /// The caller stopped an ingest or index update at a commit point.
    #[error(
        "stopped at a commit point: corpus `{corpus}` keeps what was committed ({tokens} tokens)"
    )]
    Cancelled {
        /// The corpus.
        corpus: String,
        /// Its committed tokens when it stopped.
        tokens: usize,
    },
    /// The store was written by a different format version of kvdb.
    #[error(
        "the store {path} has format version {found}, this kvdb reads version {expected}: \
         use a matching kvdb or ingest again into a new store"
    )]
    FormatVersion {
        /// The store.
        path: PathBuf,
        /// Version found.
        found: u32,
        /// Version this build reads.
        expected: u32,
    },
    /// CUDA was asked for in a build without it.
    #[error(
        "this kvdb was built without GPU support: rebuild with `--features gpu` \
         (`cargo build --release --features gpu`) or use `--device cpu`"
    )]
    NoGpuSupport,
    /// A corpus's retrieval layers do not fit the GPU's free memory.
    #[error(
        "corpus `{corpus}`'s retrieval layers take {needed} bytes on the GPU (with room for a \
         routed index's lists) and {free} are free: \
         keep them in host memory behind a GPU cache (`--gpu-kv host`, which `auto` chooses \
         when they do not fit) or ask with `--device cpu`"
    )]
    GpuMemory {
        /// The corpus.
        corpus: String,
        /// Bytes its keys and values take there, with the room a routed index's lists and
        /// bucket map take.
        needed: usize,
        /// Bytes free on the device.
        free: usize,
    },
    /// The host has too little memory available to pin one more of a corpus's retrieval
    /// layers (pinned memory is never paged out: the kernel would kill the process instead).
    #[error(
        "corpus `{corpus}` keeps {layers} retrieval layers in pinned host memory; {pinned} are \
         pinned, the next needs {needed} bytes and the host has {available} available, \
         {reserve} of which are left to the rest of the system (a store on a tmpfs takes from \
         it): free host memory, keep more layers on the GPU (`--gpu-kv auto` or \
         `split:SIZE`), or ask with `--device cpu`"
    )]
    HostMemory {
        /// The corpus.
        corpus: String,
        /// Layers to be kept in host memory.
        layers: usize,
        /// Layers pinned before this one (released with the error).
        pinned: usize,
        /// Bytes the next layer takes.
        needed: usize,
        /// Bytes of host memory available.
        available: usize,
        /// Bytes that must stay available besides.
        reserve: usize,
    },
    /// Full attention on a GPU over a corpus kept in host memory.
    #[error(
        "full attention reads every key of corpus `{corpus}`, whose keys and values are (some \
         layers' or all) in host memory: ask with retrieval (an index), keep the corpus on the \
         GPU (`--gpu-kv resident`, where it fits) or use `--device cpu`"
    )]
    FullAttentionFromHost {
        /// The corpus.
        corpus: String,
    },
    /// A step selected more blocks of a layer than its GPU block cache holds.
    #[error(
        "layer {layer} of corpus `{corpus}` selected {needed} blocks of its keys in one step and \
         its GPU block cache holds {slots}: give the caches more memory (`--gpu-kv host:SIZE`), \
         read the rows in place without them (`--gpu-kv host:0`) or retrieve fewer keys \
         (`--k`)"
    )]
    GpuCacheTooSmall {
        /// The corpus.
        corpus: String,
        /// The layer.
        layer: usize,
        /// Distinct blocks the step needed.
        needed: usize,
        /// Blocks the layer's cache holds.
        slots: usize,
    },
    /// A layer's GPU block cache could not be allocated when a question first needed it.
    #[error(
        "layer {layer} of corpus `{corpus}` needs {bytes} bytes of GPU memory for its block \
         cache and {free} are free now: give the caches less memory (`--gpu-kv host:SIZE`), \
         read the rows in place without them (`--gpu-kv host:0`) or ask with an index routed \
         on the GPU (`ivf…,norope,all`, saap), which needs no cache"
    )]
    GpuCacheMemory {
        /// The corpus.
        corpus: String,
        /// The layer.
        layer: usize,
        /// Bytes the cache takes.
        bytes: usize,
        /// Bytes free on the device.
        free: usize,
    },
    /// A query option the GPU path does not have yet.
    #[error("{what} is not available on the GPU yet: use `--device cpu` for it")]
    NotOnGpu {
        /// The option.
        what: &'static str,
    },
    /// No corpus of this name.
    #[error("no corpus `{name}` in the store{}", available_list(.available))]
    CorpusMissing {
        /// The name asked for.
        name: String,
        /// The corpora the store has.
        available: Vec<String>,
    },
    /// A corpus name that cannot be used.
    #[error(
        "`{name}` is not a valid corpus name: use 1 to 64 letters, digits, `-`, `_` or `.`, \
         starting with a letter or digit"
    )]
    InvalidCorpusName {
        /// The name given.
        name: String,
    },
    /// The corpus was ingested with another model.
    #[error(
        "corpus `{corpus}` was ingested with model {expected_name} (sha256 {expected}); the \
         model given has sha256 {found}: pass `--model` with the corpus's model"
    )]
    ModelMismatch {
        /// The corpus.
        corpus: String,
        /// The model the corpus records.
        expected_name: String,
        /// Its hash.
        expected: String,
        /// The hash of the model given.
        found: String,
    },
    /// An input file or folder cannot be ingested.
    #[error("{path}: {reason}")]
    Document {
        /// The file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// The corpus (plus what is being added) would not fit the model's context.
    #[error(
        "corpus `{corpus}` would hold {tokens} tokens with {what}, more than the model's \
         context of {context} tokens"
    )]
    ContextOverflow {
        /// The corpus.
        corpus: String,
        /// What was being added.
        what: String,
        /// Tokens it would hold.
        tokens: usize,
        /// The model's context length.
        context: usize,
    },
    /// An interrupted document is pending and is not among the inputs.
    #[error(
        "corpus `{corpus}` has an interrupted document `{title}` ({done} of {total} tokens \
         stored); run the ingest again with that file to finish it"
    )]
    Interrupted {
        /// The corpus.
        corpus: String,
        /// The pending document's title.
        title: String,
        /// Tokens of it stored.
        done: usize,
        /// Its length in tokens.
        total: usize,
    },
    /// The corpus has no index of this spec.
    #[error(
        "corpus `{corpus}` has no index `{spec}` (it has: {})",
        available.join(", ")
    )]
    IndexMissing {
        /// The corpus.
        corpus: String,
        /// The spec asked for (canonical).
        spec: String,
        /// The specs it has.
        available: Vec<String>,
    },
    /// Removing the only index of a corpus would leave queries without a default.
    #[error("`{spec}` is the only index of corpus `{corpus}`: add another before removing it")]
    LastIndex {
        /// The corpus.
        corpus: String,
        /// Its only spec.
        spec: String,
    },
    /// An index could not be built; nothing of it was saved.
    #[error("index `{spec}` of corpus `{corpus}` could not be built, nothing of it was saved{}: {source}",
        if *.dropped { " and it is no longer listed" } else { "" })]
    IndexBuild {
        /// The corpus.
        corpus: String,
        /// The spec.
        spec: String,
        /// Whether the spec had been listed (by an older kvdb, or a corpus created with it
        /// over HTTP) and was taken off the list, so the corpus does not stay stuck on it.
        dropped: bool,
        /// Why.
        #[source]
        source: Box<Error>,
    },
    /// A prompt, question or text with nothing in it.
    #[error("the {what} is empty{hint}")]
    EmptyInput {
        /// What was empty.
        what: &'static str,
        /// What to do about it (with its leading punctuation), or nothing.
        hint: &'static str,
    },
    /// A prompt template without the place for the question.
    #[error("the prompt template has no `{{question}}` placeholder")]
    TemplatePlaceholder,
    /// Text that does not fit in the model's context after the corpus.
    #[error(
        "the {what} has {tokens} tokens; after the corpus's {corpus_tokens} tokens the \
         model's context of {context} leaves room for at most {room}"
    )]
    TooLongForContext {
        /// What was too long.
        what: &'static str,
        /// Its tokens.
        tokens: usize,
        /// The corpus's tokens.
        corpus_tokens: usize,
        /// The model's context length.
        context: usize,
        /// Tokens that would fit.
        room: usize,
    },
    /// A corpus that exists but holds no tokens to query.
    #[error("corpus `{corpus}` holds no tokens yet: ingest documents first")]
    CorpusEmpty {
        /// The corpus.
        corpus: String,
    },
    /// Estimating unvisited buckets with an index that has no buckets.
    #[error("`{spec}` is not a bucket index: only ivf and saap can estimate unvisited buckets")]
    NotBucketIndex {
        /// The index asked for.
        spec: String,
    },
    /// No SAAP artifact for this model and bucket count.
    #[error(
        "no SAAP artifact with {centroids} buckets for this model at {}: train one with \
         `kvdb saap train --centroids {centroids} --out FILE TEXT...` (which registers it) or \
         name one with --saap FILE",
        .path.display()
    )]
    SaapArtifactMissing {
        /// Where it was looked for.
        path: PathBuf,
        /// The buckets the spec asks for.
        centroids: usize,
    },
    /// A SAAP artifact that does not fit the index asked for.
    #[error("{}: {problem}", .path.display())]
    SaapArtifactMismatch {
        /// The artifact.
        path: PathBuf,
        /// How it does not fit.
        problem: String,
    },
    /// More indexes than a corpus can list.
    #[error("corpus `{corpus}` would have {count} indexes, more than the {max} it can list")]
    TooManyIndexes {
        /// The corpus.
        corpus: String,
        /// Indexes it would have.
        count: usize,
        /// The most it can list.
        max: usize,
    },
    /// A saved index is behind the corpus and cannot be rebuilt where it is read.
    #[error(
        "the {spec} index of layer {layer} KV head {head} is not saved for these {tokens} \
         tokens yet: bring the corpus's indexes up to date (`kvdb index add --corpus {corpus} \
         {spec}`, or POST /v1/corpora/{corpus}/indexes to a server)"
    )]
    IndexNotSaved {
        /// The corpus.
        corpus: String,
        /// The index.
        spec: String,
        /// Where it is missing.
        layer: usize,
        /// Its KV head.
        head: usize,
        /// The corpus's tokens.
        tokens: usize,
    },
    /// SAAP training with drills that leave no room for the text.
    #[error(
        "{drills} drills take about {drill_tokens} of the {budget} training tokens, leaving \
         too few for the text: plant fewer drills or train on more tokens"
    )]
    TooManyDrills {
        /// Drills asked for.
        drills: usize,
        /// Tokens they take.
        drill_tokens: usize,
        /// Training tokens.
        budget: usize,
    },
    /// SAAP training cannot go on with what it was given (too little text, too few keys).
    #[error("saap training: {0}")]
    SaapTraining(String),
    /// Training for retrieval layers on a model that has none.
    #[error("the model has no retrieval layers")]
    NoRetrievalLayers,
    /// The caller stopped a query while it was answering (an HTTP client went away).
    #[error("the query was stopped by its caller")]
    Abandoned,
    /// A broken invariant of kvdb itself: a bug, reported as neither the user's mistake nor
    /// a damaged store.
    #[error("internal error (a bug in kvdb): {0}")]
    Internal(String),
    /// A write-ahead log file of the store is damaged, so that opening the store would drop
    /// committed data; the store was left as it was.
    #[error(
        "the store's write-ahead log is damaged at {file}: {damage}. Nothing was changed: kvdb \
         refused to open the store {store} because recovering it would drop committed data. \
         To recover, restore the folder {store} from a backup or copy made before the damage \
         (kvdb has no snapshot command yet), or ingest the documents again into a new store"
    )]
    WalDamaged {
        /// The store.
        store: PathBuf,
        /// The damaged log file (the store's folder when no file could be singled out).
        file: PathBuf,
        /// What is wrong, and where.
        damage: String,
        /// RocksDB's error, when its recovery found the damage (a last record lost whole
        /// passes RocksDB's recovery and is caught by kvdb's commit note instead).
        #[source]
        source: Option<rocksdb::Error>,
    },
    /// Stored data that does not decode (a damaged store or a bug).
    #[error("the store is damaged: {0}")]
    Corrupt(String),
    /// RocksDB failed.
    #[error("store: {0}")]
    Rocks(#[from] rocksdb::Error),
    /// The model failed.
    #[error(transparent)]
    Model(kvdb_model::ModelError),
    /// Tensor code failed.
    #[error(transparent)]
    Candle(#[from] candle_core::Error),
    /// Retrieval attention failed.
    #[error(transparent)]
    Attention(kvdb_attention::AttentionError),
    /// An index failed.
    #[error(transparent)]
    Index(#[from] kvdb_index::IndexError),
    /// An I/O error outside the store.
    #[error("{context}: {source}")]
    Io {
        /// What was being done.
        context: String,
        /// The error.
        source: std::io::Error,
    },
}

/// kvdb's own error when `source` is one (raised by kvdb's code that another crate called
/// back: attention inside the model's forward pass, keys read for the attention crate), else
/// `wrap`ped as the other crate's error.
fn ours_or(
    source: Box<dyn std::error::Error + Send + Sync>,
    wrap: impl FnOnce(Box<dyn std::error::Error + Send + Sync>) -> Error,
) -> Error {
    match source.downcast::<Error>() {
        Ok(ours) => *ours,
        Err(other) => wrap(other),
    }
}

impl From<kvdb_model::ModelError> for Error {
    fn from(e: kvdb_model::ModelError) -> Self {
        match e {
            kvdb_model::ModelError::BackendFailed { layer, source } => ours_or(source, |source| {
                Error::Model(kvdb_model::ModelError::BackendFailed { layer, source })
            }),
            e => Error::Model(e),
        }
    }
}

impl From<kvdb_attention::AttentionError> for Error {
    fn from(e: kvdb_attention::AttentionError) -> Self {
        match e {
            kvdb_attention::AttentionError::Source(source) => ours_or(source, |source| {
                Error::Attention(kvdb_attention::AttentionError::Source(source))
            }),
            e => Error::Attention(e),
        }
    }
}

fn available_list(available: &[String]) -> String {
    if available.is_empty() {
        " (it has none yet)".to_string()
    } else {
        format!("; it has: {}", available.join(", "))
    }
}

/// The engine's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
