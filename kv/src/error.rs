//! The crate's error type. Every fallible function returns [`KvResult`]; I/O errors carry the path involved.

use std::path::PathBuf;

/// Errors of the KV store.
#[derive(Debug, thiserror::Error)]
pub enum KvError {
    /// An I/O operation on `path` failed.
    #[error("{op} {path}: {err}")]
    Io {
        /// What was being done ("write", "rename", ...).
        op: &'static str,
        /// The file or directory.
        path: PathBuf,
        /// The OS error (in the message, not chained, so it is printed once).
        err: std::io::Error,
    },
    /// A file's bytes do not match its header or checksums.
    #[error("corrupt KV file: {0}")]
    Corrupt(String),
    /// The caller passed inconsistent data (wrong span length, row counts that do not match values, ...).
    #[error("invalid KV input: {0}")]
    Invalid(String),
    /// The requested page or checkpoint is not (or no longer) in the store.
    #[error("not in the KV store: {0}")]
    Missing(String),
    /// Disk caching is switched off (see `DiskStatus::last_error` for why).
    #[error("disk caching is off: {0}")]
    DiskOff(String),
    /// The caller's callback asked to stop loading.
    #[error("load aborted by the caller: {0}")]
    Aborted(String),
}

impl KvError {
    /// Wraps an I/O error with the operation and path.
    pub fn io(op: &'static str, path: impl Into<PathBuf>, err: std::io::Error) -> KvError {
        KvError::Io { op, path: path.into(), err }
    }
}

/// `Result` with [`KvError`].
pub type KvResult<T> = std::result::Result<T, KvError>;
