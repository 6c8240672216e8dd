//! `ds4-bench mask`: the per-token cost of constrained decoding (structured outputs), per grammar kind (a JSON
//! schema, a Lark grammar, a regex), on the bundled DeepSeek V4 tokenizer with the mask as wide as the Flash logits
//! row.
//!
//! For each grammar a seeded random walk samples uniformly among the ids the grammar allows (the worst case for a
//! matcher: a noisy model visits states a real one rarely does), restarting with a fresh matcher whenever the
//! grammar is complete. Per token it times computing the mask (`Constraint::mask`, what the server runs on a worker
//! beside the model's step) and advancing by the sampled id (`Constraint::consume`, on the critical path), and
//! reports mean, p50, p99 and max in µs. With a model (`-m FILE` or `--synthetic SPEC`) it also times decode ticks
//! of one session and reports each grammar's mean and p99 mask time as a share of the tick (the server computes the
//! mask during the tick, so a share under 100 % costs the tick nothing but the consume).

use std::io::Write;
use std::time::{Duration, Instant};

use anyhow::{Context, Result};
use ds4_engine::grammar::{ConstraintFactory, GrammarSpec};
use ds4_engine::tokenizer::Tokenizer;

use crate::blocks::SplitMix64;

/// The Flash logits width (its vocabulary): masks cover this many ids.
pub const FLASH_LOGITS: usize = 129_280;

/// CSV header of the grammar rows.
pub const CSV_HEADER: &str =
    "grammar,tokens,restarts,mask_mean_us,mask_p50_us,mask_p99_us,mask_max_us,consume_mean_us,consume_p99_us";

/// A small patch language in Lark (unbounded: hunks and lines repeat freely).
const PATCH_LARK: &str = r#"start: "*** Begin Patch\n" hunk+ "*** End Patch\n"
hunk: add | update | delete
add: "*** Add File: " PATH "\n" ("+" LINE "\n")+
delete: "*** Delete File: " PATH "\n"
update: "*** Update File: " PATH "\n" ("@@" LINE? "\n" change+)+
change: (" " | "-" | "+") LINE "\n"
PATH: /[A-Za-z0-9_.\/-]{1,80}/
LINE: /[^\n]{0,200}/
"#;

/// The grammars measured: (name, spec).
pub fn grammars() -> Vec<(&'static str, GrammarSpec)> {
    // Bounded strings and arrays, so that a random walk goes through the structure (an unbounded string keeps a
    // uniform walk inside it for ever).
    let schema = serde_json::json!({
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 40},
            "summary": {"type": "string", "maxLength": 200},
            "files": {"type": "array", "maxItems": 8, "items": {
                "type": "object",
                "properties": {
                    "path": {"type": "string", "maxLength": 60},
                    "action": {"enum": ["add", "update", "delete"]},
                    "lines": {"type": "integer", "minimum": 0, "maximum": 100000}
                },
                "required": ["path", "action"],
                "additionalProperties": false
            }},
            "done": {"type": "boolean"}
        },
        "required": ["title", "files", "done"],
        "additionalProperties": false
    });
    vec![
        ("json_schema", GrammarSpec::JsonSchema(schema)),
        ("lark_patch", GrammarSpec::Lark(PATCH_LARK.into())),
        ("regex", GrammarSpec::Regex("[a-z]{1,12}(-[0-9]{1,6}){0,3}( [A-Za-z ,.]{0,80})?".into())),
    ]
}

/// Per-token timings of one grammar.
#[derive(Debug, Clone)]
pub struct MaskRow {
    pub grammar: &'static str,
    pub tokens: usize,
    pub restarts: usize,
    pub mask: Vec<Duration>,
    pub consume: Vec<Duration>,
}

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}

/// (mean, p50, p99, max) in µs.
pub fn stats(v: &[Duration]) -> (f64, f64, f64, f64) {
    if v.is_empty() {
        return (0.0, 0.0, 0.0, 0.0);
    }
    let mut s: Vec<f64> = v.iter().copied().map(us).collect();
    s.sort_by(f64::total_cmp);
    let at = |q: f64| s[((s.len() - 1) as f64 * q).round() as usize];
    (s.iter().sum::<f64>() / s.len() as f64, at(0.5), at(0.99), s[s.len() - 1])
}

