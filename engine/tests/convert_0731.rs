//! V4-Flash-0731 checkpoints (issue 15): the golden `tiny-a` checkpoint turned into a 0731-shaped one here — the
//! `dspark_*` config fields, `compress_ratios` listing the three drafter stages after the trunk layers, and a
//! three-stage drafter under `mtp.{0,1,2}.*` (BF16, F32 and an I64 table) — must convert, keep the drafter tensors
//! (same values, official names, reversed dims), record the revision, and run the trunk with exactly the logits of
//! the April conversion of the same trunk. The engine must load the 0731 file with and without its drafter tensors
//! and with unknown extra keys, and refuse a file missing a required trunk tensor with an error naming it.

use std::path::{Path, PathBuf};

use ds4_engine::convert::{convert, ConvertOptions, Recipe};
use ds4_engine::gguf::{GgufFile, GgufWriter, MetaValue, TensorDecl};
use ds4_engine::model::config::Revision;
use ds4_engine::{Engine, EngineOptions};
use safetensors::tensor::{Dtype, TensorView};
use safetensors::SafeTensors;

fn golden_dir() -> Option<PathBuf> {
    ds4_engine::testdata::shared("golden/tiny-a", "model.safetensors")
}

/// The drafter tensors added to the fixture: name, dtype, shape, little-endian bytes.
fn drafter_tensors(d: usize, vocab: usize) -> Vec<(String, Dtype, Vec<usize>, Vec<u8>)> {
    let mut out = Vec::new();
    let mut x = 0x2545_f491_4f6c_dd1du64;
    let mut next = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        ((x >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    };
    for s in 0..3 {
        let bf16: Vec<u8> = (0..2 * d * d).flat_map(|_| half::bf16::from_f32(next()).to_bits().to_le_bytes()).collect();
        out.push((format!("mtp.{s}.e_proj.weight"), Dtype::BF16, vec![d, 2 * d], bf16));
        let f32s: Vec<u8> = (0..d).flat_map(|_| (1.0 + 0.1 * next()).to_le_bytes()).collect();
        out.push((format!("mtp.{s}.enorm.weight"), Dtype::F32, vec![d], f32s));
        let ids: Vec<u8> = (0..vocab as i64).flat_map(|t| ((t * 7 + s) % 8).to_le_bytes()).collect();
        out.push((format!("mtp.{s}.ffn.gate.tid2eid"), Dtype::I64, vec![vocab, 2], ids.repeat(2)));
    }
    out
}

/// Writes the 0731-shaped copy of the golden checkpoint into `dst`.
fn make_0731(golden: &Path, dst: &Path) -> serde_json::Value {
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(golden.join("config.json")).unwrap()).unwrap();
    let n_layers = cfg["num_hidden_layers"].as_u64().unwrap() as usize;
    let o = cfg.as_object_mut().unwrap();
    o.insert("dspark_block_size".into(), 5.into());
    o.insert("dspark_noise_token_id".into(), 3.into());
    o.insert("dspark_target_layer_ids".into(), serde_json::json!([n_layers - 3, n_layers - 2, n_layers - 1]));
    o.insert("dspark_markov_rank".into(), 2.into());
    o.insert("num_nextn_predict_layers".into(), 3.into());
    o.get_mut("compress_ratios").unwrap().as_array_mut().unwrap().extend([0, 0, 0].map(serde_json::Value::from));
    std::fs::create_dir_all(dst).unwrap();
    std::fs::write(dst.join("config.json"), serde_json::to_string_pretty(&cfg).unwrap()).unwrap();
    let bytes = std::fs::read(golden.join("model.safetensors")).unwrap();
    let st = SafeTensors::deserialize(&bytes).unwrap();
    let d = cfg["hidden_size"].as_u64().unwrap() as usize;
    let vocab = cfg["vocab_size"].as_u64().unwrap() as usize;
    let extra = drafter_tensors(d, vocab);
    let mut views: Vec<(String, TensorView)> = st.tensors().into_iter().map(|(n, v)| (n.to_string(), v)).collect();
    for (n, dt, shape, b) in &extra {
        views.push((n.clone(), TensorView::new(*dt, shape.clone(), b).unwrap()));
    }
    safetensors::serialize_to_file(views, None, &dst.join("model.safetensors")).unwrap();
    cfg
}

