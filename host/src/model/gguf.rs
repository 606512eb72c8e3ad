//! GGUF v2/v3 reader: header, typed metadata, tensor table and alignment, over a memory map.
//!
//! Every length and offset read from the file is checked, so a truncated or hostile file
//! yields an [`Error`] rather than a panic or an out-of-bounds read.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::error::{Error, Result};
use crate::tensor::{Bytes, DType, Weight};

const MAGIC: &[u8; 4] = b"GGUF";
const DEFAULT_ALIGNMENT: u64 = 32;
/// Upper bounds that keep a corrupt header from asking for absurd allocations.
const MAX_STRING: u64 = 1 << 24;
const MAX_COUNT: u64 = 1 << 28;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum MetaValue {
    U8(u8),
    I8(i8),
    U16(u16),
    I16(i16),
    U32(u32),
    I32(i32),
    U64(u64),
    I64(i64),
    F32(f32),
    F64(f64),
    Bool(bool),
    Str(String),
    Array(Vec<MetaValue>),
}

impl MetaValue {
    /// The value as an unsigned integer, if it is an integer that fits.
    pub fn as_u64(&self) -> Option<u64> {
        match *self {
            MetaValue::U8(v) => Some(v as u64),
            MetaValue::U16(v) => Some(v as u64),
            MetaValue::U32(v) => Some(v as u64),
            MetaValue::U64(v) => Some(v),
            MetaValue::I8(v) => u64::try_from(v).ok(),
            MetaValue::I16(v) => u64::try_from(v).ok(),
            MetaValue::I32(v) => u64::try_from(v).ok(),
            MetaValue::I64(v) => u64::try_from(v).ok(),
            _ => None,
        }
    }

    pub fn as_i64(&self) -> Option<i64> {
        match *self {
            MetaValue::I8(v) => Some(v as i64),
            MetaValue::I16(v) => Some(v as i64),
            MetaValue::I32(v) => Some(v as i64),
            MetaValue::I64(v) => Some(v),
            _ => self.as_u64().and_then(|v| i64::try_from(v).ok()),
        }
    }

    pub fn as_f64(&self) -> Option<f64> {
        match *self {
            MetaValue::F32(v) => Some(v as f64),
            MetaValue::F64(v) => Some(v),
            _ => self.as_i64().map(|v| v as f64),
        }
    }

    pub fn as_str(&self) -> Option<&str> {
        match self {
            MetaValue::Str(s) => Some(s),
            _ => None,
        }
    }

    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            MetaValue::Bool(b) => Some(b),
            _ => None,
        }
    }

    pub fn as_array(&self) -> Option<&[MetaValue]> {
        match self {
            MetaValue::Array(a) => Some(a),
            _ => None,
        }
    }
}

/// One entry of the tensor table.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    /// GGUF order: `dims[0]` is the fastest-varying (columns).
    pub dims: Vec<u64>,
    pub dtype: DType,
    /// Absolute byte offset in the file.
    pub offset: usize,
    pub len: usize,
}

/// An opened GGUF file.
pub struct GgufFile {
    pub path: PathBuf,
    pub version: u32,
    pub metadata: BTreeMap<String, MetaValue>,
    pub tensors: BTreeMap<String, TensorInfo>,
    map: Arc<Mmap>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata_keys", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
    path: &'a Path,
}

impl<'a> Cursor<'a> {
    fn bad(&self, reason: impl Into<String>) -> Error {
        Error::BadGguf {
            path: self.path.to_path_buf(),
            reason: format!("{} (at byte {})", reason.into(), self.pos),
        }
    }

