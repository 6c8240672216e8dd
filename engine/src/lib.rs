//! # ds4-engine
//!
//! A native inference engine for one model, DeepSeek V4 Flash. This crate holds everything that turns a model
//! file and token ids into logits:
//!
//! | folder | what lives there |
//! | --- | --- |
//! | [`gguf`] | the GGUF v3 container: memory-mapped reader with validated, zero-copy tensor views, and a writer |
//! | [`quant`] | block quant formats (F32, F16, BF16, Q8_0, Q2_K, Q4_K, IQ2_XXS, Q8_K): dequantize, quantize, dot products |
//! | [`convert`] | official checkpoint folder (safetensors, FP8/FP4) → DS4 GGUF |
//! | [`model`] | hyperparameters read from GGUF metadata, the weight table, the forward pass (`recipe`) |
//! | [`persist`] | sessions ↔ the `ds4-kv` disk tier: shared pages + a checkpoint; restore the longest cached prefix |
//! | [`tables`] | flat component tables (struct-of-arrays): sessions and their KV state |
//! | [`graph`] | the per-tick node graph: fine ops over named tensors with declared reads/writes, as plain data (built by `model::recipe`) |
//! | [`exec`] | the executor: places each node (native override, portable kernel, or whole stage) and runs the graph |
//! | [`backend`] | op implementations: `cpu` (reference + SIMD) and `wgpu` |
//! | [`tokenizer`], [`chat`], [`sampler`] | text in, text out |
//! | [`speculative`] | speculative decoding: drafters, the batched verify tick, lossless acceptance, exact roll back of rejected drafts |
//! | [`grammar`] | constrained decoding (JSON schema, regex, Lark) with `llguidance`: per-token masks for the sampler |
//! | [`testdata`] | for tests: where `../shared` is, and the skip-unless-CI rule |
//!
//! Errors: every fallible function returns [`Result`], whose [`Error`] names the op, file or tensor involved.
//!
//! Public surface: the top-level modules above stay `pub` (except `error`, whose [`Error`] and [`Result`] are
//! re-exported here), because the other crates use them: [`engine`] (the [`Engine`] facade: server, cli, benches,
//! tests), [`tables`] (session ids and snapshots), [`persist`] (the `ds4-kv` bridge: server, benches), [`gguf`],
//! [`tokenizer`], [`chat`], [`sampler`], [`grammar`] (server, cli), [`speculative`] (benches, tests), [`convert`] (cli, server, tests), [`model`] (hyperparameters),
//! [`graph`] (benches, `ds4-kernels-native`), [`exec`] (benches), [`quant`] (benches, engine tests), [`backend`]
//! (benches, tests) and [`testdata`] (tests). Inside them only these submodules are public: `backend::{cpu, wgpu}`,
//! `backend::wgpu::context` (the wgpu test context of the `ds4-tests` crate), `model::config` (`Revision`),
//! `convert::{demo, imatrix, plan, synth_tokenizer}` (synthetic models and the imatrix writer for tests, benches and
//! cli), `chat::effort` and `quant::simd`; every other submodule is `pub(crate)`, its public items reached through
//! the re-exports of its parent. The `bench-internals` feature also opens `backend::cpu::{matmul, pool}` to the
//! kernel benchmarks; that is not a stable API.
#![forbid(unsafe_op_in_unsafe_fn)]
// Module docs describe the internal design and link the private modules and items that carry it.
#![allow(rustdoc::private_intra_doc_links)]

pub mod backend;
pub mod chat;
pub mod convert;
pub mod engine;
pub(crate) mod error;
pub mod exec;
pub mod gguf;
pub mod grammar;
pub mod graph;
pub mod model;
pub mod persist;
pub mod quant;
pub mod sampler;
pub mod speculative;
pub mod tables;
pub mod testdata;
pub mod tokenizer;

pub use engine::{BackendKind, Engine, EngineOptions};
pub use error::{Error, Result};
pub use tables::{SessionId, SessionSnapshot};
