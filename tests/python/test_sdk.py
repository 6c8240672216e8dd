"""Drive the real `ds4-server` binary (`--demo-model random`: random weights, real tokenizer and chat template) with the
official `openai` and `anthropic` Python SDKs.

Run: `cargo build -p ds4-server && pip install openai anthropic pytest prometheus-client && pytest tests/python`.
The binary is `$DS4_SERVER_BIN` or `target/debug/ds4-server`. The server listens on 127.0.0.1 only; every loop is
bounded. The demo model's text is noise, so the tests check shapes, usage accounting and determinism, not wording.
"""

import concurrent.futures
import json
import os
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

import anthropic
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("DS4_SERVER_BIN", os.path.join(ROOT, "target", "debug", "ds4-server"))
MODEL = "deepseek-v4-flash"


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
        [BIN, "--port", str(port), "--ctx", "4096", "--max-active", "32", "--no-kv-disk", "--demo-model", "random"],
        stdout=subprocess.DEVNULL,
        stderr=errlog,
        text=True,
    )
    base = f"http://127.0.0.1:{port}"
    for _ in range(600):  # up to 60 s to load the demo model
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
        assert proc.wait(timeout=30) == 0, "ds4-server should exit cleanly on SIGTERM"
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.fixture()
def oai(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="dummy", max_retries=0, timeout=120)


@pytest.fixture()
def ant(server):
    return anthropic.Anthropic(base_url=server, api_key="dummy", max_retries=0, timeout=120)


BASH_TOOL = {
    "type": "function",
    "function": {
        "name": "bash",
        "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
    },
}


def test_models(oai):
    ids = [m.id for m in oai.models.list().data]
    assert ids == [MODEL]


def test_chat_non_streaming(oai):
    r = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hi"}], max_tokens=8, temperature=0
    )
    assert r.object == "chat.completion"
    c = r.choices[0]
    assert c.message.role == "assistant"
    assert c.finish_reason in ("stop", "length", "tool_calls")
    assert r.usage.prompt_tokens > 0
    assert 0 < r.usage.completion_tokens <= 8
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


def test_chat_streaming_with_usage(oai):
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to three"}],
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishes) == 1
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    # Streaming and non-streaming produce the same text at temperature 0.
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    again = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Count to three"}],
        max_tokens=12,
        temperature=0,
    )
    assert again.choices[0].message.content == text


def test_chat_tool_round_trip(oai):
    messages = [
        {"role": "user", "content": "list the files here"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "bash", "arguments": '{"command":"ls"}'}}],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "README.md\nhello.py\n"},
    ]
    r = oai.chat.completions.create(model=MODEL, messages=messages, tools=[BASH_TOOL], max_tokens=8, temperature=0)
    assert r.choices[0].message.role == "assistant"
    # The prefix up to the tool result is a longer prompt than the question alone.
    short = oai.chat.completions.create(
        model=MODEL, messages=messages[:1], tools=[BASH_TOOL], max_tokens=1, temperature=0
    )
    assert r.usage.prompt_tokens > short.usage.prompt_tokens


def test_chat_prefix_reuse_reports_cached_tokens(oai):
    msgs = [{"role": "user", "content": "The quick brown fox jumps over the lazy dog " * 10}]
    first = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
    second = oai.chat.completions.create(model=MODEL, messages=msgs, max_tokens=4, temperature=0)
    assert second.usage.prompt_tokens == first.usage.prompt_tokens
    # The engine cannot roll back, so the server keeps a copy of each prefilled prompt: a repeat reuses all of it.
    assert second.usage.prompt_tokens_details.cached_tokens == first.usage.prompt_tokens
    assert second.choices[0].message.content == first.choices[0].message.content


def test_responses_non_streaming_and_streaming(oai):
    r = oai.responses.create(model=MODEL, input="Say hi", max_output_tokens=8, temperature=0)
    assert r.status in ("completed", "incomplete")
    assert r.usage.input_tokens > 0 and r.usage.output_tokens > 0
    events = list(
        oai.responses.create(model=MODEL, input="Say hi", max_output_tokens=8, temperature=0, stream=True)
    )
    assert events[0].type == "response.created"
    assert events[-1].type in ("response.completed", "response.incomplete")
    seq = [e.sequence_number for e in events]
    assert seq == list(range(len(events)))
    assert events[-1].response.output_text == r.output_text


