//! The runners of `ds4-bench`'s reports, one per subcommand (the arguments are parsed in `main.rs`): each prints
//! the machine summary, builds or opens the model, runs its module and writes CSV and `#` notes to stdout.

use super::*;

pub(crate) fn run_kernels(a: &KernelsArgs) -> Result<()> {
    let m = machine::Machine::detect();
    let threads = a.common.threads();
    let quick = a.common.quick;
    let opts = kernels::KernelOptions {
        threads,
        working_set: if quick {
            4 << 20
        } else {
            a.working_set_mib.map(|m| m << 20).unwrap_or_else(|| kernels::default_working_set(m.llc_bytes))
        },
        batch: if quick { a.batch.min(4) } else { a.batch },
        budget: if quick { Duration::ZERO } else { Duration::from_millis(a.budget_ms) },
        min_passes: if quick { 1 } else { a.passes.max(1) },
        types: a.types.iter().map(|t| kernels::parse_type(t)).collect::<Result<_>>()?,
        all_shapes: a.all_shapes,
    };
    let mut out = std::io::stdout().lock();
    write!(out, "{}", m.summary("cpu (ds4_engine::quant, std scoped threads)", threads))?;
    writeln!(out, "# working set per case: {} MiB", opts.working_set >> 20)?;
    let pb = progress::bar(0, a.common.quiet);
    let rows = kernels::run(&engine_api::EngineKernels::new(threads), &opts, &mut out, &pb)?;
    pb.finish_and_clear();
    if let Some(p) = &a.plot {
        plot::kernels(&rows, p)?;
        writeln!(out, "# plot: {}", p.display())?;
    }
    Ok(())
}

pub(crate) fn run_membw(a: &MembwArgs) -> Result<()> {
    let m = machine::Machine::detect();
    let threads = a.common.threads();
    let sizes: Vec<usize> = if a.common.quick {
        vec![1 << 20, 4 << 20]
    } else if a.sizes_mib.is_empty() {
        vec![16 << 20, kernels::default_working_set(m.llc_bytes) as usize]
    } else {
        a.sizes_mib.iter().map(|&s| (s.max(1) << 20) as usize).collect()
    };
    let budget = if a.common.quick { Duration::ZERO } else { Duration::from_millis(a.budget_ms) };
    let mut out = std::io::stdout().lock();
    write!(out, "{}", m.summary("cpu (std scoped threads, streaming read)", threads))?;
    let pb = progress::bar(0, a.common.quiet);
    membw::sweep(&sizes, threads, if a.common.quick { 1 } else { 3 }, budget, &mut out, &pb)?;
    pb.finish_and_clear();
    Ok(())
}

