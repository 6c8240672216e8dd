//! The real model behind the seam: [`EngineRunner`] adapts `ds4_engine::engine::Engine` to [`Runner`], and
//! [`EngineCodec`] adapts the DeepSeek-V4 tokenizer, chat renderer and DSML stream parser to [`Codec`].
//!
//! [`load`] opens a DS4 GGUF file, or the built-in demo model when no path is given (the trained one, or with
//! `LoadOptions::demo_seed` the random-weight one with the real vocabulary and tokenizer).
//!
//! Notes for the next engineer:
//! - The engine rolls a session back exactly within its roll-back log's reach (`Engine::rollback`, R = 1024 tokens
//!   by default): [`Runner::truncate`] succeeds inside [`Runner::rollback_floor`] and answers `false` beyond it
//!   (nothing is recomputed; the scheduler then starts elsewhere), and [`Runner::can_truncate`] stays `false`
//!   because the reach is bounded. [`Runner::fork`] (`Engine::fork`: KV pages shared, only the tail copied) lets
//!   the scheduler keep a copy of each prompt's state, so a follow-up that diverges after the prompt (regenerate, a
//!   re-rendered assistant turn) reuses it even beyond the roll-back reach.
//! - `step` is one engine tick (decode tokens first, then prefill up to the engine's `max_batch_tokens`);
//!   `pending` reports what is still queued, so a decoding session is never held up by a long prefill.
//! - Tools are attached to the first message (the renderer prints them in the system prompt); the function object
//!   is written with keys `name`, `description`, `parameters` in that order. Consecutive system messages are joined
//!   with `"\n\n"` first. The prompt comes from [`chat::render_prompt`], so it always ends in the assistant
//!   transition (a `system` message after a user turn is folded into that turn by the renderer).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use ds4_engine::chat::{self, JsonValue, Mode, ParseEvent, RenderOptions, StreamParser};
use ds4_engine::engine::{BackendKind, Engine, EngineOptions};
use ds4_engine::gguf::GgufFile;
use ds4_engine::tokenizer::{StreamDecoder, Tokenizer};

use crate::model::{
    BackendError, Codec, Conversation, EncodeError, ModelInfo, OutputParser, Parsed, Runner, RunnerSessionId,
    TokenDecoder, TurnRole,
};

fn be(e: impl std::fmt::Display) -> BackendError {
    BackendError(e.to_string())
}

/// The engine as a [`Runner`].
pub struct EngineRunner {
    engine: Engine,
    ids: HashMap<RunnerSessionId, ds4_engine::tables::SessionId>,
    next: RunnerSessionId,
    max_sessions: usize,
    /// Tokens of roll-back log per session (`EngineOptions::rollback`), for [`Runner::session_bytes`].
    rollback: usize,
    /// The drafter (`--speculative mtp|dspark|auto` on a model file with one); every engine session is attached
    /// to it.
    drafter: Option<ds4_engine::speculative::AnyDrafter>,
}

impl EngineRunner {
    /// Turns on the model file's drafter of `kind`; an error when the file has none. Returns its name.
    pub fn enable_drafter(
        &mut self,
        kind: ds4_engine::speculative::DrafterKind,
        min_confidence: f32,
    ) -> Result<&'static str, BackendError> {
        let threads = self.engine.options().threads;
        let d = ds4_engine::speculative::AnyDrafter::require(self.engine.model(), kind, min_confidence, threads)
            .map_err(be)?;
        let name = d.name();
        self.drafter = Some(d);
        let sids: Vec<_> = self.ids.values().copied().collect();
        for sid in sids {
            self.attach(sid);
        }
        Ok(name)
    }

    /// Whether the model file holds a drafter of `kind`.
    pub fn has_drafter(&self, kind: ds4_engine::speculative::DrafterKind) -> bool {
        ds4_engine::speculative::AnyDrafter::present(self.engine.model(), kind)
    }

    fn attach(&mut self, sid: ds4_engine::tables::SessionId) {
        use ds4_engine::speculative::Drafter;
        if let Some(d) = &mut self.drafter {
            if let Err(e) = d.attach(&mut self.engine, sid) {
                tracing::warn!(error = %e, "the drafter could not attach a session");
            }
        }
    }

    fn sid(&self, session: RunnerSessionId) -> Result<ds4_engine::tables::SessionId, BackendError> {
        self.ids.get(&session).copied().ok_or_else(|| BackendError(format!("unknown session {session}")))
    }
}

