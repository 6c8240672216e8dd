//! `ds4 run` (one prompt → one answer) and `ds4 chat` (interactive), on top of [`ds4_engine::engine::Engine`].
//!
//! The generation loop ([`generate`]) ties the text pieces together: render the conversation ([`ds4_engine::chat`]),
//! encode it, feed it, then per step: sample ([`ds4_engine::sampler::Sampler`], greedy inside DSML syntax and on
//! structural tokens), decode incrementally ([`ds4_engine::tokenizer::StreamDecoder`]), check stop sequences and the token
//! limit ([`ds4_engine::sampler::StopChecker`]) and parse reasoning / content / tool calls ([`ds4_engine::chat::StreamParser`]).
//!
//! Output: the answer goes to stdout as it is generated; reasoning goes to stderr (so `ds4 run … > answer.txt` keeps
//! only the answer); tool calls are printed to stdout as one JSON line each once complete.

use std::io::{BufRead, Write};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use anyhow::Context;

use ds4_engine::chat::{
    render, Message, Mode, ParseEvent, ParsedMessage, ReasoningEffort, RenderInput, Role, StreamParser,
};
use ds4_engine::engine::{BackendKind, Engine, EngineOptions};
use ds4_engine::gguf::GgufFile;
use ds4_engine::sampler::{Sampler, SamplerConfig, StopChecker, StopStatus};
use ds4_engine::speculative::auto::{AutoPause, TickCost};
use ds4_engine::speculative::{AnyDrafter, Cycle, Drafter, DrafterKind, SpecStats};
use ds4_engine::tables::SessionId;
use ds4_engine::tokenizer::{Tokenizer, EOS_TOKEN};

/// Options shared by `ds4 run` and `ds4 chat`.
#[derive(clap::Args, Debug, Clone)]
pub struct GenArgs {
    /// The DS4 GGUF model file (default: the built-in demo model, small and trained: words, not sense).
    #[arg(short = 'm', long = "model")]
    pub model: Option<PathBuf>,
    /// A system prompt.
    #[arg(long)]
    pub system: Option<String>,
    /// Thinking mode (the default).
    #[arg(long, conflicts_with = "nothink")]
    pub think: bool,
    /// Chat mode: answer without reasoning.
    #[arg(long)]
    pub nothink: bool,
    /// Reasoning effort in thinking mode: high or max.
    #[arg(long = "reasoning-effort", default_value = "high")]
    pub reasoning_effort: String,
    /// Maximum generated tokens per answer.
    #[arg(long = "max-tokens", default_value_t = 1024)]
    pub max_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 1.0)]
    pub temperature: f32,
    #[arg(long = "top-p", default_value_t = 1.0)]
    pub top_p: f32,
    /// 0 = off.
    #[arg(long = "top-k", default_value_t = 0)]
    pub top_k: usize,
    #[arg(long = "min-p", default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Stop when this text appears (repeatable).
    #[arg(long = "stop")]
    pub stop: Vec<String>,
    /// cpu, wgpu or cuda (cuda: a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub backend: BackendKind,
    /// Where groups of ops run besides --backend: `experts=cpu` runs every MoE layer's experts on the CPU and the
    /// rest on the GPU backend (a model bigger than GPU memory); `default`: everything on --backend.
    #[arg(long, default_value = "default")]
    pub placement: ds4_engine::exec::Placement,
    /// At exit, print to stderr which backend and kernel ran each node kind of the last tick (the executor's
    /// placement report).
    #[arg(long)]
    pub placement_report: bool,
    /// Worker threads (0 = all cores).
    #[arg(long, default_value_t = 0)]
    pub threads: usize,
    /// Context length (0 = the model's).
    #[arg(long, default_value_t = 0)]
    pub ctx: usize,
    /// Speculative decoding: off, mtp (the model's MTP block drafts; an error without one), dspark (the V4-Flash-0731
    /// DSpark drafter; an error without one) or auto (the model's drafter — MTP, else DSpark — paused while its
    /// drafts do not pay for their measured cost). The answer is the one plain decoding gives.
    #[arg(long, default_value = "auto")]
    pub speculative: SpecChoice,
    /// Drafted tokens per verify run at most.
    #[arg(long = "draft-len", default_value_t = 3, value_parser = clap::value_parser!(u64).range(1..=16))]
    pub draft_len: u64,
}

