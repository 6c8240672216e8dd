//! `ds4 convert --input DIR --output FILE.gguf --recipe {f32,f16,q8_0,q2,q4} [--tokenizer tokenizer.json]`: an
//! official checkpoint folder → DS4 GGUF (see [`ds4_engine::convert`]).

use std::path::PathBuf;

use ds4_engine::convert::{convert_with, ConvertOptions, Progress, Recipe};

/// Arguments of `ds4 convert`.
#[derive(clap::Args, Debug)]
pub struct ConvertArgs {
    /// Checkpoint folder: config.json plus *.safetensors (sharded with model.safetensors.index.json, or single).
    #[arg(long)]
    pub input: PathBuf,
    /// Output GGUF file (written as FILE.tmp, renamed when complete).
    #[arg(long)]
    pub output: PathBuf,
    /// Recipe: f32, f16, q8_0, or the shipped q2 (IQ2_XXS/Q2_K experts) / q4 (Q4_K experts).
    #[arg(long, default_value = "q2")]
    pub recipe: Recipe,
    /// tokenizer.json whose vocabulary and merges go into tokenizer.ggml.*.
    #[arg(long)]
    pub tokenizer: Option<PathBuf>,
    /// Importance matrix (llama.cpp legacy .dat, e.g. from the C engine's --imatrix-out) for quantized tensors.
    #[arg(long)]
    pub imatrix: Option<PathBuf>,
    /// general.name (default: the input folder's name).
    #[arg(long)]
    pub name: Option<String>,
    /// Hide the progress bar.
    #[arg(long)]
    pub quiet: bool,
}

/// The converter's progress as an indicatif bar on stderr (bytes of tensor data written).
struct Bar(indicatif::ProgressBar);

fn bar() -> indicatif::ProgressBar {
    let pb = indicatif::ProgressBar::with_draw_target(None, indicatif::ProgressDrawTarget::stderr());
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{spinner} [{elapsed_precise}] {wide_bar} {binary_bytes}/{binary_total_bytes} ({binary_bytes_per_sec}, eta {eta}) {msg}",
    ) {
        pb.set_style(style);
    }
    pb
}

impl Progress for Bar {
    fn start(&self, total_bytes: u64) {
        self.0.set_length(total_bytes);
    }
    fn tensor(&self, name: &str) {
        self.0.set_message(name.to_string());
    }
    fn advance(&self, bytes: u64) {
        self.0.inc(bytes);
    }
    fn finish(&self) {
        self.0.finish_and_clear();
    }
}

/// Runs `ds4 convert`.
pub fn run(a: ConvertArgs) -> anyhow::Result<i32> {
    let opts = ConvertOptions {
        input: a.input,
        output: a.output,
        recipe: a.recipe,
        tokenizer: a.tokenizer,
        imatrix: a.imatrix,
        name: a.name,
    };
    let bar = Bar(if a.quiet { indicatif::ProgressBar::hidden() } else { bar() });
    let r = convert_with(&opts, &bar)?;
    println!(
        "wrote {} ({} tensors, {} bytes, {:.1} s, {:.1} MB/s)",
        opts.output.display(),
        r.n_tensors,
        r.file_bytes,
        r.seconds,
        r.file_bytes as f64 / 1e6 / r.seconds.max(1e-9)
    );
    for (ty, (n, bytes)) in &r.by_type {
        println!("  {ty:<8} {n:>6} tensors {bytes:>16} bytes");
    }
    if !r.unused.is_empty() {
        println!("  {} checkpoint tensors not used (e.g. {})", r.unused.len(), r.unused[0]);
    }
    Ok(0)
}
