//! The seam between the HTTP/API layers and the model.
//!
//! Two traits split the work by thread:
//! - [`Runner`] is the model itself: a table of sessions, `feed` tokens into one, `step` once over all of them
//!   (continuous batching), read a session's `logits`. Exactly one thread (the scheduler) owns it, so it is `Send` but
//!   never shared.
//! - [`Codec`] is text in / text out: chat rendering, tokenizing, streaming detokenizing and parsing the completion
//!   into reasoning / content / tool calls. Request handlers use it concurrently (`Send + Sync`).
//!
//! [`Conversation`] is the one API-neutral chat shape every API layer converts into; the codec renders it to the
//! prompt text. Invariant: rendering is a pure function of the conversation, so a history that is sent back
//! unchanged renders to the same bytes (the basis of prefix reuse).
//!
//! The deterministic fake used by tests lives in [`crate::fake`]; the real engine adapter in [`crate::engine`].

use serde_json::Value;

/// A [`Runner`]'s session handle (the engine adapter maps it to a `ds4_engine::tables::SessionId`).
pub type RunnerSessionId = u64;

/// An error from the model side, already phrased for a human.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BackendError(pub String);

impl std::fmt::Display for BackendError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for BackendError {}

/// Bytes of KV state the runner's live sessions hold, per memory, for `/metrics` (the disk tier's are the tier
/// store's: [`crate::kvdisk::TierStats::disk_bytes`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvBytes {
    pub device: u64,
    pub host: u64,
}

