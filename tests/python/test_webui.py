"""Open the built-in web page of the real `ds4-server` binary (`--demo-model random`) in headless Chromium, driven over the
Chrome DevTools Protocol (a websocket, `websocket-client`): send a chat message with the keyboard, see the reply
stream in, stop a long generation with the Stop button, and see the status view count the requests and show the
cached tokens of a second turn.

Needs Debian's `chromium` (or `$DS4_CHROMIUM`) and `pip install websocket-client`; `scripts/test.sh` installs both.
Without them the test is skipped, except with CI=true, where it fails. Every wait is bounded; the server and the
browser listen on 127.0.0.1 only and are stopped by their process ids. With `DS4_WEBUI_SCREENSHOT=FILE.png` the test
also saves a screenshot of the page after the second turn (how docs/webui.png was made).
"""

import base64
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request

import pytest

try:
    import websocket  # websocket-client
except ImportError:  # pragma: no cover - reported by the fixture
    websocket = None

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BIN = os.environ.get("DS4_SERVER_BIN", os.path.join(ROOT, "target", "debug", "ds4-server"))
CHROMIUM = (
    os.environ.get("DS4_CHROMIUM")
    or shutil.which("chromium")
    or shutil.which("chromium-browser")
    or shutil.which("google-chrome")
)
# Big enough that the demo model needs far longer than the test waits to generate to the end.
CTX = 32768


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def read_log(f):
    """What a child process wrote to its log file so far (for failure messages)."""
    f.flush()
    f.seek(0)
    return f.read()[-4000:]


def missing(what):
    msg = f"{what} is needed for the web page test (scripts/test.sh installs it)"
    if os.environ.get("CI") == "true":
        pytest.fail(msg)
    pytest.skip(msg)


def stop_process(proc, sig=signal.SIGTERM, timeout=20):
    if proc.poll() is None:
        proc.send_signal(sig)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)


