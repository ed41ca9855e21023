//! Opening GGUF files: a bounds-checked walk of the header before candle parses it (so that a
//! corrupt file is an error, never a huge allocation or a panic), and a check that every
//! tensor's bytes are in the file.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::Device;

use crate::config::ModelConfig;
use crate::error::{ModelError, Result};

/// An open GGUF file: its parsed header and a reader for tensor data.
#[derive(Debug)]
pub struct GgufFile {
    path: PathBuf,
    content: Content,
    reader: BufReader<File>,
}

impl GgufFile {
    /// Opens and validates `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref().to_path_buf();
        if !path.exists() {
            return Err(ModelError::MissingFile { path });
        }
        let io = |source| ModelError::Io {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(io)?;
        let size = file.metadata().map_err(io)?.len();
        let mut reader = BufReader::new(file);
        let invalid = |reason: String| ModelError::InvalidGguf {
            path: path.clone(),
            reason,
        };
        HeaderCheck::new(&mut reader, size)
            .walk()
            .map_err(invalid)?;
        reader.seek(SeekFrom::Start(0)).map_err(io)?;
        let content = Content::read(&mut reader).map_err(|e| invalid(e.to_string()))?;
        for (name, info) in &content.tensor_infos {
            let elems = info.shape.elem_count();
            let block = info.ggml_dtype.block_size();
            if elems % block != 0 {
                return Err(invalid(format!(
                    "tensor `{name}` has {elems} elements, not a multiple of its block size {block}"
                )));
            }
            let bytes = (elems / block * info.ggml_dtype.type_size()) as u64;
            let end = content
                .tensor_data_offset
                .saturating_add(info.offset)
                .saturating_add(bytes);
            if end > size {
                return Err(ModelError::Truncated {
                    path,
                    tensor: name.clone(),
                    needed: end,
                    size,
                });
            }
        }
        Ok(Self {
            path,
            content,
            reader,
        })
    }

    /// The file's path.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The metadata key/value pairs.
    pub fn metadata(&self) -> &HashMap<String, Value> {
        &self.content.metadata
    }

    /// The parsed header.
    pub fn content(&self) -> &Content {
        &self.content
    }

    /// The typed model configuration.
    pub fn config(&self) -> Result<ModelConfig> {
        ModelConfig::from_gguf(&self.content)
    }

    /// Whether the file holds a tensor of this name.
    pub fn has_tensor(&self, name: &str) -> bool {
        self.content.tensor_infos.contains_key(name)
    }

    /// The storage type of a tensor, if present.
    pub fn tensor_dtype(&self, name: &str) -> Option<GgmlDType> {
        self.content.tensor_infos.get(name).map(|t| t.ggml_dtype)
    }

    /// Reads a tensor (in its stored quantization) and checks its shape, given in GGUF order
    /// reversed, i.e. as candle reports it (`[rows, cols]`).
    pub fn tensor(&mut self, name: &str, shape: &[usize], device: &Device) -> Result<QTensor> {
        let tensor = self
            .content
            .tensor(&mut self.reader, name, device)
            .map_err(|e| {
                if self.content.tensor_infos.contains_key(name) {
                    ModelError::Tensor {
                        name: name.to_string(),
                        reason: e.to_string(),
                    }
                } else {
                    ModelError::Tensor {
                        name: name.to_string(),
                        reason: "missing from the file".into(),
                    }
                }
            })?;
        if tensor.shape().dims() != shape {
            return Err(ModelError::Tensor {
                name: name.to_string(),
                reason: format!("shape {:?}, expected {shape:?}", tensor.shape().dims()),
            });
        }
        Ok(tensor)
    }
}

/// Walks the GGUF header checking every length against the bytes left in the file.
struct HeaderCheck<'a, R> {
    reader: &'a mut R,
    left: u64,
}

type Check<T> = std::result::Result<T, String>;

impl<'a, R: Read> HeaderCheck<'a, R> {
    fn new(reader: &'a mut R, size: u64) -> Self {
        Self { reader, left: size }
    }

