//! The models the server may run: GGUF files in one folder (`$KVDB_HOME/models`), named by
//! file name only (never a path), each loaded once and shared by every corpus and request
//! that uses it. A corpus names its model by sha256, so files are hashed once (again only
//! when their size or modification time changes).

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use kvdb::store::CorpusManifest;
use kvdb::{ComputeDevice, LoadedModel};
use kvdb_model::LoadOptions;

use crate::error::{echo, ApiError, ApiResult};

/// The model folder and what was loaded from it.
#[derive(Debug)]
pub(crate) struct Models {
    dir: PathBuf,
    /// Where models run their forward passes (ingest; queries' sessions run on the CPU).
    device: ComputeDevice,
    /// Loaded models by sha256. Held while loading, so a model loads once however many
    /// requests ask for it at the same time.
    loaded: Mutex<HashMap<String, Arc<LoadedModel>>>,
    /// File hashes by path, with the size and modification time they were computed at.
    hashes: Mutex<HashMap<PathBuf, (u64, SystemTime, String)>>,
}

impl Models {
    pub(crate) fn new(dir: PathBuf, device: ComputeDevice) -> Self {
        Self {
            dir,
            device,
            loaded: Mutex::default(),
            hashes: Mutex::default(),
        }
    }

    /// The GGUF files of the folder, by name.
    pub(crate) fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(&self.dir)
            .into_iter()
            .flatten()
            .flatten()
            .filter_map(|e| e.file_name().into_string().ok())
            .filter(|n| n.ends_with(".gguf"))
            .collect();
        names.sort();
        names
    }

    /// The model file `name` (`None`: the default model), loaded. Names are file names in
    /// the folder: anything with a path separator or a leading dot is refused.
    pub(crate) fn by_name(&self, name: Option<&str>) -> ApiResult<Arc<LoadedModel>> {
        let name = name.unwrap_or(kvdb_model::fetch::DEFAULT_MODEL_FILE);
        let plain = Path::new(name).file_name().and_then(|n| n.to_str()) == Some(name);
        if !plain || name.starts_with('.') || name.is_empty() {
            return Err(ApiError::invalid(format!(
                "`{}` is not a model name: name a file of the server's model folder, \
                 e.g. `{}`",
                echo(name),
                kvdb_model::fetch::DEFAULT_MODEL_FILE
            )));
        }
        let path = self.dir.join(name);
        if !path.is_file() {
            return Err(ApiError::invalid(format!(
                "no model `{}` in the server's model folder; it has: {}",
                echo(name),
                list(&self.names())
            )));
        }
        let sha = self.hash(&path)?;
        self.load(&sha, &path)
    }

    /// The model `manifest` was ingested with, found in the folder by its sha256.
    pub(crate) fn for_corpus(&self, manifest: &CorpusManifest) -> ApiResult<Arc<LoadedModel>> {
        let sha = &manifest.model.sha256;
        if let Some(m) = self.lock_loaded()?.get(sha) {
            return Ok(m.clone());
        }
        for name in self.names() {
            let path = self.dir.join(&name);
            if self.hash(&path)? == *sha {
                return self.load(sha, &path);
            }
        }
        Err(ApiError::conflict(format!(
            "corpus `{}` was ingested with model {} (sha256 {sha}), which is not in the \
             server's model folder",
            manifest.name, manifest.model.name
        )))
    }

    fn load(&self, sha: &str, path: &Path) -> ApiResult<Arc<LoadedModel>> {
        let mut loaded = self.lock_loaded()?;
        if let Some(m) = loaded.get(sha) {
            return Ok(m.clone());
        }
        let model = Arc::new(kvdb::load_model(
            Some(path),
            &LoadOptions::default(),
            self.device,
        )?);
        loaded.insert(model.record.sha256.clone(), model.clone());
        Ok(model)
    }

    fn lock_loaded(
        &self,
    ) -> ApiResult<std::sync::MutexGuard<'_, HashMap<String, Arc<LoadedModel>>>> {
        self.loaded
            .lock()
            .map_err(|_| ApiError::internal("a model load panicked"))
    }

    fn hash(&self, path: &Path) -> ApiResult<String> {
        let meta = std::fs::metadata(path).map_err(ApiError::internal)?;
        let stamp = (meta.len(), meta.modified().map_err(ApiError::internal)?);
        let mut hashes = self
            .hashes
            .lock()
            .map_err(|_| ApiError::internal("a model hash panicked"))?;
        if let Some((len, modified, sha)) = hashes.get(path) {
            if (*len, *modified) == stamp {
                return Ok(sha.clone());
            }
        }
        let sha = kvdb_model::fetch::sha256_file(path).map_err(ApiError::internal)?;
        hashes.insert(path.to_path_buf(), (stamp.0, stamp.1, sha.clone()));
        Ok(sha)
    }
}

fn list(names: &[String]) -> String {
    if names.is_empty() {
        "none (fetch the default with `kvdb model fetch`)".into()
    } else {
        names.join(", ")
    }
}