/// `--speculative` of `ds4 run/chat/generate`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum SpecChoice {
    Off,
    Mtp,
    Dspark,
    Auto,
}

/// The drafter `choice` asks for on `engine`'s model (`None`: plain decoding).
pub fn drafter_for(engine: &Engine, choice: SpecChoice, threads: usize) -> anyhow::Result<Option<AnyDrafter>> {
    let kind = match choice {
        SpecChoice::Off => return Ok(None),
        SpecChoice::Mtp => DrafterKind::Mtp,
        SpecChoice::Dspark => DrafterKind::Dspark,
        SpecChoice::Auto => DrafterKind::Any,
    };
    let d = if choice == SpecChoice::Auto {
        AnyDrafter::load(engine.model(), kind, 0.0, threads)?
    } else {
        let name = if kind == DrafterKind::Mtp { "mtp" } else { "dspark" };
        Some(
            AnyDrafter::require(engine.model(), kind, 0.0, threads)
                .map_err(|e| anyhow::anyhow!("--speculative {name}: {e}"))?,
        )
    };
    if let Some(d) = &d {
        tracing::info!(drafter = d.name(), "speculative decoding");
    }
    Ok(d)
}

/// Arguments of `ds4 run`.
#[derive(clap::Args, Debug)]
pub struct RunArgs {
    #[command(flatten)]
    pub gen: GenArgs,
    /// The user prompt ("-" reads it from stdin).
    #[arg(short = 'p', long = "prompt")]
    pub prompt: String,
}

/// Arguments of `ds4 chat`.
#[derive(clap::Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub gen: GenArgs,
}

struct Loaded {
    engine: Engine,
    tok: Tokenizer,
    mode: Mode,
    effort: ReasoningEffort,
    sampler: SamplerConfig,
}

fn load(g: &GenArgs) -> anyhow::Result<Loaded> {
    let effort: ReasoningEffort = g.reasoning_effort.parse()?;
    let backend = g.backend;
    let sampler = SamplerConfig {
        temperature: g.temperature,
        top_p: g.top_p,
        top_k: g.top_k,
        min_p: g.min_p,
        seed: g.seed,
        ..Default::default()
    };
    sampler.validate()?;
    let file = match &g.model {
        Some(path) => {
            let f = GgufFile::open(path)?;
            f.prefault();
            f
        }
        None => {
            tracing::info!(
                "no -m given: using the built-in demo model (small, trained on Python docs: words, not sense)"
            );
            GgufFile::from_bytes(ds4_engine::convert::trained_demo_gguf().to_vec())?
        }
    };
    let name = g.model.as_ref().map_or_else(|| "the demo model".to_string(), |p| p.display().to_string());
    let tok = Tokenizer::from_gguf(&file).with_context(|| format!("tokenizer of {name}"))?;
    let opts = EngineOptions { backend, threads: g.threads, ctx: g.ctx, placement: g.placement, ..Default::default() };
    let engine = Engine::from_gguf(file, opts)?;
    let mode = if g.nothink { Mode::Chat } else { Mode::Thinking };
    Ok(Loaded { engine, tok, mode, effort, sampler })
}

/// How one assistant turn is generated.
#[derive(Clone, Copy, Debug)]
pub struct TurnOptions<'a> {
    /// The mode the prompt was rendered in (where the parser starts).
    pub mode: Mode,
    pub sampler: &'a SamplerConfig,
    pub stops: &'a [String],
    pub max_tokens: usize,
    /// When set (e.g. by Ctrl-C), generation stops after the current token and the flag is cleared.
    pub cancel: Option<&'a AtomicBool>,
}

