//! The model: hyperparameters read from GGUF metadata ([`config`]), the weight table ([`weights`]), rope
//! frequencies ([`rope`]) and the activation-simulation rounding ([`sim`]).
//!
//! The forward pass itself is expressed as job-graph ops ([`crate::graph`]) implemented by backends
//! ([`crate::backend`]); this module holds what every backend shares.

pub mod config;
pub mod rope;
pub mod sim;
pub mod weights;

pub use config::{LayerKind, ModelConfig, RopeParams};
pub use rope::RopeFreqs;
pub use weights::{Mat, Model, WeightId, WeightTable};
