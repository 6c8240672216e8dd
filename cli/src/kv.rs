//! `ds4 kv ls|inspect|gc`: look after a disk KV cache directory (see the `ds4-kv` crate) without a model loaded.
//!
//! * `ds4 kv ls --dir DIR`: one line per file: key, kind, token range, bytes, last use (UTC), refs (files built on
//!   it), model identity; then corrupt and temp files.
//! * `ds4 kv inspect FILE [--dir DIR]`: header, per-layer block layout (tag, rows × width, encoding, bytes) and the
//!   result of checking every block checksum. Exit code 2 when the file is corrupt.
//! * `ds4 kv gc --dir DIR [--max-mb N] [--verify]`: remove temp files of dead writers, corrupt files and orphans,
//!   then evict (leaves first, lowest value first) until the files fit in N MiB.
//!
//! `--json` on `ls` and `inspect` prints the same data as JSON for scripts.

use std::fmt::Write as _;
use std::io::Write as _;
use std::path::PathBuf;

use ds4_kv::{admin, disk};

/// Arguments of `ds4 kv`.
#[derive(clap::Args, Debug)]
pub struct KvArgs {
    #[command(subcommand)]
    pub cmd: KvCmd,
}

/// `ds4 kv` subcommands.
#[derive(clap::Subcommand, Debug)]
pub enum KvCmd {
    /// List the cache files of a directory.
    Ls {
        /// The cache directory.
        #[arg(long)]
        dir: PathBuf,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Print one file's header and layout and verify its checksums.
    Inspect {
        /// The file (a path, or a file name / key inside --dir).
        file: String,
        /// Directory to resolve FILE in.
        #[arg(long)]
        dir: Option<PathBuf>,
        /// Print JSON.
        #[arg(long)]
        json: bool,
    },
    /// Remove temp, corrupt and orphaned files; enforce a size budget.
    Gc {
        /// The cache directory.
        #[arg(long)]
        dir: PathBuf,
        /// Budget in MiB (no eviction without it).
        #[arg(long)]
        max_mb: Option<u64>,
        /// Also read every file and check every block checksum.
        #[arg(long)]
        verify: bool,
        /// Recency half-life of the eviction score, in hours.
        #[arg(long, default_value_t = 6.0)]
        half_life_hours: f64,
    },
}

/// `YYYY-MM-DD HH:MM:SS` (UTC) of unix seconds.
fn utc(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + i64::from(m <= 2);
    format!("{y:04}-{m:02}-{d:02} {:02}:{:02}:{:02}", rem / 3600, rem % 3600 / 60, rem % 60)
}

fn resolve(file: &str, dir: Option<PathBuf>) -> PathBuf {
    let direct = PathBuf::from(file);
    let Some(dir) = dir else { return direct };
    for cand in [file.to_string(), format!("{file}.page"), format!("{file}.ckpt")] {
        let p = dir.join(&cand);
        if p.exists() {
            return p;
        }
    }
    direct
}

/// Runs `ds4 kv`.
/// `writeln!` into the output buffer (writing to a `String` cannot fail).
macro_rules! out {
    ($o:expr, $($t:tt)*) => {{
        let _ = writeln!($o, $($t)*);
    }};
}

pub fn run(a: KvArgs) -> anyhow::Result<i32> {
    let mut o = String::new();
    let code = run_into(a, &mut o)?;
    // Ignore a closed pipe (`ds4 kv ls | head`): the output was not wanted any more.
    let _ = std::io::stdout().lock().write_all(o.as_bytes());
    Ok(code)
}

fn run_into(a: KvArgs, o: &mut String) -> anyhow::Result<i32> {
    match a.cmd {
        KvCmd::Ls { dir, json } => {
            let l = admin::list(&dir)?;
            if json {
                out!(o, "{}", serde_json::to_string_pretty(&l)?);
                return Ok(0);
            }
            out!(
                o,
                "{:<40}  {:<4}  {:>17}  {:>12}  {:<19}  {:>4}  model",
                "key",
                "kind",
                "tokens",
                "bytes",
                "last use (UTC)",
                "refs"
            );
            for f in &l.files {
                let h = &f.header;
                let end = h.token_start + h.tokens.len() as u64;
                out!(
                    o,
                    "{:<40}  {:<4}  {:>17}  {:>12}  {:<19}  {:>4}  {}{}",
                    h.key.hex(),
                    h.kind.ext(),
                    format!("{}..{}", h.token_start, end),
                    f.bytes,
                    utc(f.last_use),
                    f.refs,
                    h.identity,
                    if f.orphan { "  (orphan)" } else { "" }
                );
            }
            let total: u64 = l.files.iter().map(|f| f.bytes).sum();
            out!(o, "{} files, {} bytes ({:.1} MiB)", l.files.len(), total, total as f64 / (1 << 20) as f64);
            for (p, why) in &l.corrupt {
                out!(o, "corrupt: {} ({why})", p.display());
            }
            for p in &l.temp {
                out!(o, "temp: {}", p.display());
            }
            Ok(0)
        }
        KvCmd::Inspect { file, dir, json } => {
            let path = resolve(&file, dir);
            let size = std::fs::metadata(&path).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?.len();
            let header = {
                let f = std::fs::File::open(&path)?;
                ds4_kv::format::read_header(&mut std::io::BufReader::new(f), &path)?
            };
            let check = disk::verify_file(&path).and_then(|h| {
                if h.file_bytes() == size {
                    Ok(())
                } else {
                    Err(ds4_kv::KvError::Corrupt(format!("size {size}, header implies {}", h.file_bytes())))
                }
            });
            if json {
                let v = serde_json::json!({
                    "path": path, "bytes": size, "header": header,
                    "checksum": match &check { Ok(()) => "ok".to_string(), Err(e) => e.to_string() },
                });
                out!(o, "{}", serde_json::to_string_pretty(&v)?);
            } else {
                let h = &header;
                out!(o, "file: {} ({size} bytes)", path.display());
                out!(o, "kind: {:?}, saved on {:?}, created {}", h.kind, h.reason, utc(h.created));
                out!(o, "key: {}", h.key.hex());
                out!(o, "parent: {}", h.parent.hex());
                out!(o, "model: {} ({})", h.identity, h.model.hex());
                out!(
                    o,
                    "tokens: {}..{} ({} own, page span {})",
                    h.token_start,
                    h.token_start + h.tokens.len() as u64,
                    h.tokens.len(),
                    h.span_tokens
                );
                out!(o, "layout: {} groups, {} blocks, payload {} bytes", h.groups, h.blocks.len(), h.payload_bytes);
                for g in 0..h.groups {
                    let blocks: Vec<String> = h
                        .blocks
                        .iter()
                        .filter(|b| b.group == g)
                        .map(|b| format!("tag {} {}x{} {} {}B", b.tag, b.rows, b.width, b.encoding.name(), b.bytes))
                        .collect();
                    out!(o, "  group {g:>3}: {}", if blocks.is_empty() { "-".to_string() } else { blocks.join(", ") });
                }
                match &check {
                    Ok(()) => out!(o, "checksum: ok"),
                    Err(e) => out!(o, "checksum: FAILED: {e}"),
                }
            }
            Ok(if check.is_ok() { 0 } else { 2 })
        }
        KvCmd::Gc { dir, max_mb, verify, half_life_hours } => {
            let s = admin::gc(&dir, max_mb.map(|m| m << 20), verify, half_life_hours * 3600.0)?;
            out!(
                o,
                "removed {} temp, {} corrupt, {} orphaned files; evicted {}; {} -> {} bytes",
                s.temp_removed,
                s.corrupt_removed,
                s.orphans_removed,
                s.evicted,
                s.bytes_before,
                s.bytes_after
            );
            Ok(0)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_dates() {
        assert_eq!(utc(0), "1970-01-01 00:00:00");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00");
        assert_eq!(utc(1_798_761_600 + 3_661), "2027-01-01 01:01:01");
    }

    fn cache(dir: &std::path::Path) -> ds4_kv::Key {
        use ds4_kv::{KvOptions, KvStore, ModelIdentity, RowBlock, SaveReason};
        let s =
            KvStore::open(dir, ModelIdentity::new("cli-test"), KvOptions { span_tokens: 128, ..Default::default() })
                .unwrap();
        let toks: Vec<u32> = (0..130).collect();
        let v: Vec<f32> = (0..512).map(|i| i as f32).collect();
        let rows = vec![vec![RowBlock { tag: 0, rows: 1, width: 512, values: &v }]];
        let p = s.put_page(&s.root(), &toks[..128], &rows, SaveReason::Cold).unwrap();
        s.put_checkpoint(&p.key, &toks[128..], &rows, SaveReason::Shutdown).unwrap();
        p.key
    }

    #[test]
    fn ls_inspect_gc_exit_codes() {
        let dir = tempfile::tempdir().unwrap();
        let key = cache(dir.path());
        let d = || dir.path().to_path_buf();
        assert_eq!(run(KvArgs { cmd: KvCmd::Ls { dir: d(), json: false } }).unwrap(), 0);
        assert_eq!(run(KvArgs { cmd: KvCmd::Ls { dir: d(), json: true } }).unwrap(), 0);
        let inspect = |json| run(KvArgs { cmd: KvCmd::Inspect { file: key.hex(), dir: Some(d()), json } });
        assert_eq!(inspect(false).unwrap(), 0);
        assert_eq!(inspect(true).unwrap(), 0);
        // Flip a payload bit: inspect reports it with exit code 2, gc --verify removes it (and the orphaned checkpoint).
        let path = dir.path().join(disk::file_name(&key, ds4_kv::EntryKind::Page));
        let mut b = std::fs::read(&path).unwrap();
        let n = b.len();
        b[n - 1] ^= 1;
        std::fs::write(&path, b).unwrap();
        assert_eq!(inspect(false).unwrap(), 2);
        let gc = KvCmd::Gc { dir: d(), max_mb: Some(1), verify: true, half_life_hours: 6.0 };
        assert_eq!(run(KvArgs { cmd: gc }).unwrap(), 0);
        assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
        assert!(run(KvArgs { cmd: KvCmd::Ls { dir: dir.path().join("missing"), json: false } }).is_err());
    }
}