fn run_logits(file: GgufFile, prompt: &[u32]) -> (Vec<f32>, Revision) {
    let opts = EngineOptions { exact: true, threads: 2, ..EngineOptions::default() };
    let mut e = Engine::from_gguf(file, opts).unwrap();
    let rev = e.config().revision;
    let s = e.create_session();
    e.set_prefill_logits(s, true).unwrap();
    e.feed(s, prompt).unwrap();
    e.run_until_idle().unwrap();
    (e.take_all_logits(s).unwrap(), rev)
}

/// `f` rewritten: metadata edited by `meta`, tensors kept where `keep` says so.
fn rewrite(f: &GgufFile, meta: impl Fn(&mut Vec<(String, MetaValue)>), keep: impl Fn(&str) -> bool) -> GgufFile {
    let mut md = f.metadata().to_vec();
    meta(&mut md);
    let kept: Vec<_> = f.tensors().iter().filter(|t| keep(&t.name)).collect();
    let decls = kept.iter().map(|t| TensorDecl { name: t.name.clone(), ty: t.ty, dims: t.dims.clone() }).collect();
    let mut w = GgufWriter::new(Vec::new(), &md, decls).unwrap();
    for t in &kept {
        w.write_tensor(&t.name, f.view(t).data).unwrap();
    }
    GgufFile::from_bytes(w.finish().unwrap()).unwrap()
}

