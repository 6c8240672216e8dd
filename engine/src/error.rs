//! The engine's one error type. Variants carry the file, tensor, op and shapes involved so that a message alone says
//! what went wrong. Nothing in the engine panics on bad input; it returns one of these.

use std::path::PathBuf;

/// Every error the engine reports.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// An I/O error on a named file.
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A GGUF file that is truncated, corrupt or inconsistent. `what` says which part and why.
    #[error("invalid GGUF file{}: {what}", fmt_path(.path))]
    Gguf { path: Option<PathBuf>, what: String },
    /// A tensor with an unexpected type or shape.
    #[error("tensor {name}: {what}")]
    Tensor { name: String, what: String },
    /// A required tensor is missing from a model or checkpoint.
    #[error("missing tensor {0}")]
    MissingTensor(String),
    /// Model metadata that is missing or inconsistent.
    #[error("model metadata: {0}")]
    Metadata(String),
    /// A quant-format error (bad block length, unsupported type for an op).
    #[error("quant {op} on {ty}: {what}")]
    Quant { op: &'static str, ty: String, what: String },
    /// An op received buffers of incompatible shapes.
    #[error("op {op}: shape mismatch: {what}")]
    Shape { op: &'static str, what: String },
    /// Converter input problems (checkpoint folder, safetensors, config.json).
    #[error("convert: {0}")]
    Convert(String),
    /// Tokenizer problems.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// Chat rendering / parsing problems.
    #[error("chat: {0}")]
    Chat(String),
    /// A session-level problem (unknown session, context overflow).
    #[error("session: {0}")]
    Session(String),
    /// The requested context does not fit.
    #[error("context overflow: {tokens} tokens do not fit in a context of {ctx}")]
    ContextOverflow { tokens: usize, ctx: usize },
    /// A backend failed (device lost, shader error, unsupported op).
    #[error("backend {backend}: {what}")]
    Backend { backend: &'static str, what: String },
    /// Bad command-line or API argument.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
}

fn fmt_path(p: &Option<PathBuf>) -> String {
    match p {
        Some(p) => format!(" {}", p.display()),
        None => String::new(),
    }
}

impl Error {
    /// Wraps an I/O error with the path it happened on.
    pub fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Error::Io { path: path.into(), source }
    }
}

/// The engine's result type.
pub type Result<T, E = Error> = std::result::Result<T, E>;