impl Runner for EngineRunner {
    fn vocab_size(&self) -> usize {
        self.engine.config().vocab
    }

    fn create_session(&mut self) -> Result<RunnerSessionId, BackendError> {
        if self.ids.len() >= self.max_sessions {
            return Err(BackendError(format!("session table full ({} sessions)", self.max_sessions)));
        }
        let sid = self.engine.create_session();
        self.next += 1;
        self.ids.insert(self.next, sid);
        self.attach(sid);
        Ok(self.next)
    }

    fn free_session(&mut self, session: RunnerSessionId) {
        if let Some(sid) = self.ids.remove(&session) {
            if let Some(d) = &mut self.drafter {
                use ds4_engine::speculative::Drafter;
                d.detach(&mut self.engine, sid);
            }
            let _ = self.engine.free_session(sid);
        }
    }

    fn truncate(&mut self, session: RunnerSessionId, len: usize) -> bool {
        // Only the exact in-place roll back (no recompute): beyond its reach the scheduler starts elsewhere.
        self.ids.get(&session).is_some_and(|&sid| self.engine.rollback(sid, len).is_ok())
    }

    fn rollback_floor(&self, session: RunnerSessionId) -> Option<usize> {
        let sid = *self.ids.get(&session)?;
        let (floor, pos) = (self.engine.rollback_floor(sid).ok()?, self.engine.position(sid).ok()?);
        (floor < pos).then_some(floor)
    }

    fn fork(&mut self, session: RunnerSessionId) -> Option<RunnerSessionId> {
        if self.ids.len() >= self.max_sessions {
            return None;
        }
        // Shares the KV pages; copies only the private tail (see `Engine::fork`).
        let sid = self.engine.fork(*self.ids.get(&session)?).ok()?;
        self.next += 1;
        self.ids.insert(self.next, sid);
        self.attach(sid);
        Some(self.next)
    }

    fn can_draft(&self) -> bool {
        self.drafter.is_some()
    }

    fn draft(&mut self, reqs: &[(RunnerSessionId, &[u32], usize)]) -> Vec<Vec<u32>> {
        let Some(d) = &mut self.drafter else {
            return vec![Vec::new(); reqs.len()];
        };
        let mut mapped = Vec::with_capacity(reqs.len());
        for &(s, ctx, k) in reqs {
            match self.ids.get(&s) {
                Some(&sid) => mapped.push((sid, ctx, k)),
                None => return vec![Vec::new(); reqs.len()],
            }
        }
        match d.draft_many(&mut self.engine, &mapped) {
            Ok(v) => v,
            Err(e) => {
                // Drafting is an optimisation: a failure costs the drafts, never the output.
                tracing::warn!(error = %e, "drafting failed; decoding these sessions plainly this tick");
                vec![Vec::new(); reqs.len()]
            }
        }
    }

    fn feed_verify(&mut self, session: RunnerSessionId, tokens: &[u32]) -> Result<(), BackendError> {
        let sid = self.sid(session)?;
        let _ = self.engine.take_all_logits(sid).map_err(be)?;
        self.engine.set_prefill_logits(sid, true).map_err(be)?;
        let fed = self.engine.feed(sid, tokens).map_err(be);
        if fed.is_err() {
            self.engine.set_prefill_logits(sid, false).map_err(be)?;
        }
        fed
    }

    fn take_verify_logits(&mut self, session: RunnerSessionId) -> Vec<f32> {
        let Ok(sid) = self.sid(session) else { return Vec::new() };
        let _ = self.engine.set_prefill_logits(sid, false);
        self.engine.take_all_logits(sid).unwrap_or_default()
    }

    fn commit_verify(&mut self, session: RunnerSessionId, len: usize, logits: &[f32]) -> Result<(), BackendError> {
        let sid = self.sid(session)?;
        if self.engine.position(sid).map_err(be)? > len {
            if self.engine.rollback_floor(sid).map_err(be)? <= len {
                self.engine.rollback(sid, len).map_err(be)?;
            } else {
                // Beyond the roll-back log (the scheduler drafts only where it is live): recompute the kept tokens.
                tracing::warn!(len, "speculative roll back beyond the log: recomputing the session");
                self.engine.truncate(sid, len).map_err(be)?;
                self.engine.run_until_idle().map_err(be)?;
            }
        }
        self.engine.set_logits(sid, logits).map_err(be)
    }

