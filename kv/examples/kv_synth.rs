//! Fills a cache directory with one synthetic DeepSeek-V4-Flash-shaped session and times save and restore.
//!
//! `cargo run --release -p ds4-kv --example kv_synth -- DIR [TOKENS]`
//!
//! Layers as in Flash: 21 CSA (one 512-d KV row + one 128-d indexer row per 4 tokens), 20 HCA (one 512-d row per 128
//! tokens), 2 with nothing beyond the window. KV rows are FP8-rounded with bf16 rope dims, indexer rows are
//! f16-exact, like the live engine; the checkpoint holds a 43 × 128 × 512 raw window (bf16-exact) and 129,280 f32
//! logits. Prints MB/s for saving, loading, and a plain sequential write of the same f32 bytes for comparison.

use std::time::Instant;

use ds4_kv::{KvOptions, KvStore, ModelIdentity, RowBlock, SaveReason};

fn rnd(s: &mut u64) -> f32 {
    *s = s.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    ((*s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
}

fn kv_rows(n: usize, s: &mut u64) -> Vec<f32> {
    let mut v = Vec::with_capacity(n * 512);
    for _ in 0..n {
        for b in 0..7 {
            let scale = (2f32).powi(-(b % 5) - 6);
            for _ in 0..64 {
                let m = 8.0 + ((rnd(s) + 1.0) * 4.0).floor().min(7.0);
                let e = ((rnd(s) + 1.0) * 3.0).floor();
                v.push(m / 8.0 * (2f32).powf(e) * scale * if rnd(s) < 0.0 { -1.0 } else { 1.0 });
            }
        }
        for _ in 0..64 {
            v.push(half::bf16::from_f32(rnd(s)).to_f32());
        }
    }
    v
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let dir = args.get(1).ok_or("usage: kv_synth DIR [TOKENS]")?;
    let n_tokens: usize = args.get(2).map(|s| s.parse()).transpose()?.unwrap_or(16384);
    let opts = KvOptions { span_tokens: 256, disk_budget_bytes: u64::MAX, ..KvOptions::default() };
    let store = KvStore::open(dir, ModelIdentity::new("synthetic-flash sim=1"), opts)?;
    let mut s = 12345u64;
    let span = 256usize;
    let tokens: Vec<u32> = (0..n_tokens as u32).map(|i| i.wrapping_mul(2654435761) % 129_280).collect();
    let (mut parent, mut f32_bytes, mut t_save) = (store.root(), 0usize, 0f64);
    let mut pages = Vec::new();
    for (p, chunk) in tokens.chunks_exact(span).enumerate() {
        let csa: Vec<(Vec<f32>, Vec<f32>)> = (0..21)
            .map(|_| {
                (
                    kv_rows(span / 4, &mut s),
                    (0..span / 4 * 128).map(|_| half::f16::from_f32(rnd(&mut s)).to_f32()).collect(),
                )
            })
            .collect();
        let hca: Vec<Vec<f32>> = (0..20).map(|_| kv_rows(span / 128, &mut s)).collect();
        let mut layers: Vec<Vec<RowBlock<'_>>> = Vec::new();
        for (kv, idx) in &csa {
            layers.push(vec![
                RowBlock { tag: 0, rows: (span / 4) as u32, width: 512, values: kv },
                RowBlock { tag: 1, rows: (span / 4) as u32, width: 128, values: idx },
            ]);
        }
        for kv in &hca {
            layers.push(vec![RowBlock { tag: 0, rows: (span / 128) as u32, width: 512, values: kv }]);
        }
        layers.push(vec![]);
        layers.push(vec![]);
        f32_bytes += layers.iter().flatten().map(|b| b.values.len() * 4).sum::<usize>();
        let t = Instant::now();
        parent = store.put_page(&parent, chunk, &layers, SaveReason::Cold)?.key;
        t_save += t.elapsed().as_secs_f64();
        pages.push(parent);
        let _ = p;
    }
    let window: Vec<f32> = (0..43 * 128 * 512).map(|_| half::bf16::from_f32(rnd(&mut s)).to_f32()).collect();
    let logits: Vec<f32> = (0..129_280).map(|_| rnd(&mut s) * 20.0).collect();
    let tail = &tokens[tokens.len() / span * span..];
    let t = Instant::now();
    let ck = store.put_checkpoint(
        &parent,
        tail,
        &[
            vec![RowBlock { tag: 10, rows: 43 * 128, width: 512, values: &window }],
            vec![RowBlock { tag: 11, rows: 1, width: 129_280, values: &logits }],
        ],
        SaveReason::Shutdown,
    )?;
    t_save += t.elapsed().as_secs_f64();
    f32_bytes += (window.len() + logits.len()) * 4;
    let st = store.status();
    println!(
        "saved {} pages + 1 checkpoint: {} bytes on disk for {} f32 bytes ({:.2}x smaller)",
        pages.len(),
        st.bytes,
        f32_bytes,
        f32_bytes as f64 / st.bytes as f64
    );
    println!("save: {:.3} s = {:.0} MB/s of f32 input", t_save, f32_bytes as f64 / t_save / 1e6);

    let t = Instant::now();
    let mut sum = 0f64;
    for k in pages.iter().chain(std::iter::once(&ck.key)) {
        store.load(k, |v| {
            sum += v.values[0] as f64;
            Ok(())
        })?;
    }
    let t_load = t.elapsed().as_secs_f64();
    println!(
        "load (page cache warm): {:.3} s = {:.0} MB/s of f32 output (checksum {sum:.3})",
        t_load,
        f32_bytes as f64 / t_load / 1e6
    );

    let raw = std::path::Path::new(dir).join("raw-sequential.bin");
    let buf = vec![0u8; 1 << 20];
    let t = Instant::now();
    {
        use std::io::Write;
        let mut f = std::fs::File::create(&raw)?;
        for _ in 0..st.bytes.div_ceil(1 << 20) {
            f.write_all(&buf)?;
        }
        f.sync_all()?;
    }
    let t_raw = t.elapsed().as_secs_f64();
    std::fs::remove_file(&raw)?;
    println!(
        "raw sequential write of the same {} bytes + fsync: {:.3} s = {:.0} MB/s",
        st.bytes,
        t_raw,
        st.bytes as f64 / t_raw / 1e6
    );
    Ok(())
}
