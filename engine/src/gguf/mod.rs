//! The GGUF v3 container: a validating, memory-mapped reader ([`GgufFile`]) and a streaming writer
//! ([`GgufWriter`]).
//!
//! Layout of a file: magic `GGUF`, version, tensor count, metadata count, the metadata key/values, the tensor
//! infos (name, dims, type, offset), padding to `general.alignment` (default 32), then the tensor data region.
//! Dims are GGUF-style: `dims[0]` is the innermost, contiguous dimension.
//!
//! Guarantees of the reader: every count, length, offset and size is checked against the bytes actually present
//! before it is used, so a truncated, corrupt or hostile file yields [`crate::Error::Gguf`] naming what is wrong,
//! never a panic or an out-of-bounds read. Tensor data is never copied: [`GgufFile::tensor`] returns a slice of
//! the mapping.

mod metadata;
mod reader;
mod writer;

pub use metadata::{MetaValue, ValueType};
pub use reader::{GgufFile, TensorInfo, TensorView};
pub use writer::{GgufWriter, TensorDecl};

/// The four magic bytes at the start of every GGUF file.
pub const MAGIC: &[u8; 4] = b"GGUF";
/// The default data alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's maximum number of tensor dimensions.
pub const MAX_DIMS: usize = 4;