def test_responses_tool_round_trip(oai):
    tools = [
        {"type": "function", "name": "exec_command", "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}}},
        {"type": "web_search"},
    ]
    r = oai.responses.create(
        model=MODEL,
        input=[
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You are Codex."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "list the files"}]},
            {"type": "function_call", "call_id": "call_9", "name": "exec_command", "arguments": '{"cmd":"ls"}'},
            {"type": "function_call_output", "call_id": "call_9", "output": "README.md\n"},
        ],
        tools=tools,
        reasoning={"summary": "auto"},
        store=False,
        max_output_tokens=8,
        temperature=0,
    )
    assert r.status in ("completed", "incomplete")
    assert r.output, "at least one output item"


def test_anthropic_messages_thinking_and_tools(ant):
    tools = [{"name": "Bash", "description": "Run", "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]
    kwargs = dict(
        model=MODEL,
        max_tokens=16,
        system=[{"type": "text", "text": "x-anthropic-billing-header: cc_version=2.1.332.93d; cc_entrypoint=sdk-cli;"},
                {"type": "text", "text": "You are an agent."}],
        thinking={"type": "enabled", "budget_tokens": 1024},
        tools=tools,
        messages=[{"role": "user", "content": "list the files here"}],
        extra_body={"temperature": 0},  # this SDK version has no temperature parameter
    )
    m = ant.messages.create(**kwargs)
    assert m.type == "message" and m.role == "assistant"
    assert m.stop_reason in ("end_turn", "max_tokens", "tool_use")
    assert m.usage.output_tokens > 0
    with ant.messages.stream(**kwargs) as stream:
        events = list(stream)
        final = stream.get_final_message()
    assert events[0].type == "message_start"
    assert final.usage.output_tokens == m.usage.output_tokens
    assert [b.type for b in final.content] == [b.type for b in m.content]
    # A second conversation differing only in the billing line reuses the whole prefix.
    kwargs["system"][0]["text"] = "x-anthropic-billing-header: cc_version=2.1.332.862; cc_entrypoint=sdk-cli;"
    m2 = ant.messages.create(**kwargs)
    assert m2.usage.cache_read_input_tokens > 0 and m2.usage.input_tokens == 0


def test_anthropic_tool_round_trip_and_count_tokens(ant):
    messages = [
        {"role": "user", "content": "list the files here"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "Bash", "input": {"command": "ls"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "README.md"}]},
    ]
    tools = [{"name": "Bash", "description": "Run", "input_schema": {"type": "object", "properties": {"command": {"type": "string"}}}}]
    m = ant.messages.create(model=MODEL, max_tokens=8, tools=tools, messages=messages, extra_body={"temperature": 0})
    assert m.role == "assistant"
    n = ant.messages.count_tokens(model=MODEL, tools=tools, messages=messages).input_tokens
    assert n == m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0)


def post_json(url, body):
    """(status, JSON answer) of a plain POST."""
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def test_tokenize_and_detokenize_match_the_sdk(server, oai):
    """The llama-server / vLLM helpers: the prompt length the SDK's chat request reports is what `/v1/tokenize`
    counts for the same messages, and detokenize gives a text back."""
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "count my tokens"}]
    status, tok = post_json(server + "/v1/tokenize", {"model": MODEL, "messages": messages})
    assert status == 200 and tok["count"] == len(tok["tokens"]) and tok["max_model_len"] == 4096
    c = oai.chat.completions.create(model=MODEL, messages=messages, max_tokens=1, temperature=0)
    assert c.usage.prompt_tokens == tok["count"]
    text = "Hello, wörld — 你好"
    status, out = post_json(server + "/tokenize", {"content": text})
    assert status == 200 and all(isinstance(i, int) for i in out["tokens"])
    status, back = post_json(server + "/detokenize", {"tokens": out["tokens"]})
    assert status == 200 and back["content"] == text and back["prompt"] == text
    status, err = post_json(server + "/detokenize", {"tokens": [-1]})
    assert status == 400 and err["error"]["param"] == "tokens[0]"


def test_errors_through_the_sdks(oai, ant):
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="llama-3", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError) as e:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "word " * 5000}])
    assert "4096" in str(e.value)
    with pytest.raises(anthropic.BadRequestError):
        ant.messages.create(model=MODEL, max_tokens=0, messages=[{"role": "user", "content": "x"}])


def test_metrics_parse(server, oai):
    oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=2)
    with urllib.request.urlopen(server + "/metrics", timeout=10) as r:
        text = r.read().decode()
    families = {f.name: f for f in text_string_to_metric_families(text)}
    reqs = families["ds4_requests"]
    assert any(s.labels.get("endpoint") == "chat_completions" and s.labels.get("status") == "200" for s in reqs.samples)
    assert families["ds4_time_to_first_token_seconds"].type == "histogram"
    assert families["ds4_inter_token_latency_seconds"].type == "histogram"
    for name in ("ds4_queue_depth", "ds4_active_sessions", "ds4_kv_bytes", "ds4_prefix_cache_hit_tokens"):
        assert name in families, name


def test_load_32_concurrent_streaming_clients(server):
    prompts = [f"Client {i}: tell me about the number {i * 7}." for i in range(32)]

    def run(prompt):
        client = openai.OpenAI(base_url=server + "/v1", api_key="dummy", max_retries=0, timeout=300)
        stream = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=16, temperature=0, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    solo = {p: run(p) for p in prompts[:4]}
    with concurrent.futures.ThreadPoolExecutor(max_workers=32) as pool:
        rounds = [list(pool.map(run, prompts)) for _ in range(3)]
    for got in rounds:
        assert len(got) == 32
        for p, text in zip(prompts, got):
            if p in solo:
                assert text == solo[p], f"batched answer differs from the solo run for {p!r}"
    # Every client got the same answer in every round (batch composition does not change results).
    assert rounds[0] == rounds[1] == rounds[2]
