//! `ds4 tokenize`: check a tokenizer against `{"text","ids"}` cases, or print the ids of a text.
//!
//! `ds4 tokenize --tokenizer tokenizer.json --jsonl cases.jsonl` (or `-m model.gguf` instead of `--tokenizer`;
//! neither = the bundled DeepSeek-V4 tokenizer) checks that every line's text encodes to its ids and its ids decode
//! to its text, prints each failure on stderr and `N passed, M failed` as the last line, and exits non-zero on any
//! failure. `ds4 tokenize [--tokenizer …] TEXT` prints the ids of TEXT as a JSON list.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Context;

use ds4_engine::gguf::GgufFile;
use ds4_engine::tokenizer::Tokenizer;

/// Arguments of `ds4 tokenize`.
#[derive(clap::Args, Debug)]
pub struct TokenizeArgs {
    /// A Hugging Face tokenizer.json.
    #[arg(long, conflicts_with = "model")]
    pub tokenizer: Option<PathBuf>,
    /// A GGUF model file whose tokenizer.ggml.* metadata defines the tokenizer.
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// A JSONL file of {"text": ..., "ids": [...]} cases to check.
    #[arg(long)]
    pub jsonl: Option<PathBuf>,
    /// Text to tokenize (when no --jsonl is given).
    pub text: Option<String>,
}

/// Loads the tokenizer the arguments name.
pub fn load(tokenizer: Option<&PathBuf>, model: Option<&PathBuf>) -> anyhow::Result<Tokenizer> {
    Ok(match (tokenizer, model) {
        (Some(p), _) => Tokenizer::from_json_file(p)?,
        (None, Some(m)) => {
            let f = GgufFile::open(m)?;
            Tokenizer::from_gguf(&f).with_context(|| format!("tokenizer of {}", m.display()))?
        }
        (None, None) => Tokenizer::bundled()?,
    })
}

/// Runs `ds4 tokenize`.
pub fn run(a: TokenizeArgs) -> anyhow::Result<i32> {
    let tok = load(a.tokenizer.as_ref(), a.model.as_ref())?;
    let Some(cases) = a.jsonl else {
        let text = a.text.context("give --jsonl CASES or a TEXT to tokenize")?;
        writeln!(std::io::stdout().lock(), "{}", serde_json::to_string(&tok.encode(&text)?)?)?;
        return Ok(0);
    };
    let data = std::fs::read_to_string(&cases).with_context(|| format!("reading {}", cases.display()))?;
    let (mut passed, mut failed) = (0usize, 0usize);
    for (n, line) in data.lines().enumerate().filter(|(_, l)| !l.trim().is_empty()) {
        let line_no = n + 1;
        let case: serde_json::Value = match serde_json::from_str(line) {
            Ok(v) => v,
            Err(e) => {
                eprintln!("line {line_no}: invalid JSON: {e}");
                failed += 1;
                continue;
            }
        };
        let text = case.get("text").and_then(|t| t.as_str());
        let ids: Option<Vec<u32>> = case.get("ids").and_then(|v| v.as_array()).and_then(|a| {
            a.iter().map(|x| x.as_u64().and_then(|x| u32::try_from(x).ok())).collect::<Option<Vec<u32>>>()
        });
        let (Some(text), Some(ids)) = (text, ids) else {
            eprintln!("line {line_no}: expected {{\"text\": string, \"ids\": [u32...]}}");
            failed += 1;
            continue;
        };
        let mut ok = true;
        match tok.encode(text) {
            Ok(got) if got == ids => {}
            Ok(got) => {
                let at = got.iter().zip(&ids).position(|(a, b)| a != b).unwrap_or(got.len().min(ids.len()));
                eprintln!("line {line_no}: encode differs at id #{at} (got {} ids, want {})", got.len(), ids.len());
                ok = false;
            }
            Err(e) => {
                eprintln!("line {line_no}: encode failed: {e}");
                ok = false;
            }
        }
        match tok.decode(&ids) {
            Ok(got) if got == text => {}
            Ok(_) => {
                eprintln!("line {line_no}: decode(ids) differs from the text");
                ok = false;
            }
            Err(e) => {
                eprintln!("line {line_no}: decode failed: {e}");
                ok = false;
            }
        }
        if ok {
            passed += 1;
        } else {
            failed += 1;
        }
    }
    writeln!(std::io::stdout().lock(), "{passed} passed, {failed} failed")?;
    Ok(if failed == 0 && passed > 0 { 0 } else { 1 })
}