    fn take(&mut self, n: usize) -> Result<&'a [u8]> {
        let end = self
            .pos
            .checked_add(n)
            .filter(|&e| e <= self.buf.len())
            .ok_or_else(|| self.bad(format!("file truncated: needed {n} more bytes")))?;
        let s = &self.buf[self.pos..end];
        self.pos = end;
        Ok(s)
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let s = self.take(N)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }

    fn u32(&mut self) -> Result<u32> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn count(&mut self, what: &str) -> Result<usize> {
        let n = self.u64()?;
        if n > MAX_COUNT {
            return Err(self.bad(format!("{what} count {n} is implausibly large")));
        }
        Ok(n as usize)
    }

    fn string(&mut self) -> Result<String> {
        let n = self.u64()?;
        if n > MAX_STRING {
            return Err(self.bad(format!("string length {n} is implausibly large")));
        }
        let bytes = self.take(n as usize)?;
        String::from_utf8(bytes.to_vec()).map_err(|_| self.bad("string is not valid UTF-8"))
    }

    fn value(&mut self, ty: u32, depth: u32) -> Result<MetaValue> {
        Ok(match ty {
            0 => MetaValue::U8(self.array::<1>()?[0]),
            1 => MetaValue::I8(self.array::<1>()?[0] as i8),
            2 => MetaValue::U16(u16::from_le_bytes(self.array()?)),
            3 => MetaValue::I16(i16::from_le_bytes(self.array()?)),
            4 => MetaValue::U32(self.u32()?),
            5 => MetaValue::I32(i32::from_le_bytes(self.array()?)),
            6 => MetaValue::F32(f32::from_le_bytes(self.array()?)),
            7 => match self.array::<1>()?[0] {
                0 => MetaValue::Bool(false),
                1 => MetaValue::Bool(true),
                b => return Err(self.bad(format!("bool value {b} is neither 0 nor 1"))),
            },
            8 => MetaValue::Str(self.string()?),
            9 => {
                if depth > 2 {
                    return Err(self.bad("arrays nested too deeply"));
                }
                let inner = self.u32()?;
                let n = self.count("array")?;
                let mut v = Vec::with_capacity(n.min(1 << 16));
                for _ in 0..n {
                    v.push(self.value(inner, depth + 1)?);
                }
                MetaValue::Array(v)
            }
            10 => MetaValue::U64(self.u64()?),
            11 => MetaValue::I64(i64::from_le_bytes(self.array()?)),
            12 => MetaValue::F64(f64::from_le_bytes(self.array()?)),
            t => return Err(self.bad(format!("unknown metadata value type {t}"))),
        })
    }
}

impl GgufFile {
    /// Opens and parses a GGUF file. The tensor data stays memory-mapped.
    pub fn open(path: &Path) -> Result<GgufFile> {
        let file = std::fs::File::open(path).map_err(|e| Error::io(path, e))?;
        // SAFETY: the map is read-only; a model file changed underneath a running process is
        // outside what we defend against (as with every mmap-based loader).
        let map = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?;
        Self::parse(path, Arc::new(map))
    }

    fn parse(path: &Path, map: Arc<Mmap>) -> Result<GgufFile> {
        if map.len() < 4 || &map[..4] != MAGIC {
            return Err(Error::NotGguf {
                path: path.to_path_buf(),
                reason: "missing the GGUF magic bytes".into(),
            });
        }
        let mut c = Cursor {
            buf: &map,
            pos: 4,
            path,
        };
        let version = c.u32()?;
        if !(2..=3).contains(&version) {
            return Err(Error::NotGguf {
                path: path.to_path_buf(),
                reason: format!("GGUF version {version} is not supported (2 and 3 are)"),
            });
        }
        let n_tensors = c.count("tensor")?;
        let n_kv = c.count("metadata")?;
        let mut metadata = BTreeMap::new();
        for _ in 0..n_kv {
            let key = c.string()?;
            let ty = c.u32()?;
            let v = c.value(ty, 0)?;
            metadata.insert(key, v);
        }
        let alignment = match metadata.get("general.alignment") {
            None => DEFAULT_ALIGNMENT,
            Some(v) => match v.as_u64() {
                Some(a) if a.is_power_of_two() => a,
                _ => return Err(c.bad(format!("general.alignment {v:?} is not a power of two"))),
            },
        };
        let mut raw = Vec::with_capacity(n_tensors.min(1 << 16));
        for _ in 0..n_tensors {
            let name = c.string()?;
            let n_dims = c.u32()?;
            if n_dims == 0 || n_dims > 4 {
                return Err(c.bad(format!("tensor `{name}` has {n_dims} dimensions")));
            }
            let mut dims = Vec::with_capacity(n_dims as usize);
            for _ in 0..n_dims {
                dims.push(c.u64()?);
            }
            let type_id = c.u32()?;
            let offset = c.u64()?;
            raw.push((name, dims, type_id, offset));
        }
        let data_start = (c.pos as u64).div_ceil(alignment) * alignment;
        let mut tensors = BTreeMap::new();
        for (name, dims, type_id, offset) in raw {
            let dtype = DType::from_ggml(type_id).ok_or_else(|| Error::UnknownTensorType {
                tensor: name.clone(),
                type_id,
            })?;
            let elems = dims
                .iter()
                .try_fold(1u64, |a, &d| a.checked_mul(d))
                .filter(|&n| n < (1u64 << 40))
                .ok_or_else(|| c.bad(format!("tensor `{name}` has an absurd size {dims:?}")))?;
            if dims[0] % dtype.block_elems() as u64 != 0 {
                return Err(c.bad(format!(
                    "tensor `{name}`: row length {} is not a multiple of the {dtype} block ({})",
                    dims[0],
                    dtype.block_elems()
                )));
            }
            let len = dtype
                .bytes_for(elems as usize)
                .ok_or_else(|| c.bad(format!("tensor `{name}` size overflows")))?;
            if offset % alignment != 0 {
                return Err(c.bad(format!("tensor `{name}` offset {offset} is not aligned")));
            }
            let start = data_start
                .checked_add(offset)
                .filter(|&s| s.checked_add(len as u64).is_some_and(|e| e <= map.len() as u64))
                .ok_or_else(|| Error::BadGguf {
                    path: path.to_path_buf(),
                    reason: format!(
                        "tensor `{name}` ({len} bytes at offset {offset}) lies past the end of the file ({} bytes): the file is truncated",
                        map.len()
                    ),
                })?;
            tensors.insert(
                name.clone(),
                TensorInfo {
                    name,
                    dims,
                    dtype,
                    offset: start as usize,
                    len,
                },
            );
        }
        Ok(GgufFile {
            path: path.to_path_buf(),
            version,
            metadata,
            tensors,
            map,
        })
    }