    fn bytes<const N: usize>(&mut self) -> Check<[u8; N]> {
        if self.left < N as u64 {
            return Err("the header ends early (truncated file)".into());
        }
        let mut b = [0u8; N];
        self.reader
            .read_exact(&mut b)
            .map_err(|e| format!("reading the header: {e}"))?;
        self.left -= N as u64;
        Ok(b)
    }

    fn u32(&mut self) -> Check<u32> {
        Ok(u32::from_le_bytes(self.bytes::<4>()?))
    }

    fn u64(&mut self) -> Check<u64> {
        Ok(u64::from_le_bytes(self.bytes::<8>()?))
    }

    fn skip(&mut self, n: u64) -> Check<()> {
        if n > self.left {
            return Err(format!(
                "a header field claims {n} bytes but only {} remain (corrupt or truncated file)",
                self.left
            ));
        }
        let copied = std::io::copy(&mut self.reader.by_ref().take(n), &mut std::io::sink())
            .map_err(|e| format!("reading the header: {e}"))?;
        if copied != n {
            return Err("the header ends early (truncated file)".into());
        }
        self.left -= n;
        Ok(())
    }

    fn string(&mut self) -> Check<()> {
        let n = self.u64()?;
        self.skip(n)
    }

    /// Skips one value of GGUF type `ty`.
    fn value(&mut self, ty: u32, depth: usize) -> Check<()> {
        match ty {
            0 | 1 | 7 => self.skip(1),
            2 | 3 => self.skip(2),
            4..=6 => self.skip(4),
            10..=12 => self.skip(8),
            8 => self.string(),
            9 if depth < 2 => {
                let elem = self.u32()?;
                let count = self.u64()?;
                match elem {
                    8 | 9 => (0..count).try_for_each(|_| self.value(elem, depth + 1)),
                    _ => {
                        let size = match elem {
                            0 | 1 | 7 => 1,
                            2 | 3 => 2,
                            4..=6 => 4,
                            10..=12 => 8,
                            other => return Err(format!("unknown array element type {other}")),
                        };
                        self.skip(count.checked_mul(size).ok_or("array size overflows")?)
                    }
                }
            }
            9 => Err("arrays nested too deeply".into()),
            other => Err(format!("unknown metadata value type {other}")),
        }
    }

    fn walk(mut self) -> Check<()> {
        let magic = self.bytes::<4>()?;
        if &magic != b"GGUF" {
            return Err(format!("bad magic {magic:02x?}, expected `GGUF`"));
        }
        let version = self.u32()?;
        if version == 1 {
            return Err("GGUF version 1 (32-bit lengths, from 2023) is not supported; re-convert the model with a current llama.cpp".into());
        }
        if !(2..=3).contains(&version) {
            return Err(format!("unsupported GGUF version {version}"));
        }
        let (n_tensors, n_kv) = (self.u64()?, self.u64()?);
        // Each entry takes at least 12 bytes: a bound that stops absurd counts early.
        if n_tensors.saturating_add(n_kv).saturating_mul(12) > self.left {
            return Err(format!("{n_tensors} tensors and {n_kv} metadata entries cannot fit in the file (corrupt or truncated file)"));
        }
        for _ in 0..n_kv {
            self.string()?;
            let ty = self.u32()?;
            self.value(ty, 0)?;
        }
        for _ in 0..n_tensors {
            self.string()?;
            let n_dims = self.u32()?;
            if n_dims > 4 {
                return Err(format!("a tensor claims {n_dims} dimensions (at most 4)"));
            }
            let mut elems: u64 = 1;
            for _ in 0..n_dims {
                let d = self.u64()?;
                elems = elems.checked_mul(d).ok_or("tensor dimensions overflow")?;
            }
            if elems > (1 << 40) {
                return Err(format!("a tensor claims {elems} elements"));
            }
            let dtype = self.u32()?;
            // The ggml types candle reads.
            if !matches!(dtype, 0..=3 | 6..=15 | 30) {
                return Err(format!("unsupported tensor type {dtype}"));
            }
            self.u64()?;
        }
        Ok(())
    }
}
