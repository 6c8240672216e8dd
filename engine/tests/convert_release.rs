//! The converter on checkpoints in the official release's storage formats, generated here: FP8 e4m3 weights with
//! e8m0 block scales (`<base>.scale`, 128×128 blocks), FP4 e2m1 routed experts packed two per byte in I8 with e8m0
//! per-32 scales, BF16/F16/F32 tensors and an I64 `tid2eid`; single-file and sharded (index json) layouts; and the
//! errors for broken inputs.
//!
//! Every stored code is drawn at random and the expected f32 value is computed here from the format definitions
//! (independently of the converter's decoders), so the f32 recipe must reproduce it exactly.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use ds4_engine::convert::{convert, ConvertOptions, Recipe};
use ds4_engine::gguf::GgufFile;
use ds4_engine::quant::{dequantize_row, GgmlType};
use safetensors::tensor::{Dtype, TensorView};

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn unit(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
}

/// e4m3fn by definition: bias 7, subnormals at exponent 0.
fn e4m3_ref(b: u8) -> f32 {
    let mag = if (b >> 3) & 15 == 0 {
        (b & 7) as f32 * 2f32.powi(-9)
    } else {
        (8 + (b & 7)) as f32 * 2f32.powi(((b >> 3) & 15) as i32 - 10)
    };
    if b & 0x80 != 0 {
        -mag
    } else {
        mag
    }
}

fn e2m1_ref(n: u8) -> f32 {
    let mag = match n & 7 {
        0 => 0.0,
        1 => 0.5,
        2 => 1.0,
        3 => 1.5,
        4 => 2.0,
        5 => 3.0,
        6 => 4.0,
        _ => 6.0,
    };
    if n & 8 != 0 {
        -mag
    } else {
        mag
    }
}

#[derive(Clone, Copy)]
enum Store {
    F32,
    Bf16,
    F16,
    Fp8,
    Fp4,
}

struct Stored {
    dtype: Dtype,
    shape: Vec<usize>,
    bytes: Vec<u8>,
}

/// A generated checkpoint: stored tensors by official name and the expected GGUF contents by GGUF name.
struct Fixture {
    config: serde_json::Value,
    stored: BTreeMap<String, Stored>,
    expected: HashMap<String, (Vec<u64>, Vec<f32>)>,
    rng: Rng,
}

impl Fixture {
    fn put(&mut self, name: &str, dtype: Dtype, shape: Vec<usize>, bytes: Vec<u8>) {
        self.stored.insert(name.to_string(), Stored { dtype, shape, bytes });
    }

    /// Generates one official tensor; returns its expected (dequantized) values.
    fn gen(&mut self, name: &str, shape: &[usize], store: Store) -> Vec<f32> {
        let n: usize = shape.iter().product();
        match store {
            Store::F32 => {
                let v: Vec<f32> = (0..n).map(|_| self.rng.unit()).collect();
                self.put(name, Dtype::F32, shape.to_vec(), v.iter().flat_map(|x| x.to_le_bytes()).collect());
                v
            }
            Store::Bf16 | Store::F16 => {
                let bits: Vec<u16> = (0..n)
                    .map(|_| match store {
                        Store::Bf16 => half::bf16::from_f32(self.rng.unit()).to_bits(),
                        _ => half::f16::from_f32(self.rng.unit()).to_bits(),
                    })
                    .collect();
                let v = bits
                    .iter()
                    .map(|&b| match store {
                        Store::Bf16 => f32::from_bits((b as u32) << 16),
                        _ => half::f16::from_bits(b).to_f32(),
                    })
                    .collect();
                let dtype = if matches!(store, Store::Bf16) { Dtype::BF16 } else { Dtype::F16 };
                self.put(name, dtype, shape.to_vec(), bits.iter().flat_map(|b| b.to_le_bytes()).collect());
                v
            }
            Store::Fp8 => {
                let (r, c) = (shape[0], shape[1]);
                let (sr, sc) = (r.div_ceil(128), c.div_ceil(128));
                let scales: Vec<u8> = (0..sr * sc).map(|_| 118 + (self.rng.next() % 8) as u8).collect();
                let codes: Vec<u8> = (0..n)
                    .map(|_| loop {
                        let b = self.rng.next() as u8;
                        if b & 0x7f != 0x7f {
                            break b;
                        }
                    })
                    .collect();
                let v = (0..n)
                    .map(|i| {
                        let s = scales[(i / c / 128) * sc + (i % c) / 128];
                        e4m3_ref(codes[i]) * 2f32.powi(s as i32 - 127)
                    })
                    .collect();
                self.put(name, Dtype::F8_E4M3, shape.to_vec(), codes);
                let base = name.strip_suffix(".weight").unwrap();
                self.put(&format!("{base}.scale"), Dtype::F8_E8M0, vec![sr, sc], scales);
                v
            }
            Store::Fp4 => {
                let (r, c) = (shape[0], shape[1]);
                let scales: Vec<u8> = (0..r * c / 32).map(|_| 120 + (self.rng.next() % 8) as u8).collect();
                let nib: Vec<u8> = (0..n).map(|_| (self.rng.next() & 15) as u8).collect();
                let packed: Vec<u8> = nib.chunks(2).map(|p| p[0] | (p[1] << 4)).collect();
                let v = (0..n).map(|i| e2m1_ref(nib[i]) * 2f32.powi(scales[i / 32] as i32 - 127)).collect();
                self.put(name, Dtype::I8, vec![r, c / 2], packed);
                let base = name.strip_suffix(".weight").unwrap();
                self.put(&format!("{base}.scale"), Dtype::F8_E8M0, vec![r, c / 32], scales);
                v
            }
        }
    }

