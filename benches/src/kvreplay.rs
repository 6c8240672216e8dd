//! `ds4-bench kv --replay FILE.jsonl`: replays a trace of requests through the prefix cache the server uses —
//! parked RAM sessions (forked and rolled back exactly, [`Engine::rollback`]) and the disk store
//! (`ds4_engine::persist`: pages, checkpoints, restore points) — and reports per request how much of it could be
//! reused and how much was.
//!
//! Per request — one JSON object per line, either token ids `{"tokens": [ids...]}` or a conversation rendered with
//! the engine's chat renderer ([`ds4_engine::chat::render_prompt`]) and tokenized with the model's tokenizer
//! ([`parse_trace`]): OpenAI chat `{"messages": [...], "tools": [...]}` (optional `"thinking": true`), or Anthropic
//! messages `{"system": ..., "messages": [...], "tools": [{"name", "input_schema"}]}` (text, `thinking`, `tool_use`
//! and `tool_result` blocks, mapped onto the OpenAI shape):
//! 1. `lcp`: the longest common prefix with every request seen before (including those of an earlier pass);
//! 2. lookup: the parked session with the longest usable common prefix (`min(lcp, len − 1)` when it is within that
//!    session's roll-back reach, or the whole session when the request extends it) versus the disk store's longest
//!    checkpointed prefix of `tokens[..len − 1]` — the larger wins; RAM: fork + roll back, disk: restore
//!    (`restore_s`, timed); `reused` = tokens whose state came from the cache;
//! 3. prefill of the rest (`prefill_s`, timed; `recomputed` tokens);
//! 4. with `verify`, a cold prefill of the whole request in a fresh session: `exact` = the logits are bit-identical;
//! 5. the request's `completion` (what the model generated) is appended, then the session is parked (LRU beyond
//!    `max_parked`, evicted sessions are saved to disk) and saved to the store (a checkpoint at its end, a restore
//!    point at the page boundary below it and one below the prompt's end: [`persist::save_marked`]; the server gets
//!    the latter from the copy of the prompt's state it parks and saves beside the session).
//!    As in the server, a system + tools block (a rendered request's tokens before the first `<｜User｜>`) of at
//!    least `system_block_min_tokens` is also saved at its last page boundary, the prefill pausing there (part of
//!    `prefill_s`), unless the reused prefix or the store holds it already.
//!
//! `passes = 2` replays the trace again after a simulated restart: every parked session is dropped from RAM (saved
//! first, like a shutdown), the store is reopened on the same directory, and the second pass starts with an empty
//! RAM tier. CSV header [`CSV_HEADER`].

use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use ds4_engine::chat::{self, Mode, RenderInput, RenderOptions};
use ds4_engine::engine::Engine;
use ds4_engine::persist;
use ds4_engine::tables::SessionId;
use ds4_engine::tokenizer::Tokenizer;
use ds4_kv::{KvStore, SavePolicy, SaveReason};
use serde_json::{json, Value};

/// The CSV header of a replay.
pub const CSV_HEADER: &str = "pass,request,tokens,lcp,reused,tier,recomputed,restore_s,prefill_s,exact";

/// One request's outcome.
#[derive(Clone, Debug, PartialEq)]
pub struct ReplayRow {
    pub pass: usize,
    pub request: usize,
    pub tokens: usize,
    /// Longest common prefix with everything replayed before.
    pub lcp: usize,
    pub reused: usize,
    /// `ram`, `disk` or `none`.
    pub tier: &'static str,
    pub restore_s: f64,
    pub prefill_s: f64,
    /// Logits bit-identical to a cold prefill (`None` without `verify`).
    pub exact: Option<bool>,
}

impl ReplayRow {
    /// The CSV line matching [`CSV_HEADER`].
    pub fn csv(&self) -> String {
        format!(
            "{},{},{},{},{},{},{},{:.4},{:.4},{}",
            self.pass,
            self.request,
            self.tokens,
            self.lcp,
            self.reused,
            self.tier,
            self.tokens - self.reused,
            self.restore_s,
            self.prefill_s,
            self.exact.map_or("-".to_string(), |e| e.to_string())
        )
    }
}

