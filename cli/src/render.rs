//! `ds4 render --mode chat|thinking [--reasoning-effort high|max] < INPUT.json`: prints the prompt the official
//! DeepSeek-V4 encoding gives for a conversation, with no trailing newline.
//!
//! INPUT is a list of messages, or `{"tools": [...], "messages": [...]}` where the tools belong to the first message.
//! `--input FILE` reads a file instead of stdin.

use std::io::{Read, Write};
use std::path::PathBuf;

use anyhow::Context;

use ds4_engine::chat::{render, Mode, ReasoningEffort, RenderInput};

/// Arguments of `ds4 render`.
#[derive(clap::Args, Debug)]
pub struct RenderArgs {
    /// chat or thinking.
    #[arg(long, default_value = "thinking")]
    pub mode: String,
    /// high (default) or max; only changes the prompt in thinking mode.
    #[arg(long = "reasoning-effort", default_value = "high")]
    pub reasoning_effort: String,
    /// Read the conversation from this file instead of stdin.
    #[arg(long)]
    pub input: Option<PathBuf>,
}

/// Runs `ds4 render`.
pub fn run(a: RenderArgs) -> anyhow::Result<i32> {
    let mode: Mode = a.mode.parse()?;
    let effort: ReasoningEffort = a.reasoning_effort.parse()?;
    let text = match &a.input {
        Some(p) => std::fs::read_to_string(p).with_context(|| format!("reading {}", p.display()))?,
        None => {
            let mut s = String::new();
            std::io::stdin().read_to_string(&mut s).context("reading stdin")?;
            s
        }
    };
    let input = RenderInput::from_json(&text)?;
    let prompt = render(&input, mode, effort)?;
    let mut out = std::io::stdout().lock();
    out.write_all(prompt.as_bytes())?;
    out.flush()?;
    Ok(0)
}