    /// One official tensor that maps 1:1 to a GGUF tensor.
    fn one(&mut self, official: &str, gguf: &str, shape: &[usize], store: Store) {
        let v = self.gen(official, shape, store);
        self.expected.insert(gguf.to_string(), (shape.iter().rev().map(|&d| d as u64).collect(), v));
    }

    fn new(seed: u64) -> Fixture {
        let config = serde_json::json!({
            "vocab_size": 256, "hidden_size": 256, "num_hidden_layers": 3, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 128, "qk_rope_head_dim": 64, "q_lora_rank": 128, "o_groups": 2,
            "o_lora_rank": 128, "moe_intermediate_size": 256, "n_routed_experts": 4, "n_shared_experts": 1,
            "num_experts_per_tok": 2, "routed_scaling_factor": 1.5, "swiglu_limit": 10.0, "num_hash_layers": 1,
            "rope_theta": 10000.0, "compress_rope_theta": 160000.0,
            "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536,
                             "beta_fast": 32, "beta_slow": 1},
            "max_position_embeddings": 1048576, "sliding_window": 128, "index_n_heads": 2, "index_head_dim": 64,
            "index_topk": 8, "compress_ratios": [0, 4, 8, 0], "hc_mult": 4, "hc_sinkhorn_iters": 20,
            "hc_eps": 1e-6, "rms_norm_eps": 1e-6, "norm_topk_prob": true,
            "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}
        });
        let mut f = Fixture { config, stored: BTreeMap::new(), expected: HashMap::new(), rng: Rng(seed | 1) };
        let (d, v, hd, ql, ol, og, h, ff, ne, k) = (256, 256, 128, 128, 128, 2, 2, 256, 4, 2);
        f.one("embed.weight", "token_embd.weight", &[v, d], Store::Bf16);
        for il in 0..3usize {
            let o = |x: &str| format!("layers.{il}.{x}");
            let g = |x: &str| format!("blk.{il}.{x}");
            for s in ["attn", "ffn"] {
                f.one(&o(&format!("hc_{s}_fn")), &g(&format!("hc_{s}_fn.weight")), &[24, 4 * d], Store::F32);
                f.one(&o(&format!("hc_{s}_base")), &g(&format!("hc_{s}_base.weight")), &[24], Store::F32);
                f.one(&o(&format!("hc_{s}_scale")), &g(&format!("hc_{s}_scale.weight")), &[3], Store::F32);
            }
            f.one(&o("attn_norm.weight"), &g("attn_norm.weight"), &[d], Store::Bf16);
            f.one(&o("attn.wq_a.weight"), &g("attn_q_a.weight"), &[ql, d], Store::Fp8);
            f.one(&o("attn.q_norm.weight"), &g("attn_q_a_norm.weight"), &[ql], Store::Bf16);
            f.one(&o("attn.wq_b.weight"), &g("attn_q_b.weight"), &[h * hd, ql], Store::Fp8);
            f.one(&o("attn.wkv.weight"), &g("attn_kv.weight"), &[hd, d], Store::Fp8);
            f.one(&o("attn.kv_norm.weight"), &g("attn_kv_a_norm.weight"), &[hd], Store::Bf16);
            f.one(&o("attn.attn_sink"), &g("attn_sinks.weight"), &[h], Store::F32);
            f.one(&o("attn.wo_a.weight"), &g("attn_output_a.weight"), &[og * ol, h * hd / og], Store::Fp8);
            f.one(&o("attn.wo_b.weight"), &g("attn_output_b.weight"), &[d, og * ol], Store::Fp8);
            let ratio = [0, 4, 8][il];
            if ratio > 0 {
                let w = if ratio == 4 { 2 * hd } else { hd };
                f.one(&o("attn.compressor.ape"), &g("attn_compressor_ape.weight"), &[ratio, w], Store::F32);
                f.one(&o("attn.compressor.wkv.weight"), &g("attn_compressor_kv.weight"), &[w, d], Store::Bf16);
                f.one(&o("attn.compressor.wgate.weight"), &g("attn_compressor_gate.weight"), &[w, d], Store::Bf16);
                f.one(&o("attn.compressor.norm.weight"), &g("attn_compressor_norm.weight"), &[hd], Store::Bf16);
            }
            if ratio == 4 {
                let (ih, ihd) = (2, 64);
                f.one(&o("attn.indexer.wq_b.weight"), &g("indexer.attn_q_b.weight"), &[ih * ihd, ql], Store::Fp8);
                f.one(&o("attn.indexer.weights_proj.weight"), &g("indexer.proj.weight"), &[ih, d], Store::Bf16);
                f.one(
                    &o("attn.indexer.compressor.ape"),
                    &g("indexer_compressor_ape.weight"),
                    &[4, 2 * ihd],
                    Store::F32,
                );
                f.one(
                    &o("attn.indexer.compressor.wkv.weight"),
                    &g("indexer_compressor_kv.weight"),
                    &[2 * ihd, d],
                    Store::F16,
                );
                f.one(
                    &o("attn.indexer.compressor.wgate.weight"),
                    &g("indexer_compressor_gate.weight"),
                    &[2 * ihd, d],
                    Store::Bf16,
                );
                f.one(
                    &o("attn.indexer.compressor.norm.weight"),
                    &g("indexer_compressor_norm.weight"),
                    &[ihd],
                    Store::Bf16,
                );
            }
            f.one(&o("ffn_norm.weight"), &g("ffn_norm.weight"), &[d], Store::Bf16);
            f.one(&o("ffn.gate.weight"), &g("ffn_gate_inp.weight"), &[ne, d], Store::Bf16);
            if il == 0 {
                let ids: Vec<i64> = (0..v * k).map(|i| ((i * 7 + i / k) % ne) as i64).collect();
                let bytes = ids.iter().flat_map(|x| x.to_le_bytes()).collect();
                f.put(&o("ffn.gate.tid2eid"), Dtype::I64, vec![v, k], bytes);
                f.expected.insert(
                    g("ffn_gate_tid2eid.weight"),
                    (vec![k as u64, v as u64], ids.iter().map(|&x| x as f32).collect()),
                );
            } else {
                f.one(&o("ffn.gate.bias"), &g("exp_probs_b.bias"), &[ne], Store::F32);
            }
            for (w, gname, shape) in
                [("w1", "ffn_gate_exps", [ff, d]), ("w3", "ffn_up_exps", [ff, d]), ("w2", "ffn_down_exps", [d, ff])]
            {
                let mut all = Vec::new();
                for e in 0..ne {
                    all.extend(f.gen(&o(&format!("ffn.experts.{e}.{w}.weight")), &shape, Store::Fp4));
                }
                f.expected
                    .insert(g(&format!("{gname}.weight")), (vec![shape[1] as u64, shape[0] as u64, ne as u64], all));
            }
            f.one(&o("ffn.shared_experts.w1.weight"), &g("ffn_gate_shexp.weight"), &[ff, d], Store::Fp8);
            f.one(&o("ffn.shared_experts.w3.weight"), &g("ffn_up_shexp.weight"), &[ff, d], Store::Fp8);
            f.one(&o("ffn.shared_experts.w2.weight"), &g("ffn_down_shexp.weight"), &[d, ff], Store::Fp8);
        }
        f.one("hc_head_fn", "output_hc_fn.weight", &[4, 4 * d], Store::F32);
        f.one("hc_head_base", "output_hc_base.weight", &[4], Store::F32);
        f.one("hc_head_scale", "output_hc_scale.weight", &[1], Store::F32);
        f.one("norm.weight", "output_norm.weight", &[d], Store::Bf16);
        f.one("head.weight", "output.weight", &[v, d], Store::Bf16);
        // An MTP tensor the DS4 main file does not use.
        f.gen("mtp.0.enorm.weight", &[d], Store::Bf16);
        f
    }

    /// Writes config.json and the tensors, in `shards` files (with an index json when more than one).
    fn write(&self, dir: &Path, shards: usize) {
        std::fs::write(dir.join("config.json"), serde_json::to_string_pretty(&self.config).unwrap()).unwrap();
        let names: Vec<&String> = self.stored.keys().collect();
        let per = names.len().div_ceil(shards);
        let mut weight_map = serde_json::Map::new();
        for (si, chunk) in names.chunks(per).enumerate() {
            let file = if shards == 1 {
                "model.safetensors".to_string()
            } else {
                format!("model-{:05}-of-{shards:05}.safetensors", si + 1)
            };
            let views: Vec<(String, TensorView)> = chunk
                .iter()
                .map(|n| {
                    let s = &self.stored[*n];
                    ((*n).clone(), TensorView::new(s.dtype, s.shape.clone(), &s.bytes).unwrap())
                })
                .collect();
            for n in chunk {
                weight_map.insert((*n).clone(), serde_json::Value::String(file.clone()));
            }
            safetensors::serialize_to_file(views, None, &dir.join(&file)).unwrap();
        }
        if shards > 1 {
            let index = serde_json::json!({"metadata": {}, "weight_map": weight_map});
            std::fs::write(dir.join("model.safetensors.index.json"), index.to_string()).unwrap();
        }
    }
}

