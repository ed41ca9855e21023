//! Reading the documents an ingest is given: files and folders of `.txt`, `.md` and `.html`
//! (markup stripped), each identified by the sha256 of its bytes.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

/// Extensions read as plain text.
const TEXT: [&str; 4] = ["txt", "md", "markdown", "text"];
/// Extensions read as HTML.
const HTML: [&str; 3] = ["html", "htm", "xhtml"];

/// One input document, read and checked (serialisable, so that a server can keep an ingest's
/// documents until it has committed them).
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
pub struct SourceDocument {
    /// Where it came from.
    pub path: PathBuf,
    /// Its title (the file name).
    pub title: String,
    /// Its text (markup stripped for HTML).
    pub text: String,
    /// sha256 of the file's bytes, hex.
    pub sha256: String,
    /// The file's size in bytes.
    pub bytes: usize,
}

/// Reads every document named by `paths` (files, or folders searched recursively in name
/// order), in the order given. Any unreadable, empty or non-UTF-8 document is an error, so
/// that nothing is ingested from a set with a bad member.
pub fn read_documents(paths: &[PathBuf]) -> Result<Vec<SourceDocument>> {
    let mut files = Vec::new();
    for path in paths {
        let meta = std::fs::metadata(path).map_err(|e| Error::Document {
            path: path.clone(),
            reason: format!("cannot read it: {e}"),
        })?;
        if meta.is_dir() {
            let before = files.len();
            collect_folder(path, &mut files)?;
            if files.len() == before {
                return Err(Error::Document {
                    path: path.clone(),
                    reason: "the folder holds no .txt, .md or .html files".into(),
                });
            }
        } else {
            if kind(path).is_none() {
                return Err(Error::Document {
                    path: path.clone(),
                    reason: "unsupported file type: kvdb reads .txt, .md and .html".into(),
                });
            }
            files.push(path.clone());
        }
    }
    files.iter().map(|p| read_document(p)).collect()
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Text,
    Html,
}

fn kind(path: &Path) -> Option<Kind> {
    let ext = path.extension()?.to_str()?.to_ascii_lowercase();
    if TEXT.contains(&ext.as_str()) {
        Some(Kind::Text)
    } else if HTML.contains(&ext.as_str()) {
        Some(Kind::Html)
    } else {
        None
    }
}

fn collect_folder(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::Document {
        path: dir.to_path_buf(),
        reason: format!("cannot list it: {e}"),
    })?;
    let mut paths = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|e| Error::Document {
            path: dir.to_path_buf(),
            reason: format!("cannot list it: {e}"),
        })?;
        paths.push(entry.path());
    }
    paths.sort();
    for path in paths {
        if path.is_dir() {
            collect_folder(&path, out)?;
        } else if kind(&path).is_some() {
            out.push(path);
        }
    }
    Ok(())
}

/// Whether `path`'s extension is one kvdb reads (.txt, .md, .html and their variants).
pub fn is_supported_document(path: &Path) -> bool {
    kind(path).is_some()
}

/// Reads one file: UTF-8 required, HTML reduced to its text, empty text refused.
pub fn read_document(path: &Path) -> Result<SourceDocument> {
    let bytes = std::fs::read(path).map_err(|e| Error::Document {
        path: path.to_path_buf(),
        reason: format!("cannot read it: {e}"),
    })?;
    document_from_bytes(path, &bytes)
}

/// A document from bytes that did not come from a file (e.g. an upload): `path` names it
/// (its file name is the title, its extension picks HTML or text). UTF-8 required, HTML
/// reduced to its text, empty text refused.
pub fn document_from_bytes(path: &Path, bytes: &[u8]) -> Result<SourceDocument> {
    let bad = |reason: String| Error::Document {
        path: path.to_path_buf(),
        reason,
    };
    let decoded = std::str::from_utf8(bytes).map_err(|e| {
        bad(format!(
            "not UTF-8 text (invalid bytes at offset {}); convert it first, e.g. with iconv",
            e.valid_up_to()
        ))
    })?;
    let text = match kind(path) {
        Some(Kind::Html) => html_text(decoded).map_err(bad)?,
        _ => decoded.to_string(),
    };
    if text.trim().is_empty() {
        return Err(bad("the document is empty".into()));
    }
    let title = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string());
    Ok(SourceDocument {
        path: path.to_path_buf(),
        title,
        text,
        sha256: kvdb_model::fetch::sha256_hex(bytes),
        bytes: bytes.len(),
    })
}

/// The readable text of an HTML page: markup, scripts and styles dropped, tables flattened,
/// no line wrapping.
pub(crate) fn html_text(html: &str) -> std::result::Result<String, String> {
    html2text::config::plain_no_decorate()
        .raw_mode(true)
        .allow_width_overflow()
        .string_from_read(html.as_bytes(), 100_000)
        .map_err(|e| format!("cannot read the HTML: {e}"))
}