/// Options of a replay.
#[derive(Clone, Debug)]
pub struct ReplayOptions {
    /// Tokens per KV page.
    pub span: u32,
    /// Store directory (used as is; a restart pass reopens it).
    pub dir: PathBuf,
    /// Parked RAM sessions kept at most (LRU).
    pub max_parked: usize,
    /// Bytes of KV state the parked sessions may hold (LRU beyond; the server's `--kv-ram-mb`).
    pub max_parked_bytes: u64,
    /// Use the disk store (the server's default; `false`: `--no-kv-disk`).
    pub disk: bool,
    /// 1, or 2 for a second pass after a simulated restart.
    pub passes: usize,
    /// Compare every request's logits with a cold prefill.
    pub verify: bool,
    /// A system + tools block at least this long is saved at its end (0: never), as the server's
    /// `--kv-system-block-min-tokens`.
    pub system_block_min_tokens: usize,
}

/// One request of a trace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TraceRequest {
    pub tokens: Vec<u32>,
    /// Tokens before the first user message (rendered requests; 0 for token-id lines unless given as
    /// `"system_block"`).
    pub system_block: usize,
    /// What the model generated after the prompt (`"completion"`: a text for rendered lines, token ids for
    /// token-id lines; empty when absent): the replay appends it to the session before parking it, as a server's
    /// decode would, so the next turn of the conversation meets the generated tokens — and re-renders them (a
    /// turn's reasoning dropped, a tool call re-serialized), the divergence a cache must roll back over.
    pub completion: Vec<u32>,
}

/// Parses a JSONL trace (see the module docs): token-id lines need no tokenizer, rendered lines need `tok`. Errors
/// name the line.
pub fn parse_trace(text: &str, vocab: usize, tok: Option<&Tokenizer>) -> Result<Vec<TraceRequest>> {
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let r = parse_line(line, vocab, tok).with_context(|| format!("trace line {}", i + 1))?;
        out.push(r);
    }
    Ok(out)
}

/// Token ids below `vocab` from a JSON array.
fn token_ids(arr: &[Value], vocab: usize) -> Result<Vec<u32>> {
    let mut toks = Vec::with_capacity(arr.len());
    for t in arr {
        match t.as_u64() {
            Some(t) if (t as usize) < vocab => toks.push(t as u32),
            _ => bail!("{t} is not a token id below the vocabulary size {vocab}"),
        }
    }
    Ok(toks)
}

/// `text` tokenized, every id below `vocab`.
fn encode(tok: &Tokenizer, text: &str, vocab: usize) -> Result<Vec<u32>> {
    let toks = tok.encode(text)?;
    if let Some(&t) = toks.iter().find(|&&t| t as usize >= vocab) {
        bail!("the tokenizer produced id {t}, not below the model's vocabulary size {vocab}");
    }
    Ok(toks)
}

fn parse_line(line: &str, vocab: usize, tok: Option<&Tokenizer>) -> Result<TraceRequest> {
    let v: Value = serde_json::from_str(line)?;
    let (tokens, system_block) = if let Some(arr) = v.get("tokens").and_then(Value::as_array) {
        let toks = token_ids(arr, vocab)?;
        let block = (v.get("system_block").and_then(Value::as_u64).unwrap_or(0) as usize).min(toks.len());
        (toks, block)
    } else if v.get("messages").is_some_and(Value::is_array) {
        let Some(tok) = tok else { bail!("a rendered request needs the model's tokenizer") };
        let openai = if is_anthropic(&v) { anthropic_to_openai(&v)? } else { v.clone() };
        let thinking = v.get("thinking").is_some_and(|t| t.as_bool() == Some(true) || t.is_object());
        let input = RenderInput::from_json(&openai.to_string())?;
        let mode = if thinking { Mode::Thinking } else { Mode::Chat };
        let text = chat::render_prompt(&input.messages, &RenderOptions { mode, ..RenderOptions::default() })?;
        let toks = encode(tok, &text, vocab)?;
        let block = tok.special().user.and_then(|u| toks.iter().position(|&t| t == u)).unwrap_or(0);
        (toks, block)
    } else {
        bail!("expected an object with a \"tokens\" array of token ids or a \"messages\" array");
    };
    if tokens.is_empty() {
        bail!("empty request");
    }
    let completion = match v.get("completion") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::Array(arr)) => token_ids(arr, vocab).context("completion")?,
        Some(Value::String(text)) => {
            let Some(tok) = tok else { bail!("a completion text needs the model's tokenizer") };
            encode(tok, text, vocab).context("completion")?
        }
        Some(other) => bail!("completion: expected a text or an array of token ids, not {other}"),
    };
    Ok(TraceRequest { tokens, system_block, completion })
}