/// Speculative decoding for [`generate`]: the drafter, the most tokens it drafts per verify run, and with
/// `auto` the measured cost that pauses drafting while it does not pay (`ds4_engine::speculative::auto`).
pub struct Speculation<'a> {
    pub drafter: &'a mut AnyDrafter,
    pub draft_len: usize,
    pub stats: SpecStats,
    /// `--speculative auto`: the turn's drafting pauses while its drafts do not pay; `None` (`mtp`): always drafts.
    pub auto: Option<(AutoPause, TickCost)>,
}

impl<'a> Speculation<'a> {
    /// One turn's speculation with `drafter` as `g`'s `--speculative` and `--draft-len` ask.
    pub fn new(drafter: &'a mut AnyDrafter, g: &GenArgs) -> Self {
        let auto = (g.speculative == SpecChoice::Auto).then(|| (AutoPause::default(), TickCost::default()));
        Speculation { drafter, draft_len: g.draft_len as usize, stats: SpecStats::default(), auto }
    }
}

/// Whether a token ends the turn.
#[derive(PartialEq)]
enum Next {
    Go,
    Stop,
}

/// Runs one assistant turn: feeds `new_tokens` to `sess`, then samples until EOS, a stop sequence or the token
/// limit. `on_event` sees every parser event as it happens. Returns the parsed answer.
///
/// With `spec`, each sampled token is fed with the drafter's continuation as one verify run
/// ([`Engine::verify_drafts`]); the accepted drafts go through the same decoding, stop and parse steps as sampled
/// tokens, so the answer is the one plain decoding gives (token for token at temperature 0; the same distribution
/// otherwise: no draft is made or kept inside DSML syntax, where sampling turns greedy).
pub fn generate(
    engine: &mut Engine,
    sess: SessionId,
    tok: &Tokenizer,
    new_tokens: &[u32],
    opt: &TurnOptions<'_>,
    mut spec: Option<&mut Speculation<'_>>,
    on_event: &mut dyn FnMut(&ParseEvent),
) -> ds4_engine::Result<ParsedMessage> {
    let TurnOptions { mode, sampler: sampler_cfg, stops, max_tokens, cancel } = *opt;
    engine.feed(sess, new_tokens)?;
    engine.run_until_idle()?;
    let mut sampler = Sampler::new(sampler_cfg.clone())?;
    let special = tok.special();
    sampler.set_structural_tokens([Some(special.eos), special.dsml, special.think_end].into_iter().flatten());
    let mut parser = StreamParser::new(mode);
    let mut dec = tok.stream_decoder();
    let mut stop = StopChecker::new(stops.iter().cloned(), Some(max_tokens));
    let emit = |parser: &mut StreamParser, text: &str, on_event: &mut dyn FnMut(&ParseEvent)| {
        for e in parser.push(text) {
            on_event(&e);
        }
    };
    // The text side of one generated token (it is fed by the caller).
    let mut take = |id: u32, parser: &mut StreamParser, on_event: &mut dyn FnMut(&ParseEvent)| {
        if id == special.eos {
            let rest = dec.finish() + &stop.finish();
            emit(parser, &rest, on_event);
            emit(parser, EOS_TOKEN, on_event);
            return Ok::<Next, ds4_engine::Error>(Next::Stop);
        }
        let piece = dec.push(id)?;
        Ok(match stop.push(&piece) {
            StopStatus::Continue { emit: text } => {
                emit(parser, &text, on_event);
                Next::Go
            }
            StopStatus::Stop { emit: text, reason } => {
                tracing::debug!(?reason, "generation stopped");
                emit(parser, &text, on_event);
                Next::Stop
            }
        })
    };
    let mut forced: Option<u32> = None;
    let mut generated = 0usize;
    loop {
        if cancel.is_some_and(|c| c.swap(false, Ordering::SeqCst)) {
            tracing::info!("generation stopped (interrupted)");
            let rest = dec.finish() + &stop.finish();
            emit(&mut parser, &rest, on_event);
            break;
        }
        let id = match forced.take() {
            Some(t) => t,
            None => sampler.sample_with(engine.logits(sess)?, parser.in_tool_syntax())?,
        };
        sampler.accept(id);
        generated += 1;
        // An end token is fed too, so the session's history holds the whole turn (the next turn continues after it).
        if take(id, &mut parser, on_event)? == Next::Stop {
            engine.feed(sess, &[id])?;
            engine.run_until_idle()?;
            break;
        }
        let room = max_tokens.saturating_sub(generated + 1);
        let t0 = std::time::Instant::now();
        let paused = spec.as_ref().and_then(|sp| sp.auto.as_ref()).is_some_and(|(a, _)| !a.drafting(generated));
        let draft = match spec.as_deref_mut() {
            Some(sp) if room > 0 && !parser.in_tool_syntax() && !paused => {
                let mut ctx = engine.history(sess)?.to_vec();
                ctx.push(id);
                let mut d = sp.drafter.draft(engine, sess, &ctx, sp.draft_len.min(room))?;
                d.truncate(sp.draft_len.min(room));
                d
            }
            _ => Vec::new(),
        };
        if draft.is_empty() {
            engine.feed(sess, &[id])?;
            engine.run_until_idle()?;
            if let Some((_, cost)) = spec.as_deref_mut().and_then(|sp| sp.auto.as_mut()) {
                cost.plain_tick(t0.elapsed().as_secs_f64());
            }
            continue;
        }
        let base = engine.position(sess)?;
        let mut cycle = [Cycle { session: sess, first: id, draft: &draft, sampler: &mut sampler }];
        let v = engine.verify_drafts(&mut cycle)?.remove(0);
        if let Some(sp) = spec.as_deref_mut() {
            sp.stats.cycles += 1;
            sp.stats.drafted += draft.len();
            sp.stats.accepted += v.accepted;
            if let Some((pause, cost)) = &mut sp.auto {
                cost.spec_tick(t0.elapsed().as_secs_f64());
                if pause.record(v.accepted, generated + v.accepted, cost.ratio()) {
                    tracing::debug!(cost = cost.ratio(), "speculation paused: its drafts do not pay");
                }
            }
        }
        forced = Some(v.next);
        let mut end = false;
        for (j, &d) in draft[..v.accepted].iter().enumerate() {
            generated += 1;
            let next = take(d, &mut parser, on_event)?;
            if next == Next::Stop || parser.in_tool_syntax() {
                // Keep the session up to this token, with its logits (as plain decoding leaves it); inside DSML
                // syntax the next token is sampled again, greedily.
                let keep = base + 2 + j;
                if engine.position(sess)? > keep {
                    engine.truncate(sess, keep)?;
                    engine.run_until_idle()?;
                }
                forced = None;
                end = next == Next::Stop;
                break;
            }
        }
        if end {
            break;
        }
    }
    let (last, result) = parser.finish();
    for e in &last {
        on_event(e);
    }
    Ok(result)
}

