//! `ds4-server` binary: parse flags, load the model (or the built-in demo model), serve until SIGINT/SIGTERM, drain
//! in-flight requests, exit 0.

use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use clap::Parser;
use ds4_server::cli::Args;
use ds4_server::kvdisk::DiskTier;
use ds4_server::model::{Codec, ModelInfo, Runner};
use ds4_server::scheduler::SchedulerConfig;
use ds4_server::{build_state_with_tier, http, Limits};

pub fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "info,ds4_server=info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let args = Args::parse();
    let weight_bytes = args.model.as_ref().and_then(|m| std::fs::metadata(m).ok()).map_or(0, |m| m.len());
    let max_parked_bytes = match args.kv_ram_mb {
        Some(mb) => mb.saturating_mul(1 << 20),
        None => ds4_server::context::ram_tier_default(weight_bytes, ds4_server::context::mem_available()),
    };
    tracing::info!(max_parked_bytes, "RAM KV tier budget (set --kv-ram-mb to choose)");
    let config = SchedulerConfig {
        max_active: args.max_active.max(1),
        max_queue: args.max_queue,
        prefill_chunk: args.prefill_chunk.max(1),
        max_parked: args.max_parked,
        max_parked_bytes,
        context_size: 0,
        speculative: ds4_server::scheduler::SpecConfig { mode: args.speculative, draft_len: args.draft_len as usize },
    };
    let mut max_connections = args.max_connections.max(1);
    if let Some(fds) = ds4_server::conn::raise_fd_limit() {
        // Leave room for the model file, the KV cache files and the listener.
        let room = (fds as usize).saturating_sub(64).max(16);
        if max_connections > room {
            tracing::warn!(max_connections, open_files = fds, "--max-connections lowered to fit the open-file limit");
            max_connections = room;
        }
    }
    let limits = Limits {
        max_body_bytes: args.max_body_mb.max(1) << 20,
        keepalive: Duration::from_secs(args.keepalive_s),
        max_output_tokens: args.max_output_tokens.map(|n| n.max(1)),
        webui: !args.no_webui,
        request_memory: ds4_server::membudget::RequestMemory::new(
            args.request_memory_mb.max(1) << 20,
            Duration::from_secs(args.request_memory_wait_s),
        ),
        conn: ds4_server::conn::ConnLimits {
            max_connections,
            header_timeout: Duration::from_secs(args.header_timeout_s.max(1)),
            idle_timeout: Duration::from_secs(args.idle_timeout_s.max(1)),
            body_timeout: Duration::from_secs(args.body_timeout_s.max(1)),
        },
        access: ds4_server::guard::Access::new(
            &args.host,
            &args.allowed_hosts,
            &args.cors_origins,
            args.api_key.clone(),
        ),
    };
    if limits.access.has_api_key() {
        tracing::info!("API key required (Authorization: Bearer or x-api-key)");
    }
    let remote = match &args.kv_remote {
        Some(url) => {
            let mut cfg = ds4_server::kvremote::RemoteConfig::new(url).map_err(|e| anyhow::anyhow!("{e}"))?;
            cfg.timeout = Duration::from_millis(args.kv_remote_timeout_ms);
            cfg.queue = args.kv_remote_queue as usize;
            Some((cfg, Arc::new(ds4_server::kvremote::RemoteStats::default())))
        }
        None => None,
    };
    let (runner, codec, info): (Box<dyn Runner>, Arc<dyn Codec>, _) = if let Some(fake) = fake_model(&args, &config)? {
        fake
    } else {
        let random_demo = args.demo_model == ds4_server::cli::DemoModel::Random;
        if args.model.is_none() {
            let what = if random_demo {
                "random weights, real tokenizer: output is noise"
            } else {
                "a 1.7M-parameter model trained on Python docs: words, not sense"
            };
            tracing::warn!("no -m given: serving the built-in demo model ({what})");
            eprintln!("ds4-server: no -m given, serving the built-in demo model ({what})");
        }
        let backend = args.backend;
        let opts = ds4_server::engine::LoadOptions {
            backend,
            placement: args.placement,
            ctx: args.ctx.unwrap_or(0),
            max_batch_tokens: config.prefill_chunk + config.max_active,
            max_sessions: config.max_active + config.max_parked + 8,
            active_sessions: config.max_active,
            demo_seed: random_demo.then_some(1),
        };
        let (mut runner, codec, info) =
            ds4_server::engine::load(args.model.as_deref(), &opts).map_err(|e| anyhow::anyhow!("{e}"))?;
        use ds4_server::scheduler::SpecMode;
        match args.speculative.drafter() {
            None => {}
            Some(kind) if args.speculative == SpecMode::Auto && !runner.has_drafter(kind) => {
                tracing::info!("--speculative auto: the model has no drafter (MTP block or DSpark); plain decoding")
            }
            Some(kind) => {
                let name = runner
                    .enable_drafter(kind, args.draft_min_confidence)
                    .map_err(|e| anyhow::anyhow!("--speculative: {e}"))?;
                tracing::info!(mode = ?args.speculative, drafter = name, draft_len = args.draft_len, "speculative decoding");
            }
        }
        (Box::new(runner), Arc::new(codec), info)
    };
    // A body larger than the context could hold as text is refused before it is read.
    let derived = info.context_size.saturating_mul(256).max(8 << 20);
    let limits = Limits { max_body_bytes: limits.max_body_bytes.min(derived), ..limits };
    let tier = open_tiers(&args, runner.as_ref(), remote.as_ref(), max_parked_bytes)?;
    let state = build_state_with_tier(runner, tier, codec, info, config, limits);
    if let Some((_, stats)) = remote {
        let _ = state.metrics.kv_remote.set(stats);
    }
    let rt = tokio::runtime::Builder::new_multi_thread().enable_all().build().context("starting tokio")?;
    rt.block_on(async {
        let addr = format!("{}:{}", args.host, args.port);
        let listener = tokio::net::TcpListener::bind(&addr).await.with_context(|| format!("binding {addr}"))?;
        let local = listener.local_addr()?;
        // The signal handlers are installed before the address is announced: a SIGTERM sent by whoever saw
        // "listening" must find them (a lazily polled handler can miss one sent in the first iterations).
        let shutdown = shutdown_signal()?;
        tracing::info!(%local, model = %state.info.id, ctx = state.info.context_size, "ds4-server listening");
        eprintln!("ds4-server: listening on http://{local}");
        http::serve(listener, state.clone(), shutdown, Duration::from_secs(args.drain_timeout_s)).await;
        anyhow::Ok(())
    })?;
    state.scheduler.shutdown();
    tracing::info!("ds4-server stopped");
    Ok(())
}