/// An Anthropic Messages body: a top-level `system`, tools with `input_schema`, or content blocks of Anthropic
/// types.
fn is_anthropic(v: &Value) -> bool {
    let block_types = ["tool_use", "tool_result", "thinking"];
    v.get("system").is_some()
        || v["tools"].as_array().is_some_and(|t| t.iter().any(|t| t.get("input_schema").is_some()))
        || v["messages"].as_array().is_some_and(|ms| {
            ms.iter().any(|m| {
                m["content"]
                    .as_array()
                    .is_some_and(|bs| bs.iter().any(|b| b["type"].as_str().is_some_and(|t| block_types.contains(&t))))
            })
        })
}

/// The text of an Anthropic `system` / `content` value (a string or text blocks, joined with blank lines).
fn anthropic_text(v: &Value) -> String {
    match v {
        Value::String(s) => s.clone(),
        Value::Array(bs) => {
            let texts: Vec<&str> =
                bs.iter().filter(|b| b["type"] == "text").filter_map(|b| b["text"].as_str()).collect();
            texts.join("\n\n")
        }
        _ => String::new(),
    }
}

/// Maps an Anthropic Messages body onto the OpenAI chat shape the renderer reads: `system` → a system message,
/// tools → functions, `tool_use` blocks → assistant tool calls, `tool_result` blocks → tool messages, `thinking`
/// blocks → reasoning.
fn anthropic_to_openai(v: &Value) -> Result<Value> {
    let mut messages = Vec::new();
    if let Some(sys) = v.get("system") {
        messages.push(json!({"role": "system", "content": anthropic_text(sys)}));
    }
    for m in v["messages"].as_array().into_iter().flatten() {
        let role = m["role"].as_str().context("a message without a role")?;
        let Some(blocks) = m["content"].as_array() else {
            messages.push(json!({"role": role, "content": anthropic_text(&m["content"])}));
            continue;
        };
        let (mut text, mut reasoning, mut calls) = (Vec::new(), Vec::new(), Vec::new());
        for b in blocks {
            match b["type"].as_str().unwrap_or("") {
                "text" => text.push(b["text"].as_str().unwrap_or("").to_string()),
                "thinking" => reasoning.push(b["thinking"].as_str().unwrap_or("").to_string()),
                "tool_use" => calls.push(json!({"id": b["id"], "type": "function",
                    "function": {"name": b["name"], "arguments": b["input"].to_string()}})),
                "tool_result" => messages.push(json!({"role": "tool", "tool_call_id": b["tool_use_id"],
                    "content": anthropic_text(&b["content"])})),
                _ => {}
            }
        }
        if !text.is_empty() || !calls.is_empty() || !reasoning.is_empty() {
            let mut msg = json!({"role": role, "content": text.join("\n\n")});
            if !reasoning.is_empty() {
                msg["reasoning_content"] = json!(reasoning.join("\n\n"));
            }
            if !calls.is_empty() {
                msg["tool_calls"] = json!(calls);
            }
            messages.push(msg);
        }
    }
    let tools: Vec<Value> = v["tools"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|t| {
            json!({"type": "function", "function": {"name": t["name"], "description": t["description"],
                "parameters": t["input_schema"]}})
        })
        .collect();
    Ok(json!({"messages": messages, "tools": tools}))
}

fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

struct Parked {
    id: SessionId,
    tokens: Vec<u32>,
    /// Where its last prompt ended (the rest was generated): saves mark it with a restore point.
    prompt_len: usize,
    last_used: u64,
    /// KV bytes when parked.
    bytes: u64,
}

/// The replay's cache: parked sessions and the store.
struct Cache {
    parked: Vec<Parked>,
    store: KvStore,
    /// Whether the store is used (saves and restores).
    disk: bool,
    clock: u64,
}

