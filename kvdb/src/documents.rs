//! Reading the documents an ingest is given: files and folders of `.txt`, `.md` and `.html`
//! (markup stripped), and files named on their own without an extension (`LICENSE`,
//! `README`: read as text), each identified by the sha256 of its bytes.

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
/// order, where only `.txt`, `.md` and `.html` files count), in the order given. A file named
/// on its own without an extension is read as text. Any unreadable, empty or non-UTF-8
/// document is an error, so that nothing is ingested from a set with a bad member.
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
            if !is_supported_document(path) {
                return Err(Error::Document {
                    path: path.clone(),
                    reason: "unsupported file type: kvdb reads .txt, .md and .html, and files \
                             without an extension as text"
                        .into(),
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

/// Whether a document named `path` on its own (a file on the command line, an upload) is one
/// kvdb reads: .txt, .md, .html and their variants, or no extension at all. A name without one
/// is text for a reason (LICENSE, README), checked as UTF-8 like any other; another extension
/// is a format kvdb cannot read. A folder's files need one of the extensions.
pub fn is_supported_document(path: &Path) -> bool {
    kind(path).is_some() || path.extension().is_none()
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A file named on its own without an extension is text; one with an unknown extension
    /// is refused; a folder's files without an extension are not picked up.
    #[test]
    fn a_named_file_without_an_extension_is_text() -> anyhow::Result<()> {
        let dir = tempfile::tempdir()?;
        let licence = dir.path().join("LICENSE");
        std::fs::write(&licence, "Permission is granted.\n")?;
        let pdf = dir.path().join("paper.pdf");
        std::fs::write(&pdf, "%PDF-1.7")?;
        let notes = dir.path().join("notes.md");
        std::fs::write(&notes, "# Notes\n")?;

        let read = read_documents(std::slice::from_ref(&licence))?;
        assert_eq!(read.len(), 1);
        assert_eq!(read[0].title, "LICENSE");
        assert_eq!(read[0].text, "Permission is granted.\n");

        let refused = read_documents(&[pdf]).unwrap_err().to_string();
        assert!(refused.contains("unsupported file type"), "{refused}");

        let folder = read_documents(&[dir.path().to_path_buf()])?;
        let titles: Vec<&str> = folder.iter().map(|d| d.title.as_str()).collect();
        assert_eq!(titles, ["notes.md"]);

        // Binary bytes without an extension are refused as text that is not UTF-8.
        let blob = dir.path().join("blob");
        std::fs::write(&blob, [0xff, 0xfe, 0x00])?;
        let refused = read_documents(&[blob]).unwrap_err().to_string();
        assert!(refused.contains("not UTF-8"), "{refused}");
        Ok(())
    }
}
