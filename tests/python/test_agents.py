"""The three real coding agents (Claude Code, Codex, opencode), pinned, against the real `ds4-server` binary.

- With `--fake-model --fake-script` (see server/README.md "Fake model"): per client a tool round trip in which the
  client really runs its shell tool (the script asks it to write a marker file; the test checks the file and that the
  command's output came back to the model), then a second turn continuing the session (`claude --continue`,
  `codex exec resume --last`, `opencode run --continue`) whose usage, as the client itself reports it, shows the first
  turn's prompt served from the server's prefix cache. No request any client sent may get a 4xx/5xx
  (`ds4_requests_total` on /metrics).
- Structured outputs from the clients themselves, on the scripted model (whose grammar support is a mask over its
  byte vocabulary: a scripted reply that does not fit the format still comes back in it): `codex exec
  --output-schema FILE` ends with a message that validates against FILE, and an interactive Claude Code session's
  title request (`output_config.format` json_schema, sent only by the interactive UI) is answered with JSON that
  validates against the schema it sent (seen through a recording proxy).
- With the random demo model (`--demo-model random`: real tokenizer and template, random weights) and hidden thinking: keep-alive pings
  arrive at least every 15 s, and a client that goes away has its generation stopped within 2 s (/metrics).

The clients come from `$DS4_AGENTS_DIR/node_modules/.bin` (scripts/test.sh installs them into
`${DS4_CACHE_DIR:-$HOME/.cache/ds4}/npm`). A missing client skips its test, except with CI=true where it fails.
Every client runs with HOME set to a scratch folder, telemetry/update/model fetches off, and talks only to the
server on 127.0.0.1. Every run is bounded by a timeout.
"""

import http.client
import http.server
import json
import os
import pty
import re
import select
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.request

import jsonschema
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("DS4_SERVER_BIN", os.path.join(ROOT, "target", "debug", "ds4-server"))
# The scripted test model lives only in the test build of the server (feature `test-model`).
TEST_BIN = os.environ.get("DS4_TEST_SERVER_BIN", os.path.join(ROOT, "target", "debug", "ds4-test-server"))
CACHE = os.environ.get("DS4_CACHE_DIR", os.path.join(os.path.expanduser("~"), ".cache", "ds4"))
AGENTS = os.environ.get("DS4_AGENTS_DIR", os.path.join(CACHE, "npm"))
CI = os.environ.get("CI") == "true"
MODEL = "deepseek-v4-flash"
RUN_TIMEOUT = 180  # seconds per client invocation

