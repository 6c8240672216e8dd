"""Structured outputs against the real `ds4-server` binary and its random demo model (`--demo-model random`: its free output is
noise, so only the grammar can make it valid).

A few hundred generated JSON schemas (nesting, enums, bounded strings and arrays, `$defs`/`$ref`, optional fields),
regexes and a Lark grammar go through all four APIs, streamed and not; every answer that ends normally must validate
(Python `jsonschema`, `re.fullmatch`); an answer cut by `max_tokens` must say so (`length` / `max_tokens` /
`incomplete`). Bad schemas and grammars must get a 400 that names the problem.

Run: `cargo build -p ds4-server && pip install pytest jsonschema httpx && pytest tests/python/test_structured.py`.
The binary is `$DS4_SERVER_BIN` or `target/debug/ds4-server`; it listens on 127.0.0.1 only.
"""

import concurrent.futures
import json
import os
import random
import re
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

import httpx
import jsonschema
import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("DS4_SERVER_BIN", os.path.join(ROOT, "target", "debug", "ds4-server"))
MODEL = "deepseek-v4-flash"
MAX_TOKENS = 300
N_SCHEMAS = int(os.environ.get("DS4_STRUCTURED_SCHEMAS", "300"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_log(f):
    """What a child process wrote to its log file so far (for failure messages)."""
    f.flush()
    f.seek(0)
    return f.read()[-4000:]


@pytest.fixture(scope="module")
def server():
    if not os.path.exists(BIN):
        pytest.fail(f"{BIN} not found: run `cargo build -p ds4-server` first")
    port = free_port()
    # stderr goes to a file, not a pipe: nobody reads a pipe while the tests run, and a full one (64 KiB of
    # log lines) would block the process mid-request.
    errlog = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(
        [BIN, "--port", str(port), "--ctx", "2048", "--max-active", "32", "--demo-model", "random"],
        stdout=subprocess.DEVNULL,
        stderr=errlog,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):
        if proc.poll() is not None:
            pytest.fail(f"ds4-server exited: {read_log(errlog)}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=1) as r:
                if r.status == 200:
                    break
        except OSError:
            time.sleep(0.1)
    else:
        proc.kill()
        pytest.fail("ds4-server did not become healthy")
    yield base
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()


# ---- random schemas ---------------------------------------------------------------------------------------------

WORDS = ["alpha", "beta", "gamma", "delta", "x", "y", "on", "off", "red", "blue"]


def gen_schema(rng, depth, defs):
    """A schema whose every instance is short: strings, arrays and integers are bounded, objects closed."""
    kinds = ["string", "enum", "integer", "boolean", "null", "const"]
    if depth > 0:
        kinds += ["object", "object", "array", "anyOf"]
        if defs is not None:
            kinds.append("ref")
    k = rng.choice(kinds)
    if k == "string":
        s = {"type": "string", "maxLength": rng.randint(0, 8)}
        if rng.random() < 0.3:
            s["minLength"] = rng.randint(0, s["maxLength"])
        if rng.random() < 0.2:
            s = {"type": "string", "pattern": "^[a-z]{1,5}$"}
        return s
    if k == "enum":
        pool = WORDS + [1, 2, 3, True, None]
        return {"enum": rng.sample(pool, rng.randint(1, 4))}
    if k == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 500)}
    if k == "boolean":
        return {"type": "boolean"}
    if k == "null":
        return {"type": "null"}
    if k == "const":
        return {"const": rng.choice(WORDS)}
    if k == "array":
        a = {"type": "array", "items": gen_schema(rng, depth - 1, defs), "maxItems": rng.randint(0, 3)}
        if rng.random() < 0.3:
            a["minItems"] = rng.randint(0, a["maxItems"])
        return a
    if k == "anyOf":
        return {"anyOf": [gen_schema(rng, depth - 1, defs) for _ in range(rng.randint(2, 3))]}
    if k == "ref":
        name = f"d{len(defs)}"
        defs[name] = gen_schema(rng, depth - 1, None)
        return {"$ref": f"#/$defs/{name}"}
    n = rng.randint(1, 4)
    names = rng.sample(["id", "name", "tags", "kind", "count", "ok", "meta", "items"], n)
    props = {p: gen_schema(rng, depth - 1, defs) for p in names}
    required = [p for p in names if rng.random() < 0.6]
    o = {"type": "object", "properties": props, "additionalProperties": False}
    if required:
        o["required"] = required
    return o


def random_schema(seed):
    rng = random.Random(seed)
    defs = {}
    root = gen_schema(rng, 3, defs)
    if root.get("type") != "object":
        root = {"type": "object", "properties": {"value": root}, "required": ["value"], "additionalProperties": False}
    if defs:
        root["$defs"] = defs
    return root


# Digits as [0-9]: the grammar engine's `\d` is Unicode's decimal digits, from newer Unicode tables than Python's
# `re` has (a random model does emit digits such as U+10D48, which llguidance accepts and Python 3.12 does not know).
REGEXES = [
    r"[a-z]{1,8}",
    r"[0-9]{3}-[0-9]{4}",
    r"(yes|no|maybe)",
    r"[A-Z][a-z]{0,5}( [A-Z][a-z]{0,5}){0,2}",
    r"#[0-9a-f]{6}",
    r"(0|[1-9][0-9]{0,2})\.[0-9]{2}",
]

LARK = r"""
start: "[" item ("," item)? ("," item)? "]"
item: NUM | WORD
NUM: /[0-9]{1,3}/
WORD: /[a-z]{1,4}/
"""
LARK_RE = r"\[(?:[0-9]{1,3}|[a-z]{1,4})(?:,(?:[0-9]{1,3}|[a-z]{1,4})){0,2}\]"

# ---- the four APIs ----------------------------------------------------------------------------------------------


def sse_events(resp):
    """(event name or None, parsed data) for each SSE data frame."""
    event = None
    for line in resp.iter_lines():
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data = line[5:].strip()
            if data == "[DONE]":
                return
            yield event, json.loads(data)
            event = None


def format_for(api, kind, value):
    """The request fields that ask `api` for `kind` (`schema`, `regex`, `lark`)."""
    if kind == "schema":
        if api in ("chat", "completions"):
            return {"response_format": {"type": "json_schema", "json_schema": {"name": "out", "schema": value, "strict": True}}}
        if api == "responses":
            return {"text": {"format": {"type": "json_schema", "name": "out", "schema": value, "strict": True}}}
        return {"output_config": {"format": {"type": "json_schema", "schema": value}}}
    fmt = {"type": "regex", "pattern": value} if kind == "regex" else {"type": "grammar", "syntax": "lark", "definition": value}
    if api in ("chat", "completions"):
        return {"response_format": fmt}
    if api == "responses":
        return {"text": {"format": fmt}}
    return {"output_config": {"format": fmt}}


def ask(base, api, stream, fields, seed, max_tokens=MAX_TOKENS):
    """Returns (status, text, cut) where `cut` says the output limit ended the answer."""
    prompt = "Answer in the requested format."
    if api == "chat":
        path, body = "/v1/chat/completions", {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens, "seed": seed}
    elif api == "completions":
        path, body = "/v1/completions", {"prompt": prompt, "max_tokens": max_tokens, "seed": seed}
    elif api == "responses":
        path, body = "/v1/responses", {"input": prompt, "max_output_tokens": max_tokens}
    else:
        path, body = "/v1/messages", {"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens}
    body.update({"model": MODEL, "stream": stream, **fields})
    url = base + path
    if not stream:
        r = httpx.post(url, json=body, timeout=300)
        if r.status_code != 200:
            return r.status_code, r.text, False
        j = r.json()
        if api == "chat":
            c = j["choices"][0]
            return 200, c["message"]["content"], c["finish_reason"] == "length"
        if api == "completions":
            c = j["choices"][0]
            return 200, c["text"], c["finish_reason"] == "length"
        if api == "responses":
            text = "".join(p["text"] for o in j["output"] if o["type"] == "message" for p in o["content"] if p["type"] == "output_text")
            assert j["text"]["format"] == fields["text"]["format"]
            return 200, text, j["status"] == "incomplete"
        text = "".join(b["text"] for b in j["content"] if b["type"] == "text")
        return 200, text, j["stop_reason"] == "max_tokens"
    with httpx.stream("POST", url, json=body, timeout=300) as r:
        if r.status_code != 200:
            return r.status_code, r.read().decode(), False
        text, cut = "", None
        for event, d in sse_events(r):
            if api == "chat":
                for c in d.get("choices", []):
                    text += c["delta"].get("content") or ""
                    if c.get("finish_reason"):
                        cut = c["finish_reason"] == "length"
            elif api == "completions":
                for c in d.get("choices", []):
                    text += c.get("text") or ""
                    if c.get("finish_reason"):
                        cut = c["finish_reason"] == "length"
            elif api == "responses":
                if d["type"] == "response.output_text.delta":
                    text += d["delta"]
                elif d["type"] in ("response.completed", "response.incomplete", "response.failed"):
                    cut = d["type"] == "response.incomplete"
                    done = "".join(p["text"] for o in d["response"]["output"] if o["type"] == "message" for p in o["content"])
                    assert done == text, "the final response repeats the streamed text"
            else:
                if d["type"] == "content_block_delta" and d["delta"]["type"] == "text_delta":
                    text += d["delta"]["text"]
                elif d["type"] == "message_delta":
                    cut = d["delta"]["stop_reason"] == "max_tokens"
        assert cut is not None, f"{api} stream ended without a finish"
        return 200, text, cut


APIS = [(api, stream) for api in ("chat", "completions", "responses", "messages") for stream in (False, True)]


def run_all(base, cases):
    """cases: (api, stream, kind, value, seed) → results in order."""
    with concurrent.futures.ThreadPoolExecutor(24) as pool:
        futs = [pool.submit(ask, base, api, stream, format_for(api, kind, value), seed) for api, stream, kind, value, seed in cases]
        return [f.result() for f in futs]


def test_generated_schemas_validate_on_every_api(server):
    cases = []
    for i in range(N_SCHEMAS):
        api, stream = APIS[i % len(APIS)]
        cases.append((api, stream, "schema", random_schema(i), i))
    results = run_all(server, cases)
    complete = 0
    for (api, stream, _, schema, seed), (status, text, cut) in zip(cases, results):
        where = f"{api} stream={stream} seed={seed} schema={json.dumps(schema)}"
        assert status == 200, f"{where}: {text}"
        if cut:
            continue  # an honest length cut
        complete += 1
        try:
            value = json.loads(text)
        except ValueError as e:
            pytest.fail(f"{where}: not JSON ({e}): {text!r}")
        jsonschema.validate(value, schema)
    # Bounded schemas: nearly every answer ends before the limit, so the check above is not vacuous.
    assert complete >= 0.9 * len(cases), f"only {complete} of {len(cases)} answers ended before {MAX_TOKENS} tokens"


def test_regexes_and_a_lark_grammar_match_on_every_api(server):
    cases = []
    for j, (api, stream) in enumerate(APIS):
        for k, rx in enumerate(REGEXES):
            cases.append((api, stream, "regex", rx, 100 * j + k))
        cases.append((api, stream, "lark", LARK, 1000 + j))
    results = run_all(server, cases)
    for (api, stream, kind, value, seed), (status, text, cut) in zip(cases, results):
        where = f"{api} stream={stream} {kind} {value!r} seed={seed}"
        assert status == 200, f"{where}: {text}"
        assert not cut, f"{where}: a bounded pattern hit the limit"
        pattern = LARK_RE if kind == "lark" else value
        assert re.fullmatch(pattern, text), f"{where}: {text!r}"


def test_the_output_limit_is_an_honest_length_cut(server):
    schema = {"type": "object", "properties": {"s": {"type": "string", "minLength": 200, "maxLength": 300}}, "required": ["s"]}
    for api, stream in APIS:
        status, text, cut = ask(server, api, stream, format_for(api, "schema", schema), 5, max_tokens=8)
        assert status == 200 and cut, f"{api} stream={stream}: {status} {cut} {text!r}"


def test_json_object_and_strict_tools(server):
    r = httpx.post(server + "/v1/chat/completions", timeout=300, json={
        "model": MODEL, "max_tokens": 200, "seed": 1,
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {"type": "json_object"},
    })
    assert r.status_code == 200, r.text
    c = r.json()["choices"][0]
    if c["finish_reason"] != "length":
        assert isinstance(json.loads(c["message"]["content"]), dict)
    # Strict tools: any call that comes back has arguments valid against the tool's schema.
    params = {"type": "object", "properties": {"path": {"type": "string", "maxLength": 10}, "depth": {"type": "integer", "minimum": 0, "maximum": 3}},
              "required": ["path", "depth"], "additionalProperties": False}
    calls = 0
    for seed in range(12):
        r = httpx.post(server + "/v1/chat/completions", timeout=300, json={
            "model": MODEL, "max_tokens": 120, "seed": seed,
            "messages": [{"role": "user", "content": "list files"}],
            "tools": [{"type": "function", "function": {"name": "ls", "parameters": params, "strict": True}}],
        })
        assert r.status_code == 200, r.text
        for call in r.json()["choices"][0]["message"].get("tool_calls") or []:
            calls += 1
            assert call["function"]["name"] == "ls"
            jsonschema.validate(json.loads(call["function"]["arguments"]), params)


BAD = [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}, "nonsense"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"$ref": "#/$defs/nope"}}, "required": ["a"]}}}, "nope"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "schema"),
    ({"type": "regex", "pattern": "(unclosed"}, "regex"),
    ({"type": "grammar", "syntax": "lark", "definition": "start: missing_rule"}, "missing_rule"),
    ({"type": "xml"}, "xml"),
]


@pytest.mark.parametrize("fmt,needle", BAD)
def test_bad_formats_are_400s_naming_the_problem(server, fmt, needle):
    for api in ("chat", "completions", "responses", "messages"):
        if api in ("chat", "completions"):
            fields = {"response_format": fmt}
        else:
            flat = dict(fmt)
            if fmt["type"] == "json_schema":
                flat = {"type": "json_schema", "name": "x", **fmt["json_schema"]}
                flat.pop("name") if api == "messages" else None
            fields = {"text": {"format": flat}} if api == "responses" else {"output_config": {"format": flat}}
        status, text, _ = ask(server, api, False, fields, 0)
        assert status == 400, f"{api} {fmt}: {status} {text}"
        assert needle in text, f"{api} {fmt}: {text}"