impl Cache {
    /// The best parked session for `req`: `(index, usable tokens)`.
    fn best_ram(&self, engine: &Engine, req: &[u32]) -> Option<(usize, usize)> {
        self.parked
            .iter()
            .enumerate()
            .filter_map(|(i, p)| {
                let lcp = common_prefix(&p.tokens, req);
                let n = if lcp == p.tokens.len() && lcp < req.len() {
                    lcp
                } else {
                    let n = lcp.min(req.len() - 1);
                    if engine.rollback_floor(p.id).ok()? > n {
                        return None;
                    }
                    n
                };
                (n > 0).then_some((i, n, p.last_used))
            })
            .max_by_key(|&(_, n, t)| (n, t))
            .map(|(i, n, _)| (i, n))
    }

    /// The store's longest checkpointed prefix of `req` as a new session, with logits whenever it covers all of
    /// `req` (a restore point holds none: then one token less).
    fn disk_restore(&self, engine: &mut Engine, req: &[u32]) -> Result<Option<(SessionId, usize)>> {
        let r = persist::restore_longest(&self.store, engine, req)?;
        if let Some((id, n)) = r {
            if n == req.len() && engine.logits(id).is_err() {
                engine.free_session(id)?;
                return Ok(persist::restore_longest(&self.store, engine, &req[..req.len() - 1])?);
            }
        }
        Ok(r)
    }

    /// Saves `id` with a restore point below `prompt_len` too ([`persist::save_marked`]).
    fn save(&self, engine: &Engine, id: SessionId, reason: SaveReason, prompt_len: usize) -> Result<()> {
        if self.disk && engine.position(id)? > 0 {
            persist::save_marked(&self.store, engine, id, reason, &[prompt_len])?;
        }
        Ok(())
    }

    fn park(&mut self, engine: &mut Engine, p: (SessionId, Vec<u32>, usize), opts: &ReplayOptions) -> Result<()> {
        self.clock += 1;
        let (id, tokens, prompt_len) = p;
        let (device, host) = engine.kv_bytes_by_tier(id)?;
        self.parked.push(Parked { id, tokens, prompt_len, last_used: self.clock, bytes: device + host });
        while self.parked.len() > opts.max_parked
            || self.parked.iter().map(|p| p.bytes).sum::<u64>() > opts.max_parked_bytes
        {
            let lru = (0..self.parked.len()).min_by_key(|&i| self.parked[i].last_used).unwrap_or(0);
            let p = self.parked.swap_remove(lru);
            self.save(engine, p.id, SaveReason::Evict, p.prompt_len)?;
            engine.free_session(p.id)?;
        }
        Ok(())
    }

    /// Drops every parked session (saved first, like a shutdown).
    fn drop_all(&mut self, engine: &mut Engine) -> Result<()> {
        for p in std::mem::take(&mut self.parked) {
            self.save(engine, p.id, SaveReason::Shutdown, p.prompt_len)?;
            engine.free_session(p.id)?;
        }
        Ok(())
    }
}