fn printer() -> impl FnMut(&ParseEvent) {
    move |e: &ParseEvent| match e {
        ParseEvent::ReasoningDelta(d) => {
            let mut err = std::io::stderr().lock();
            let _ = err.write_all(d.as_bytes());
            let _ = err.flush();
        }
        ParseEvent::ContentDelta(d) => {
            let mut out = std::io::stdout().lock();
            let _ = out.write_all(d.as_bytes());
            let _ = out.flush();
        }
        ParseEvent::Error(m) => tracing::warn!("model output: {m}"),
        _ => {}
    }
}

/// Prints the completed tool calls (one JSON line each) and ends the answer's line.
fn print_turn_end(p: &ParsedMessage) -> std::io::Result<()> {
    let mut out = std::io::stdout().lock();
    for c in &p.tool_calls {
        let line = serde_json::json!({"tool_call": {"name": c.name, "arguments": c.arguments}});
        writeln!(out, "\n{line}")?;
    }
    writeln!(out)?;
    out.flush()
}

fn conversation_start(g: &GenArgs) -> Vec<Message> {
    g.system.iter().map(|s| Message::new(Role::System, s.clone())).collect()
}

/// Runs `ds4 run`.
pub fn run(a: RunArgs) -> anyhow::Result<i32> {
    let mut l = load(&a.gen)?;
    let prompt = if a.prompt == "-" {
        let mut s = String::new();
        std::io::Read::read_to_string(&mut std::io::stdin(), &mut s)?;
        s
    } else {
        a.prompt.clone()
    };
    let mut messages = conversation_start(&a.gen);
    messages.push(Message::new(Role::User, prompt));
    let text = render(&RenderInput { messages }, l.mode, l.effort)?;
    let ids = l.tok.encode(&text)?;
    let sess = l.engine.create_session();
    let mut drafter = drafter_for(&l.engine, a.gen.speculative, a.gen.threads)?;
    if let Some(d) = &mut drafter {
        d.attach(&mut l.engine, sess)?;
    }
    let mut spec = drafter.as_mut().map(|d| Speculation::new(d, &a.gen));
    let mut on_event = printer();
    let opt = TurnOptions {
        mode: l.mode,
        sampler: &l.sampler,
        stops: &a.gen.stop,
        max_tokens: a.gen.max_tokens,
        cancel: None,
    };
    let parsed = generate(&mut l.engine, sess, &l.tok, &ids, &opt, spec.as_mut(), &mut on_event)?;
    print_turn_end(&parsed)?;
    if let Some(sp) = &spec {
        spec_summary(&sp.stats);
    }
    placement_report(&a.gen, &l.engine);
    Ok(0)
}