# One script for all three clients: each offers its own shell tool (Bash / exec_command / bash), so the `tool`
# condition picks the call in that client's argument shape. The marker is printed by the command, so the answer
# to the tool result ("tool said: ...") proves the command's real output came back.
SCRIPT = [
    {"when": {"last": "user", "contains": "SECOND TURN"}, "reply": {"reasoning": "Again.", "text": "second turn done"}},
    {"when": {"last": "tool"}, "reply": {"reasoning": "It ran.", "text": "tool said: {last}"}},
    {
        "when": {"last": "user", "contains": "RUN THE TOOL", "tool": "Bash"},
        "reply": {
            "reasoning": "Run it.",
            "tool_calls": [
                {
                    "name": "Bash",
                    "arguments": {
                        "command": "echo ds4-marker-claude > made.txt && cat made.txt",
                        "description": "Write a marker file",
                    },
                }
            ],
        },
    },
    {
        "when": {"last": "user", "contains": "RUN THE TOOL", "tool": "exec_command"},
        "reply": {
            "reasoning": "Run it.",
            "tool_calls": [
                {"name": "exec_command", "arguments": {"cmd": "echo ds4-marker-codex > made.txt && cat made.txt"}}
            ],
        },
    },
    {
        "when": {"last": "user", "contains": "RUN THE TOOL", "tool": "bash"},
        "reply": {
            "reasoning": "Run it.",
            "tool_calls": [
                {
                    "name": "bash",
                    "arguments": {
                        "command": "echo ds4-marker-opencode > made.txt && cat made.txt",
                        "description": "Write a marker file",
                    },
                }
            ],
        },
    },
]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A `ds4-server` process on 127.0.0.1 (log in a file, never a pipe that could fill)."""

    def __init__(self, tmp, args, bin=BIN):
        if not os.path.exists(bin):
            pytest.fail(f"{bin} not found: run `cargo build -p ds4-server` (and for the scripted test model "
                        "`cargo build -p ds4-server --features test-model --bin ds4-test-server`) first")
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log_path = os.path.join(tmp, "server.log")
        self.log = open(self.log_path, "w")
        self.proc = subprocess.Popen(
            # --no-kv-disk: a test never writes into the real cache directory.
            [bin, "--host", "127.0.0.1", "--port", str(self.port), "--no-kv-disk", *args],
            stdout=subprocess.DEVNULL,
            stderr=self.log,
        )
        for _ in range(1200):  # up to 120 s (the demo model is built at start)
            if self.proc.poll() is not None:
                pytest.fail(f"ds4-server exited: {self.read_log()}")
            try:
                with urllib.request.urlopen(self.base + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        self.stop()
        pytest.fail("ds4-server did not become healthy")

    def read_log(self):
        with open(self.log_path) as f:
            return f.read()

    def metrics(self):
        """{(name, frozenset(labels)): value}."""
        with urllib.request.urlopen(self.base + "/metrics", timeout=10) as r:
            text = r.read().decode()
        out = {}
        for line in text.splitlines():
            if not line or line.startswith("#"):
                continue
            m = re.match(r'^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})? (\S+)$', line)
            if m:
                labels = frozenset(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
                out[(m.group(1), labels)] = float(m.group(3))
        return out

    def metric(self, name, **labels):
        return self.metrics().get((name, frozenset(labels.items())), 0.0)

    def requests(self):
        """{(endpoint, status): count} of every request so far."""
        return {
            (dict(k[1])["endpoint"], int(dict(k[1])["status"])): v
            for k, v in self.metrics().items()
            if k[0] == "ds4_requests_total"
        }

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()


def client(name):
    path = os.path.join(AGENTS, "node_modules", ".bin", name)
    if not os.path.exists(path):
        msg = f"{name} is not installed in {AGENTS} (scripts/test.sh installs the pinned clients)"
        if CI:
            pytest.fail(msg)
        pytest.skip(msg)
    return path


@pytest.fixture()
def fake_server(tmp_path):
    script = tmp_path / "script.json"
    script.write_text(json.dumps(SCRIPT))
    # Fake tokens are bytes: agent prompts are 30-50k of them (the fake model has no real context limit).
    s = Server(str(tmp_path), ["--fake-model", "--fake-script", str(script), "--ctx", "1000000"], bin=TEST_BIN)
    yield s
    s.stop()


def scratch(tmp_path, name):
    """(home, repo): a fresh HOME and a small git repo as the working directory."""
    home = tmp_path / f"home-{name}"
    repo = tmp_path / f"repo-{name}"
    home.mkdir()
    repo.mkdir()
    (repo / "README.md").write_text("# scratch\n")
    (repo / "hello.py").write_text("print('hello')\n")
    git = shutil.which("git")
    if git:
        env = {**os.environ, "HOME": str(home), "GIT_CONFIG_NOSYSTEM": "1"}
        subprocess.run([git, "init", "-q"], cwd=repo, env=env, check=True, timeout=30)
    return home, repo


def run(cmd, cwd, env, timeout=RUN_TIMEOUT):
    base = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TERM", "TMPDIR", "USER", "SHELL")}
    base.update(env)
    try:
        p = subprocess.run(
            cmd, cwd=cwd, env=base, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired as e:
        pytest.fail(f"{cmd[0]} timed out after {timeout} s\nstdout: {e.stdout}\nstderr: {e.stderr}")
    return p


def assert_no_errors(server, expect_endpoint, at_least=3):
    reqs = server.requests()
    bad = {k: v for k, v in reqs.items() if k[1] >= 400}
    assert not bad, f"requests answered with errors: {bad}\n{server.read_log()[-4000:]}"
    assert sum(v for (ep, _), v in reqs.items() if ep == expect_endpoint) >= at_least, reqs


def assert_reused(cached, prompt, turn1_prompt, who):
    """The second turn's prompt came mostly from cache: at least the first turn's (largest) prompt."""
    assert cached > 0, f"{who}: second turn reused nothing (prompt {prompt})"
    assert cached >= 0.9 * turn1_prompt, f"{who}: cached {cached} of {prompt}; turn 1's prompt was {turn1_prompt}"
    assert cached <= prompt


def test_claude_code(fake_server, tmp_path):
    claude = client("claude")
    home, repo = scratch(tmp_path, "claude")
    env = {
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": fake_server.base,
        "ANTHROPIC_API_KEY": "dummy",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
    }
    common = ["--model", MODEL, "--output-format", "json", "--allowedTools", "Bash"]
    p = run([claude, "-p", "RUN THE TOOL please", *common], repo, env)
    assert p.returncode == 0, f"stdout: {p.stdout}\nstderr: {p.stderr}"
    assert (repo / "made.txt").read_text().strip() == "ds4-marker-claude"
    out = json.loads(p.stdout)
    assert "tool said: ds4-marker-claude" in out["result"], out
    turn1 = fake_server.metric("ds4_prompt_tokens_total")
    hits1 = fake_server.metric("ds4_prefix_cache_hit_tokens_total", tier="host")

    p = run([claude, "--continue", "-p", "SECOND TURN now", *common], repo, env)
    assert p.returncode == 0, f"stdout: {p.stdout}\nstderr: {p.stderr}"
    out = json.loads(p.stdout)
    assert "second turn done" in out["result"], out
    u = out["usage"]
    prompt = u["input_tokens"] + u["cache_read_input_tokens"]
    hits2 = fake_server.metric("ds4_prefix_cache_hit_tokens_total", tier="host") - hits1
    assert hits2 == u["cache_read_input_tokens"], (hits2, u)
    # Turn 1's two requests together exceed its last prompt; half their sum is a safe lower bound of it.
    assert_reused(u["cache_read_input_tokens"], prompt, turn1 / 2, "claude")
    assert_no_errors(fake_server, "messages")


def test_codex(fake_server, tmp_path):
    codex = client("codex")
    home, repo = scratch(tmp_path, "codex")
    env = codex_home(home, fake_server.base)
    flags = ["--json", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox"]
    p = run([codex, "exec", *flags, "RUN THE TOOL please"], repo, env)
    assert p.returncode == 0, f"stdout: {p.stdout}\nstderr: {p.stderr}"
    assert (repo / "made.txt").read_text().strip() == "ds4-marker-codex"
    events = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    texts = [e["item"].get("text", "") for e in events if e.get("type") == "item.completed"]
    assert any("tool said: " in t and "ds4-marker-codex" in t for t in texts), events
    turn1 = [e["usage"] for e in events if e.get("type") == "turn.completed"][-1]

    p = run([codex, "exec", "resume", "--last", *flags, "SECOND TURN now"], repo, env)
    assert p.returncode == 0, f"stdout: {p.stdout}\nstderr: {p.stderr}"
    events = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    texts = [e["item"].get("text", "") for e in events if e.get("type") == "item.completed"]
    assert any("second turn done" in t for t in texts), events
    u = [e["usage"] for e in events if e.get("type") == "turn.completed"][-1]
    # Codex sums a turn's requests; turn 1 had two, of which the larger is at least half the sum.
    assert_reused(u["cached_input_tokens"], u["input_tokens"], turn1["input_tokens"] / 2, "codex")
    assert_no_errors(fake_server, "responses")


def test_opencode(fake_server, tmp_path):
    opencode = client("opencode")
    home, repo = scratch(tmp_path, "opencode")
    cfg = home / ".config" / "opencode"
    cfg.mkdir(parents=True)
    (cfg / "opencode.json").write_text(
        json.dumps(
            {
                "$schema": "https://opencode.ai/config.json",
                "provider": {
                    "ds4": {
                        "name": "ds4",
                        "npm": "@ai-sdk/openai-compatible",
                        "options": {"baseURL": fake_server.base + "/v1", "apiKey": "dummy"},
                        "models": {MODEL: {"name": "DeepSeek V4 Flash", "limit": {"context": 1000000, "output": 32000}}},
                    }
                },
            }
        )
    )
    env = {
        "HOME": str(home),
        "XDG_CONFIG_HOME": str(home / ".config"),
        "XDG_DATA_HOME": str(home / ".local" / "share"),
        "XDG_CACHE_HOME": str(home / ".cache"),
        "XDG_STATE_HOME": str(home / ".local" / "state"),
        "OPENCODE_DISABLE_AUTOUPDATE": "1",
        "OPENCODE_DISABLE_MODELS_FETCH": "1",
        "OPENCODE_DISABLE_LSP_DOWNLOAD": "1",
        "OPENCODE_DISABLE_SHARE": "1",
    }
    flags = ["-m", f"ds4/{MODEL}", "--format", "json"]
    p = run([opencode, "run", *flags, "RUN THE TOOL please"], repo, env)
    assert p.returncode == 0, f"stdout: {p.stdout}\nstderr: {p.stderr}"
    assert (repo / "made.txt").read_text().strip() == "ds4-marker-opencode"
    events = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    assert "tool said: ds4-marker-opencode" in p.stdout, p.stdout
    steps1 = [e["part"]["tokens"] for e in events if e.get("type") == "step_finish"]
    assert steps1, p.stdout
    turn1_prompt = max(t["input"] + t["cache"]["read"] for t in steps1)

    p = run([opencode, "run", "--continue", *flags, "SECOND TURN now"], repo, env)
    assert p.returncode == 0, f"stdout: {p.stdout}\nstderr: {p.stderr}"
    assert "second turn done" in p.stdout, p.stdout
    events = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    t = [e["part"]["tokens"] for e in events if e.get("type") == "step_finish"][-1]
    assert_reused(t["cache"]["read"], t["input"] + t["cache"]["read"], turn1_prompt, "opencode")
    assert_no_errors(fake_server, "chat_completions")


# --- structured outputs asked for by the clients themselves ---------------------------------------------------

# What the scripted model answers: replies that do NOT fit the requested formats (a number where a string is due,
# an extra key, plain prose), so only the server's grammar can make the answers valid.
STRUCTURED_SCRIPT = [
    {"when": {"contains": "SCHEMA TEST"},
     "reply": {"reasoning": "Answer in the schema.", "text": '{"answer": 42, "extra": true, "count": "many"}'}},
    {"when": {"contains": "TITLE TEST", "tool": "Bash"}, "reply": {"text": "done"}},
    {"when": {"contains": "TITLE TEST"}, "reply": {"text": "Sure, here is a title: Listing files"}},
]

# Bounded (a noisy string must end) and strict-compatible (every property required, no others).
OUTPUT_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 12},
        "count": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "count"],
    "additionalProperties": False,
}


@pytest.fixture()
def structured_server(tmp_path):
    script = tmp_path / "script.json"
    script.write_text(json.dumps(STRUCTURED_SCRIPT))
    s = Server(str(tmp_path), ["--fake-model", "--fake-script", str(script), "--ctx", "1000000"], bin=TEST_BIN)
    yield s
    s.stop()


def codex_home(home, base):
    (home / ".codex").mkdir()
    (home / ".codex" / "config.toml").write_text(
        f"""model = "{MODEL}"
