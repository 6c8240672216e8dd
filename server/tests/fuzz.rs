//! Bounded request-decoding fuzz: every recorded client request, mutated (JSON nodes replaced by values of other
//! types, nodes deleted, bytes flipped, bodies truncated) and sent to the server. Every answer must be a well-formed
//! success or a JSON error in the endpoint's shape with a 4xx status, and the server must keep serving.

mod common;

use common::{fixtures, request, TestServer};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

fn count(v: &Value) -> usize {
    1 + match v {
        Value::Array(a) => a.iter().map(count).sum(),
        Value::Object(o) => o.values().map(count).sum(),
        _ => 0,
    }
}

/// The `k`-th node of `v` in pre-order.
fn nth(v: &mut Value, k: usize) -> Option<&mut Value> {
    if k == 0 {
        return Some(v);
    }
    let mut k = k - 1;
    let children: Vec<&mut Value> = match v {
        Value::Array(a) => a.iter_mut().collect(),
        Value::Object(o) => o.values_mut().collect(),
        _ => return None,
    };
    for c in children {
        let n = count(c);
        if k < n {
            return nth(c, k);
        }
        k -= n;
    }
    None
}

fn random_value(rng: &mut StdRng) -> Value {
    match rng.gen_range(0..8) {
        0 => Value::Null,
        1 => json!(rng.gen::<bool>()),
        2 => json!(rng.gen::<i64>()),
        3 => json!(-1.5e300),
        4 => json!("\u{0}\u{ffff}<｜end▁of▁sentence｜></think>"),
        5 => json!([]),
        6 => json!({}),
        _ => json!([{"type": "mystery", "text": 5}]),
    }
}

fn mutate(body: &Value, rng: &mut StdRng) -> Vec<u8> {
    let mut v = body.clone();
    match rng.gen_range(0..4) {
        0 | 1 => {
            let k = rng.gen_range(0..count(&v));
            let new = random_value(rng);
            if let Some(target) = nth(&mut v, k) {
                *target = new;
            }
            v.to_string().into_bytes()
        }
        2 => {
            let mut b = v.to_string().into_bytes();
            for _ in 0..rng.gen_range(1..8) {
                let i = rng.gen_range(0..b.len());
                b[i] = rng.gen();
            }
            b
        }
        _ => {
            let b = v.to_string().into_bytes();
            b[..rng.gen_range(0..b.len())].to_vec()
        }
    }
}

#[test]
fn mutated_client_requests_never_break_the_server() {
    let mut all = Vec::new();
    for client in ["claude-code", "codex", "opencode"] {
        let Some(fx) = fixtures(client) else { return };
        all.extend(fx);
    }
    let server = TestServer::start();
    let mut rng = StdRng::seed_from_u64(0x5eed);
    let mut statuses = std::collections::BTreeMap::new();
    for (name, f) in &all {
        let path = f["path"].as_str().unwrap();
        let mut body = f["body"].clone();
        body["stream"] = json!(rng.gen::<bool>());
        for _ in 0..25 {
            let bytes = mutate(&body, &mut rng);
            let r = request(server.addr, "POST", path, &[("content-type", "application/json")], &bytes);
            *statuses.entry(r.status).or_insert(0) += 1;
            assert!(matches!(r.status, 200 | 400 | 404 | 413), "{name}: status {} for {}", r.status, r.body);
            if r.status != 200 {
                let e = r.json();
                let msg = if path.starts_with("/v1/messages") {
                    assert_eq!(e["type"], "error");
                    e["error"]["message"].as_str().map(String::from)
                } else {
                    e["error"]["message"].as_str().map(String::from)
                };
                assert!(msg.is_some_and(|m| !m.is_empty()), "{name}: {}", r.body);
            } else if r.header("content-type").is_some_and(|c| c.starts_with("text/event-stream")) {
                // Streams end with their API's terminal event.
                assert!(
                    r.body.contains("data: [DONE]")
                        || r.body.contains("event: message_stop")
                        || r.body.contains("event: response.completed")
                        || r.body.contains("event: response.incomplete"),
                    "{name}: unterminated stream {}",
                    r.body
                );
            }
        }
    }
    eprintln!("status counts: {statuses:?}");
    assert!(statuses.get(&400).copied().unwrap_or(0) > 10, "mutations should hit decoding errors: {statuses:?}");
    assert_eq!(server.get("/health").status, 200);
}