pub(crate) fn run_throughput(a: &RunArgs) -> Result<()> {
    let m = machine::Machine::detect();
    let threads = a.common.threads();
    if let (Some(path), Some(spec)) = (&a.write, &a.synthetic) {
        return write_synthetic(spec, path, threads, a.common.quiet);
    }
    if a.print_graph {
        let pb = progress::bar(0, true);
        let (file, _) = open_model(&m, a.model.as_deref(), a.synthetic.as_deref(), threads, &pb)?;
        let cfg = engine_api::EngineConfig {
            threads,
            ctx: a.ctx_start + 1,
            batch_tokens: a.batch_tokens,
            backend: a.backend.clone(),
            exact: false,
            placement: Default::default(),
        };
        let engine = engine_api::engine_for(file, &cfg)?;
        print!("{}", engine.decode_graph_dot(a.ctx_start));
        return Ok(());
    }
    let quick = a.common.quick;
    let opts = throughput::ThroughputOptions {
        ctx_start: if quick { 8 } else { a.ctx_start },
        ctx_max: if quick { 16 } else { a.ctx_max },
        step: if quick { 8 } else { a.step },
        gen_tokens: if quick { 2 } else { a.gen_tokens },
        sessions: a.sessions,
    };
    opts.frontiers()?;
    let mut out = std::io::stdout().lock();
    write!(out, "{}", m.summary(&format!("{} (ds4_engine::engine::Engine)", a.backend), threads))?;

    // The roofline's denominator, measured before the model takes the memory.
    let bw_bytes = if quick { 4 << 20 } else { kernels::default_working_set(m.llc_bytes) as usize };
    let mut buf = vec![0u8; bw_bytes];
    blocks::SplitMix64::new(1).fill_bytes(&mut buf);
    let passes = if quick { 1 } else { 3 };
    let bw = membw::measure(&buf, threads, passes, Duration::from_millis(if quick { 0 } else { 400 }), || {});
    drop(buf);
    writeln!(
        out,
        "# memory bandwidth: {:.2} GB/s ({} MiB streaming read, {} threads)",
        bw.gbs,
        bw_bytes >> 20,
        threads
    )?;

    let pb = progress::bar(0, a.common.quiet);
    let (file, line) = open_model(&m, a.model.as_deref(), a.synthetic.as_deref(), threads, &pb)?;
    writeln!(out, "{line}")?;
    pb.set_position(0);
    let cfg = engine_api::EngineConfig {
        threads,
        ctx: opts.ctx_needed(),
        batch_tokens: a.batch_tokens,
        backend: a.backend.clone(),
        exact: false,
        placement: a.placement,
    };
    let mut engine = engine_api::engine_for(file, &cfg)?;
    if let Some(name) = engine.device_name() {
        writeln!(out, "# device: {name}")?;
    }
    let c = engine.config();
    let per_token = roofline::weight_bytes_per_token(&engine.model().file, c.n_experts, c.n_experts_used);
    let roof = roofline::roofline_tps(bw.gbs, per_token);
    writeln!(
        out,
        "# decode roofline: {:.1} MB of weights per token / {:.2} GB/s = {:.2} tokens/s (single session)",
        per_token as f64 / 1e6,
        bw.gbs,
        roof
    )?;
    if opts.sessions > 1 {
        writeln!(out, "# gen_tps and kvcache_bytes: aggregate over {} concurrent sessions", opts.sessions)?;
    }
    out.flush()?;
    let rows = throughput::run(&mut engine, &opts, &mut out, &pb)?;
    pb.finish_and_clear();
    if a.placement_report {
        for line in engine.placement_report().to_string().lines() {
            writeln!(out, "# {}", line.trim_start_matches("# "))?;
        }
    }
    if a.placement != ds4_engine::exec::Placement::default() || host_fallback(&engine) {
        writeln!(out, "{}", bus_line(&a.placement, &engine))?;
    }
    if let Some(t) = crate::account::prefill_and_decode(&mut engine, a.batch_tokens)? {
        let layers = engine.config().n_layers;
        writeln!(out, "{}", crate::account::line("prefill chunk", &t.prefill, layers))?;
        writeln!(out, "{}", crate::account::line("decode tick", &t.decode, layers))?;
        writeln!(out, "{}", crate::account::readback_line(&t))?;
        writeln!(out, "{}", crate::account::kernel_line("decode tick GPU time", &t.decode, 8))?;
    }
    for r in &rows {
        writeln!(
            out,
            "# ctx {}: decode {:.2} t/s = {:.1}% of the roofline ({:.2} GB/s of weights), prefill {:.2} t/s",
            r.ctx_tokens,
            r.gen_tps,
            100.0 * r.gen_tps / roof,
            r.gen_tps * per_token as f64 / 1e9,
            r.prefill_tps
        )?;
        writeln!(out, "# ctx {}: prefill tick by op: {}", r.ctx_tokens, r.prefill_ops_line())?;
        writeln!(out, "# ctx {}: decode tick by op: {}", r.ctx_tokens, r.decode_ops_line())?;
    }
    if let Some(p) = &a.plot {
        plot::throughput(&rows, opts.sessions, roof, p)?;
        writeln!(out, "# plot: {}", p.display())?;
    }
    Ok(())
}