model_provider = "ds4"

[model_providers.ds4]
name = "ds4"
base_url = "{base}/v1"
env_key = "DS4_API_KEY"
wire_api = "responses"

[analytics]
enabled = false

[feedback]
enabled = false
"""
    )
    return {"HOME": str(home), "CODEX_HOME": str(home / ".codex"), "DS4_API_KEY": "dummy"}


@pytest.fixture(params=["scripted", "demo"])
def schema_server(request, tmp_path):
    """The scripted model (its reply deliberately does not fit the schema) and the demo model (random weights: its
    free output is noise); on both only the grammar can make the answer valid."""
    if request.param == "scripted":
        yield request.getfixturevalue("structured_server")
        return
    s = Server(str(tmp_path), ["--ctx", "65536", "--max-active", "2", "--demo-model", "random"])
    s.model_kind = "demo"
    yield s
    s.stop()


def test_codex_output_schema(schema_server, tmp_path):
    structured_server = schema_server
    codex = client("codex")
    home, repo = scratch(tmp_path, "codex-schema")
    demo = getattr(structured_server, "model_kind", "scripted") == "demo"
    # The demo model's tool calls are noise too, and a free-text parameter (a shell command, a patch) need not end
    # before the context does: for it the proxy passes each request on with `tool_choice: "none"` (the server then
    # offers no tools), so the answer is the schema alone. The scripted model keeps the tools.
    proxy = RecordingProxy(structured_server.port, rewrite=(lambda r: {**r, "tool_choice": "none"}) if demo else None)
    env = codex_home(home, proxy.base)
    schema_file = tmp_path / "schema.json"
    schema_file.write_text(json.dumps(OUTPUT_SCHEMA))
    flags = ["--json", "--skip-git-repo-check", "--sandbox", "read-only", "--output-schema", str(schema_file)]
    if demo:
        # The demo model's free reasoning is noise that need not end: ask for none, so the answer starts at once.
        flags += ["-c", 'model_reasoning_effort="none"']
    try:
        p = run([codex, "exec", *flags, "SCHEMA TEST: answer in the schema"], repo, env)
    finally:
        proxy.stop()
    assert p.returncode == 0, f"stdout: {p.stdout}\nstderr: {p.stderr}"
    # The request carried the schema as Responses `text.format`.
    formats = [(r["request"] or {}).get("text", {}).get("format") for r in proxy.records]
    sent = [f for f in formats if f and f.get("type") == "json_schema"]
    assert sent and sent[0]["schema"] == OUTPUT_SCHEMA, formats
    events = [json.loads(line) for line in p.stdout.splitlines() if line.startswith("{")]
    messages = [e["item"]["text"] for e in events
                if e.get("type") == "item.completed" and e["item"].get("type") == "agent_message"]
    assert messages, events
    answer = json.loads(messages[-1])
    jsonschema.validate(answer, OUTPUT_SCHEMA)
    # Neither model answers in the schema by itself (the scripted reply is deliberately invalid, the demo model is
    # noise): the grammar made it so (the request carried text.format).
    assert structured_server.metric("ds4_structured_requests_total") >= 1
    assert_no_errors(structured_server, "responses", at_least=1)


class RecordingProxy:
    """A proxy on 127.0.0.1 in front of the server that records every request body and the whole answer to it (a
    stream is read to its end, then passed on). `rewrite`, when given, changes each JSON request before it goes on
    (the record keeps the request as the client sent it)."""

    def __init__(self, upstream_port, rewrite=None):
        self.records = []
        lock = threading.Lock()
        records = self.records

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self):
                body = self.rfile.read(int(self.headers.get("content-length", 0)))
                skip = {"host", "content-length", "connection", "accept-encoding"}
                headers = {k: v for k, v in self.headers.items() if k.lower() not in skip}
                sent = body
                if rewrite is not None:
                    try:
                        sent = json.dumps(rewrite(json.loads(body))).encode()
                    except ValueError:
                        pass
                conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=300)
                conn.request("POST", self.path, body=sent, headers=headers)
                r = conn.getresponse()
                data = r.read()
                conn.close()
                with lock:
                    try:
                        req = json.loads(body)
                    except ValueError:
                        req = None
                    records.append({"path": self.path, "request": req, "status": r.status,
                                    "response": data.decode(errors="replace")})
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("content-length", "transfer-encoding", "connection"):
                        self.send_header(k, v)
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):
                pass

        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.base = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def stop(self):
        self.httpd.shutdown()
        self.httpd.server_close()


def sse_text(body):
    """The text of an Anthropic messages stream (its text_delta events joined)."""
    out = []
    for frame in body.split("\n\n"):
        for line in frame.splitlines():
            if line.startswith("data: "):
                ev = json.loads(line[6:])
                if ev.get("type") == "content_block_delta" and ev["delta"].get("type") == "text_delta":
                    out.append(ev["delta"]["text"])
    return "".join(out)


def test_claude_code_session_title(structured_server, tmp_path):
    """Claude Code names a session with a side request carrying `output_config.format` (a json_schema with a
    `title` string). Only its interactive UI sends it, so Claude Code runs in a pseudo-terminal with onboarding,
    the API key and the folder's trust already accepted in its config, and non-essential traffic allowed (the title
    request is part of it; nothing outside 127.0.0.1 is reachable)."""
    claude = client("claude")
    home, repo = scratch(tmp_path, "claude-title")
    (home / ".claude.json").write_text(json.dumps({
        "hasCompletedOnboarding": True,
        "customApiKeyResponses": {"approved": ["dummy"], "rejected": []},
        "projects": {str(repo): {"hasTrustDialogAccepted": True, "hasCompletedProjectOnboarding": True}},
    }))
    proxy = RecordingProxy(structured_server.port)
    env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "USER", "SHELL", "TMPDIR")}
    env.update({"HOME": str(home), "ANTHROPIC_BASE_URL": proxy.base, "ANTHROPIC_API_KEY": "dummy",
                "DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
                "TERM": "xterm-256color"})
    master, slave = pty.openpty()
    proc = subprocess.Popen([claude, "--model", MODEL, "TITLE TEST: list the files here"], cwd=repo, env=env,
                            stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    screen = b""

    def answered():
        titles = [r for r in proxy.records if (r["request"] or {}).get("output_config", {}).get("format")]
        main = [r for r in proxy.records if (r["request"] or {}).get("tools")]
        return titles, main

    try:
        deadline = time.monotonic() + RUN_TIMEOUT
        while time.monotonic() < deadline:
            # Keep reading the terminal (a full pty would block the client).
            ready, _, _ = select.select([master], [], [], 0.2)
            if ready:
                try:
                    screen += os.read(master, 65536)
                except OSError:
                    break
            titles, main = answered()
            if titles and main:
                break
            assert proc.poll() is None, f"claude exited: {screen[-3000:]!r}"
        titles, main = answered()
        assert titles, f"no title request in {[r['request'] for r in proxy.records]}\n{screen[-3000:]!r}"
    finally:
        proc.kill()
        proc.wait(timeout=30)
        os.close(master)
        proxy.stop()
    t = titles[0]
    fmt = t["request"]["output_config"]["format"]
    assert fmt["type"] == "json_schema", fmt
    assert t["status"] == 200, t["response"][:2000]
    text = sse_text(t["response"]) if t["request"].get("stream") else json.loads(t["response"])["content"][0]["text"]
    jsonschema.validate(json.loads(text), fmt["schema"])
    assert structured_server.metric("ds4_structured_requests_total") >= 1
    assert_no_errors(structured_server, "messages", at_least=2)


# --- the demo model: hidden thinking is not silence, and a client that goes away stops its generation ---------


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory):
    s = Server(str(tmp_path_factory.mktemp("demo")), ["--ctx", "8192", "--max-active", "4", "--demo-model", "random"])
    yield s
    s.stop()


def open_request(base, path, body):
    """POST on a raw socket; returns the socket once the request is sent."""
    port = int(base.rsplit(":", 1)[1])
    s = socket.create_connection(("127.0.0.1", port), timeout=30)
    data = json.dumps(body).encode()
    head = (
        f"POST {path} HTTP/1.1\r\nhost: 127.0.0.1\r\ncontent-type: application/json\r\n"
        f"x-api-key: dummy\r\nanthropic-version: 2023-06-01\r\ncontent-length: {len(data)}\r\n\r\n"
    )
    s.sendall(head.encode() + data)
    return s


HIDDEN = {
    "model": MODEL,
    "max_tokens": 100000,
    "stream": True,
    "thinking": {"type": "adaptive", "display": "omitted"},
    "messages": [{"role": "user", "content": "Think about it for a long while."}],
}


def test_demo_hidden_thinking_sends_pings(demo_server):
    """Thinking on and hidden (Claude Code's `display: "omitted"`): the random-weight model never closes its
    reasoning, so nothing visible is ever written, yet frames keep coming at least every 15 s."""
    s = open_request(demo_server.base, "/v1/messages?beta=true", HIDDEN)
    s.settimeout(20)
    buf = b""
    arrivals = []
    start = time.monotonic()
    try:
        while time.monotonic() - start < 17:
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                pytest.fail(f"nothing written for 20 s: {buf[-2000:]!r}")
            assert chunk, f"the stream ended early: {buf[-2000:]!r}"
            buf += chunk
            arrivals.append(time.monotonic())
    finally:
        s.close()
    text = buf.decode(errors="replace")
    assert " 200 " in text.split("\r\n", 1)[0], text[:500]
    assert "event: ping" in text or ": keep-alive" in text, text[-2000:]
    assert "thinking_delta" not in text, "hidden reasoning was sent"
    gaps = [b - a for a, b in zip([start] + arrivals, arrivals)]
    assert max(gaps) <= 15, f"silent for {max(gaps):.1f} s"
    assert len(arrivals) >= 3, f"{len(arrivals)} writes in 17 s"


CANCEL_CASES = [
    ("/v1/messages", {k: v for k, v in HIDDEN.items() if k != "stream"}),
    (
        "/v1/chat/completions",
        {"model": MODEL, "max_tokens": 100000, "reasoning_effort": "high",
         "messages": [{"role": "user", "content": "Think about it."}]},
    ),
    ("/v1/responses", {"model": MODEL, "max_output_tokens": 100000, "reasoning": {"effort": "high"}, "input": "Think."}),
    ("/v1/completions", {"model": MODEL, "max_tokens": 100000, "prompt": "Once upon a time"}),
]


@pytest.mark.parametrize("stream", [True, False], ids=["stream", "json"])
@pytest.mark.parametrize("path,body", CANCEL_CASES, ids=[c[0].rsplit("/", 1)[1] for c in CANCEL_CASES])
def test_demo_dropped_client_stops_within_2s(demo_server, path, body, stream):
    before = demo_server.metric("ds4_completion_tokens_total")
    cancelled = demo_server.metric("ds4_generations_cancelled_total")
    s = open_request(demo_server.base, path, {**body, "stream": stream})
    try:
        deadline = time.monotonic() + 120
        while demo_server.metric("ds4_completion_tokens_total") < before + 3:
            assert time.monotonic() < deadline, "generation did not start"
            time.sleep(0.05)
    finally:
        s.close()  # the client goes away (as if killed) without reading anything
    gone = time.monotonic()
    while True:
        m = demo_server.metrics()
        if m.get(("ds4_active_sessions", frozenset()), 1) == 0 and m.get(
            ("ds4_generations_cancelled_total", frozenset()), 0
        ) > cancelled:
            break
        assert time.monotonic() - gone < 2.0, f"still generating 2 s after the client went away: {m}"
        time.sleep(0.02)
    # And it stays stopped: no more tokens are produced for it.
    n = demo_server.metric("ds4_completion_tokens_total")
    time.sleep(0.3)
    assert demo_server.metric("ds4_completion_tokens_total") == n


def test_demo_claude_code_hidden_thinking_then_killed(tmp_path):
    """Claude Code itself (adaptive thinking, `display: "omitted"`) on the demo model: the reasoning never ends, so
    the server only sends keep-alives (at least one per 15 s); killing the client frees its session within 2 s."""
    claude = client("claude")
    server = Server(str(tmp_path), ["--ctx", "32768", "--max-active", "2", "--demo-model", "random"])
    home, repo = scratch(tmp_path, "claude-demo")
    env = {
        "HOME": str(home),
        "ANTHROPIC_BASE_URL": server.base,
        "ANTHROPIC_API_KEY": "dummy",
        "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
        "DISABLE_TELEMETRY": "1",
        "DISABLE_AUTOUPDATER": "1",
        "DISABLE_ERROR_REPORTING": "1",
    }
    base_env = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TERM", "TMPDIR", "USER", "SHELL")}
    log = open(tmp_path / "claude.log", "w")
    proc = subprocess.Popen(
        [claude, "-p", "Think it through.", "--model", MODEL],
        cwd=repo,
        env={**base_env, **env},
        stdin=subprocess.DEVNULL,
        stdout=log,
        stderr=log,
    )
    try:
        deadline = time.monotonic() + 150
        while server.metric("ds4_completion_tokens_total") < 3:
            assert proc.poll() is None, f"claude exited: {open(tmp_path / 'claude.log').read()}"
            assert time.monotonic() < deadline, "Claude Code's request did not start generating"
            time.sleep(0.2)
        assert server.metric("ds4_active_sessions") == 1
        # Watch the keep-alive counter for 17 s: it must tick at least every 15 s.
        last_tick, last_value, ticks = time.monotonic(), server.metric("ds4_keepalives_total"), 0
        start = time.monotonic()
        while time.monotonic() - start < 17:
            v = server.metric("ds4_keepalives_total")
            now = time.monotonic()
            if v > last_value:
                last_tick, last_value, ticks = now, v, ticks + 1
            assert now - last_tick <= 15, "no keep-alive for 15 s"
            time.sleep(0.25)
        assert ticks >= 2, f"{ticks} keep-alives in 17 s"
        assert proc.poll() is None, "Claude Code gave up on the stream"
        assert not [k for k in server.requests() if k[1] >= 400], server.requests()
    finally:
        proc.kill()
        proc.wait(timeout=30)
        log.close()
    try:
        killed = time.monotonic()
        while server.metric("ds4_active_sessions") != 0:
            assert time.monotonic() - killed < 2.0, "still generating 2 s after Claude Code was killed"
            time.sleep(0.02)
        assert server.metric("ds4_generations_cancelled_total") >= 1
    finally:
        server.stop()