fn gguf_values(g: &GgufFile, name: &str) -> Vec<f32> {
    let t = g.tensor(name).unwrap_or_else(|| panic!("{name} missing"));
    if t.info.ty == GgmlType::I32 {
        return t.data.chunks_exact(4).map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32).collect();
    }
    let row = t.info.dims[0] as usize;
    let rb = t.info.ty.row_bytes(row as u64).unwrap() as usize;
    let mut out = vec![0f32; t.info.n_elements() as usize];
    for (src, dst) in t.data.chunks_exact(rb).zip(out.chunks_exact_mut(row)) {
        dequantize_row(t.info.ty, src, dst).unwrap();
    }
    out
}

fn convert_dir(dir: &Path, recipe: Recipe) -> ds4_engine::Result<(GgufFile, ds4_engine::convert::ConvertReport)> {
    let out = dir.join(format!("out-{recipe}.gguf"));
    let r = convert(&ConvertOptions::new(dir, &out, recipe))?;
    Ok((GgufFile::open(&out).unwrap(), r))
}

#[test]
fn release_formats_decode_exactly_single_and_sharded() {
    let fx = Fixture::new(7);
    let mut bytes_of = Vec::new();
    for shards in [1, 3] {
        let tmp = tempfile::tempdir().unwrap();
        fx.write(tmp.path(), shards);
        let (g, report) = convert_dir(tmp.path(), Recipe::F32).unwrap();
        assert_eq!(report.unused, vec!["mtp.0.enorm.weight".to_string()]);
        assert_eq!(g.tensors().len(), fx.expected.len());
        for (name, (dims, want)) in &fx.expected {
            let t = g.tensor_info(name).unwrap_or_else(|| panic!("{name} missing"));
            assert_eq!(&t.dims, dims, "{name} dims");
            let got = gguf_values(&g, name);
            assert_eq!(got.len(), want.len());
            if let Some(i) = got.iter().zip(want).position(|(a, b)| a != b) {
                panic!("{name}[{i}]: got {}, want {} (shards {shards})", got[i], want[i]);
            }
        }
        assert_eq!(g.get_int_array("deepseek4.attention.compress_ratios").unwrap(), vec![0, 4, 8]);
        bytes_of.push(g.tensors().iter().map(|t| g.view(t).data.to_vec()).collect::<Vec<_>>());
    }
    assert!(bytes_of[0] == bytes_of[1], "sharded and single-file conversions differ");
}