    fn feed(&mut self, session: RunnerSessionId, tokens: &[u32]) -> Result<(), BackendError> {
        let sid = *self.ids.get(&session).ok_or_else(|| BackendError(format!("unknown session {session}")))?;
        self.engine.feed(sid, tokens).map_err(be)
    }

    fn step(&mut self) -> Result<(), BackendError> {
        self.engine.step().map_err(be)?;
        Ok(())
    }

    fn pending(&self, session: RunnerSessionId) -> usize {
        self.ids.get(&session).and_then(|&sid| self.engine.pending(sid).ok()).unwrap_or(0)
    }

    fn logits(&self, session: RunnerSessionId) -> Option<&[f32]> {
        self.engine.logits(*self.ids.get(&session)?).ok()
    }

    fn set_logit_candidates(&mut self, session: RunnerSessionId, k: usize) {
        if let Some(&sid) = self.ids.get(&session) {
            if let Err(e) = self.engine.set_logit_candidates(sid, k) {
                tracing::warn!(error = %e, "logit candidates not set; whole rows come back");
            }
        }
    }

    fn kv_bytes(&self) -> crate::model::KvBytes {
        // The CPU backend's KV is host memory; wgpu keeps it on the device with a lazily synced host mirror.
        let (device, host) = self
            .ids
            .values()
            .filter_map(|&sid| self.engine.kv_bytes_by_tier(sid).ok())
            .fold((0, 0), |(d, h), (sd, sh)| (d + sd, h + sh));
        crate::model::KvBytes { device, host }
    }

    fn kv_bytes_copied(&self) -> u64 {
        self.engine.kv_bytes_copied()
    }

    fn session_bytes(&self, session: RunnerSessionId) -> u64 {
        let Some(&sid) = self.ids.get(&session) else { return 0 };
        let (device, host) = self.engine.kv_bytes_by_tier(sid).unwrap_or((0, 0));
        // The roll-back log is reserved up front and touched as tokens arrive: count what the position reached.
        let pos = self.engine.position(sid).unwrap_or(0);
        let log = crate::context::rollback_log_bytes(self.engine.config(), self.rollback, pos);
        device + host + if pos == 0 { 0 } else { log }
    }

    fn position(&self, session: RunnerSessionId) -> Option<usize> {
        self.engine.position(*self.ids.get(&session)?).ok()
    }

    fn kv_layout(&self) -> Option<ds4_engine::persist::KvLayout> {
        Some(ds4_engine::persist::KvLayout::of(&self.engine))
    }

    fn export(
        &mut self,
        session: RunnerSessionId,
        store: &ds4_kv::KvStore,
        reason: ds4_kv::SaveReason,
    ) -> Result<ds4_engine::persist::SaveJob, BackendError> {
        let sid = self.sid(session)?;
        ds4_engine::persist::SaveJob::prepare(store, &self.engine, sid, reason, &[]).map_err(be)
    }

    fn import(&mut self, snapshot: ds4_engine::tables::SessionSnapshot) -> Result<RunnerSessionId, BackendError> {
        if self.ids.len() >= self.max_sessions {
            return Err(BackendError(format!("session table full ({} sessions)", self.max_sessions)));
        }
        let sid = self.engine.restore(snapshot).map_err(be)?;
        self.next += 1;
        self.ids.insert(self.next, sid);
        // The restored positions' final streams are not in the file: the drafter's first window is cold.
        self.attach(sid);
        Ok(self.next)
    }
}

/// Tokenizer + chat template + DSML parser as a [`Codec`].
pub struct EngineCodec {
    tok: Tokenizer,
    neutraliser: Result<crate::markers::Neutraliser, BackendError>,
    /// The loaded model's revision: its chat template's reasoning-effort texts follow it.
    revision: ds4_engine::chat::effort::Revision,
    /// The logits width grammars' masks cover (the model's vocabulary; at least the tokenizer's).
    logits: usize,
    /// Built on first use (a trie over the vocabulary: ~0.1 s).
    grammar: std::sync::OnceLock<Result<Arc<crate::structured::GrammarSupport>, BackendError>>,
}

