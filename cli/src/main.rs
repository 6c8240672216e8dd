//! The `ds4` command-line tool, on the `ds4-engine` library's public API. One file per subcommand; [`run`] parses
//! arguments and dispatches. Kept out of the engine crate so the library does not depend on clap, ctrlc or
//! tracing-subscriber.
//!
//! The argument shapes of `logits`, `generate`, `tokenize`, `render`, `convert` and `inspect` are a contract that
//! external checks rely on: keep them stable.

use clap::{Parser, Subcommand};

mod convert;
mod generate;
mod inspect;
mod kv;
mod logits;
mod render;
mod run;
mod tokenize;

/// `ds4`: run, inspect and convert DeepSeek V4 Flash models.
#[derive(Parser, Debug)]
#[command(name = "ds4", version, about)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

/// The subcommands.
#[derive(Subcommand, Debug)]
pub enum Command {
    /// Print a GGUF file's metadata and tensor table.
    Inspect(inspect::InspectArgs),
    /// Check a tokenizer against {"text","ids"} cases (--jsonl), or print the ids of a text.
    Tokenize(tokenize::TokenizeArgs),
    /// Render a conversation (JSON on stdin) into the model's prompt text.
    Render(render::RenderArgs),
    /// Answer one prompt with a model (reasoning on stderr, answer on stdout).
    Run(run::RunArgs),
    /// Interactive chat with a model, one user turn per line.
    Chat(run::ChatArgs),
    /// Convert an official checkpoint folder (config.json + safetensors) to a DS4 GGUF file.
    Convert(convert::ConvertArgs),
    /// Write the logits of every prompt position (little-endian f32 `[n_tokens, vocab]`).
    Logits(logits::LogitsArgs),
    /// Greedy generation from a token prompt; prints the generated ids.
    Generate(generate::GenerateArgs),
    /// Disk KV cache maintenance: ls, inspect, gc.
    Kv(kv::KvArgs),
}

/// Initializes logging (`RUST_LOG` controls the level; default `info`) on stderr.
pub fn init_logging() {
    let filter = tracing_subscriber::EnvFilter::try_from_default_env()
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let _ = tracing_subscriber::fmt().with_env_filter(filter).with_writer(std::io::stderr).try_init();
}

fn main() {
    std::process::exit(run());
}

/// Parses the arguments and runs the subcommand. Returns the process exit code.
fn run() -> i32 {
    init_logging();
    let cli = Cli::parse();
    let r = match cli.command {
        Command::Inspect(a) => inspect::run(a),
        Command::Tokenize(a) => tokenize::run(a),
        Command::Render(a) => render::run(a),
        Command::Run(a) => run::run(a),
        Command::Chat(a) => run::chat(a),
        Command::Convert(a) => convert::run(a),
        Command::Logits(a) => logits::run(a),
        Command::Generate(a) => generate::run(a),
        Command::Kv(a) => kv::run(a),
    };
    match r {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            1
        }
    }
}
