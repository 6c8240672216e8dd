// ds4 web page: a chat on the server's own /v1/chat/completions (streamed), and a status view polled from
// /v1/status. No dependencies, no build step. Every text from the model or the server goes into the page through
// textContent, never as HTML. The API key (when the server has one) lives in localStorage and is sent as
// "Authorization: Bearer".
"use strict";

(() => {
  const $ = (id) => document.getElementById(id);
  const KEY_STORE = "ds4.apiKey";
  const POLL_MS = 1000;
  const TIER_LABELS = { device: "device (GPU)", host: "RAM", disk: "disk", remote: "remote" };

  const chat = { messages: [], controller: null, model: "deepseek-v4-flash" };

  function el(tag, cls, text) {
    const e = document.createElement(tag);
    if (cls) e.className = cls;
    if (text !== undefined && text !== null) e.textContent = text;
    return e;
  }

  function headers(json) {
    const h = {};
    if (json) h["Content-Type"] = "application/json";
    const k = $("api-key").value.trim();
    if (k) h["Authorization"] = "Bearer " + k;
    return h;
  }

  function scrollDown() {
    const log = $("log");
    log.scrollTop = log.scrollHeight;
  }

  function addMessage(role) {
    const box = el("div", "msg " + role);
    box.appendChild(el("div", "role", role));
    $("log").appendChild(box);
    scrollDown();
    return box;
  }

  // The data payloads of a text/event-stream body, one string per event.
  async function* sseData(body) {
    const reader = body.getReader();
    const decoder = new TextDecoder();
    let buf = "";
    for (;;) {
      const { value, done } = await reader.read();
      if (done) break;
      buf += decoder.decode(value, { stream: true }).replace(/\r\n/g, "\n");
      let end;
      while ((end = buf.indexOf("\n\n")) >= 0) {
        const block = buf.slice(0, end);
        buf = buf.slice(end + 2);
        const data = block
          .split("\n")
          .filter((l) => l.startsWith("data:"))
          .map((l) => l.slice(5).replace(/^ /, ""))
          .join("\n");
        if (data) yield data;
      }
    }
  }

  // One assistant turn as it streams in: thinking (folded), content, tool calls, in the order they arrive.
  class Reply {
    constructor(box) {
      this.box = box;
      this.reasoning = "";
      this.text = "";
      this.calls = [];
      this.thinkingPre = null;
      this.contentDiv = null;
    }

    think(t) {
      if (!this.thinkingPre) {
        const d = el("details", "thinking");
        d.appendChild(el("summary", null, "Thinking"));
        this.thinkingPre = el("pre");
        d.appendChild(this.thinkingPre);
        this.box.appendChild(d);
      }
      this.reasoning += t;
      this.thinkingPre.textContent = this.reasoning;
    }

    say(t) {
      if (!this.contentDiv) {
        this.contentDiv = el("div", "content");
        this.box.appendChild(this.contentDiv);
      }
      this.text += t;
      this.contentDiv.textContent = this.text;
    }

    tool(delta) {
      const i = Number.isInteger(delta.index) ? delta.index : this.calls.length;
      let call = this.calls[i];
      if (!call) {
        const div = el("div", "tool-call");
        const name = el("div", "tool-name", "tool call");
        const args = el("pre", "tool-args");
        div.append(name, args);
        this.box.appendChild(div);
        call = this.calls[i] = { id: "", name: "", arguments: "", nameEl: name, argsEl: args };
      }
      if (delta.id) call.id = delta.id;
      const f = delta.function || {};
      if (f.name) call.name += f.name;
      if (f.arguments) call.arguments += f.arguments;
      call.nameEl.textContent = "tool call: " + call.name;
      call.argsEl.textContent = call.arguments;
    }

    error(message) {
      this.box.appendChild(el("div", "error", message));
    }

    // The turn as a history message for the next request (null when nothing came back).
    message() {
      const calls = this.calls.filter(Boolean);
      if (!this.text && !calls.length) return null;
      const m = { role: "assistant", content: this.text };
      if (this.reasoning) m.reasoning_content = this.reasoning;
      if (calls.length) {
        m.tool_calls = calls.map((c) => ({ id: c.id, type: "function", function: { name: c.name, arguments: c.arguments } }));
      }
      return m;
    }
  }

  function setBusy(busy) {
    $("send").disabled = busy;
    $("stop").disabled = !busy;
    $("new-chat").disabled = busy;
  }

  async function errorText(res) {
    try {
      const j = await res.json();
      if (j && j.error && j.error.message) return res.status + ": " + j.error.message;
    } catch (_) {
      // not JSON
    }
    return res.status + " " + res.statusText;
  }

  async function send(text) {
    chat.messages.push({ role: "user", content: text });
    addMessage("user").appendChild(el("div", "content", text));
    const box = addMessage("assistant");
    box.classList.add("streaming");
    const reply = new Reply(box);
    const controller = new AbortController();
    chat.controller = controller;
    setBusy(true);
    const body = {
      model: chat.model,
      messages: chat.messages,
      stream: true,
      stream_options: { include_usage: true },
    };
    const max = parseInt($("max-tokens").value, 10);
    if (max > 0) body.max_tokens = max;
    if ($("thinking").checked) body.reasoning_effort = "high";
    let finish = null;
    let usage = null;
    try {
      const res = await fetch("/v1/chat/completions", {
        method: "POST",
        headers: headers(true),
        body: JSON.stringify(body),
        signal: controller.signal,
      });
      if (!res.ok) throw new Error(await errorText(res));
      for await (const data of sseData(res.body)) {
        if (data === "[DONE]") break;
        const chunk = JSON.parse(data);
        if (chunk.usage) usage = chunk.usage;
        for (const c of chunk.choices || []) {
          const d = c.delta || {};
          if (d.reasoning_content) reply.think(d.reasoning_content);
          if (d.content) reply.say(d.content);
          for (const t of d.tool_calls || []) reply.tool(t);
          if (c.finish_reason) finish = c.finish_reason;
        }
        scrollDown();
      }
    } catch (e) {
      if (e.name === "AbortError") {
        finish = "stopped";
      } else {
        finish = "error";
        reply.error(String(e.message || e));
      }
    } finally {
      chat.controller = null;
      setBusy(false);
    }
    box.classList.remove("streaming");
    box.dataset.finish = finish || "stop";
    const meta = [finish === "stopped" ? "stopped" : "finish: " + (finish || "stop")];
    if (usage) {
      const cached = (usage.prompt_tokens_details && usage.prompt_tokens_details.cached_tokens) || 0;
      meta.push(`prompt ${usage.prompt_tokens} (cached ${cached}) · output ${usage.completion_tokens} tokens`);
    }
    box.appendChild(el("div", "meta", meta.join(" · ")));
    const m = reply.message();
    if (m) chat.messages.push(m);
    else if (finish === "error") chat.messages.pop(); // the failed turn leaves the history as it was
    scrollDown();
    pollNow();
  }

  function fmtBytes(n) {
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) {
      n /= 1024;
      i++;
    }
    return (i ? n.toFixed(1) : String(n)) + " " + units[i];
  }

  const fmtNum = (x, digits) => (x === null || x === undefined ? "–" : Number(x).toFixed(digits));

  function fmtUptime(s) {
    s = Math.floor(s);
    const h = Math.floor(s / 3600);
    const m = Math.floor((s % 3600) / 60);
    return (h ? h + " h " : "") + (h || m ? m + " min " : "") + (s % 60) + " s";
  }

  function row(cells) {
    const tr = el("tr");
    for (const c of cells) tr.appendChild(el("td", null, c));
    return tr;
  }

  function renderStatus(s) {
    $("model").textContent = s.model + (s.demo ? " (demo model: random weights)" : "") + " · ctx " + s.context_size;
    chat.model = s.model;
    $("stat-active").textContent = s.sessions.active;
    $("stat-parked").textContent = s.sessions.parked;
    $("stat-queue").textContent = s.queue.waiting + " / " + s.queue.max;
    $("stat-prefill-tps").textContent = fmtNum(s.tokens_per_s.prefill, 1);
    $("stat-decode-tps").textContent = fmtNum(s.tokens_per_s.decode, 1);
    $("stat-requests").textContent = s.totals.requests;
    $("stat-cached").textContent = s.totals.cached_tokens + " of " + s.totals.prompt_tokens;
    $("stat-uptime").textContent = fmtUptime(s.uptime_s);
    const tiers = $("tiers").tBodies[0];
    tiers.replaceChildren(
      ...Object.keys(s.kv_bytes).map((t) =>
        row([TIER_LABELS[t] || t, fmtBytes(s.kv_bytes[t]), String((s.cache_hit_tokens || {})[t] || 0)])
      )
    );
    const recent = $("recent").tBodies[0];
    recent.replaceChildren(
      ...s.recent.map((r) => {
        const tr = row([
          new Date(r.submitted_unix_ms).toLocaleTimeString([], { hour12: false }),
          String(r.prompt_tokens),
          String(r.cached_tokens),
          String(r.output_tokens),
          r.ttft_ms === null ? "–" : fmtNum(r.ttft_ms, 0) + " ms",
          fmtNum(r.queue_ms, 0) + " ms",
          fmtNum(r.decode_tps, 1),
          r.outcome,
        ]);
        tr.dataset.cached = r.cached_tokens;
        tr.dataset.outcome = r.outcome;
        tr.title = r.cached_tokens ? "cached from " + (TIER_LABELS[r.cache_tier] || r.cache_tier) : "no cache hit";
        return tr;
      })
    );
  }

  let pollTimer = null;
  async function poll() {
    clearTimeout(pollTimer);
    try {
      const res = await fetch("/v1/status", { headers: headers(false), cache: "no-store" });
      if (!res.ok) throw new Error(res.status === 401 ? "needs the API key" : await errorText(res));
      renderStatus(await res.json());
      $("status-error").textContent = "";
    } catch (e) {
      $("status-error").textContent = String(e.message || e);
    }
    pollTimer = setTimeout(poll, document.hidden ? POLL_MS * 5 : POLL_MS);
  }
  const pollNow = () => poll();

  function init() {
    const key = $("api-key");
    key.value = localStorage.getItem(KEY_STORE) || "";
    key.addEventListener("change", () => {
      localStorage.setItem(KEY_STORE, key.value.trim());
      pollNow();
    });
    $("composer").addEventListener("submit", (e) => {
      e.preventDefault();
      const text = $("prompt").value;
      if (!text.trim() || chat.controller) return;
      $("prompt").value = "";
      send(text);
    });
    $("prompt").addEventListener("keydown", (e) => {
      if (e.key === "Enter" && !e.shiftKey && !e.isComposing) {
        e.preventDefault();
        $("composer").requestSubmit();
      }
    });
    $("stop").addEventListener("click", () => {
      if (chat.controller) chat.controller.abort();
    });
    $("new-chat").addEventListener("click", () => {
      chat.messages = [];
      $("log").replaceChildren();
    });
    document.addEventListener("visibilitychange", () => {
      if (!document.hidden) pollNow();
    });
    poll();
  }

  init();
})();