impl EngineCodec {
    /// A codec for an April-revision model (see [`EngineCodec::with_revision`]).
    pub fn new(tok: Tokenizer) -> Self {
        let neutraliser = crate::markers::Neutraliser::new(&tok);
        let logits = tok.vocab_size();
        EngineCodec { tok, neutraliser, revision: Default::default(), logits, grammar: Default::default() }
    }

    /// Masks cover `logits` ids (the model's output width, when it is wider than the tokenizer's vocabulary).
    pub fn with_logits(mut self, logits: usize) -> Self {
        self.logits = logits.max(self.tok.vocab_size());
        self
    }

    /// Render for the model revision `revision` (from the loaded file's `deepseek4.revision`).
    pub fn with_revision(mut self, revision: ds4_engine::chat::effort::Revision) -> Self {
        self.revision = revision;
        self
    }

    fn render_options(&self, conv: &Conversation) -> RenderOptions {
        let mode = if conv.thinking { Mode::Thinking } else { Mode::Chat };
        RenderOptions { mode, revision: self.revision, ..RenderOptions::default() }
    }
}

fn tool_json(t: &crate::model::ToolSpec) -> Result<JsonValue, BackendError> {
    let text = format!(
        "{{\"name\":{},\"description\":{},\"parameters\":{}}}",
        serde_json::Value::String(t.name.clone()),
        serde_json::Value::String(t.description.clone()),
        t.parameters
    );
    JsonValue::parse(&text).map_err(|e| BackendError(format!("tool {}: {e}", t.name)))
}

/// Convert a [`Conversation`] to the renderer's messages.
pub fn to_chat_messages(conv: &Conversation) -> Result<Vec<chat::Message>, BackendError> {
    let mut out = Vec::with_capacity(conv.messages.len());
    for m in &conv.messages {
        let role = match m.role {
            TurnRole::System => chat::Role::System,
            TurnRole::User => chat::Role::User,
            TurnRole::Assistant => chat::Role::Assistant,
            TurnRole::Tool => chat::Role::Tool,
        };
        // Consecutive system messages (Codex's two developer messages) are one system prompt, so the tool list
        // (attached below) follows all of it instead of splitting it.
        if let Some(prev) = out.last_mut().filter(|p: &&mut chat::Message| p.role == role && role == chat::Role::System)
        {
            let text = prev.content.get_or_insert_with(String::new);
            if !text.is_empty() && !m.content.is_empty() {
                text.push_str("\n\n");
            }
            text.push_str(&m.content);
            continue;
        }
        let mut msg = chat::Message::new(role, m.content.clone());
        if !m.reasoning.is_empty() {
            msg.reasoning_content = Some(m.reasoning.clone());
        }
        msg.tool_call_id = m.tool_call_id.clone();
        msg.tool_calls = m
            .tool_calls
            .iter()
            .map(|c| chat::ToolCall { id: Some(c.id.clone()), name: c.name.clone(), arguments: c.arguments.clone() })
            .collect();
        out.push(msg);
    }
    if !conv.tools.is_empty() {
        let tools =
            conv.tools.iter().map(|t| tool_json(t).map(|f| chat::Tool { function: f })).collect::<Result<_, _>>()?;
        match out.first_mut() {
            Some(first) if first.role == chat::Role::System => first.tools = tools,
            _ => {
                let mut sys = chat::Message::new(chat::Role::System, String::new());
                sys.tools = tools;
                out.insert(0, sys);
            }
        }
    }
    Ok(out)
}

impl Codec for EngineCodec {
    fn render(&self, conv: &Conversation) -> Result<String, BackendError> {
        let messages = to_chat_messages(conv)?;
        chat::render_prompt(&messages, &self.render_options(conv)).map_err(be)
    }

    fn encode(&self, text: &str) -> Result<Vec<u32>, BackendError> {
        self.tok.encode(text).map_err(be)
    }

    fn encode_bounded(&self, text: &str, limit: usize) -> Result<Vec<u32>, EncodeError> {
        self.tok.encode_bounded(text, limit).map_err(be)?.ok_or(EncodeError::TooLong { limit })
    }