/// The KV tiers behind the RAM tier for `runner`'s model (none for a runner whose sessions cannot be saved): the
/// disk tier (on by default under the user's cache directory; `--no-kv-disk` off), else with `--kv-remote` an
/// in-memory local tier, and the shared tier on Redis behind either.
fn open_tiers(
    args: &Args,
    runner: &dyn Runner,
    remote: Option<&(ds4_server::kvremote::RemoteConfig, Arc<ds4_server::kvremote::RemoteStats>)>,
    max_parked_bytes: u64,
) -> anyhow::Result<Option<DiskTier>> {
    let Some(layout) = runner.kv_layout() else {
        if args.kv_remote.is_some() {
            tracing::warn!("--kv-remote is ignored: this model's sessions cannot be saved");
        }
        return Ok(None);
    };
    let policy = ds4_kv::SavePolicy {
        system_block_min_tokens: args.kv_system_block_min_tokens,
        ..ds4_kv::SavePolicy::default()
    };
    let dir = if args.no_kv_disk {
        None
    } else if let Some(d) = &args.kv_disk_dir {
        Some(d.clone())
    } else {
        let d = ds4_server::kvdisk::default_dir();
        if d.is_none() {
            tracing::warn!("neither XDG_CACHE_HOME nor HOME is set: disk KV tier off (--kv-disk-dir DIR)");
        }
        d
    };
    let mut tier = None;
    if let Some(dir) = &dir {
        let space = match args.kv_disk_space_mb {
            Some(mb) => mb.saturating_mul(1 << 20),
            None => ds4_server::kvdisk::default_space(
                ds4_server::kvdisk::free_space(dir),
                ds4_server::kvdisk::dir_bytes(dir),
            ),
        };
        match DiskTier::open(layout.clone(), dir.clone(), space) {
            Ok(t) => tier = Some(t),
            Err(e) => tracing::error!(error = %e, "--kv-disk-dir: disk KV tier off"),
        }
    }
    if let Some((cfg, stats)) = remote {
        let mut t = match tier {
            Some(t) => t,
            // No disk tier: the restore points shared through Redis land in memory.
            None => DiskTier::open_memory(layout, (max_parked_bytes / 4).max(256 << 20))
                .map_err(|e| anyhow::anyhow!("--kv-remote: {e}"))?,
        };
        t.attach_remote(cfg, stats.clone()).map_err(|e| anyhow::anyhow!("{e}"))?;
        // A turn may land on another replica next: a session is saved (and shared) at the end of a request once it
        // grew REMOTE_CONTINUED_EVERY tokens, not only every 10k.
        t.set_policy(ds4_kv::SavePolicy {
            continued_every: policy.continued_every.min(ds4_server::kvremote::REMOTE_CONTINUED_EVERY),
            ..policy
        });
        return Ok(Some(t));
    }
    if let Some(t) = &mut tier {
        t.set_policy(policy);
    }
    Ok(tier)
}