/// The speculation counters of a run (a `tracing` line).
fn spec_summary(st: &SpecStats) {
    tracing::info!(
        cycles = st.cycles,
        drafted = st.drafted,
        accepted = st.accepted,
        acceptance = format!("{:.2}", st.acceptance_rate()),
        mean_accepted_length = format!("{:.2}", st.mean_accepted_length()),
        "speculative decoding"
    );
}

/// With `--placement-report`, the engine's placement of its last tick on stderr.
fn placement_report(g: &GenArgs, engine: &Engine) {
    if g.placement_report {
        eprint!("{}", engine.placement_report());
    }
}

/// Reads one user message: a line, or several lines when a line ends with `\\` (continued) or between two lines
/// holding only `"""`. Returns `None` at end of input.
fn read_message(input: &mut dyn BufRead) -> std::io::Result<Option<String>> {
    let mut msg = String::new();
    let mut in_block = false;
    loop {
        let mut line = String::new();
        if input.read_line(&mut line)? == 0 {
            return Ok(if msg.is_empty() { None } else { Some(msg) });
        }
        let line = line.trim_end_matches(['\n', '\r']);
        if line.trim() == "\"\"\"" {
            if in_block {
                return Ok(Some(msg));
            }
            in_block = true;
            continue;
        }
        if in_block {
            if !msg.is_empty() {
                msg.push('\n');
            }
            msg.push_str(line);
            continue;
        }
        if let Some(head) = line.strip_suffix('\\') {
            msg.push_str(head);
            msg.push('\n');
            continue;
        }
        msg.push_str(line);
        return Ok(Some(msg));
    }
}

/// Installs the Ctrl-C handler of `ds4 chat`: during generation it sets `cancel` (generation stops, the REPL goes
/// on); at the prompt it quits.
fn install_interrupt(cancel: Arc<AtomicBool>, generating: Arc<AtomicBool>) {
    let r = ctrlc::set_handler(move || {
        if generating.load(Ordering::SeqCst) {
            cancel.store(true, Ordering::SeqCst);
        } else {
            eprintln!();
            std::process::exit(130);
        }
    });
    if let Err(e) = r {
        tracing::warn!("Ctrl-C handler not installed: {e}");
    }
}