    pub fn get(&self, key: &str) -> Option<&MetaValue> {
        self.metadata.get(key)
    }

    /// A required string value.
    pub fn str(&self, key: &str) -> Result<&str> {
        self.get(key)
            .ok_or_else(|| missing(key))?
            .as_str()
            .ok_or_else(|| wrong_type(key, "a string"))
    }

    /// A required unsigned integer value.
    pub fn u64(&self, key: &str) -> Result<u64> {
        self.get(key)
            .ok_or_else(|| missing(key))?
            .as_u64()
            .ok_or_else(|| wrong_type(key, "an unsigned integer"))
    }

    /// An optional float value (integers are accepted too).
    pub fn f64_opt(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| wrong_type(key, "a number")),
        }
    }

    /// An optional unsigned integer value.
    pub fn u64_opt(&self, key: &str) -> Result<Option<u64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(Some)
                .ok_or_else(|| wrong_type(key, "an unsigned integer")),
        }
    }

    /// A required array of strings.
    pub fn str_array(&self, key: &str) -> Result<Vec<&str>> {
        let arr = self
            .get(key)
            .ok_or_else(|| missing(key))?
            .as_array()
            .ok_or_else(|| wrong_type(key, "an array"))?;
        arr.iter()
            .map(|v| {
                v.as_str()
                    .ok_or_else(|| wrong_type(key, "an array of strings"))
            })
            .collect()
    }

    /// A tensor as a [`Weight`] sharing the memory map. `expected` is the logical shape in
    /// row-major order (`[rows, cols]` or `[len]`); a mismatch is an error naming the tensor.
    pub fn weight(&self, name: &str, expected: &[usize]) -> Result<Weight> {
        let info = self
            .tensors
            .get(name)
            .ok_or_else(|| Error::MissingTensor(name.to_string()))?;
        let actual: Vec<usize> = info.dims.iter().rev().map(|&d| d as usize).collect();
        if actual != expected {
            return Err(Error::ShapeMismatch {
                tensor: name.to_string(),
                expected: expected.to_vec(),
                actual,
            });
        }
        let cols = info.dims[0] as usize;
        let rows = info.dims[1..].iter().product::<u64>() as usize;
        Ok(Weight {
            dtype: info.dtype,
            rows,
            cols,
            data: Bytes::Mapped {
                map: self.map.clone(),
                offset: info.offset,
                len: info.len,
            },
        })
    }
}

fn missing(key: &str) -> Error {
    Error::BadMetadata {
        key: key.to_string(),
        reason: "missing".into(),
    }
}

fn wrong_type(key: &str, what: &str) -> Error {
    Error::BadMetadata {
        key: key.to_string(),
        reason: format!("expected {what}"),
    }
}
