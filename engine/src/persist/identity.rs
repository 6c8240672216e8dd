//! The [`ModelIdentity`] of a loaded engine: what must match for stored KV rows to be reusable.
//!
//! It covers the architecture and every size (the full [`crate::model::ModelConfig`]), the quant recipe
//! (`general.file_type`) and every tensor's storage type, the activation-simulation flag (exact vs FP8/FP4
//! simulation produce different KV values), and a SHA1 over the tensor table (names, types, dims) plus a sample of
//! each tensor's bytes (first and last 256 bytes), so two models with the same shapes but different weights get
//! different identities. Cost: a few pages touched per tensor, no full read of the weights.

use sha1::{Digest, Sha1};

use crate::engine::Engine;
use crate::gguf::MetaValue;

const SAMPLE: usize = 256;

/// The identity text (human-readable head + weights fingerprint) of `engine`'s model and mode.
pub fn identity_text(engine: &Engine) -> String {
    let model = engine.model();
    let file = &model.file;
    let mut h = Sha1::new();
    h.update(b"ds4-engine/tensors");
    for t in file.tensors() {
        h.update((t.name.len() as u64).to_le_bytes());
        h.update(t.name.as_bytes());
        h.update(format!("{:?}", t.ty).as_bytes());
        h.update((t.dims.len() as u64).to_le_bytes());
        for d in &t.dims {
            h.update(d.to_le_bytes());
        }
        if let Some(v) = file.tensor(&t.name) {
            let d = v.data;
            h.update((d.len() as u64).to_le_bytes());
            h.update(&d[..d.len().min(SAMPLE)]);
            h.update(&d[d.len().saturating_sub(SAMPLE)..]);
        }
    }
    let fp: [u8; 20] = h.finalize().into();
    let fp: String = fp.iter().map(|b| format!("{b:02x}")).collect();
    let file_type = match file.get("general.file_type") {
        Some(MetaValue::U32(v)) => v.to_string(),
        Some(other) => format!("{other:?}"),
        None => "none".into(),
    };
    let sim = if engine.options().exact { 0 } else { 1 };
    format!(
        "ds4 deepseek4 file_type={file_type} sim={sim} tensors={} weights={fp} config={:?}",
        file.tensors().len(),
        model.config
    )
}

/// [`identity_text`] as a [`ds4_kv::ModelIdentity`].
pub fn model_identity(engine: &Engine) -> ds4_kv::ModelIdentity {
    ds4_kv::ModelIdentity::new(identity_text(engine))
}