#[test]
fn a_0731_checkpoint_converts_keeps_its_drafter_and_runs_the_april_trunk() {
    let Some(golden) = golden_dir() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let ck = tmp.path().join("tiny-0731");
    let cfg = make_0731(&golden, &ck);
    let n_layers = cfg["num_hidden_layers"].as_u64().unwrap() as usize;

    let april_out = tmp.path().join("april.gguf");
    let r = convert(&ConvertOptions::new(&golden, &april_out, Recipe::F32)).unwrap();
    assert!(r.unused.is_empty(), "{:?}", r.unused);
    let v_out = tmp.path().join("0731.gguf");
    let r = convert(&ConvertOptions::new(&ck, &v_out, Recipe::F32)).unwrap();
    assert!(r.unused.is_empty(), "drafter tensors are all kept: {:?}", r.unused);

    let april = GgufFile::open(&april_out).unwrap();
    let v = GgufFile::open(&v_out).unwrap();
    assert_eq!(april.get_str("deepseek4.revision").unwrap(), "2604");
    assert_eq!(v.get_str("deepseek4.revision").unwrap(), "0731");
    assert_eq!(v.get_usize("deepseek4.dspark.block_size").unwrap(), 5);
    assert_eq!(v.get_usize("deepseek4.dspark.noise_token_id").unwrap(), 3);
    assert_eq!(v.get_usize("deepseek4.dspark.markov_rank").unwrap(), 2);
    let ids = v.get_int_array("deepseek4.dspark.target_layer_ids").unwrap();
    assert_eq!(ids, vec![n_layers as i64 - 3, n_layers as i64 - 2, n_layers as i64 - 1]);
    assert_eq!(v.get_int_array("deepseek4.attention.compress_ratios").unwrap().len(), n_layers + 3);
    assert_eq!(v.get_usize("deepseek4.block_count").unwrap(), n_layers);

    // The trunk is byte-identical to the April conversion; the drafter follows it, values unchanged.
    for t in april.tensors() {
        let u = v.tensor_info(&t.name).unwrap_or_else(|| panic!("0731 file lacks {}", t.name));
        assert_eq!((u.ty, &u.dims), (t.ty, &t.dims), "{}", t.name);
        assert!(april.view(t).data == v.view(u).data, "{} differs", t.name);
    }
    let d = cfg["hidden_size"].as_u64().unwrap() as usize;
    let vocab = cfg["vocab_size"].as_u64().unwrap() as usize;
    let drafter = drafter_tensors(d, vocab);
    assert_eq!(v.tensors().len(), april.tensors().len() + drafter.len());
    for (name, dt, shape, bytes) in &drafter {
        let t = v.tensor(name).unwrap_or_else(|| panic!("drafter tensor {name} missing"));
        let rev: Vec<u64> = shape.iter().rev().map(|&x| x as u64).collect();
        assert_eq!(t.info.dims, rev, "{name}");
        let want: Vec<u8> = match dt {
            Dtype::BF16 => bytes
                .chunks_exact(2)
                .flat_map(|c| f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16).to_le_bytes())
                .collect(),
            Dtype::I64 => bytes.chunks_exact(8).flat_map(|c| (c[0] as i32).to_le_bytes()).collect(),
            _ => bytes.clone(),
        };
        assert!(t.data == want.as_slice(), "{name}: values differ");
    }

    // Same trunk, same logits; both track the golden reference.
    let g: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(golden.join("golden.json")).unwrap()).unwrap();
    let prompt: Vec<u32> = g["prompt_tokens"].as_array().unwrap().iter().map(|x| x.as_u64().unwrap() as u32).collect();
    let (la, ra) = run_logits(GgufFile::open(&april_out).unwrap(), &prompt);
    let (lv, rv) = run_logits(GgufFile::open(&v_out).unwrap(), &prompt);
    assert_eq!((ra, rv), (Revision::April, Revision::V0731));
    assert!(la == lv, "0731 trunk logits differ from the April trunk's");
    let want: Vec<f32> = std::fs::read(golden.join("prefill_logits.f32"))
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    let diff = lv.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
    assert!(lv.len() == want.len() && diff <= 1e-3, "max |logit - golden| = {diff}");

    // Without the drafter tensors, and with unknown extra keys, the 0731 file still runs the same trunk.
    let stripped =
        rewrite(&v, |m| m.push(("deepseek4.some_future_key".into(), MetaValue::U32(7))), |n| !n.starts_with("mtp."));
    assert_eq!(run_logits(stripped, &prompt).0, lv);
    // A missing trunk tensor is an error naming it; an unknown revision is an error naming the key.
    let broken = rewrite(&v, |_| {}, |n| n != "blk.0.attn_norm.weight");
    let e = Engine::from_gguf(broken, EngineOptions::default()).unwrap_err().to_string();
    assert!(e.contains("blk.0.attn_norm.weight"), "{e}");
    let future = rewrite(
        &v,
        |m| {
            m.iter_mut()
                .filter(|(k, _)| k == "deepseek4.revision")
                .for_each(|(_, x)| *x = MetaValue::String("9999".into()))
        },
        |_| true,
    );
    let e = Engine::from_gguf(future, EngineOptions::default()).unwrap_err().to_string();
    assert!(e.contains("deepseek4.revision") && e.contains("9999"), "{e}");
}

#[test]
fn incomplete_dspark_fields_are_named() {
    let Some(golden) = golden_dir() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(golden.join("config.json")).unwrap()).unwrap();
    cfg.as_object_mut().unwrap().insert("dspark_block_size".into(), 5.into());
    std::fs::write(tmp.path().join("config.json"), cfg.to_string()).unwrap();
    std::fs::copy(golden.join("model.safetensors"), tmp.path().join("model.safetensors")).unwrap();
    let e = convert(&ConvertOptions::new(tmp.path(), tmp.path().join("o.gguf"), Recipe::F32)).unwrap_err().to_string();
    assert!(e.contains("missing key `dspark_"), "{e}");
    assert!(!tmp.path().join("o.gguf").exists());
}