/// Runs `ds4 chat`: one user turn per message (see [`read_message`] for multi-line input). Commands: `/think`,
/// `/nothink` switch the mode, `/reset` starts over, `/exit` (or end of input) quits; Ctrl-C stops a generation
/// without quitting.
pub fn chat(a: ChatArgs) -> anyhow::Result<i32> {
    let mut l = load(&a.gen)?;
    let mut messages = conversation_start(&a.gen);
    let mut sess = l.engine.create_session();
    let mut drafter = drafter_for(&l.engine, a.gen.speculative, a.gen.threads)?;
    if let Some(d) = &mut drafter {
        d.attach(&mut l.engine, sess)?;
    }
    let mut stats = SpecStats::default();
    let stdin = std::io::stdin();
    let mut on_event = printer();
    let cancel = Arc::new(AtomicBool::new(false));
    let generating = Arc::new(AtomicBool::new(false));
    install_interrupt(cancel.clone(), generating.clone());
    loop {
        eprint!("> ");
        let Some(line) = read_message(&mut stdin.lock())? else { break };
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => break,
            "/reset" => {
                messages = conversation_start(&a.gen);
                sess = renew_session(&mut l.engine, drafter.as_mut(), sess)?;
                continue;
            }
            "/think" => {
                l.mode = Mode::Thinking;
                eprintln!("(thinking mode)");
                continue;
            }
            "/nothink" => {
                l.mode = Mode::Chat;
                eprintln!("(chat mode)");
                continue;
            }
            _ => {}
        }
        messages.push(Message::new(Role::User, line));
        let text = render(&RenderInput { messages: messages.clone() }, l.mode, l.effort)?;
        let ids = l.tok.encode(&text)?;
        // Reuse the session when what it has processed is a prefix of the new prompt (earlier reasoning that the
        // format drops, or a mode switch, makes it differ; then start over).
        let done = l.engine.history(sess)?.to_vec();
        let new = if ids.starts_with(&done) {
            &ids[done.len()..]
        } else {
            sess = renew_session(&mut l.engine, drafter.as_mut(), sess)?;
            &ids[..]
        };
        let opt = TurnOptions {
            mode: l.mode,
            sampler: &l.sampler,
            stops: &a.gen.stop,
            max_tokens: a.gen.max_tokens,
            cancel: Some(&cancel),
        };
        cancel.store(false, Ordering::SeqCst);
        generating.store(true, Ordering::SeqCst);
        let mut spec = drafter.as_mut().map(|d| Speculation::new(d, &a.gen));
        let parsed = generate(&mut l.engine, sess, &l.tok, new, &opt, spec.as_mut(), &mut on_event);
        if let Some(sp) = spec {
            stats.cycles += sp.stats.cycles;
            stats.drafted += sp.stats.drafted;
            stats.accepted += sp.stats.accepted;
        }
        generating.store(false, Ordering::SeqCst);
        let parsed = parsed?;
        print_turn_end(&parsed)?;
        messages.push(parsed.to_message());
    }
    if drafter.is_some() {
        spec_summary(&stats);
    }
    placement_report(&a.gen, &l.engine);
    Ok(0)
}

/// Frees `sess` and makes a new session (attached to the drafter, when there is one).
fn renew_session(engine: &mut Engine, drafter: Option<&mut AnyDrafter>, sess: SessionId) -> anyhow::Result<SessionId> {
    let s = engine.create_session();
    if let Some(d) = drafter {
        d.detach(engine, sess);
        d.attach(engine, s)?;
    }
    engine.free_session(sess)?;
    Ok(s)
}

#[cfg(test)]
mod tests {
    use super::*;
    use ds4_engine::chat::ParsedToolCall;

    fn demo() -> (Engine, Tokenizer) {
        let bytes = ds4_engine::convert::demo::demo_model_gguf(3).unwrap();
        let tok = Tokenizer::from_gguf(&GgufFile::from_bytes(bytes.clone()).unwrap()).unwrap();
        let engine = Engine::from_gguf(GgufFile::from_bytes(bytes).unwrap(), EngineOptions::default()).unwrap();
        (engine, tok)
    }