#[test]
fn q2_and_q4_from_fp4_experts() {
    let fx = Fixture::new(11);
    let tmp = tempfile::tempdir().unwrap();
    fx.write(tmp.path(), 1);
    for (recipe, gate_ty, down_ty, tol) in
        [(Recipe::Q2, GgmlType::Iq2Xxs, GgmlType::Q2K, 0.45), (Recipe::Q4, GgmlType::Q4K, GgmlType::Q4K, 0.1)]
    {
        let (g, _) = convert_dir(tmp.path(), recipe).unwrap();
        for il in 0..3 {
            for (name, ty) in [
                (format!("blk.{il}.ffn_gate_exps.weight"), gate_ty),
                (format!("blk.{il}.ffn_up_exps.weight"), gate_ty),
                (format!("blk.{il}.ffn_down_exps.weight"), down_ty),
                (format!("blk.{il}.attn_q_b.weight"), GgmlType::Q8_0),
                (format!("blk.{il}.ffn_down_shexp.weight"), GgmlType::Q8_0),
                (format!("blk.{il}.hc_ffn_fn.weight"), GgmlType::F16),
                (format!("blk.{il}.ffn_gate_inp.weight"), GgmlType::F16),
            ] {
                let t = g.tensor_info(&name).unwrap();
                assert_eq!(t.ty, ty, "{recipe} {name}");
                let (_, want) = &fx.expected[&name];
                let got = gguf_values(&g, &name);
                let err: f64 = got.iter().zip(want).map(|(a, b)| ((a - b) as f64).powi(2)).sum();
                let norm: f64 = want.iter().map(|b| (*b as f64).powi(2)).sum();
                let rel = (err / norm).sqrt();
                let tol = if ty == GgmlType::Q8_0 {
                    8e-3
                } else if ty == GgmlType::F16 {
                    5e-4
                } else {
                    tol
                };
                assert!(rel <= tol, "{recipe} {name} ({ty}): relative RMS error {rel}");
            }
        }
        assert_eq!(g.tensor_info("blk.0.ffn_gate_tid2eid.weight").unwrap().ty, GgmlType::I32);
        assert_eq!(g.tensor_info("output.weight").unwrap().ty, GgmlType::Q8_0);
        assert_eq!(g.tensor_info("token_embd.weight").unwrap().ty, GgmlType::F16);
    }
}