/// Replays `requests` on `engine` (see the module docs), writing CSV lines to `out`.
pub fn replay(
    engine: &mut Engine,
    requests: &[TraceRequest],
    opts: &ReplayOptions,
    out: &mut dyn Write,
) -> Result<Vec<ReplayRow>> {
    if opts.passes == 0 || opts.passes > 2 {
        bail!("passes must be 1 or 2");
    }
    if let Some(r) = requests.iter().find(|r| r.tokens.len() + r.completion.len() + 1 > engine.ctx()) {
        bail!(
            "a request of {} tokens and {} completion tokens does not fit the engine context {}",
            r.tokens.len(),
            r.completion.len(),
            engine.ctx()
        );
    }
    let policy = SavePolicy { system_block_min_tokens: opts.system_block_min_tokens, ..SavePolicy::default() };
    let kv_opts = persist::kv_options(engine.config(), opts.span, u64::MAX / 4);
    std::fs::create_dir_all(&opts.dir).with_context(|| format!("creating {}", opts.dir.display()))?;
    let store = persist::open_store(engine, &opts.dir, kv_opts.clone())?;
    let mut cache = Cache { parked: Vec::new(), store, disk: opts.disk, clock: 0 };
    writeln!(out, "{CSV_HEADER}")?;
    // Every session parked so far: its prompt and what was generated after it.
    let mut seen: Vec<Vec<u32>> = Vec::new();
    let mut rows = Vec::new();
    for pass in 1..=opts.passes {
        if pass > 1 {
            cache.drop_all(engine)?;
            // A restart: the store is reopened from its directory.
            cache.store = persist::open_store(engine, &opts.dir, kv_opts.clone())?;
        }
        for (ri, request) in requests.iter().enumerate() {
            let req = &request.tokens;
            let lcp = seen.iter().map(|s| common_prefix(s, req)).max().unwrap_or(0);
            let t0 = Instant::now();
            let ram = cache.best_ram(engine, req);
            let ram_n = ram.map_or(0, |(_, n)| n);
            let probe = cache.store.longest_prefix(req);
            let disk_n = if cache.disk && probe.checkpoint.is_some() { probe.matched_tokens } else { 0 };
            let disk = if disk_n > ram_n { cache.disk_restore(engine, req)? } else { None };
            let (id, reused, tier) = if let Some((id, n)) = disk.filter(|&(_, n)| n > ram_n) {
                (id, n, "disk")
            } else if let Some((i, n)) = ram {
                if let Some((d, _)) = disk {
                    engine.free_session(d)?;
                }
                let id = engine.fork(cache.parked[i].id)?;
                if n < engine.position(id)? {
                    engine.rollback(id, n)?;
                }
                cache.clock += 1;
                cache.parked[i].last_used = cache.clock;
                (id, n, "ram")
            } else {
                (engine.create_session(), 0, "none")
            };
            let restore_s = t0.elapsed().as_secs_f64();
            let t0 = Instant::now();
            let mut fed = reused;
            if let Some(at) = policy.system_block_end(request.system_block, opts.span as usize) {
                let probe = cache.store.longest_prefix(&req[..at]);
                let stored = probe.checkpoint.is_some() && probe.matched_tokens == at;
                if cache.disk && at > reused && at < req.len() && !stored {
                    engine.feed(id, &req[reused..at])?;
                    engine.run_until_idle()?;
                    cache.save(engine, id, SaveReason::SystemBlock, at)?;
                    fed = at;
                }
            }
            engine.feed(id, &req[fed..])?;
            engine.run_until_idle()?;
            let prefill_s = t0.elapsed().as_secs_f64();
            let exact = if opts.verify {
                let c = engine.create_session();
                engine.feed(c, req)?;
                engine.run_until_idle()?;
                let same =
                    engine.logits(c)?.iter().map(|x| x.to_bits()).eq(engine.logits(id)?.iter().map(|x| x.to_bits()));
                engine.free_session(c)?;
                Some(same)
            } else {
                None
            };
            // The model's answer, as a decode would have appended it (chunked feeding is bit-identical to one
            // token per tick).
            let mut history = req.clone();
            if !request.completion.is_empty() {
                engine.feed(id, &request.completion)?;
                engine.run_until_idle()?;
                history.extend_from_slice(&request.completion);
            }
            cache.save(engine, id, SaveReason::Continued, req.len())?;
            cache.park(engine, (id, history.clone(), req.len()), opts)?;
            let row =
                ReplayRow { pass, request: ri, tokens: req.len(), lcp, reused, tier, restore_s, prefill_s, exact };
            writeln!(out, "{}", row.csv())?;
            out.flush()?;
            rows.push(row);
            seen.push(history);
        }
    }
    cache.drop_all(engine)?;
    Ok(rows)
}

#[cfg(test)]
mod tests {
    use super::*;
    use indicatif::ProgressBar;

    use ds4_tests::tokens as ids;

    fn cat(parts: &[&[u32]]) -> Vec<u32> {
        parts.iter().flat_map(|p| p.iter().copied()).collect()
    }