    fn turn(engine: &mut Engine, tok: &Tokenizer, cfg: &SamplerConfig, max_tokens: usize) -> (ParsedMessage, String) {
        let text = render(
            &RenderInput { messages: vec![Message::new(Role::User, "Hello")] },
            Mode::Thinking,
            ReasoningEffort::High,
        )
        .unwrap();
        let ids = tok.encode(&text).unwrap();
        let sess = engine.create_session();
        let mut seen = String::new();
        let opt = TurnOptions { mode: Mode::Thinking, sampler: cfg, stops: &[], max_tokens, cancel: None };
        let p = generate(engine, sess, tok, &ids, &opt, None, &mut |e| match e {
            ParseEvent::ReasoningDelta(d) | ParseEvent::ContentDelta(d) => seen += d,
            _ => {}
        })
        .unwrap();
        let n = engine.history(sess).unwrap().len() - ids.len();
        assert!(n <= max_tokens + 1, "{n} tokens generated for a limit of {max_tokens}");
        engine.free_session(sess).unwrap();
        (p, seen)
    }

    #[test]
    fn generation_on_the_demo_model_is_deterministic_and_bounded() {
        let (mut engine, tok) = demo();
        let cfg = SamplerConfig { seed: 9, temperature: 0.8, ..Default::default() };
        let (a, seen_a) = turn(&mut engine, &tok, &cfg, 12);
        let (b, _) = turn(&mut engine, &tok, &cfg, 12);
        assert_eq!(a, b);
        assert_eq!(seen_a, format!("{}{}", a.reasoning_content, a.content));
        assert!(a
            .tool_calls
            .iter()
            .all(|c: &ParsedToolCall| serde_json::from_str::<serde_json::Value>(&c.arguments).is_ok()));
        let (g, _) = turn(&mut engine, &tok, &SamplerConfig::greedy(), 6);
        assert_eq!(g, turn(&mut engine, &tok, &SamplerConfig::greedy(), 6).0);
    }

    #[test]
    fn multi_line_messages() {
        let mut input: &[u8] = b"one\ntwo \\\nthree\n\"\"\"\na\n\nb\n\"\"\"\nlast";
        assert_eq!(read_message(&mut input).unwrap().as_deref(), Some("one"));
        assert_eq!(read_message(&mut input).unwrap().as_deref(), Some("two \nthree"));
        assert_eq!(read_message(&mut input).unwrap().as_deref(), Some("a\n\nb"));
        assert_eq!(read_message(&mut input).unwrap().as_deref(), Some("last"));
        assert_eq!(read_message(&mut input).unwrap(), None);
    }

    #[test]
    fn a_set_cancel_flag_stops_generation_and_is_cleared() {
        let (mut engine, tok) = demo();
        let cfg = SamplerConfig { temperature: 0.0, ..Default::default() };
        let ids = tok.encode("Hello").unwrap();
        let sess = engine.create_session();
        let cancel = AtomicBool::new(true);
        let opt = TurnOptions { mode: Mode::Chat, sampler: &cfg, stops: &[], max_tokens: 50, cancel: Some(&cancel) };
        generate(&mut engine, sess, &tok, &ids, &opt, None, &mut |_| {}).unwrap();
        assert_eq!(engine.history(sess).unwrap().len(), ids.len(), "no token may be generated after a cancel");
        assert!(!cancel.load(Ordering::SeqCst), "the flag is cleared");
        generate(&mut engine, sess, &tok, &[], &TurnOptions { max_tokens: 3, ..opt }, None, &mut |_| {}).unwrap();
        assert!(engine.history(sess).unwrap().len() > ids.len(), "a later turn generates again");
    }