/// Converts a broken variant of the fixture and returns the error text; checks no output or temp file is left.
fn broken(edit: impl FnOnce(&mut Fixture, &Path)) -> String {
    let mut fx = Fixture::new(3);
    let tmp = tempfile::tempdir().unwrap();
    fx.write(tmp.path(), 2);
    edit(&mut fx, tmp.path());
    let out = tmp.path().join("bad.gguf");
    let e = convert(&ConvertOptions::new(tmp.path(), &out, Recipe::F32)).unwrap_err().to_string();
    assert!(!out.exists(), "output written despite error: {e}");
    assert!(!tmp.path().join("bad.gguf.tmp").exists(), "temp file left behind: {e}");
    e
}

#[test]
fn broken_checkpoints_give_clear_errors() {
    // missing tensor, named
    let e = broken(|fx, dir| {
        fx.stored.remove("layers.1.ffn.experts.2.w3.weight");
        fx.write(dir, 2);
    });
    assert!(e.contains("layers.1.ffn.experts.2.w3.weight"), "{e}");

    // wrong shape: name, expected, got
    let e = broken(|fx, dir| {
        fx.gen("layers.2.attn.wkv.weight", &[64, 256], Store::Bf16);
        fx.write(dir, 2);
    });
    assert!(e.contains("layers.2.attn.wkv.weight") && e.contains("[128, 256]") && e.contains("[64, 256]"), "{e}");

    // missing FP8 scale for packed FP4
    let e = broken(|fx, dir| {
        fx.stored.remove("layers.0.ffn.experts.1.w1.scale");
        fx.write(dir, 2);
    });
    assert!(e.contains("layers.0.ffn.experts.1.w1.weight") && e.contains("scale"), "{e}");

    // unsupported dtype
    let e = broken(|fx, dir| {
        fx.put("norm.weight", Dtype::U32, vec![256], vec![0; 1024]);
        fx.write(dir, 2);
    });
    assert!(e.contains("norm.weight") && e.contains("U32"), "{e}");

    // tid2eid with an expert id out of range
    let e = broken(|fx, dir| {
        fx.put(
            "layers.0.ffn.gate.tid2eid",
            Dtype::I32,
            vec![256, 2],
            [9i32; 512].iter().flat_map(|x| x.to_le_bytes()).collect(),
        );
        fx.write(dir, 2);
    });
    assert!(e.contains("tid2eid") && e.contains('9'), "{e}");

    // truncated shard
    let e = broken(|_, dir| {
        let p = dir.join("model-00002-of-00002.safetensors");
        let len = std::fs::metadata(&p).unwrap().len();
        let f = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        f.set_len(len - 100).unwrap();
    });
    assert!(e.contains("model-00002-of-00002.safetensors") && e.contains("truncated"), "{e}");

    // garbage header
    let e = broken(|_, dir| {
        std::fs::write(dir.join("model-00001-of-00002.safetensors"), b"\x10\0\0\0\0\0\0\0{not json at all}").unwrap();
    });
    assert!(e.contains("model-00001-of-00002.safetensors"), "{e}");

    // index names a missing shard
    let e = broken(|_, dir| {
        std::fs::remove_file(dir.join("model-00002-of-00002.safetensors")).unwrap();
    });
    assert!(e.contains("model-00002-of-00002.safetensors"), "{e}");

    // missing config key
    let e = broken(|fx, dir| {
        fx.config.as_object_mut().unwrap().remove("o_lora_rank");
        fx.write(dir, 2);
    });
    assert!(e.contains("o_lora_rank"), "{e}");

    // no config at all
    let e = broken(|_, dir| std::fs::remove_file(dir.join("config.json")).unwrap());
    assert!(e.contains("config.json"), "{e}");
}