    /// Agent-shaped traces over token ids, `(prompt, completion)`: a shared system/tools prompt, a title request
    /// beside the agent request, re-rendered tails (the model's reasoning and answer after a prompt's assistant
    /// opening, re-rendered without the reasoning by the next turn), a turn that extends the generated answer
    /// exactly, several conversations on one system prompt, an edited earlier message.
    fn agent_trace(vocab: usize) -> Vec<(Vec<u32>, Vec<u32>)> {
        let sys = ids(1, 260, vocab);
        let (u1, a1, u2, a2, u3) =
            (ids(2, 40, vocab), ids(3, 30, vocab), ids(4, 25, vocab), ids(5, 20, vocab), ids(6, 15, vocab));
        let open = ids(7, 3, vocab); // the assistant-turn opening a prompt ends with
        let closed = ids(8, 2, vocab); // how the next turn re-renders the finished assistant turn
        let title = ids(9, 12, vocab);
        let (r1, r2) = (ids(14, 12, vocab), ids(15, 10, vocab)); // generated reasoning, dropped by the next turn
        let t1 = cat(&[&sys, &u1, &open]);
        let t2 = cat(&[&sys, &u1, &closed, &a1, &u2, &open]);
        let t3 = cat(&[&sys, &u1, &closed, &a1, &u2, &closed, &a2, &u3, &open]);
        let mut u2_edited = u2.clone();
        u2_edited[10] = (u2_edited[10] + 1) % vocab as u32;
        let t3_edit = cat(&[&sys, &u1, &closed, &a1, &u2_edited, &open]);
        let b1 = cat(&[&sys, &ids(10, 35, vocab), &open]);
        let b1_answer = ids(11, 20, vocab);
        let b2 = cat(&[&b1, &b1_answer, &ids(12, 18, vocab), &open]);
        let c1 = cat(&[&sys, &ids(13, 22, vocab), &open]);
        let none = Vec::new;
        vec![
            (t1, cat(&[&r1, &a1])),
            (cat(&[&title, &u1, &open]), ids(16, 6, vocab)),
            (t2, cat(&[&r2, &a2])),
            (b1, b1_answer),
            (t3, none()),
            (t3_edit, none()),
            (b2, none()),
            (c1, none()),
        ]
    }

    #[test]
    fn agent_traces_reuse_their_common_prefix_in_ram_and_after_a_restart_with_exact_logits() {
        let spec = crate::synth::Spec::parse("tiny:layers=3:recipe=f16").unwrap();
        let file = crate::synth::build(&spec, 2, &ProgressBar::hidden()).unwrap().file;
        let cfg = crate::engine_api::EngineConfig {
            threads: 2,
            ctx: 1024,
            batch_tokens: 64,
            backend: "cpu".into(),
            exact: false,
            placement: Default::default(),
        };
        let mut engine = crate::engine_api::engine_for(file, &cfg).unwrap();
        let trace: Vec<TraceRequest> = agent_trace(engine.config().vocab)
            .into_iter()
            .map(|(tokens, completion)| TraceRequest { tokens, system_block: 0, completion })
            .collect();
        let text: String = trace
            .iter()
            .map(|t| format!("{}\n", serde_json::json!({ "tokens": t.tokens, "completion": t.completion })))
            .collect();
        assert_eq!(parse_trace(&text, engine.config().vocab, None).unwrap(), trace);
        let tmp = tempfile::tempdir().unwrap();
        let span = 16;
        let opts = ReplayOptions {
            span,
            dir: tmp.path().join("kv"),
            max_parked: 4,
            max_parked_bytes: u64::MAX,
            disk: true,
            passes: 2,
            verify: true,
            system_block_min_tokens: 0,
        };
        let mut out = Vec::new();
        let rows = replay(&mut engine, &trace, &opts, &mut out).unwrap();
        assert_eq!(rows.len(), 2 * trace.len());
        for r in &rows {
            assert_eq!(r.exact, Some(true), "logits differ from a cold prefill: {r:?}");
            assert!(r.reused + span as usize >= r.lcp, "reused less than the common prefix minus a page: {r:?}");
            assert!(r.reused <= r.lcp, "{r:?}");
        }
        // The first pass reuses from RAM (the edited message and the re-rendered tails by roll back) ...
        let first: Vec<_> = rows.iter().filter(|r| r.pass == 1).collect();
        assert_eq!(first[0].tier, "none");
        assert!(first[2..].iter().all(|r| r.tier == "ram" && r.reused + 1 >= r.lcp), "{first:?}");
        // The second turn re-renders the first one's generated answer (its assistant opening closed, the
        // reasoning dropped): it diverges inside the first prompt and is served by rolling back over the generated
        // tokens. The third request of conversation b extends b's generated answer: all of it is reused.
        assert!(first[2].lcp < trace[0].tokens.len() && first[2].lcp + 3 >= trace[0].tokens.len(), "{first:?}");
        assert_eq!(first[6].reused, trace[3].tokens.len() + trace[3].completion.len(), "{first:?}");
        // ... the second (after the restart) from disk first, everything seen before.
        let second: Vec<_> = rows.iter().filter(|r| r.pass == 2).collect();
        assert_eq!(second[0].tier, "disk");
        assert!(second.iter().all(|r| r.lcp == r.tokens));
        let text = String::from_utf8(out).unwrap();
        assert_eq!(text.lines().next(), Some(CSV_HEADER));
        assert_eq!(text.lines().count(), rows.len() + 1);
        // Bad traces are clear errors.
        assert!(parse_trace("{\"tokens\": [1, 2]}\n{\"text\": \"x\"}", 100, None)
            .unwrap_err()
            .to_string()
            .contains("line 2"));
        assert!(parse_trace("{\"tokens\": [1, 200]}", 100, None).is_err());
        assert!(parse_trace("{\"tokens\": []}", 100, None).is_err());
        assert!(parse_trace("{\"tokens\": [1], \"completion\": [100]}", 100, None).is_err());
        let text_completion = parse_trace("{\"tokens\": [1], \"completion\": \"hi\"}", 100, None);
        assert!(format!("{:#}", text_completion.unwrap_err()).contains("tokenizer"));
        let no_tok = parse_trace("{\"messages\": [{\"role\": \"user\", \"content\": \"hi\"}]}", 100, None);
        assert!(format!("{:#}", no_tok.unwrap_err()).contains("tokenizer"));
    }