/// `--synthetic SPEC --write FILE`: streams the model to FILE and prints one `# wrote` line.
pub(crate) fn write_synthetic(spec: &str, path: &std::path::Path, threads: usize, quiet: bool) -> Result<()> {
    let spec = synth::Spec::parse(spec)?;
    let t0 = std::time::Instant::now();
    let pb = progress::bar(0, quiet);
    let bytes = synth::write_file(&spec, threads, &pb, path)?;
    pb.finish_and_clear();
    println!(
        "# wrote synthetic {} to {} ({:.2} GiB of weights, {:.1} s)",
        synth::spec_name(&spec),
        path.display(),
        bytes as f64 / (1u64 << 30) as f64,
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

/// Opens `-m FILE` or builds the synthetic spec (refusing one that does not fit in memory); returns the file and a
/// `# model:` line.
pub(crate) fn open_model(
    m: &machine::Machine,
    path: Option<&std::path::Path>,
    spec: Option<&str>,
    threads: usize,
    pb: &indicatif::ProgressBar,
) -> Result<(ds4_engine::gguf::GgufFile, String)> {
    if let Some(p) = path {
        let f = ds4_engine::gguf::GgufFile::open(p)?;
        f.prefault();
        let line = format!("# model: {} ({:.2} GiB)", p.display(), f.file_size() as f64 / (1u64 << 30) as f64);
        return Ok((f, line));
    }
    let Some(spec) = spec else {
        anyhow::bail!("give a model: -m FILE or --synthetic flash[:layers=N] (see --help)");
    };
    let spec = synth::Spec::parse(spec)?;
    let (_, need) = synth::footprint(&spec)?;
    if let Some(avail) = m.mem_available {
        if need > avail {
            anyhow::bail!(
                "synthetic {} needs {:.1} GiB of weights, only {:.1} GiB of memory is available (use fewer layers)",
                synth::spec_name(&spec),
                need as f64 / (1u64 << 30) as f64,
                avail as f64 / (1u64 << 30) as f64
            );
        }
    }
    let s = synth::build(&spec, threads, pb)?;
    tracing::debug!(bytes_per_token = s.bytes_per_token, "synthetic model built");
    let line = format!(
        "# model: synthetic {} ({:.2} GiB of weights, built in {:.1} s)",
        synth::spec_name(&spec),
        s.tensor_bytes as f64 / (1u64 << 30) as f64,
        s.build_secs
    );
    Ok((s.file, line))
}

pub(crate) fn run_mask(a: &MaskArgs) -> Result<()> {
    let m = machine::Machine::detect();
    let threads = a.common.threads();
    let mut out = std::io::stdout().lock();
    write!(out, "{}", m.summary("cpu (llguidance matcher, one thread)", threads))?;
    writeln!(out, "# masks over {} ids (the Flash logits row), bundled tokenizer", mask::FLASH_LOGITS)?;
    let tokens = if a.common.quick { 50 } else { a.tokens.max(1) };
    let rows = mask::run(tokens, &mut out)?;
    if a.model.is_none() && a.synthetic.is_none() {
        return Ok(());
    }
    let pb = progress::bar(0, a.common.quiet);
    let (file, line) = open_model(&m, a.model.as_deref(), a.synthetic.as_deref(), threads, &pb)?;
    pb.finish_and_clear();
    writeln!(out, "{line}")?;
    let ctx = if a.common.quick { 8 } else { a.ctx.max(1) };
    let ticks = if a.common.quick { 2 } else { a.decode.max(1) };
    let cfg = engine_api::EngineConfig {
        threads,
        ctx: ctx + ticks + 2,
        batch_tokens: 256,
        backend: "cpu".into(),
        exact: false,
        placement: Default::default(),
    };
    let mut engine = engine_api::engine_for(file, &cfg)?;
    let prompt = throughput::prompt(ctx, engine.config().vocab);
    let s = engine.create_session();
    engine.feed(s, &prompt)?;
    engine.run_until_idle()?;
    let mut next = ds4_engine::engine::argmax(engine.logits(s)?);
    // One untimed tick, then the timed ones.
    let mut times = Vec::with_capacity(ticks);
    for i in 0..=ticks {
        let t = std::time::Instant::now();
        engine.feed(s, &[next])?;
        engine.run_until_idle()?;
        next = ds4_engine::engine::argmax(engine.logits(s)?);
        if i > 0 {
            times.push(t.elapsed());
        }
    }
    engine.free_session(s)?;
    let (tick, _, tick99, _) = mask::stats(&times);
    writeln!(
        out,
        "# decode tick (one session, ctx {ctx}, {ticks} ticks): mean {:.2} ms, p99 {:.2} ms",
        tick / 1e3,
        tick99 / 1e3
    )?;
    for r in &rows {
        let (mean, _, p99, _) = mask::stats(&r.mask);
        writeln!(
            out,
            "# {}: mask mean {:.2} % of the mean tick, p99 {:.2} %",
            r.grammar,
            100.0 * mean / tick,
            100.0 * p99 / tick
        )?;
    }
    Ok(())
}

pub(crate) fn run_kv(a: &KvArgs) -> Result<()> {
    let m = machine::Machine::detect();
    let threads = a.common.threads();
    let quick = a.common.quick;
    let mut out = std::io::stdout().lock();
    write!(out, "{}", m.summary(&format!("{} (ds4_engine::engine::Engine) + ds4_kv::KvStore", a.backend), threads))?;
    let pb = progress::bar(0, a.common.quiet);
    let spec = if quick { "tiny:layers=3:recipe=f16" } else { a.synthetic.as_str() };
    let (file, line) = open_model(&m, a.model.as_deref(), Some(spec), threads, &pb)?;
    writeln!(out, "{line}")?;
    if let Some(path) = &a.replay {
        return run_kv_replay(a, path, file, threads, &mut out);
    }
    let lengths = if quick { vec![5, 16, 27] } else { a.lengths.clone() };
    let tier_io = a.tier_io.map(|n| tierio::TierIoOptions {
        tokens: if quick { n.min(300) } else { n },
        sessions: a.sessions,
        ticks: if quick { a.ticks.min(8) } else { a.ticks },
        span: 0,
    });
    let max = lengths.iter().copied().max().unwrap_or(0);
    let cfg = engine_api::EngineConfig {
        threads,
        ctx: (max.max(a.fork.unwrap_or(0)) + 1).max(tier_io.as_ref().map_or(0, tierio::ctx_for)),
        batch_tokens: a.batch_tokens,
        backend: a.backend.clone(),
        exact: false,
        placement: Default::default(),
    };
    let mut engine = engine_api::engine_for(file, &cfg)?;
    if let Some(n) = a.fork {
        return kvbench::fork(&mut engine, n, &mut out);
    }
    let max_ratio = engine.config().compress_ratios.iter().copied().max().unwrap_or(0);
    let span = kvbench::span_for(max_ratio, if quick { 8 } else { a.span });
    let tmp;
    let dir = match &a.dir {
        Some(d) => d.clone(),
        None => {
            tmp = tempfile::Builder::new().prefix("ds4-bench-kv").tempdir()?;
            tmp.path().to_path_buf()
        }
    };
    if let Some(mut o) = tier_io {
        o.span = span;
        writeln!(
            out,
            "# tier I/O: {} tokens saved and restored, {} sessions decoding, store {}",
            o.tokens,
            o.sessions,
            dir.display()
        )?;
        pb.finish_and_clear();
        tierio::run(&mut engine, &o, &dir, &mut out)?;
        return Ok(());
    }
    writeln!(out, "# store: {} (span {span} tokens)", dir.display())?;
    pb.set_position(0);
    let opts = kvbench::KvBenchOptions { lengths, span, dir };
    let rows = kvbench::run(&mut engine, &opts, &mut out, &pb)?;
    pb.finish_and_clear();
    if let Some(p) = &a.plot {
        plot::kv(&rows, p)?;
        writeln!(out, "# plot: {}", p.display())?;
    }
    Ok(())
}

pub(crate) fn run_kv_replay(
    a: &KvArgs,
    path: &std::path::Path,
    file: ds4_engine::gguf::GgufFile,
    threads: usize,
    out: &mut dyn std::io::Write,
) -> Result<()> {
    let text = std::fs::read_to_string(path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
    let cfg = engine_api::EngineConfig {
        threads,
        ctx: 0, // the model's trained context
        batch_tokens: a.batch_tokens,
        backend: "cpu".into(),
        exact: false,
        placement: Default::default(),
    };
    // Rendered requests need the model's tokenizer; a trace of token ids does not.
    let tok = ds4_engine::tokenizer::Tokenizer::from_gguf(&file).ok();
    let mut engine = engine_api::engine_for(file, &cfg)?;
    let requests = kvreplay::parse_trace(&text, engine.config().vocab, tok.as_ref())?;
    let max_ratio = engine.config().compress_ratios.iter().copied().max().unwrap_or(0);
    let span = kvbench::span_for(max_ratio, a.span);
    let tmp;
    let dir = match &a.dir {
        Some(d) => d.clone(),
        None => {
            tmp = tempfile::Builder::new().prefix("ds4-bench-kv-replay").tempdir()?;
            tmp.path().to_path_buf()
        }
    };
    writeln!(out, "# replay: {} requests, store {} (span {span} tokens)", requests.len(), dir.display())?;
    let opts = kvreplay::ReplayOptions {
        span,
        dir: dir.join("kv"),
        max_parked: a.max_parked,
        max_parked_bytes: a.ram_mb.map_or(u64::MAX, |mb| mb.saturating_mul(1 << 20)),
        disk: !a.no_disk,
        passes: if a.restart { 2 } else { 1 },
        verify: a.verify,
        system_block_min_tokens: a.system_block_min_tokens,
    };
    let rows = kvreplay::replay(&mut engine, &requests, &opts, out)?;
    let (tok, lcp, reused): (usize, usize, usize) =
        rows.iter().fold((0, 0, 0), |(t, l, r), x| (t + x.tokens, l + x.lcp, r + x.reused));
    writeln!(out, "# total: {tok} tokens, {lcp} in common prefixes, {reused} reused, {} recomputed", tok - reused)?;
    Ok(())
}

pub(crate) fn run_speculate(a: &SpeculateArgs) -> Result<()> {
    let m = machine::Machine::detect();
    let threads = a.common.threads();
    let quick = a.common.quick;
    let mut out = std::io::stdout().lock();
    let what = format!("{} (ds4_engine::speculative, {:?} drafter)", a.backend, a.drafter);
    write!(out, "{}", m.summary(&what, threads))?;
    let pb = progress::bar((a.drafts.len() + 1) as u64, a.common.quiet);
    let spec = if quick { "tiny:layers=3:recipe=f16" } else { a.synthetic.as_str() };
    let (file, line) = open_model(&m, a.model.as_deref(), Some(spec), threads, &pb)?;
    writeln!(out, "{line}")?;
    let vocab = file.get_usize("deepseek4.vocab_size")?;
    let (prompt_len, tokens) = if quick { (a.prompt.min(8), a.tokens.min(8)) } else { (a.prompt, a.tokens) };
    let prompts: Vec<Vec<u32>> = if a.prompt_text.is_empty() {
        vec![throughput::prompt(prompt_len.max(1), vocab)]
    } else {
        let tok = ds4_engine::tokenizer::Tokenizer::from_gguf(&file)?;
        a.prompt_text
            .iter()
            .map(|t| {
                let msgs = vec![ds4_engine::chat::Message::new(ds4_engine::chat::Role::User, t.clone())];
                let text = ds4_engine::chat::render(
                    &ds4_engine::chat::RenderInput { messages: msgs },
                    ds4_engine::chat::Mode::Chat,
                    ds4_engine::chat::ReasoningEffort::High,
                )?;
                Ok(tok.encode(&text)?)
            })
            .collect::<Result<_>>()?
    };
    let longest = prompts.iter().map(Vec::len).max().unwrap_or(0);
    let cfg = engine_api::EngineConfig {
        threads,
        ctx: longest + tokens + a.drafts.iter().copied().max().unwrap_or(0) + 2,
        batch_tokens: 256,
        backend: a.backend.clone(),
        exact: false,
        placement: Default::default(),
    };
    let mut engine = engine_api::engine_for(file, &cfg)?;
    pb.set_position(0);
    speculate::run(&mut engine, &prompts, tokens, &a.drafts, a.drafter, &mut out, &pb)?;
    pb.finish_and_clear();
    Ok(())
}

pub(crate) fn run_correctness(a: &CorrectnessArgs) -> Result<()> {
    let m = machine::Machine::detect();
    let threads = a.common.threads();
    if a.backends.len() < 2 {
        anyhow::bail!("--backends: give at least two backends to compare");
    }
    let mut out = std::io::stdout().lock();
    write!(out, "{}", m.summary(&a.backends.join(" vs "), threads))?;
    let pb = progress::bar(a.backends.len() as u64, a.common.quiet);
    let spec = a.synthetic.as_deref().or(if a.common.quick { Some("tiny:layers=3:recipe=f16") } else { None });
    let mut outs = Vec::new();
    for b in &a.backends {
        pb.set_message(format!("running {b}"));
        let (file, line) = open_model(&m, a.model.as_deref(), spec, threads, &indicatif::ProgressBar::hidden())?;
        if outs.is_empty() {
            writeln!(out, "{line}")?;
        }
        let vocab = file.get_usize("deepseek4.vocab_size")?;
        let tokens = if a.tokens.is_empty() { throughput::prompt(16, vocab) } else { a.tokens.clone() };
        let gen = if a.common.quick { a.gen.min(2) } else { a.gen };
        let (backend, placement) = match b.split_once(':') {
            Some((backend, p)) => (backend, p.parse()?),
            None => (b.as_str(), ds4_engine::exec::Placement::default()),
        };
        let cfg = engine_api::EngineConfig {
            threads,
            ctx: tokens.len() + gen + 1,
            batch_tokens: 256,
            backend: backend.to_string(),
            exact: a.exact,
            placement,
        };
        let mut engine = engine_api::engine_with_acts(file, &cfg, a.f32_acts)?;
        outs.push(correctness::collect(&mut engine, b, &tokens, gen)?);
        if placement != ds4_engine::exec::Placement::default() || host_fallback(&engine) {
            writeln!(out, "{} ({b})", bus_line(&placement, &engine))?;
        }
        pb.inc(1);
    }
    pb.finish_and_clear();
    let tol = correctness::Tolerance { max_abs: a.tol, min_agree: a.min_agree, min_greedy: a.min_greedy };
    let pairs = correctness::report(&outs, tol, &mut out)?;
    let failed: Vec<String> = pairs.iter().filter(|p| !p.pass).map(|p| format!("{} vs {}", p.a, p.b)).collect();
    if !failed.is_empty() {
        anyhow::bail!(
            "beyond tolerance (|Δlogit| <= {}, argmax agreement >= {}, greedy agreement >= {}): {}",
            a.tol,
            a.min_agree,
            a.min_greedy.map_or("all".to_string(), |g| g.to_string()),
            failed.join(", ")
        );
    }
    Ok(())
}

/// Whether the engine's backend runs beside a CPU backend for the ops it has no kernel for (cuda).
fn host_fallback(engine: &ds4_engine::Engine) -> bool {
    ds4_engine::backend::registry::needs_host_fallback(engine.options().backend)
}

/// One `# placement` line: what the last tick (a decode tick after a run) moved between the two backends per token,
/// and the weight bytes the primary holds on its device.
pub(crate) fn bus_line(p: &ds4_engine::exec::Placement, engine: &ds4_engine::Engine) -> String {
    let b = engine.copied_bytes();
    let (up, down) = b.per_row();
    let device = engine.device_weight_bytes().map_or("-".to_string(), |w| format!("{:.1} MB", w as f64 / 1e6));
    format!(
        "# placement {p}: {:.1} KiB per token crossed (device to host {:.1} KiB, host to device {:.1} KiB; last tick, \
         {} rows); weights on the device {device} of {:.1} MB in the file",
        (up + down) / 1024.0,
        down / 1024.0,
        up / 1024.0,
        b.rows,
        engine.model().file.file_size() as f64 / 1e6
    )
}