#[test]
fn tokenizer_metadata_is_embedded_and_vocab_checked() {
    let fx = Fixture::new(5);
    let tmp = tempfile::tempdir().unwrap();
    fx.write(tmp.path(), 1);
    let write_tok = |n: usize| {
        let tokens: Vec<String> = (0..n).map(|i| format!("<t{i}>")).collect();
        let refs: Vec<&str> = tokens.iter().map(|s| s.as_str()).collect();
        let json = ds4_engine::tokenizer::tokenizer_json_from_parts(&refs, &[], None).unwrap();
        let p = tmp.path().join(format!("tokenizer-{n}.json"));
        std::fs::write(&p, json).unwrap();
        p
    };
    let out = tmp.path().join("tok.gguf");
    let mut opts = ConvertOptions::new(tmp.path(), &out, Recipe::F16);
    opts.tokenizer = Some(write_tok(256));
    convert(&opts).unwrap();
    let g = GgufFile::open(&out).unwrap();
    let tokens = g.get_str_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len(), 256);
    assert_eq!((tokens[0], tokens[255]), ("<t0>", "<t255>"));

    let out2 = tmp.path().join("tok-bad.gguf");
    let mut opts = ConvertOptions::new(tmp.path(), &out2, Recipe::F16);
    opts.tokenizer = Some(write_tok(255));
    let e = convert(&opts).unwrap_err().to_string();
    assert!(e.contains("255 tokens") && e.contains("vocab_size is 256"), "{e}");
    assert!(!out2.exists());
}

/// The `ds4` binary (package `ds4-cli`) of this test's build profile, built first.
fn ds4_bin() -> std::path::PathBuf {
    // target/<profile>/deps/<test-exe> -> target/<profile>/ds4
    let exe = std::env::current_exe().expect("current exe");
    let profile = exe.parent().and_then(Path::parent).expect("target profile dir");
    let mut cmd = std::process::Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()));
    cmd.args(["build", "-q", "-p", "ds4-cli", "--bin", "ds4"]).current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
    if profile.file_name().is_some_and(|n| n == "release") {
        cmd.arg("--release");
    }
    assert!(cmd.status().expect("running cargo build").success(), "building the ds4 binary failed");
    profile.join(format!("ds4{}", std::env::consts::EXE_SUFFIX))
}

