//! The model: hyperparameters read from GGUF metadata, the weight table, and the forward pass definition.