/// The model, owned by the scheduler thread.
pub trait Runner: Send {
    /// Number of logits per position.
    fn vocab_size(&self) -> usize;
    /// Allocate an empty session.
    fn create_session(&mut self) -> Result<RunnerSessionId, BackendError>;
    /// Release a session and its KV state. Unknown ids are ignored.
    fn free_session(&mut self, session: RunnerSessionId);
    /// Drop every token after the first `len` of `session`. Returns `false` when the runner cannot roll back (the
    /// caller then starts a fresh session instead).
    fn truncate(&mut self, session: RunnerSessionId, len: usize) -> bool;
    /// Whether [`Runner::truncate`] can work at all (lets the scheduler plan reuse without trying).
    fn can_truncate(&self) -> bool {
        false
    }
    /// Smallest length `session` can be cut back to with [`Runner::truncate`] when the runner cannot truncate
    /// everything ([`Runner::can_truncate`] false) but can roll a session back within a reach (the engine's
    /// exact in-place roll back). `None`: no roll back for this session.
    fn rollback_floor(&self, _session: RunnerSessionId) -> Option<usize> {
        None
    }
    /// A new session with a copy of `session`'s state (processed tokens and last logits), or `None` when the runner
    /// cannot copy sessions or has no room.
    fn fork(&mut self, _session: RunnerSessionId) -> Option<RunnerSessionId> {
        None
    }
    /// Queue tokens for the next [`Runner::step`]s.
    fn feed(&mut self, session: RunnerSessionId, tokens: &[u32]) -> Result<(), BackendError>;
    /// Run one model tick over all sessions together (continuous batching): sessions with one queued token (decoding)
    /// first, then prompt chunks, as far as the runner's batch budget goes. Tokens beyond it stay queued for the next
    /// step ([`Runner::pending`]).
    fn step(&mut self) -> Result<(), BackendError>;
    /// Tokens fed to `session` that no step has processed yet (0 for runners that process everything at once).
    fn pending(&self, _session: RunnerSessionId) -> usize {
        0
    }
    /// Logits after the last token fed to `session`, once a step has processed it (and `pending` is 0).
    fn logits(&self, session: RunnerSessionId) -> Option<&[f32]>;
    /// From the next step on, `session`'s sampler reads no more than the `k` best logits of a row (`k` > 0), so
    /// a device runner may bring back only those (the rest of [`Runner::logits`]'s row is then −∞); 0 asks for
    /// whole rows again and drops a row that holds only candidates. Runners that always return whole rows ignore
    /// it.
    fn set_logit_candidates(&mut self, _session: RunnerSessionId, _k: usize) {}
    /// KV bytes per tier.
    fn kv_bytes(&self) -> KvBytes {
        KvBytes::default()
    }
    /// Memory `session` holds (its KV state and per-session buffers such as a roll-back log), counted as if it
    /// shared nothing with other sessions (an upper bound); the RAM tier's byte budget is charged with it. 0 when
    /// the runner does not know.
    fn session_bytes(&self, _session: RunnerSessionId) -> u64 {
        0
    }
    /// KV bytes copied so far by forks and copy on write (`ds4_kv_fork_bytes_copied_total`).
    fn kv_bytes_copied(&self) -> u64 {
        0
    }
    /// Tokens `session` has processed (`None`: unknown session, or a runner that does not say).
    fn position(&self, _session: RunnerSessionId) -> Option<usize> {
        None
    }
    /// The KV tiers ([`crate::kvdisk`]): what loading a session needs to know of the model, detached from it.
    /// `None`: this runner's sessions cannot be saved or restored (the tier store stays off).
    fn kv_layout(&self) -> Option<ds4_engine::persist::KvLayout> {
        None
    }
    /// The KV tiers: `session`'s state, taken now for a save to `store` (a snapshot sharing the session's pages,
    /// plus its restore points); the tier's I/O worker writes it. No I/O happens here.
    fn export(
        &mut self,
        _session: RunnerSessionId,
        _store: &ds4_kv::KvStore,
        _reason: ds4_kv::SaveReason,
    ) -> Result<ds4_engine::persist::SaveJob, BackendError> {
        Err(BackendError("this runner cannot save sessions".into()))
    }
    /// The KV tiers: a new session holding `snapshot` (loaded by the tier's I/O worker).
    fn import(&mut self, _snapshot: ds4_engine::tables::SessionSnapshot) -> Result<RunnerSessionId, BackendError> {
        Err(BackendError("this runner cannot restore sessions".into()))
    }
    /// Speculative decoding: whether the runner has a drafter (`--speculative`).
    fn can_draft(&self) -> bool {
        false
    }
    /// Speculative decoding: drafts for several sessions at once (one shared drafter tick per draft position).
    /// Each request: the session, its context (processed tokens and the chosen next token, not yet fed) and the
    /// most tokens wanted. An empty draft where the drafter has nothing.
    fn draft(&mut self, reqs: &[(RunnerSessionId, &[u32], usize)]) -> Vec<Vec<u32>> {
        vec![Vec::new(); reqs.len()]
    }
    /// Speculative decoding: queue a verify run (the chosen token and its draft), keeping every position's logits
    /// for [`Runner::take_verify_logits`].
    fn feed_verify(&mut self, session: RunnerSessionId, tokens: &[u32]) -> Result<(), BackendError> {
        self.feed(session, tokens)
    }
    /// The `[n, vocab]` logits of the verify run fed last (once a step processed it).
    fn take_verify_logits(&mut self, _session: RunnerSessionId) -> Vec<f32> {
        Vec::new()
    }
    /// Keeps the first `len` tokens of `session` (an exact roll back of the rejected drafts) and makes `logits`
    /// (the verify row after the last kept token) its current logits.
    fn commit_verify(&mut self, _session: RunnerSessionId, _len: usize, _logits: &[f32]) -> Result<(), BackendError> {
        Err(BackendError("this runner does not verify drafts".into()))
    }
}

/// Who said a message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TurnRole {
    System,
    User,
    Assistant,
    Tool,
}

/// One tool call, as produced by the model or echoed back by a client.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TurnToolCall {
    pub id: String,
    pub name: String,
    /// JSON text of the arguments, byte-exact as the model produced it when known.
    pub arguments: String,
}

/// One chat message in API-neutral form.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatTurn {
    pub role: TurnRole,
    pub content: String,
    /// Reasoning text of an assistant turn (empty when none).
    pub reasoning: String,
    pub tool_calls: Vec<TurnToolCall>,
    /// For `TurnRole::Tool`: the call this result answers.
    pub tool_call_id: Option<String>,
}

impl ChatTurn {
    pub fn new(role: TurnRole, content: impl Into<String>) -> Self {
        ChatTurn { role, content: content.into(), reasoning: String::new(), tool_calls: Vec::new(), tool_call_id: None }
    }
}

/// A function tool offered to the model.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolSpec {
    pub name: String,
    pub description: String,
    /// JSON Schema of the arguments (any keywords; passed through).
    pub parameters: Value,
}