#[test]
fn cli_convert_writes_a_file_and_rejects_bad_arguments() {
    let fx = Fixture::new(9);
    let tmp = tempfile::tempdir().unwrap();
    fx.write(tmp.path(), 2);
    let out = tmp.path().join("cli.gguf");
    let bin = &ds4_bin();
    let input = tmp.path().to_str().unwrap();
    let st = std::process::Command::new(bin)
        .args(["convert", "--input", input, "--output", out.to_str().unwrap(), "--recipe", "q8_0", "--quiet"])
        .env("RUST_LOG", "warn")
        .output()
        .unwrap();
    assert!(st.status.success(), "{}", String::from_utf8_lossy(&st.stderr));
    let g = GgufFile::open(&out).unwrap();
    assert_eq!(g.tensor_info("blk.0.attn_q_b.weight").unwrap().ty, GgmlType::Q8_0);
    let st = std::process::Command::new(bin)
        .args(["convert", "--input", input, "--output", "x.gguf", "--recipe", "q3"])
        .output()
        .unwrap();
    assert!(!st.status.success());
    assert!(String::from_utf8_lossy(&st.stderr).contains("q3"));
    let st = std::process::Command::new(bin)
        .args(["convert", "--input", "/nonexistent-ds4-dir", "--output", out.to_str().unwrap(), "--recipe", "f32"])
        .output()
        .unwrap();
    assert!(!st.status.success());
    assert!(String::from_utf8_lossy(&st.stderr).contains("nonexistent-ds4-dir"));
}

#[test]
fn imatrix_steers_quantization_and_is_recorded() {
    let fx = Fixture::new(13);
    let tmp = tempfile::tempdir().unwrap();
    fx.write(tmp.path(), 1);
    // Packed per-expert vectors for blk.1 down (rows of 256 = moe_intermediate_size, 4 experts): the first half of
    // every row matters, the second half hardly.
    let packed: Vec<f32> = (0..4 * 256).map(|i| if i % 256 < 128 { 100.0 } else { 0.01 }).collect();
    let dat = ds4_engine::convert::imatrix::write_dat(&[("blk.1.ffn_down_exps.weight", 1, &packed)]);
    let im_path = tmp.path().join("imatrix.dat");
    std::fs::write(&im_path, dat).unwrap();

    let plain = tmp.path().join("plain.gguf");
    convert(&ConvertOptions::new(tmp.path(), &plain, Recipe::Q2)).unwrap();
    let weighted = tmp.path().join("weighted.gguf");
    let mut opts = ConvertOptions::new(tmp.path(), &weighted, Recipe::Q2);
    opts.imatrix = Some(im_path.clone());
    convert(&opts).unwrap();
    let (p, w) = (GgufFile::open(&plain).unwrap(), GgufFile::open(&weighted).unwrap());
    assert_eq!(w.get_usize("quantize.imatrix.entries_count").unwrap(), 1);
    assert!(w.get_str("quantize.imatrix.file").unwrap().ends_with("imatrix.dat"));

    let name = "blk.1.ffn_down_exps.weight";
    assert_eq!(w.tensor_info(name).unwrap().ty, GgmlType::Q2K);
    let (_, want) = &fx.expected[name];
    let important_err = |g: &GgufFile| -> f64 {
        let got = gguf_values(g, name);
        got.iter()
            .zip(want)
            .enumerate()
            .filter(|(i, _)| i % 256 < 128)
            .map(|(_, (a, b))| ((a - b) as f64).powi(2))
            .sum()
    };
    let (ep, ew) = (important_err(&p), important_err(&w));
    assert!(ew < ep * 0.9, "imatrix did not lower the error on important columns: {ew} vs {ep}");
    // tensors the imatrix does not cover are unchanged
    let other = "blk.2.ffn_down_exps.weight";
    assert_eq!(p.tensor(other).unwrap().data, w.tensor(other).unwrap().data);

    // an entry of the wrong size is an error naming it
    let bad = ds4_engine::convert::imatrix::write_dat(&[("blk.1.ffn_down_exps.weight", 1, &[1.0; 100])]);
    std::fs::write(&im_path, bad).unwrap();
    let e = convert(&opts).unwrap_err().to_string();
    assert!(e.contains("blk.1.ffn_down_exps.weight") && e.contains("100 values"), "{e}");
}