    fn prompt(&self, conv: &Conversation, limit: usize) -> Result<Vec<u32>, EncodeError> {
        let neutraliser = self.neutraliser.as_ref().map_err(|e| EncodeError::Failed(e.clone()))?;
        let messages = to_chat_messages(conv)?;
        crate::markers::prompt_ids(&self.tok, neutraliser, &messages, &self.render_options(conv), limit)
    }

    fn system_block_len(&self, prompt: &[u32]) -> usize {
        // Only the renderer's markers are special tokens (message text spelling one is plain text), so the first
        // `<｜User｜>` id is where the first user message starts.
        let Some(user) = self.tok.special().user else { return 0 };
        prompt.iter().position(|&t| t == user).unwrap_or(0)
    }

    fn decoder(&self) -> Box<dyn TokenDecoder> {
        Box::new(Decoder(StreamDecoder::new(&self.tok)))
    }

    fn parser(&self, thinking: bool) -> Box<dyn OutputParser> {
        let mode = if thinking { Mode::Thinking } else { Mode::Chat };
        Box::new(DsmlParser { inner: Some(StreamParser::new(mode)), call: None })
    }

    fn eos_tokens(&self) -> Vec<u32> {
        vec![self.tok.eos()]
    }

    fn bos(&self) -> Option<u32> {
        Some(self.tok.bos())
    }

    fn token_bytes(&self, id: u32) -> Vec<u8> {
        self.tok.token_bytes(id).map(<[u8]>::to_vec).unwrap_or_default()
    }

    fn grammar(&self) -> Result<Arc<crate::structured::GrammarSupport>, BackendError> {
        self.grammar
            .get_or_init(|| {
                let factory = ds4_engine::grammar::ConstraintFactory::new(&self.tok, self.logits).map_err(be)?;
                let s = self.tok.special();
                Ok(Arc::new(crate::structured::GrammarSupport {
                    factory,
                    eos: s.eos,
                    think_end: s.think_end.into_iter().collect(),
                    dsml: s.dsml,
                    call_open: None,
                }))
            })
            .clone()
    }
}

struct Decoder(StreamDecoder);

impl TokenDecoder for Decoder {
    fn push(&mut self, token: u32) -> String {
        self.0.push(token).unwrap_or_default()
    }

    fn finish(&mut self) -> String {
        self.0.finish()
    }
}

/// DSML stream parser → [`Parsed`] events (a tool call is emitted whole at its end).
struct DsmlParser {
    inner: Option<StreamParser>,
    call: Option<(String, String)>,
}

impl DsmlParser {
    fn map(&mut self, events: Vec<ParseEvent>) -> Vec<Parsed> {
        let mut out = Vec::new();
        for e in events {
            match e {
                ParseEvent::ReasoningDelta(r) => out.push(Parsed::Reasoning(r)),
                ParseEvent::ContentDelta(c) => out.push(Parsed::Content(c)),
                ParseEvent::ToolCallStart { name, .. } => self.call = Some((name, String::new())),
                ParseEvent::ToolArgsDelta { delta, .. } => {
                    if let Some((_, args)) = self.call.as_mut() {
                        args.push_str(&delta);
                    }
                }
                ParseEvent::ToolCallEnd { .. } => {
                    if let Some((name, arguments)) = self.call.take() {
                        out.push(Parsed::ToolCall { name, arguments });
                    }
                }
                ParseEvent::Error(e) => tracing::debug!(error = %e, "malformed model output"),
            }
        }
        out
    }
}

impl OutputParser for DsmlParser {
    fn push(&mut self, text: &str) -> Vec<Parsed> {
        let events = match self.inner.as_mut() {
            Some(p) => p.push(text),
            None => Vec::new(),
        };
        self.map(events)
    }

    fn finish(&mut self) -> Vec<Parsed> {
        match self.inner.take() {
            Some(p) => {
                let (events, _) = p.finish();
                self.map(events)
            }
            None => Vec::new(),
        }
    }
}

