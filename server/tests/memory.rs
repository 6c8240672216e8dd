//! The request-memory budget on the real binary (demo model): 64 concurrent 12 MB prompts keep the server under
//! 1 GB resident (sampled from /proc), it returns near its idle size afterwards, and `/health` and small requests
//! keep answering meanwhile. Each big prompt is refused (400: longer than the context; or 503 with `Retry-After`
//! when it waited too long for room), as it should be.
#![cfg(target_os = "linux")]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

const BIG: usize = 12 << 20;
const CLIENTS: usize = 64;
const PEAK_LIMIT: u64 = 1 << 30;
/// "Near its idle size": what it may keep beyond its idle resident size once the burst is over.
const AFTER_SLACK: u64 = 160 << 20;

struct Server {
    child: Child,
    addr: SocketAddr,
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn start() -> Server {
    let port = TcpListener::bind("127.0.0.1:0").unwrap().local_addr().unwrap().port();
    let child = Command::new(env!("CARGO_BIN_EXE_ds4-server"))
        .args(["--host", "127.0.0.1", "--port", &port.to_string(), "--ctx", "65536", "--request-memory-mb", "256"])
        .args(["--no-webui", "--demo-model", "random"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("start ds4-server");
    let server = Server { child, addr: SocketAddr::from(([127, 0, 0, 1], port)) };
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(180) {
        if request(server.addr, "GET", "/health", b"", Duration::from_secs(2)).is_some_and(|(s, _)| s == 200) {
            return server;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    panic!("ds4-server did not become healthy");
}

/// One request on its own connection: (status, head + body as text). `None` on a connection error or timeout.
fn request(addr: SocketAddr, method: &str, path: &str, body: &[u8], timeout: Duration) -> Option<(u16, String)> {
    let mut s = TcpStream::connect_timeout(&addr, timeout).ok()?;
    s.set_read_timeout(Some(timeout)).ok()?;
    s.set_write_timeout(Some(timeout)).ok()?;
    let head = format!(
        "{method} {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).ok()?;
    // A server that answers before reading the whole body (503) may close the connection under the write.
    let _ = s.write_all(body);
    let mut out = Vec::new();
    let _ = s.read_to_end(&mut out);
    let text = String::from_utf8_lossy(&out).into_owned();
    let status = text.split(' ').nth(1)?.parse().ok()?;
    Some((status, text))
}

fn rss(pid: u32, key: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find(|l| l.starts_with(key))
        .and_then(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn small_chat(addr: SocketAddr) -> Option<u16> {
    let body = br#"{"model":"deepseek-v4-flash","messages":[{"role":"user","content":"hi"}],"max_tokens":1}"#;
    request(addr, "POST", "/v1/chat/completions", body, Duration::from_secs(60)).map(|(s, _)| s)
}

#[test]
fn a_burst_of_huge_prompts_stays_within_the_budget_and_is_handed_back() {
    let server = start();
    let (addr, pid) = (server.addr, server.child.id());
    // Warm up (first request, allocator arenas of the worker threads), then take the idle size.
    assert_eq!(small_chat(addr), Some(200));
    std::thread::sleep(Duration::from_millis(500));
    let idle = rss(pid, "VmRSS:");
    assert!(idle > 0, "no /proc/{pid}/status");

    let mut body = br#"{"model":"deepseek-v4-flash","messages":[{"role":"user","content":""#.to_vec();
    while body.len() < BIG - 64 {
        body.extend_from_slice(b"lorem ipsum dolor sit amet ");
    }
    body.extend_from_slice(br#""}],"max_tokens":1}"#);
    let body = Arc::new(body);

    let done = Arc::new(AtomicBool::new(false));
    let peak = Arc::new(AtomicU64::new(0));
    let sampler = {
        let (done, peak) = (done.clone(), peak.clone());
        std::thread::spawn(move || {
            while !done.load(Ordering::Acquire) {
                peak.fetch_max(rss(pid, "VmRSS:"), Ordering::AcqRel);
                std::thread::sleep(Duration::from_millis(5));
            }
        })
    };
    // Small requests during the burst: /health every 100 ms, a one-token chat every 500 ms.
    let prober = {
        let done = done.clone();
        std::thread::spawn(move || {
            let (mut worst_health, mut worst_chat, mut n) = (Duration::ZERO, Duration::ZERO, 0u32);
            while !done.load(Ordering::Acquire) {
                let t = Instant::now();
                let h = request(addr, "GET", "/health", b"", Duration::from_secs(30)).map(|(s, _)| s);
                assert_eq!(h, Some(200), "/health during the burst");
                worst_health = worst_health.max(t.elapsed());
                if n % 5 == 0 {
                    let t = Instant::now();
                    assert_eq!(small_chat(addr), Some(200), "a small chat during the burst");
                    worst_chat = worst_chat.max(t.elapsed());
                }
                n += 1;
                std::thread::sleep(Duration::from_millis(100));
            }
            (worst_health, worst_chat, n)
        })
    };

    let clients: Vec<_> = (0..CLIENTS)
        .map(|_| {
            let body = body.clone();
            std::thread::spawn(move || {
                request(addr, "POST", "/v1/chat/completions", &body, Duration::from_secs(120)).expect("an answer")
            })
        })
        .collect();
    let answers: Vec<(u16, String)> = clients.into_iter().map(|c| c.join().unwrap()).collect();
    std::thread::sleep(Duration::from_millis(300));
    done.store(true, Ordering::Release);
    sampler.join().unwrap();
    let (worst_health, worst_chat, probes) = prober.join().unwrap();

    let refused_for_context = answers.iter().filter(|(s, _)| *s == 400).count();
    let busy = answers.iter().filter(|(s, _)| *s == 503).count();
    for (s, text) in &answers {
        assert!(*s == 400 || *s == 503, "a 12 MB prompt got {s}: {}", &text[..text.len().min(400)]);
        if *s == 503 {
            assert!(text.to_ascii_lowercase().contains("retry-after:"), "503 without Retry-After: {text}");
        } else {
            assert!(text.contains("context"), "400 for another reason: {text}");
        }
    }
    assert!(refused_for_context > 0, "no big prompt was read and tokenized at all ({busy} busy)");
    assert!(probes >= 2, "the prober ran {probes} times");

    let peak = peak.load(Ordering::Acquire);
    // Handed back: within a few seconds the resident size is near the idle size again.
    let t0 = Instant::now();
    let mut after = rss(pid, "VmRSS:");
    while after > idle + AFTER_SLACK && t0.elapsed() < Duration::from_secs(10) {
        std::thread::sleep(Duration::from_millis(200));
        after = rss(pid, "VmRSS:");
    }
    let mb = |b: u64| b as f64 / (1 << 20) as f64;
    eprintln!(
        "idle {:.0} MB, peak {:.0} MB, after {:.0} MB; {refused_for_context} × 400, {busy} × 503; worst /health {:?}, \
         worst small chat {:?}",
        mb(idle),
        mb(peak),
        mb(after),
        worst_health,
        worst_chat
    );
    assert!(peak < PEAK_LIMIT, "peak resident {:.0} MB (idle {:.0} MB)", mb(peak), mb(idle));
    assert!(after <= idle + AFTER_SLACK, "resident {:.0} MB after the burst, idle was {:.0} MB", mb(after), mb(idle));
}
