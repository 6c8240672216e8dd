//! The model: hyperparameters read from GGUF metadata ([`config`]), the weight table ([`weights`]) and its matrix
//! views ([`mat`]), rope frequencies ([`rope`]), the activation-simulation rounding ([`sim`]), and the forward
//! pass itself ([`recipe`]): the node graph of each tick, whose fine ops backends implement as kernels
//! ([`crate::backend`]).

pub mod config;
pub mod dspark;
pub(crate) mod mat;
pub mod recipe;
pub(crate) mod rope;
pub(crate) mod sim;
pub(crate) mod weights;

pub use config::{LayerKind, ModelConfig, RopeSpec};
pub use dspark::{DsparkModel, DsparkParams, DsparkWeights};
pub use mat::Mat;
pub use rope::RopeFreqs;
pub use weights::{packing_on, CompressorWeights, Model, MtpInputWeights, WeightId, WeightTable};