/// A whole chat request in API-neutral form.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Conversation {
    pub messages: Vec<ChatTurn>,
    pub tools: Vec<ToolSpec>,
    /// Think before answering (the prompt opens a reasoning block).
    pub thinking: bool,
}

/// What the output parser recognised in the completion text.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Parsed {
    Reasoning(String),
    Content(String),
    /// A complete tool call (arguments as JSON text). The id is assigned later by the server.
    ToolCall {
        name: String,
        arguments: String,
    },
}

/// Incremental detokenizer: token ids in, complete UTF-8 text out.
pub trait TokenDecoder: Send {
    fn push(&mut self, token: u32) -> String;
    /// Whatever is still buffered (lossy at a cut UTF-8 sequence).
    fn finish(&mut self) -> String;
}

/// Streaming completion parser: text in, events out.
pub trait OutputParser: Send {
    fn push(&mut self, text: &str) -> Vec<Parsed>;
    fn finish(&mut self) -> Vec<Parsed>;
}

/// Why a bounded tokenization gave no ids.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EncodeError {
    /// More than `limit` tokens (counting stopped there).
    TooLong {
        limit: usize,
    },
    Failed(BackendError),
}

impl From<BackendError> for EncodeError {
    fn from(e: BackendError) -> Self {
        EncodeError::Failed(e)
    }
}

/// Text side of the model, shared by all request handlers.
pub trait Codec: Send + Sync {
    /// Render a conversation to the prompt text, ending where the assistant's reply starts.
    fn render(&self, conv: &Conversation) -> Result<String, BackendError>;
    fn encode(&self, text: &str) -> Result<Vec<u32>, BackendError>;
    /// [`Codec::encode`] that stops once more than `limit` ids are produced (the work is bounded by `limit`, not
    /// by the text's length, where the codec can).
    fn encode_bounded(&self, text: &str, limit: usize) -> Result<Vec<u32>, EncodeError> {
        let ids = self.encode(text)?;
        if ids.len() > limit {
            return Err(EncodeError::TooLong { limit });
        }
        Ok(ids)
    }
    /// The prompt ids of a conversation, at most `limit` of them. Only the renderer's own markers become special
    /// tokens: text in messages, tool results and tool definitions that spells one (`<｜User｜>`) is tokenized as
    /// plain text. Agrees with what is counted (`count_tokens`) and what is generated from.
    fn prompt(&self, conv: &Conversation, limit: usize) -> Result<Vec<u32>, EncodeError> {
        let text = self.render(conv)?;
        self.encode_bounded(&text, limit)
    }
    /// The length of the system + tools block at the start of the prompt ids `prompt`: the tokens before the first
    /// user message (0 when the codec cannot tell). Conversations of one agent share it (the disk tier saves there).
    fn system_block_len(&self, _prompt: &[u32]) -> usize {
        0
    }
    fn decoder(&self) -> Box<dyn TokenDecoder>;
    /// A parser for a completion that starts inside a reasoning block when `thinking` is set.
    fn parser(&self, thinking: bool) -> Box<dyn OutputParser>;
    /// Tokens that end a completion.
    fn eos_tokens(&self) -> Vec<u32>;
    /// The beginning-of-sequence token a text gets when special tokens are added (`/tokenize`'s `add_special`).
    fn bos(&self) -> Option<u32> {
        None
    }
    /// The bytes token `id` stands for (`/tokenize`'s pieces; may be part of a UTF-8 sequence). Default: what a
    /// fresh decoder makes of the token alone.
    fn token_bytes(&self, id: u32) -> Vec<u8> {
        let mut d = self.decoder();
        let mut s = d.push(id);
        s.push_str(&d.finish());
        s.into_bytes()
    }
    /// The grammar compiler for this model's vocabulary (structured outputs); an error when the model has none.
    fn grammar(&self) -> Result<std::sync::Arc<crate::structured::GrammarSupport>, BackendError> {
        Err(BackendError("this model has no grammar support".into()))
    }
}

/// Static facts about the loaded model.
#[derive(Debug, Clone)]
pub struct ModelInfo {
    /// The id reported by `/v1/models` (requests may name any model; see `api::models`).
    pub id: String,
    pub context_size: usize,
    /// Token ids are `0..vocab_size`.
    pub vocab_size: usize,
    /// True for the built-in demo/fake model (said at startup and in `/v1/models`).
    pub demo: bool,
}