    /// The demo model (random weights, the real tokenizer and chat template) as a replay engine.
    fn demo_engine() -> (Engine, Tokenizer) {
        let bytes = ds4_engine::convert::demo_model_gguf(1).unwrap();
        let file = ds4_engine::gguf::GgufFile::from_bytes(bytes).unwrap();
        let tok = Tokenizer::from_gguf(&file).unwrap();
        let cfg = crate::engine_api::EngineConfig {
            threads: 2,
            ctx: 4096,
            batch_tokens: 128,
            backend: "cpu".into(),
            exact: false,
            placement: Default::default(),
        };
        (crate::engine_api::engine_for(file, &cfg).unwrap(), tok)
    }

    const AGENTS: &str = include_str!("../traces/agents.jsonl");

    #[test]
    fn anthropic_and_openai_shapes_render_to_the_same_tokens() {
        let (engine, tok) = demo_engine();
        let vocab = engine.config().vocab;
        let anthropic = json!({"system": [{"type": "text", "text": "Be brief."}],
            "tools": [{"name": "Bash", "description": "Runs a command.", "input_schema": {"type": "object"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": "list files"}]},
                {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash", "input": {"c": 1}}]},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "a.txt"}]}]});
        let openai = json!({"messages": [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "list files"},
                {"role": "assistant", "content": "", "tool_calls": [{"id": "t1", "type": "function",
                    "function": {"name": "Bash", "arguments": "{\"c\":1}"}}]},
                {"role": "tool", "tool_call_id": "t1", "content": "a.txt"}],
            "tools": [{"type": "function", "function": {"name": "Bash", "description": "Runs a command.",
                "parameters": {"type": "object"}}}]});
        let text = format!("{anthropic}\n{openai}\n");
        let reqs = parse_trace(&text, vocab, Some(&tok)).unwrap();
        assert_eq!(reqs[0], reqs[1]);
        let user = tok.special().user.unwrap();
        let block = reqs[0].system_block;
        assert!(block > 3 && reqs[0].tokens[block] == user && !reqs[0].tokens[..block].contains(&user));
    }

    #[test]
    fn rendered_agent_trace_reuses_its_common_prefix_in_ram_and_after_a_restart_with_exact_logits() {
        let (mut engine, tok) = demo_engine();
        let trace = parse_trace(AGENTS, engine.config().vocab, Some(&tok)).unwrap();
        assert_eq!(trace.len(), 11);
        // Claude Code (0, 2, 3, 10) share the system + tools block; the title request (1) does not.
        let cc_block = trace[0].system_block;
        assert!(cc_block > 200, "the Claude Code-like block is {cc_block} tokens");
        for i in [2, 3, 10] {
            assert_eq!(trace[i].system_block, cc_block);
            assert_eq!(trace[i].tokens[..cc_block], trace[0].tokens[..cc_block]);
        }
        assert!(trace[1].system_block < 64);
        let tmp = tempfile::tempdir().unwrap();
        let span = 64;
        let opts = ReplayOptions {
            span,
            dir: tmp.path().join("kv"),
            max_parked: 4,
            max_parked_bytes: u64::MAX,
            disk: true,
            passes: 2,
            verify: true,
            system_block_min_tokens: 128,
        };
        let mut out = Vec::new();
        let rows = replay(&mut engine, &trace, &opts, &mut out).unwrap();
        assert_eq!(rows.len(), 2 * trace.len());
        for r in &rows {
            assert_eq!(r.exact, Some(true), "logits differ from a cold prefill: {r:?}");
            assert!(r.reused + 256 >= r.lcp && r.reused + span as usize >= r.lcp, "reused too little: {r:?}");
            assert!(r.reused <= r.lcp, "{r:?}");
        }
        let first: Vec<_> = rows.iter().filter(|r| r.pass == 1).collect();
        // The tool rounds extend the first requests (Codex's assistant turn comes back without its reasoning; with
        // tools declared the renderer keeps the turn's `<think></think>`, so the history still extends the first
        // prompt); opencode's edited first message diverges inside the earlier conversation: all from RAM, within a
        // token of the common prefix. The new Claude Code conversation shares only the block (it has left RAM).
        assert_eq!(first[2].reused, trace[0].tokens.len(), "{:?}", first[2]);
        assert_eq!(first[5].lcp, trace[4].tokens.len(), "{:?}", first[5]);
        assert!(first[9].lcp < trace[7].tokens.len(), "{:?}", first[9]);
        assert!(first[10].lcp >= cc_block && first[10].lcp < cc_block + 8, "{:?}", first[10]);
        for i in [2, 3, 5, 8, 9] {
            assert!(first[i].tier == "ram" && first[i].reused + 1 >= first[i].lcp, "{:?}", first[i]);
        }
        // After the restart everything was seen before and comes from disk (or from RAM once re-parked); a prompt
        // the model answered restores the restore point its save marked at the page boundary below the prompt's end
        // (the checkpoint sits past the generated tokens), one it did not answer its own checkpoint.
        let second: Vec<_> = rows.iter().filter(|r| r.pass == 2).collect();
        assert_eq!(second[0].tier, "disk");
        assert_eq!(second[0].reused, trace[0].tokens.len() / span as usize * span as usize, "{:?}", second[0]);
        for (r, t) in second.iter().zip(&trace) {
            assert_eq!(r.lcp, r.tokens, "{r:?}");
            assert!(t.completion.is_empty() == (r.reused == r.tokens) || r.tier == "ram", "{r:?}");
        }

        // The system-block save: one conversation, a restart, a new conversation of the same agent restores the
        // block from disk (its own checkpoints lie past the block).
        let tmp = tempfile::tempdir().unwrap();
        let opts = ReplayOptions { dir: tmp.path().join("kv"), passes: 1, verify: false, ..opts };
        replay(&mut engine, &trace[3..4], &opts, &mut Vec::new()).unwrap();
        let rows = replay(&mut engine, &trace[10..11], &opts, &mut Vec::new()).unwrap();
        assert_eq!(rows[0].tier, "disk", "{:?}", rows[0]);
        assert!(rows[0].reused + span as usize > cc_block && rows[0].reused <= cc_block, "{:?}", rows[0]);
        let off = ReplayOptions { dir: tmp.path().join("kv-off"), system_block_min_tokens: 0, ..opts };
        replay(&mut engine, &trace[3..4], &off, &mut Vec::new()).unwrap();
        let rows = replay(&mut engine, &trace[10..11], &off, &mut Vec::new()).unwrap();
        assert!(rows[0].reused + span as usize <= cc_block, "without the block save: {:?}", rows[0]);
    }
}