impl MaskRow {
    pub fn csv(&self) -> String {
        let (m, p50, p99, max) = stats(&self.mask);
        let (c, _, c99, _) = stats(&self.consume);
        format!("{},{},{},{m:.1},{p50:.1},{p99:.1},{max:.1},{c:.1},{c99:.1}", self.grammar, self.tokens, self.restarts)
    }
}

/// Walk `spec` for `tokens` sampled ids (see the module doc).
pub fn walk(
    factory: &ConstraintFactory,
    eos: u32,
    name: &'static str,
    spec: &GrammarSpec,
    tokens: usize,
    seed: u64,
) -> Result<MaskRow> {
    let compile = || factory.compile(spec).map_err(|e| anyhow::anyhow!("{name}: {e}"));
    let mut c = compile()?;
    let mut rng = SplitMix64::new(seed);
    let mut row = MaskRow { grammar: name, tokens, restarts: 0, mask: Vec::new(), consume: Vec::new() };
    while row.mask.len() < tokens {
        let t = Instant::now();
        let mask = c.mask().with_context(|| format!("{name}: mask"))?;
        row.mask.push(t.elapsed());
        // EOS only once nothing else is allowed: a walk goes as deep as the grammar lets it.
        let ids: Vec<u32> = mask.ids().filter(|&i| i != eos).collect();
        if ids.is_empty() || c.is_complete() {
            c = compile()?;
            row.restarts += 1;
            continue;
        }
        let id = ids[(rng.next_u64() % ids.len() as u64) as usize];
        let t = Instant::now();
        c.consume(id).with_context(|| format!("{name}: consume"))?;
        row.consume.push(t.elapsed());
    }
    Ok(row)
}

/// The factory on the bundled tokenizer, masks `FLASH_LOGITS` wide, and its EOS id.
pub fn flash_factory() -> Result<(ConstraintFactory, u32)> {
    let tok = Tokenizer::bundled()?;
    Ok((ConstraintFactory::new(&tok, FLASH_LOGITS.max(tok.vocab_size()))?, tok.eos()))
}

/// The report's grammar section: header and one row per grammar.
pub fn run(tokens: usize, out: &mut dyn Write) -> Result<Vec<MaskRow>> {
    let (factory, eos) = flash_factory()?;
    writeln!(out, "{CSV_HEADER}")?;
    let mut rows = Vec::new();
    for (i, (name, spec)) in grammars().into_iter().enumerate() {
        let row = walk(&factory, eos, name, &spec, tokens, 0x6d61_736b + i as u64)?;
        writeln!(out, "{}", row.csv())?;
        out.flush()?;
        rows.push(row);
    }
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_grammar_walks_and_reports() {
        let (factory, eos) = flash_factory().unwrap();
        for (i, (name, spec)) in grammars().into_iter().enumerate() {
            let row = walk(&factory, eos, name, &spec, 40, i as u64).unwrap();
            assert_eq!(row.mask.len(), 40, "{name}");
            assert!(row.consume.len() + row.restarts >= 40, "{name}");
            let csv = row.csv();
            assert_eq!(csv.split(',').count(), CSV_HEADER.split(',').count(), "{csv}");
            let (mean, p50, p99, max) = stats(&row.mask);
            assert!(mean > 0.0 && p50 <= p99 && p99 <= max, "{name}: {mean} {p50} {p99} {max}");
        }
    }

    #[test]
    fn stats_are_order_statistics() {
        let v: Vec<Duration> = (1..=100).map(Duration::from_micros).collect();
        let (mean, p50, p99, max) = stats(&v);
        assert!((mean - 50.5).abs() < 1e-6);
        assert!((p50 - 51.0).abs() < 1.0 && (p99 - 99.0).abs() < 1.0 && max == 100.0);
    }
}
