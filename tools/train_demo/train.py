#!/usr/bin/env python3
"""Train a small DeepSeek-V4-architecture model (with one MTP block) on CPU, in JAX, and export it in the official
checkpoint layout (config.json + model.safetensors + tokenizer.json) for `ds4 convert`.

The forward pass is the engine's math (shared/spec/model.md) restricted to what this model uses: every layer has
compress ratio 0 (sliding-window attention with per-head sinks; no compressor/indexer), mHC with Sinkhorn, q LoRA +
per-head unweighted RMSNorm, kv norm, partial interleaved RoPE (plain theta, no YaRN: ratio-0 layers never use it),
inverse RoPE on the attention output, grouped output projection, MoE with sqrt-softplus routing (selection-only bias,
top-k, renormalised, routed scale) or hash routing (first `num_hash_layers` layers), shared expert, clamped SwiGLU,
the mHC head and the output head. The MTP block (`mtp.0.*`) follows the contract in tools/train_demo/README.md.

Modes:
  train.py --out DIR [--minutes N | --steps N]   train, then write DIR/{config.json,model.safetensors,tokenizer.json}
  train.py --fixture DIR                          tiny random model + reference trunk/MTP logits (float64 forward)
  train.py --tokenizer-only DIR                   only write DIR/tokenizer.json
  train.py --eval-ckpt DIR                        held-out loss/accuracy of a saved checkpoint (trunk and MTP)
"""

import argparse
import ast
import json
import math
import os
import random
import sys
import sysconfig
import time

import numpy as np

# ----------------------------------------------------------------------------------------------------------------------
# Tokenizer: byte-level BPE without merges; specials as added tokens.

BOS, EOS, PAD = "<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>", "<｜▁pad▁｜>"
USER, ASSISTANT, THINK, THINK_END = "<｜User｜>", "<｜Assistant｜>", "<think>", "</think>"
# Chat-template tokens the engine's renderer can emit (besides the three above), as in the release's vocabulary.
CHAT_SPECIALS = [USER, ASSISTANT, THINK, THINK_END, "｜DSML｜", "<｜latest_reminder｜>", "<｜action｜>", "<｜query｜>",
                 "<｜authority｜>", "<｜domain｜>", "<｜title｜>", "<｜read_url｜>", "<｜task｜>"]
N_BYTE0 = 3  # byte b has id N_BYTE0 + b