/// Options for [`load`].
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub backend: BackendKind,
    /// Groups of ops on a second backend (`--placement experts=cpu`).
    pub placement: ds4_engine::exec::Placement,
    /// Context per session (0: the largest that fits the memory, see [`crate::context`]).
    pub ctx: usize,
    /// Engine rows per tick.
    pub max_batch_tokens: usize,
    pub max_sessions: usize,
    /// Sessions decoding at once (`--max-active`): each may hold a roll-back log, which the default context
    /// leaves room for ([`crate::context`]).
    pub active_sessions: usize,
    /// Without a path: `None` serves the trained demo model (`ds4_engine::convert::trained_demo_gguf`), `Some(seed)`
    /// the random-weight demo model with the real vocabulary and tokenizer (`demo_model_gguf(seed)`).
    pub demo_seed: Option<u64>,
}

/// Open `path` (or build the demo model when `None`): runner, codec and model facts.
pub fn load(path: Option<&Path>, o: &LoadOptions) -> Result<(EngineRunner, EngineCodec, ModelInfo), BackendError> {
    let (file, demo) = match path {
        Some(p) => {
            let f = GgufFile::open(p).map_err(be)?;
            f.prefault();
            (f, false)
        }
        None => {
            let bytes = match o.demo_seed {
                None => ds4_engine::convert::trained_demo_gguf().to_vec(),
                Some(seed) => ds4_engine::convert::demo_model_gguf(seed).map_err(be)?,
            };
            (GgufFile::from_bytes(bytes).map_err(be)?, true)
        }
    };
    let tok = Tokenizer::from_gguf(&file).map_err(be)?;
    let ctx = if o.ctx == 0 {
        let cfg = ds4_engine::model::ModelConfig::from_gguf(&file).map_err(be)?;
        let log = crate::context::rollback_log_bytes(&cfg, EngineOptions::DEFAULT_ROLLBACK, cfg.ctx_len);
        let (ctx, why) = crate::context::auto_context(
            &cfg,
            file.file_size(),
            crate::context::mem_available(),
            o.active_sessions.max(1),
            log,
        );
        tracing::info!(ctx, "default context from memory: {why} (set --ctx to choose)");
        ctx
    } else {
        o.ctx
    };
    let opts = EngineOptions {
        backend: o.backend,
        placement: o.placement,
        ctx,
        max_batch_tokens: o.max_batch_tokens.max(1),
        ..Default::default()
    };
    let engine = Engine::from_gguf(file, opts).map_err(be)?;
    if o.placement != ds4_engine::exec::Placement::default() {
        tracing::info!(backend = %o.backend, placement = %o.placement, "ops placed on a second backend");
    }
    let info = ModelInfo {
        id: "deepseek-v4-flash".into(),
        context_size: engine.ctx(),
        vocab_size: engine.config().vocab,
        demo,
    };
    let codec = EngineCodec::new(tok).with_revision(engine.config().revision).with_logits(engine.config().vocab);
    let runner = EngineRunner {
        engine,
        ids: HashMap::new(),
        next: 0,
        max_sessions: o.max_sessions.max(1),
        rollback: EngineOptions::DEFAULT_ROLLBACK,
        drafter: None,
    };
    Ok((runner, codec, info))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_step_is_one_engine_tick_and_decode_goes_first() {
        let opts = LoadOptions {
            backend: BackendKind::Cpu,
            placement: Default::default(),
            ctx: 128,
            max_batch_tokens: 8,
            max_sessions: 4,
            active_sessions: 4,
            demo_seed: Some(1),
        };
        let (mut r, _, _) = load(None, &opts).expect("demo model");
        let (long, short) = (r.create_session().unwrap(), r.create_session().unwrap());
        r.feed(short, &[5]).unwrap();
        r.step().unwrap();
        assert!(r.logits(short).is_some());
        r.feed(long, &[7; 30]).unwrap();
        r.feed(short, &[6]).unwrap();
        r.step().unwrap();
        // One tick of 8 rows: the decode token and 7 prompt tokens; the rest waits for the next steps.
        assert_eq!((r.pending(short), r.pending(long)), (0, 23));
        let mut steps = 1;
        while r.pending(long) > 0 {
            r.step().unwrap();
            steps += 1;
            assert!(steps < 10, "the prefill does not progress");
        }
        assert_eq!(steps, 4);
        assert!(r.logits(long).is_some());
    }
}
