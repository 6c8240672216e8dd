//! `ds4 inspect FILE`: metadata and tensor table of a GGUF file.

use std::collections::BTreeMap;
use std::path::PathBuf;

use ds4_engine::gguf::GgufFile;

/// Arguments of `ds4 inspect`.
#[derive(clap::Args, Debug)]
pub struct InspectArgs {
    /// The GGUF file.
    pub file: PathBuf,
    /// Skip the per-tensor table, print only metadata and a per-type summary.
    #[arg(long)]
    pub summary: bool,
}

/// Runs `ds4 inspect`.
pub fn run(a: InspectArgs) -> anyhow::Result<i32> {
    let f = GgufFile::open(&a.file)?;
    println!("file: {}", a.file.display());
    println!(
        "GGUF v{}, {} bytes, alignment {}, {} metadata keys, {} tensors",
        f.version(),
        f.file_size(),
        f.alignment(),
        f.metadata().len(),
        f.tensors().len()
    );
    println!("\nmetadata:");
    for (k, v) in f.metadata() {
        println!("  {k} = {v}");
    }
    let mut by_type: BTreeMap<&str, (usize, u64)> = BTreeMap::new();
    for t in f.tensors() {
        let e = by_type.entry(t.ty.name()).or_default();
        e.0 += 1;
        e.1 += t.n_bytes;
    }
    if !a.summary {
        println!("\ntensors:");
        println!("  {:<48} {:>8} {:>28} {:>14}", "name", "type", "dims", "bytes");
        for t in f.tensors() {
            let dims = format!("{:?}", t.dims);
            println!("  {:<48} {:>8} {:>28} {:>14}", t.name, t.ty.name(), dims, t.n_bytes);
        }
    }
    println!("\nby type:");
    for (ty, (n, bytes)) in by_type {
        println!("  {ty:<8} {n:>6} tensors {bytes:>16} bytes");
    }
    Ok(0)
}