@pytest.fixture(scope="module")
def server():
    if not os.path.exists(BIN):
        pytest.fail(f"{BIN} not found: run `cargo build -p ds4-server` first")
    port = free_port()
    # stderr goes to a file, not a pipe: nobody reads a pipe while the tests run, and a full one (64 KiB of
    # log lines) would block the process mid-request.
    errlog = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(
        [BIN, "--host", "127.0.0.1", "--port", str(port), "--ctx", str(CTX), "--no-kv-disk", "--demo-model", "random"],
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
        stop_process(proc, signal.SIGKILL)
        pytest.fail("ds4-server did not become healthy")
    yield base
    try:
        stop_process(proc)
        assert proc.returncode == 0, "ds4-server should exit cleanly on SIGTERM"
    finally:
        if proc.poll() is None:
            proc.kill()


class Page:
    """One browser tab over CDP: evaluate JS, wait for conditions, click, type."""

    def __init__(self, ws_url):
        self.ws = websocket.create_connection(ws_url, timeout=30, suppress_origin=True)
        self.next_id = 0
        self.errors = []

    def close(self):
        self.ws.close()

    def call(self, method, **params):
        self.next_id += 1
        mid = self.next_id
        self.ws.send(json.dumps({"id": mid, "method": method, "params": params}))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            msg = json.loads(self.ws.recv())
            if msg.get("id") == mid:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            if msg.get("method") == "Runtime.exceptionThrown":
                self.errors.append(msg["params"]["exceptionDetails"].get("exception", {}).get("description", msg))
            elif msg.get("method") == "Runtime.consoleAPICalled" and msg["params"]["type"] == "error":
                self.errors.append([a.get("value", a.get("description")) for a in msg["params"]["args"]])
        raise TimeoutError(f"no answer to {method}")

    def js(self, expr):
        r = self.call("Runtime.evaluate", expression=expr, returnByValue=True, awaitPromise=True)
        if "exceptionDetails" in r:
            raise RuntimeError(f"{expr}: {r['exceptionDetails']}")
        return r["result"].get("value")

    def wait(self, expr, what, timeout=60):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            v = self.js(expr)
            if v:
                return v
            time.sleep(0.05)
        raise AssertionError(f"timed out waiting for {what} ({expr}); page errors: {self.errors}")

    def click(self, selector):
        """A real mouse click at the element's centre."""
        box = self.js(
            f"(() => {{ const r = document.querySelector({json.dumps(selector)}).getBoundingClientRect();"
            " return [r.x + r.width / 2, r.y + r.height / 2]; })()"
        )
        for kind in ("mousePressed", "mouseReleased"):
            self.call("Input.dispatchMouseEvent", type=kind, x=box[0], y=box[1], button="left", clickCount=1)

    def type_and_enter(self, selector, text):
        self.js(f"document.querySelector({json.dumps(selector)}).focus()")
        self.call("Input.insertText", text=text)
        enter = dict(key="Enter", code="Enter", windowsVirtualKeyCode=13, nativeVirtualKeyCode=13)
        self.call("Input.dispatchKeyEvent", type="keyDown", **enter)
        self.call("Input.dispatchKeyEvent", type="keyUp", **enter)


@pytest.fixture(scope="module")
def page(server):
    if CHROMIUM is None:
        missing("headless Chromium (Debian package `chromium`)")
    if websocket is None:
        missing("the Python package websocket-client")
    profile = tempfile.mkdtemp(prefix="ds4-webui-chromium-")
    # stderr goes to a file, not a pipe: nobody reads a pipe while the tests run, and a full one (64 KiB of
    # log lines) would block the process mid-request.
    errlog = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(
        [
            CHROMIUM,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--disable-extensions",
            "--disable-background-networking",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            "--window-size=1280,820",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=errlog,
        text=True,
    )
    p = None
    try:
        port_file = os.path.join(profile, "DevToolsActivePort")
        deadline = time.monotonic() + 60
        while not (os.path.exists(port_file) and open(port_file).read().strip()):
            if proc.poll() is not None:
                pytest.fail(f"chromium exited: {read_log(errlog)[-2000:]}")
            if time.monotonic() > deadline:
                pytest.fail("chromium did not open its debugging port")
            time.sleep(0.1)
        port = int(open(port_file).read().split()[0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as r:
            targets = json.load(r)
        ws_url = next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        p = Page(ws_url)
        p.call("Runtime.enable")
        p.call("Page.enable")
        p.call("Page.navigate", url=server + "/")
        p.wait("document.readyState === 'complete' && !!document.getElementById('send')", "the page to load")
        yield p
    finally:
        if p is not None:
            p.close()
        stop_process(proc, timeout=10)
        shutil.rmtree(profile, ignore_errors=True)


LAST_REPLY = "document.querySelector('#log .msg.assistant:last-of-type')"


def status_cell(row, col):
    return f"(document.querySelectorAll('#recent tbody tr')[{row}]?.cells[{col}]?.textContent)"


def test_chat_streams_stops_and_the_status_view_counts(page, server):
    page.wait("document.getElementById('stat-requests').textContent === '0'", "the status view's first poll")
    assert "deepseek-v4-flash" in page.js("document.getElementById('model').textContent")
    page.js("document.getElementById('max-tokens').value = '48'")

    # Turn 1, sent with the Enter key: a reply with text and its usage.
    page.type_and_enter("#prompt", "Hello from the browser test")
    page.wait(f"{LAST_REPLY}?.dataset.finish", "the first reply to finish")
    finish = page.js(f"{LAST_REPLY}.dataset.finish")
    # Random weights: almost surely the length limit; an end-of-sequence or a tool-call marker is possible.
    assert finish in ("length", "stop", "tool_calls"), finish
    assert page.js(f"{LAST_REPLY}.textContent.length") > len("assistant"), "the reply shows something"
    meta = page.js(f"{LAST_REPLY}.querySelector('.meta').textContent")
    m = re.search(r"prompt (\d+) \(cached (\d+)\) · output (\d+) tokens", meta)
    assert m and m.group(2) == "0" and 0 < int(m.group(3)) <= 48, meta
    assert page.js("document.getElementById('prompt').value") == ""

    # The status view counts it: one request, its prompt and output tokens, a time to first token.
    page.wait("document.getElementById('stat-requests').textContent === '1'", "the status view to count turn 1")
    page.wait(f"{status_cell(0, 3)} === '{m.group(3)}'", "turn 1 in the recent requests")
    assert page.js(status_cell(0, 1)) == m.group(1)
    assert page.js(status_cell(0, 2)) == "0"
    assert page.js(status_cell(0, 4)).endswith(" ms")
    assert page.js(status_cell(0, 7)) == ("stop" if finish == "tool_calls" else finish)

    # Turn 2, sent with the Send button: the status view shows its cached tokens (the first turn's prefix).
    page.js("document.getElementById('prompt').value = 'And a second turn'")
    page.click("#send")
    page.wait("document.querySelectorAll('#log .msg.assistant').length === 2", "the second reply box")
    page.wait(f"{LAST_REPLY}?.dataset.finish", "the second reply to finish")
    page.wait("document.querySelectorAll('#recent tbody tr').length === 2", "turn 2 in the recent requests")
    cached = int(page.js(status_cell(0, 2)))
    prompt = int(page.js(status_cell(0, 1)))
    assert 0 < cached < prompt, (cached, prompt)
    assert f"(cached {cached})" in page.js(f"{LAST_REPLY}.querySelector('.meta').textContent")
    page.wait(
        f"document.getElementById('stat-cached').textContent.startsWith('{cached} of')", "the cached-token total"
    )
    assert page.js("document.getElementById('stat-requests').textContent") == "2"
    tiers = page.js("[...document.querySelectorAll('#tiers tbody tr')].map(r => r.cells[0].textContent)")
    assert "RAM" in tiers and "disk" in tiers, tiers
    shot = os.environ.get("DS4_WEBUI_SCREENSHOT")
    if shot:
        page.js("document.getElementById('prompt').value = ''")
        png = page.call("Page.captureScreenshot", format="png")["data"]
        with open(shot, "wb") as f:
            f.write(base64.b64decode(png))

    # Turn 3: a long generation (up to the whole context), stopped with the Stop button once it streams.
    page.js("document.getElementById('max-tokens').value = ''")
    page.js("document.getElementById('prompt').value = 'Now a very long answer please'")
    page.click("#send")
    page.wait("document.querySelectorAll('#log .msg.assistant').length === 3", "the third reply box")
    length = f"({LAST_REPLY}.textContent.length)"
    streaming = f"{LAST_REPLY}.classList.contains('streaming')"
    first = page.wait(f"{streaming} && {length} > 'assistant'.length && {length}", "the long reply to stream")
    # It streams: the same reply grows while it is still streaming.
    page.wait(f"{streaming} && {length} > {first}", "the streamed reply to grow")
    assert page.js("document.getElementById('stop').disabled") is False
    page.click("#stop")
    page.wait(f"{LAST_REPLY}?.dataset.finish === 'stopped'", "the reply to stop")
    assert page.js("document.getElementById('stop').disabled") is True
    assert page.js("document.getElementById('send').disabled") is False
    # The server cancelled it: the status view lists it as cancelled, far short of the context.
    page.wait(f"{status_cell(0, 7)} === 'cancelled'", "the stopped request in the status view", timeout=30)
    out = int(page.js(status_cell(0, 3)))
    assert 0 < out < CTX // 2, out
    time.sleep(0.5)
    page.wait("document.getElementById('stat-active').textContent === '0'", "no live session after the stop")
    assert page.errors == [], page.errors