def bytes_to_unicode():
    """GPT-2's byte -> printable character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


DEEPSEEK_V4_PRE_TOKENIZER = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": "\\p{N}{1,3}"}, "behavior": "Isolated", "invert": False},
    {"type": "Split", "pattern": {"Regex": "[\u4e00-\u9fa5\u3040-\u309f\u30a0-\u30ff]+"}, "behavior": "Isolated",
     "invert": False},
    {"type": "Split", "pattern": {"Regex": "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}"
                                           "\\p{S}]?[\\p{L}\\p{M}]+| ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+"},
     "behavior": "Isolated", "invert": False},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}]}


class Tok:
    def __init__(self):
        b2u = bytes_to_unicode()
        self.tokens = [BOS, EOS, PAD] + [b2u[b] for b in range(256)] + CHAT_SPECIALS
        self.special_ids = {s: self.tokens.index(s) for s in [BOS, EOS, PAD] + CHAT_SPECIALS}
        # Longest first, so that no special is matched as a prefix of another.
        self.specials_by_len = sorted(self.special_ids, key=len, reverse=True)

    @property
    def vocab_size(self):
        return len(self.tokens)

    def encode(self, text):
        out, i = [], 0
        while i < len(text):
            for s in self.specials_by_len:
                if text.startswith(s, i):
                    out.append(self.special_ids[s])
                    i += len(s)
                    break
            else:
                j = len(text)
                for s in self.specials_by_len:
                    k = text.find(s, i)
                    if k != -1:
                        j = min(j, k)
                out.extend(N_BYTE0 + b for b in text[i:j].encode("utf-8"))
                i = j
        return out

    def decode(self, ids):
        out, buf = [], bytearray()
        for t in ids:
            if N_BYTE0 <= t < N_BYTE0 + 256:
                buf.append(t - N_BYTE0)
            else:
                out.append(buf.decode("utf-8", "replace"))
                buf = bytearray()
                out.append(self.tokens[t])
        out.append(buf.decode("utf-8", "replace"))
        return "".join(out)

    def tokenizer_json(self):
        added = []
        for i, t in enumerate(self.tokens):
            if t in self.special_ids:
                special = t in (BOS, EOS, PAD)  # as in the release: chat markers are non-special added tokens
                added.append({"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                              "normalized": not special, "special": special})
        return {
            "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
            "normalizer": {"type": "Sequence", "normalizers": []},
            "pre_tokenizer": DEEPSEEK_V4_PRE_TOKENIZER,
            "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False,
                               "use_regex": True},
            "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
            "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                      "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                      "vocab": {t: i for i, t in enumerate(self.tokens)}, "merges": []},
        }


def render_chat(user, answer, reasoning=None):
    """One user turn and the answer, as the engine's renderer writes them (chat mode, or thinking mode with
    `reasoning`)."""
    if reasoning is None:
        return f"{BOS}{USER}{user}{ASSISTANT}{THINK_END}{answer}{EOS}"
    return f"{BOS}{USER}{user}{ASSISTANT}{THINK}{reasoning}{THINK_END}{answer}{EOS}"


# ----------------------------------------------------------------------------------------------------------------------
# Training data: Python standard library docstrings and sources, as chat turns.

def collect_examples(max_chars, seed):
    stdlib = sysconfig.get_paths()["stdlib"]
    files = []
    for root, dirs, names in os.walk(stdlib):
        dirs[:] = sorted(d for d in dirs if d not in ("test", "tests", "idle_test", "site-packages", "__pycache__"))
        files += [os.path.join(root, n) for n in sorted(names) if n.endswith(".py")]
    rng = random.Random(seed)
    ex = []
    for path in files:
        try:
            src = open(path, encoding="utf-8").read()
            tree = ast.parse(src)
        except Exception:
            continue
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            if not doc or not doc.isascii():
                continue
            summary = doc.strip().split("\n")[0].strip()
            if len(summary) < 12 or len(summary) > 120:
                continue
            name = node.name
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            reasoning = None
            if rng.random() < 0.5:
                reasoning = f"The user asks about {summary[0].lower() + summary[1:]}"
            # Prose: the docstring.
            prose = " ".join(doc.split())
            if len(prose) > 40:
                user = rng.choice([f"What does the {kind} {name} do?", f"Explain {name}.", f"Describe {name}.",
                                   f"What is {name}?"])
                text = render_chat(user, prose, reasoning)
                if len(text.encode()) <= max_chars:
                    ex.append(text)
            # Code: the source.
            seg = ast.get_source_segment(src, node)
            if seg and seg.isascii() and isinstance(node, ast.FunctionDef):
                text = render_chat(summary, seg, reasoning)
                if len(text.encode()) <= max_chars:
                    ex.append(text)
    rng.shuffle(ex)
    return ex


def make_batches(tok, texts, seq):
    """[N, seq+1] int32 token rows (one conversation each, padded with PAD) and their loss masks."""
    rows = np.full((len(texts), seq + 1), tok.special_ids[PAD], dtype=np.int32)
    mask = np.zeros((len(texts), seq + 1), dtype=np.float32)
    for i, t in enumerate(texts):
        ids = tok.encode(t)[: seq + 1]
        rows[i, : len(ids)] = ids
        mask[i, : len(ids)] = 1.0
    return rows, mask


# ----------------------------------------------------------------------------------------------------------------------
# The model (official tensor names; params is a dict name -> array).

def model_config(vocab, d, n_layers, heads, head_dim, rope_dim, q_rank, o_groups, o_rank, experts, topk, ffn,
                 n_hash, window, swiglu_limit, mtp=True):
    return {
        "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4",
        "vocab_size": vocab, "hidden_size": d, "num_hidden_layers": n_layers, "num_attention_heads": heads,
        "num_key_value_heads": 1, "head_dim": head_dim, "qk_rope_head_dim": rope_dim, "q_lora_rank": q_rank,
        "o_groups": o_groups, "o_lora_rank": o_rank, "moe_intermediate_size": ffn, "n_routed_experts": experts,
        "n_shared_experts": 1, "num_experts_per_tok": topk, "scoring_func": "sqrtsoftplus",
        "topk_method": "noaux_tc", "norm_topk_prob": True, "routed_scaling_factor": 1.5,
        "swiglu_limit": swiglu_limit, "num_hash_layers": n_hash, "rope_theta": 10000.0,
        "compress_rope_theta": 160000.0,
        # Ratio-0 layers never use YaRN; the engine requires the keys, so Flash's values are written.
        "rope_scaling": {"type": "yarn", "factor": 16.0, "original_max_position_embeddings": 65536, "beta_fast": 32,
                         "beta_slow": 1}, "max_position_embeddings": 4096,
        "sliding_window": window, "index_n_heads": 4, "index_head_dim": 64, "index_topk": 4,
        "compress_ratios": [0] * (n_layers + (1 if mtp else 0)), "hc_mult": 4, "hc_sinkhorn_iters": 20,
        "hc_eps": 1e-06, "num_nextn_predict_layers": 1 if mtp else 0, "rms_norm_eps": 1e-06, "hidden_act": "silu",
        "attention_bias": False, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
        "torch_dtype": "float32",
    }


def block_shapes(c):
    d, hc = c["hidden_size"], c["hc_mult"]
    mix = (2 + hc) * hc
    H, hd = c["num_attention_heads"], c["head_dim"]
    G, R, f, E = c["o_groups"], c["o_lora_rank"], c["moe_intermediate_size"], c["n_routed_experts"]
    s = {
        "hc_attn_fn": (mix, hc * d), "hc_attn_base": (mix,), "hc_attn_scale": (3,),
        "hc_ffn_fn": (mix, hc * d), "hc_ffn_base": (mix,), "hc_ffn_scale": (3,),
        "attn_norm.weight": (d,), "attn.wq_a.weight": (c["q_lora_rank"], d), "attn.q_norm.weight": (c["q_lora_rank"],),
        "attn.wq_b.weight": (H * hd, c["q_lora_rank"]), "attn.wkv.weight": (hd, d), "attn.kv_norm.weight": (hd,),
        "attn.attn_sink": (H,), "attn.wo_a.weight": (G * R, H * hd // G), "attn.wo_b.weight": (d, G * R),
        "ffn_norm.weight": (d,), "ffn.gate.weight": (E, d),
        "ffn.shared_experts.w1.weight": (f, d), "ffn.shared_experts.w3.weight": (f, d),
        "ffn.shared_experts.w2.weight": (d, f),
    }
    for e in range(E):
        s[f"ffn.experts.{e}.w1.weight"] = (f, d)
        s[f"ffn.experts.{e}.w3.weight"] = (f, d)
        s[f"ffn.experts.{e}.w2.weight"] = (d, f)
    return s


def all_shapes(c):
    """Float parameter shapes (official names). Gate biases and tid2eid are buffers (see `buffer_arrays`)."""
    d, hc, V = c["hidden_size"], c["hc_mult"], c["vocab_size"]
    s = {"embed.weight": (V, d), "norm.weight": (d,), "head.weight": (V, d), "hc_head_fn": (hc, hc * d),
         "hc_head_base": (hc,), "hc_head_scale": (1,)}
    for il in range(c["num_hidden_layers"]):
        s.update({f"layers.{il}.{k}": v for k, v in block_shapes(c).items()})
    if c["num_nextn_predict_layers"]:
        s.update({f"mtp.0.{k}": v for k, v in block_shapes(c).items()})
        s.update({"mtp.0.e_proj.weight": (d, d), "mtp.0.h_proj.weight": (d, d), "mtp.0.enorm.weight": (d,),
                  "mtp.0.hnorm.weight": (d,), "mtp.0.norm.weight": (d,), "mtp.0.hc_head_fn": (hc, hc * d),
                  "mtp.0.hc_head_base": (hc,), "mtp.0.hc_head_scale": (1,)})
    return s


def buffer_arrays(c, rng):
    """Selection-only gate biases (learned-routing layers and the MTP block) and hash tables (hash layers)."""
    E, K, V = c["n_routed_experts"], c["num_experts_per_tok"], c["vocab_size"]
    b = {}
    prefixes = [f"layers.{il}." for il in range(c["num_hidden_layers"])]
    if c["num_nextn_predict_layers"]:
        prefixes.append("mtp.0.")
    for i, p in enumerate(prefixes):
        if p.startswith("layers.") and i < c["num_hash_layers"]:
            b[p + "ffn.gate.tid2eid"] = np.stack([rng.permutation(E)[:K] for _ in range(V)]).astype(np.int32)
        else:
            b[p + "ffn.gate.bias"] = np.zeros((E,), np.float32)
    return b


def init_params(c, rng, fixture=False):
    """Training init (or, with `fixture`, a random model whose logits are order 1 and whose mHC is far from
    uniform)."""
    n_layers = c["num_hidden_layers"]
    p = {}
    for name, shape in all_shapes(c).items():
        base = name.split(".", 2)[-1] if name.startswith(("layers.", "mtp.")) else name
        if name.endswith("norm.weight") or base.endswith("_norm.weight"):
            v = np.ones(shape) if not fixture else 1.0 + 0.2 * rng.standard_normal(shape)
        elif base.endswith("_fn"):
            v = rng.standard_normal(shape) * (0.02 if not fixture else 0.3 / math.sqrt(shape[1]) * 3)
        elif base.endswith("_base"):
            v = np.zeros(shape) if not fixture else 0.5 * rng.standard_normal(shape)
        elif base.endswith("_scale"):
            v = np.ones(shape) if not fixture else 0.5 + rng.random(shape)
        elif base == "attn.attn_sink":
            v = np.zeros(shape) if not fixture else rng.standard_normal(shape)
        elif name == "embed.weight":
            v = rng.standard_normal(shape)
        else:
            v = rng.standard_normal(shape) / math.sqrt(shape[1])
            if not fixture and (base.endswith("wo_b.weight") or base.endswith("w2.weight")):
                v = v / math.sqrt(2 * (n_layers + 1))
            if fixture and base.endswith(("w1.weight", "w3.weight")):
                v = v * 2.0  # so that the SwiGLU clamp is exercised
        p[name] = np.asarray(v, np.float32)
    return p


def make_forward(c, jnp, jax):
    d, hc, eps = c["hidden_size"], c["hc_mult"], c["rms_norm_eps"]
    hc_eps, iters = c["hc_eps"], c["hc_sinkhorn_iters"]
    H, hd, rd = c["num_attention_heads"], c["head_dim"], c["qk_rope_head_dim"]
    G, R = c["o_groups"], c["o_lora_rank"]
    E, K, L = c["n_routed_experts"], c["num_experts_per_tok"], c["swiglu_limit"]
    window, rscale = c["sliding_window"], c["routed_scaling_factor"]
    n_layers, n_hash = c["num_hidden_layers"], c["num_hash_layers"]
    theta = c["rope_theta"]

    def rms(x, w=None):
        y = x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
        return y if w is None else y * w

    def hc_pre(X, fn, base, scale):
        """X [B,T,hc,d] -> (u [B,T,d], post [B,T,hc], comb [B,T,hc,hc])."""
        flat = rms(X.reshape(X.shape[:-2] + (hc * d,)))
        mix = flat @ fn.T
        pre = jax.nn.sigmoid(mix[..., :hc] * scale[0] + base[:hc]) + hc_eps
        post = 2.0 * jax.nn.sigmoid(mix[..., hc:2 * hc] * scale[1] + base[hc:2 * hc])
        cm = mix[..., 2 * hc:].reshape(mix.shape[:-1] + (hc, hc)) * scale[2] + base[2 * hc:].reshape(hc, hc)
        comb = jax.nn.softmax(cm, axis=-1) + hc_eps
        comb = comb / (comb.sum(-2, keepdims=True) + hc_eps)
        for _ in range(iters - 1):
            comb = comb / (comb.sum(-1, keepdims=True) + hc_eps)
            comb = comb / (comb.sum(-2, keepdims=True) + hc_eps)
        u = jnp.einsum("btj,btjd->btd", pre, X)
        return u, post, comb

    def hc_post(X, f, post, comb):
        return post[..., None] * f[..., None, :] + jnp.einsum("btjk,btjd->btkd", comb, X)

    def rope(x, pos, sign):
        """Interleaved RoPE on the last rd dims of x [B,T,(H,)hd] at positions pos [T]; sign -1 = inverse."""
        inv = 1.0 / (theta ** (np.arange(0, rd, 2) / rd))
        ang = pos[:, None].astype(x.dtype) * jnp.asarray(inv, x.dtype)  # [T, rd/2]
        if x.ndim == 4:
            ang = ang[:, None, :]
        cos, sin = jnp.cos(ang), sign * jnp.sin(ang)
        nope, r = x[..., :-rd], x[..., -rd:]
        e, o = r[..., 0::2], r[..., 1::2]
        re, ro = e * cos - o * sin, o * cos + e * sin
        r2 = jnp.stack([re, ro], axis=-1).reshape(r.shape)
        return jnp.concatenate([nope, r2], axis=-1)

    def attention(P, pre, x, pos):
        B, T, _ = x.shape
        xn = rms(x, P[pre + "attn_norm.weight"])
        qr = rms(xn @ P[pre + "attn.wq_a.weight"].T, P[pre + "attn.q_norm.weight"])
        q = (qr @ P[pre + "attn.wq_b.weight"].T).reshape(B, T, H, hd)
        q = rms(q)
        kv = rms(xn @ P[pre + "attn.wkv.weight"].T, P[pre + "attn.kv_norm.weight"])
        q, kv = rope(q, pos, 1.0), rope(kv, pos, 1.0)
        s = jnp.einsum("bthd,bsd->bhts", q, kv) * (hd ** -0.5)
        t_i, s_i = np.arange(T)[:, None], np.arange(T)[None, :]
        allowed = (s_i <= t_i) & (s_i > t_i - window)
        s = jnp.where(jnp.asarray(allowed), s, -jnp.inf)
        sink = P[pre + "attn.attn_sink"].reshape(1, H, 1, 1)
        m = jnp.maximum(jnp.max(s, axis=-1, keepdims=True), sink)
        m = jax.lax.stop_gradient(m)
        ex = jnp.exp(s - m)
        p = ex / (ex.sum(-1, keepdims=True) + jnp.exp(sink - m))
        o = jnp.einsum("bhts,bsd->bthd", p, kv)
        o = rope(o, pos, -1.0)
        og = o.reshape(B, T, G, H * hd // G)
        wa = P[pre + "attn.wo_a.weight"].reshape(G, R, H * hd // G)
        y = jnp.einsum("btgi,gri->btgr", og, wa).reshape(B, T, G * R)
        return y @ P[pre + "attn.wo_b.weight"].T

    def swiglu(x, w1, w3, w2):
        g = jnp.minimum(x @ w1.T, L)
        u = jnp.clip(x @ w3.T, -L, L)
        return (jax.nn.silu(g) * u) @ w2.T

    def moe(P, Bf, pre, x, tokens, hash_layer):
        xn = rms(x, P[pre + "ffn_norm.weight"])
        s = jnp.sqrt(jax.nn.softplus(xn @ P[pre + "ffn.gate.weight"].T))  # [B,T,E]
        if hash_layer:
            sel = jnp.asarray(Bf[pre + "ffn.gate.tid2eid"])[tokens]  # [B,T,K]
        else:
            _, sel = jax.lax.top_k(jax.lax.stop_gradient(s) + Bf[pre + "ffn.gate.bias"], K)
        onehot = jax.nn.one_hot(sel, E, dtype=s.dtype).sum(-2)  # [B,T,E]
        w = s * onehot
        w = w / (w.sum(-1, keepdims=True) + 1e-20) * rscale
        w1 = jnp.stack([P[f"{pre}ffn.experts.{e}.w1.weight"] for e in range(E)])
        w3 = jnp.stack([P[f"{pre}ffn.experts.{e}.w3.weight"] for e in range(E)])
        w2 = jnp.stack([P[f"{pre}ffn.experts.{e}.w2.weight"] for e in range(E)])
        g = jnp.minimum(jnp.einsum("btd,efd->btef", xn, w1), L)
        u = jnp.clip(jnp.einsum("btd,efd->btef", xn, w3), -L, L)
        h = jax.nn.silu(g) * u * w[..., None]
        routed = jnp.einsum("btef,edf->btd", h, w2)
        shared = swiglu(xn, P[pre + "ffn.shared_experts.w1.weight"], P[pre + "ffn.shared_experts.w3.weight"],
                        P[pre + "ffn.shared_experts.w2.weight"])
        return routed + shared, onehot

    def block(P, Bf, pre, X, tokens, pos, hash_layer):
        u, post, comb = hc_pre(X, P[pre + "hc_attn_fn"], P[pre + "hc_attn_base"], P[pre + "hc_attn_scale"])
        X = hc_post(X, attention(P, pre, u, pos), post, comb)
        u, post, comb = hc_pre(X, P[pre + "hc_ffn_fn"], P[pre + "hc_ffn_base"], P[pre + "hc_ffn_scale"])
        f, load = moe(P, Bf, pre, u, tokens, hash_layer)
        return hc_post(X, f, post, comb), load

    def head(P, pre, X):
        flat = rms(X.reshape(X.shape[:-2] + (hc * d,)))
        mix = flat @ P[pre + "hc_head_fn"].T
        w = jax.nn.sigmoid(mix * P[pre + "hc_head_scale"] + P[pre + "hc_head_base"]) + hc_eps
        y = jnp.einsum("btj,btjd->btd", w, X)
        norm = P["mtp.0.norm.weight"] if pre == "mtp.0." else P["norm.weight"]
        return rms(y, norm) @ P["head.weight"].T

    def forward(P, Bf, tokens, mtp_grad_to_trunk=False):
        """tokens [B,T] -> (trunk logits [B,T,V], MTP logits [B,T,V] or None, expert loads {prefix: [E]})."""
        B, T = tokens.shape
        pos = jnp.arange(T)
        emb = P["embed.weight"][tokens]
        X = jnp.broadcast_to(emb[:, :, None, :], (B, T, hc, d))
        loads = {}
        for il in range(n_layers):
            pre = f"layers.{il}."
            X, load = block(P, Bf, pre, X, tokens, pos, il < n_hash)
            if il >= n_hash:
                loads[pre] = load.reshape(-1, E).mean(0)
        trunk = head(P, "", X)
        if not c["num_nextn_predict_layers"]:
            return trunk, None, loads
        Hs = X if mtp_grad_to_trunk else jax.lax.stop_gradient(X)
        Hprev = jnp.concatenate([jnp.zeros_like(Hs[:, :1]), Hs[:, :-1]], axis=1)
        e = rms(emb, P["mtp.0.enorm.weight"]) @ P["mtp.0.e_proj.weight"].T
        h = rms(Hprev, P["mtp.0.hnorm.weight"]) @ P["mtp.0.h_proj.weight"].T
        Xm = e[:, :, None, :] + h
        Y, load = block(P, Bf, "mtp.0.", Xm, tokens, pos, False)
        loads["mtp.0."] = load.reshape(-1, E).mean(0)
        return trunk, head(P, "mtp.0.", Y), loads

    # The building blocks, for other forwards of the same architecture (tools/train_demo/dspark_ref.py).
    forward.parts = {"rms": rms, "hc_pre": hc_pre, "hc_post": hc_post, "rope": rope, "attention": attention,
                     "swiglu": swiglu, "moe": moe, "block": block, "head": head}
    return forward


# ----------------------------------------------------------------------------------------------------------------------
# Export.

def save_checkpoint(out, c, params, buffers, tok=None):
    from safetensors.numpy import save_file
    os.makedirs(out, exist_ok=True)
    tensors = {k: np.ascontiguousarray(np.asarray(v, np.float32)) for k, v in params.items()}
    for k, v in buffers.items():
        tensors[k] = np.ascontiguousarray(np.asarray(v, np.int32 if k.endswith("tid2eid") else np.float32))
    save_file(tensors, os.path.join(out, "model.safetensors"))
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(c, f, indent=1)
    if tok is not None:
        with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(tok.tokenizer_json(), f, ensure_ascii=False)


# ----------------------------------------------------------------------------------------------------------------------
# Fixture: tiny random model + float64 reference logits.

def fixture(out, seed):
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    c = model_config(vocab=288, d=64, n_layers=2, heads=2, head_dim=32, rope_dim=8, q_rank=32, o_groups=2, o_rank=16,
                     experts=4, topk=2, ffn=32, n_hash=1, window=8, swiglu_limit=1.0)
    T = 20
    for s in range(seed, seed + 200):
        rng = np.random.default_rng(s)
        params = init_params(c, rng, fixture=True)
        buffers = buffer_arrays(c, rng)
        for k in buffers:
            if k.endswith(".bias"):
                buffers[k] = (0.1 * rng.standard_normal(buffers[k].shape)).astype(np.float32)
        tokens = np.concatenate([[0], rng.integers(2, c["vocab_size"], T - 1)]).astype(np.int32)
        P = {k: jnp.asarray(v.astype(np.float64)) for k, v in params.items()}
        Bf = {k: (jnp.asarray(v.astype(np.float64)) if v.dtype == np.float32 else v) for k, v in buffers.items()}
        fwd = make_forward(c, jnp, jax)
        trunk, mtp, _ = fwd(P, Bf, jnp.asarray(tokens)[None])
        # Router margins (learned layers): the gap between the k-th and (k+1)-th biased score must be clear of f32
        # rounding, or the engine may legitimately select other experts.
        margin = route_margin(c, P, Bf, tokens, jnp, jax)
        if margin > 1e-3:
            break
    trunk, mtp = np.asarray(trunk[0], np.float32), np.asarray(mtp[0], np.float32)
    os.makedirs(out, exist_ok=True)
    save_checkpoint(out, c, params, buffers)
    trunk.astype("<f4").tofile(os.path.join(out, "trunk_logits.f32"))
    mtp.astype("<f4").tofile(os.path.join(out, "mtp_logits.f32"))
    meta = {"generator": "tools/train_demo/train.py --fixture (JAX, float64 forward of f32 weights)", "seed": int(s),
            "tokens": tokens.tolist(), "vocab_size": c["vocab_size"], "n_tokens": T,
            "trunk_logits": {"file": "trunk_logits.f32", "shape": [T, c["vocab_size"]]},
            "mtp_logits": {"file": "mtp_logits.f32", "shape": [T, c["vocab_size"]],
                           "definition": "MTP logits at every position q: input token tokens[q], Hprev = trunk final "
                                         "streams at q-1 (zeros at q = 0), MTP attention over positions <= q in "
                                         "the window, RoPE at q; predicts tokens[q+1]"},
            "router_margin_min": float(margin),
            "logit_std": {"trunk": float(trunk.std()), "mtp": float(mtp.std())}}
    with open(os.path.join(out, "fixture.json"), "w") as f:
        json.dump(meta, f, indent=1)
    print(json.dumps({k: meta[k] for k in ("seed", "router_margin_min", "logit_std")}))


def route_margin(c, P, Bf, tokens, jnp, jax):
    """Smallest gap between the k-th and (k+1)-th biased router score over learned layers and positions (trunk
    layers re-run here through a hook: recompute with a forward that records the scores)."""
    recorded = []
    K = c["num_experts_per_tok"]
    real_top_k = jax.lax.top_k

    def spy(x, k):
        v = np.sort(np.asarray(x), axis=-1)[..., ::-1]
        recorded.append(float((v[..., k - 1] - v[..., k]).min()))
        return real_top_k(x, k)

    jax.lax.top_k = spy
    try:
        make_forward(c, jnp, jax)(P, Bf, jnp.asarray(tokens)[None])
    finally:
        jax.lax.top_k = real_top_k
    assert K < c["n_routed_experts"]
    return min(recorded) if recorded else 1.0


# ----------------------------------------------------------------------------------------------------------------------
# Training.

def train(args):
    import jax
    import jax.numpy as jnp
    tok = Tok()
    seq = args.seq
    c = model_config(vocab=tok.vocab_size, d=args.dim, n_layers=args.layers, heads=args.heads, head_dim=args.head_dim,
                     rope_dim=args.rope_dim, q_rank=args.q_rank, o_groups=args.o_groups, o_rank=args.o_rank,
                     experts=args.experts, topk=args.topk, ffn=args.ffn, n_hash=args.hash_layers, window=seq,
                     swiglu_limit=10.0)
    texts = collect_examples(max_chars=int(seq * 1.5), seed=args.seed)
    n_eval = max(64, len(texts) // 50)
    eval_texts, train_texts = texts[:n_eval], texts[n_eval:]
    tr_rows, tr_mask = make_batches(tok, train_texts, seq)
    ev_rows, ev_mask = make_batches(tok, eval_texts[: 256], seq)
    n_tok = int(tr_mask.sum())
    print(f"data: {len(train_texts)} train / {len(eval_texts)} held-out conversations, {n_tok} train tokens, "
          f"seq {seq}", flush=True)
    rng = np.random.default_rng(args.seed)
    params = {k: jnp.asarray(v) for k, v in init_params(c, rng).items()}
    buffers_np = buffer_arrays(c, rng)
    tid = {k: v for k, v in buffers_np.items() if k.endswith("tid2eid")}
    biases = {k: jnp.asarray(v) for k, v in buffers_np.items() if k.endswith(".bias")}
    n_params = sum(int(np.prod(v.shape)) for v in params.values())
    print(f"params: {n_params} ({n_params / 1e6:.2f} M), config: " + json.dumps(
        {k: c[k] for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "head_dim", "qk_rope_head_dim",
                           "n_routed_experts", "num_experts_per_tok", "moe_intermediate_size", "sliding_window")}),
          flush=True)
    fwd = make_forward(c, jnp, jax)

    def ce(logits, targets, mask):
        lp = jax.nn.log_softmax(logits, axis=-1)
        nll = -jnp.take_along_axis(lp, targets[..., None], axis=-1)[..., 0]
        return (nll * mask).sum() / jnp.maximum(mask.sum(), 1.0)

    def loss_fn(P, biases, rows, mask):
        inp, tgt, m = rows[:, :-1], rows[:, 1:], mask[:, 1:]
        trunk, mtp, loads = fwd(P, {**biases, **tid}, inp)
        lt, lm = ce(trunk, tgt, m), ce(mtp, tgt, m)
        return lt + args.mtp_weight * lm, (lt, lm, loads)

    b1, b2, adam_eps = 0.9, 0.95, 1e-8

    @jax.jit
    def step(P, opt, biases, rows, mask, lr, t):
        (loss, (lt, lm, loads)), g = jax.value_and_grad(loss_fn, has_aux=True)(P, biases, rows, mask)
        gnorm = jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree_util.tree_leaves(g)))
        clip = jnp.minimum(1.0, args.clip / (gnorm + 1e-6))
        m, v = opt
        m = jax.tree_util.tree_map(lambda a, b: b1 * a + (1 - b1) * b * clip, m, g)
        v = jax.tree_util.tree_map(lambda a, b: b2 * a + (1 - b2) * (b * clip) ** 2, v, g)
        mh, vh = 1 - b1 ** t, 1 - b2 ** t
        P = jax.tree_util.tree_map(lambda p, a, b: p - lr * (a / mh) / (jnp.sqrt(b / vh) + adam_eps), P, m, v)
        # Auxiliary-loss-free balancing: nudge the selection-only bias towards under-loaded experts.
        biases = {k: biases[k] - args.bias_rate * jnp.sign(loads[k[: -len("ffn.gate.bias")]] -
                                                           loads[k[: -len("ffn.gate.bias")]].mean())
                  for k in biases}
        return P, (m, v), biases, lt, lm, gnorm

    @jax.jit
    def evaluate(P, biases, rows, mask):
        _, (lt, lm, _) = loss_fn(P, biases, rows, mask)
        return lt, lm

    def eval_all(P, biases):
        tot_t = tot_m = 0.0
        n = 0
        for i in range(0, len(ev_rows), args.batch):
            r, mk = ev_rows[i:i + args.batch], ev_mask[i:i + args.batch]
            if len(r) < args.batch:
                break
            lt, lm = evaluate(P, biases, jnp.asarray(r), jnp.asarray(mk))
            tot_t, tot_m, n = tot_t + float(lt), tot_m + float(lm), n + 1
        return tot_t / n, tot_m / n

    zeros = jax.tree_util.tree_map(jnp.zeros_like, params)
    opt = (zeros, jax.tree_util.tree_map(jnp.zeros_like, params))
    budget = args.minutes * 60.0
    t0 = time.time()
    order = rng.permutation(len(tr_rows))
    pos = 0
    it = 0
    ema = None
    while True:
        elapsed = time.time() - t0
        frac = max(elapsed / budget if budget > 0 else 0.0, it / args.steps if args.steps > 0 else 0.0)
        if frac >= 1.0:
            break
        warm = min(1.0, (it + 1) / args.warmup)
        lr = args.lr * warm * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        if pos + args.batch > len(order):
            order, pos = rng.permutation(len(tr_rows)), 0
        idx = order[pos:pos + args.batch]
        pos += args.batch
        it += 1
        params, opt, biases, lt, lm, gn = step(params, opt, biases, jnp.asarray(tr_rows[idx]),
                                               jnp.asarray(tr_mask[idx]), lr, float(it))
        lt, lm = float(lt), float(lm)
        ema = (lt, lm) if ema is None else (0.95 * ema[0] + 0.05 * lt, 0.95 * ema[1] + 0.05 * lm)
        if it % args.log_every == 0 or it == 1:
            print(f"step {it:5d}  {time.time() - t0:7.1f}s  lr {lr:.2e}  loss trunk {lt:.3f} mtp {lm:.3f}  "
                  f"(ema {ema[0]:.3f} / {ema[1]:.3f})  |g| {float(gn):.2f}", flush=True)
        if args.eval_every and it % args.eval_every == 0:
            et, em = eval_all(params, biases)
            print(f"eval  step {it}: held-out loss trunk {et:.3f} mtp {em:.3f}", flush=True)
    wall = time.time() - t0
    et, em = eval_all(params, biases)
    summary = {"steps": it, "train_wall_s": round(wall, 1), "train_loss_trunk_ema": round(ema[0], 4),
               "train_loss_mtp_ema": round(ema[1], 4), "heldout_loss_trunk": round(et, 4),
               "heldout_loss_mtp": round(em, 4), "tokens_seen": int(it * args.batch * seq),
               "params": n_params}
    print("final: " + json.dumps(summary), flush=True)
    save_checkpoint(args.out, c, {k: np.asarray(v) for k, v in params.items()},
                    {**tid, **{k: np.asarray(v) for k, v in biases.items()}}, tok)
    with open(os.path.join(args.out, "train_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    sample(c, fwd, params, {**biases, **tid}, tok, jnp)


def sample(c, fwd, P, Bf, tok, jnp, prompts=("What does the function join do?", "Return the number of items.")):
    """Greedy continuations from the JAX model (a quick look; the engine is the real check)."""
    import jax
    W = c["sliding_window"]
    logits_at = jax.jit(lambda P, x, n: fwd(P, Bf, x)[0][0, n])
    for u in prompts:
        ids = tok.encode(f"{BOS}{USER}{u}{ASSISTANT}{THINK_END}")
        n0 = len(ids)
        while len(ids) < min(n0 + 120, W):
            x = np.full((1, W), tok.special_ids[PAD], np.int32)
            x[0, : len(ids)] = ids
            nxt = int(jnp.argmax(logits_at(P, jnp.asarray(x), len(ids) - 1)))
            ids.append(nxt)
            if nxt == tok.special_ids[EOS]:
                break
        print(f"sample: {u!r} -> {tok.decode(ids[n0:])!r}", flush=True)


def eval_checkpoint(ckpt, seed, seq, batch):
    """Held-out trunk/MTP loss and top-1 accuracy of a saved checkpoint, and how often the MTP's top-1 at q equals the
    trunk's top-1 at q (what greedy self-speculation with the MTP block would accept, to first order)."""
    import jax
    import jax.numpy as jnp
    from safetensors.numpy import load_file
    c = json.load(open(os.path.join(ckpt, "config.json")))
    t = load_file(os.path.join(ckpt, "model.safetensors"))
    P = {k: jnp.asarray(v) for k, v in t.items() if not k.endswith(("tid2eid", "gate.bias"))}
    Bf = {k: (v if k.endswith("tid2eid") else jnp.asarray(v)) for k, v in t.items()
          if k.endswith(("tid2eid", "gate.bias"))}
    tok = Tok()
    texts = collect_examples(max_chars=int(seq * 1.5), seed=seed)
    n_eval = max(64, len(texts) // 50)
    rows, mask = make_batches(tok, texts[:n_eval][:256], seq)
    fwd = jax.jit(make_forward(c, jnp, jax), static_argnums=())
    tot = {"nll_trunk": 0.0, "nll_mtp": 0.0, "acc_trunk": 0.0, "acc_mtp": 0.0, "mtp_agrees_with_trunk": 0.0}
    n = 0.0
    for i in range(0, len(rows) - batch + 1, batch):
        r, m = rows[i:i + batch], mask[i:i + batch, 1:]
        trunk, mtp, _ = fwd(P, Bf, jnp.asarray(r[:, :-1]))
        tgt = r[:, 1:]
        for name, lg in (("trunk", trunk), ("mtp", mtp)):
            lp = np.asarray(jax.nn.log_softmax(lg, -1))
            tot["nll_" + name] += float((-np.take_along_axis(lp, tgt[..., None], -1)[..., 0] * m).sum())
            tot["acc_" + name] += float(((lp.argmax(-1) == tgt) * m).sum())
        tot["mtp_agrees_with_trunk"] += float(((np.asarray(trunk).argmax(-1) == np.asarray(mtp).argmax(-1)) * m).sum())
        n += float(m.sum())
    out = {k: round(v / n, 4) for k, v in tot.items()}
    out["tokens"] = int(n)
    print(json.dumps(out), flush=True)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="out/demo-ckpt")
    ap.add_argument("--fixture", metavar="DIR")
    ap.add_argument("--tokenizer-only", metavar="DIR")
    ap.add_argument("--eval-ckpt", metavar="DIR", help="held-out losses/accuracies of a saved checkpoint")
    ap.add_argument("--minutes", type=float, default=40.0)
    ap.add_argument("--steps", type=int, default=0, help="stop after N steps (0: only the time limit)")
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--seq", type=int, default=256, help="sequence length = sliding window")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--mtp-weight", type=float, default=0.3)
    ap.add_argument("--bias-rate", type=float, default=1e-3)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--rope-dim", type=int, default=16)
    ap.add_argument("--q-rank", type=int, default=64)
    ap.add_argument("--o-groups", type=int, default=2)
    ap.add_argument("--o-rank", type=int, default=64)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--topk", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--hash-layers", type=int, default=1)
    args = ap.parse_args()
    if args.fixture:
        fixture(args.fixture, args.seed)
    elif args.eval_ckpt:
        eval_checkpoint(args.eval_ckpt, args.seed, args.seq, args.batch)
    elif args.tokenizer_only:
        os.makedirs(args.tokenizer_only, exist_ok=True)
        with open(os.path.join(args.tokenizer_only, "tokenizer.json"), "w", encoding="utf-8") as f:
            json.dump(Tok().tokenizer_json(), f, ensure_ascii=False)
    else:
        if args.steps > 0 and "--minutes" not in sys.argv:
            args.minutes = 0
        train(args)


if __name__ == "__main__":
    main()