/// What a model choice yields: the runner, the codec and the model facts.
type Model = (Box<dyn Runner>, Arc<dyn Codec>, ModelInfo);

/// `--fake-model`: the scripted test model (test builds only, feature `test-model`).
#[cfg(feature = "test-model")]
fn fake_model(args: &Args, config: &SchedulerConfig) -> anyhow::Result<Option<Model>> {
    use ds4_server::fake::{FakeCodec, FakeRunner};
    if !args.fake_model {
        return Ok(None);
    }
    tracing::warn!("--fake-model: serving the scripted test model (not a language model)");
    let info = ModelInfo {
        id: "deepseek-v4-flash".into(),
        context_size: args.ctx.unwrap_or(32768),
        vocab_size: ds4_server::fake::VOCAB,
        demo: true,
    };
    let script = match &args.fake_script {
        Some(path) => ds4_server::fake_script::Script::load(path).map_err(|e| anyhow::anyhow!("--fake-script {e}"))?,
        None => ds4_server::fake_script::Script::default(),
    };
    tracing::info!(entries = script.entries.len(), "fake model script");
    let runner = FakeRunner::new(config.max_active + config.max_parked + 8)
        .with_script(script)
        .with_delay(Duration::from_millis(args.fake_delay_ms));
    Ok(Some((Box::new(runner), Arc::new(FakeCodec), info)))
}

/// Production builds carry no test model.
#[cfg(not(feature = "test-model"))]
fn fake_model(_args: &Args, _config: &SchedulerConfig) -> anyhow::Result<Option<Model>> {
    Ok(None)
}

/// Installs the SIGINT and SIGTERM handlers now and returns a future that resolves on either.
fn shutdown_signal() -> anyhow::Result<impl std::future::Future<Output = ()>> {
    #[cfg(unix)]
    {
        use tokio::signal::unix::{signal, SignalKind};
        let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
        let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
        Ok(async move {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
        })
    }
    #[cfg(not(unix))]
    {
        Ok(async {
            let _ = tokio::signal::ctrl_c().await;
        })
    }
}