    /// A random model with the real tokenizer and an MTP block.
    fn with_mtp(seed: u64) -> (Engine, Tokenizer) {
        let mut cfg = ds4_engine::convert::demo_config();
        cfg.n_nextn_layers = 1;
        let tj = ds4_engine::tokenizer::bundled_tokenizer_json();
        let meta = ds4_engine::tokenizer::gguf_metadata_from_tokenizer_json_bytes(tj).unwrap();
        let bytes = ds4_engine::convert::random_model_gguf(&cfg, seed, meta).unwrap();
        let tok = Tokenizer::from_gguf(&GgufFile::from_bytes(bytes.clone()).unwrap()).unwrap();
        let opts = EngineOptions { threads: 2, ..EngineOptions::default() };
        (Engine::from_gguf(GgufFile::from_bytes(bytes).unwrap(), opts).unwrap(), tok)
    }

    /// The answer, every parser event and the session's final history and logits of one turn.
    fn spec_turn(
        engine: &mut Engine,
        tok: &Tokenizer,
        drafter: Option<&mut AnyDrafter>,
        stops: &[String],
        max_tokens: usize,
        auto: bool,
    ) -> (ParsedMessage, String, Vec<u32>, Vec<f32>, SpecStats) {
        let text =
            render(&RenderInput { messages: vec![Message::new(Role::User, "Hi")] }, Mode::Chat, ReasoningEffort::High)
                .unwrap();
        let ids = tok.encode(&text).unwrap();
        let sess = engine.create_session();
        let cfg = SamplerConfig::greedy();
        let opt = TurnOptions { mode: Mode::Chat, sampler: &cfg, stops, max_tokens, cancel: None };
        let mut events = String::new();
        let mut spec = drafter.map(|d| {
            d.attach(engine, sess).unwrap();
            let auto = auto.then(|| (AutoPause::default(), TickCost::default()));
            Speculation { drafter: d, draft_len: 3, stats: SpecStats::default(), auto }
        });
        let p = generate(engine, sess, tok, &ids, &opt, spec.as_mut(), &mut |e| events += &format!("{e:?}")).unwrap();
        let hist = engine.history(sess).unwrap().to_vec();
        let logits = engine.logits(sess).map(|l| l.to_vec()).unwrap_or_default();
        let stats = spec.as_ref().map(|s| s.stats).unwrap_or_default();
        if let Some(sp) = spec {
            sp.drafter.detach(engine, sess);
        }
        engine.free_session(sess).unwrap();
        (p, events, hist, logits, stats)
    }

    #[test]
    fn speculative_turns_equal_plain_turns() {
        // A seed whose greedy answer is long enough to draft in (random weights end early on some).
        let (mut engine, tok, plain) = (1..20)
            .map(|seed| {
                let (mut e, tok) = with_mtp(seed);
                let p = spec_turn(&mut e, &tok, None, &[], 40, false);
                (e, tok, p)
            })
            .find(|(_, _, p)| p.0.content.chars().count() > 20)
            .expect("a seed with a long answer");
        let mut dr = drafter_for(&engine, SpecChoice::Mtp, 2).unwrap().unwrap();
        // A stop string taken from the plain answer's middle: the turn ends there either way.
        let stop: String = plain.0.content.chars().skip(5).take(3).collect();
        for (stops, max, auto) in [(vec![], 40, false), (vec![], 7, false), (vec![stop], 40, false), (vec![], 40, true)]
        {
            let want = spec_turn(&mut engine, &tok, None, &stops, max, false);
            let got = spec_turn(&mut engine, &tok, Some(&mut dr), &stops, max, auto);
            assert_eq!((&got.0, &got.1, &got.2), (&want.0, &want.1, &want.2), "stops {stops:?}, max {max}");
            assert_eq!(got.3, want.3, "the session's logits");
            assert!(got.4.cycles > 0, "drafts were verified: {:?}", got.4);
        }
        // Without an MTP block: off under auto, an error under mtp.
        let (plain_engine, _) = demo();
        assert!(drafter_for(&plain_engine, SpecChoice::Auto, 1).unwrap().is_none());
        assert!(drafter_for(&plain_engine, SpecChoice::Mtp, 1).is_err());
    }
}
