#!/usr/bin/env python3
"""Reference forward of the DSpark drafter of DeepSeek-V4-Flash-0731 (JAX, float64 math on f32 weights), and the
tiny test fixture `engine/tests/data/dspark-tiny/` the engine's drafter is checked against.

The math is /work/notes/dspark-spec.md, followed literally (the contract the Rust implementation follows too):

1. target features f_t = concat_j mean_over_hc(H^(l_j)_t), H^(l) the trunk's mHC streams after layer l (after its FFN
   post-mix), l_j the `dspark_target_layer_ids`;
2. context rows c_t = RMSNorm(main_proj . f_t) * main_norm; per stage s, K_s[t] = RoPE_t(RMSNorm(wkv_s . c_t) *
   kv_norm_s) (no attn_norm, no mHC on the context rows);
3. the block at anchor a: ids [x_a, m, ..., m] at positions a..a+B-1, embedded and repeated over the hc streams, through
   every stage (the trunk's block recipe, ratio 0, learned routing + shared expert) whose attention lets every block
   row see the context rows K_s[t], t in max(0, a-W)..a-1, followed by the B block rows' own KV (RoPE at a+i), with
   no mask (bidirectional inside the block), per-head sinks, scale 1/sqrt(head_dim), inverse RoPE at a+i;
4. x_post_i = the mHC head collapse of the last stage's streams (its hc_head_*), base_i = head . (RMSNorm(x_post_i) *
   norm_{S-1});
5. Markov head: prev_0 = x_a, z_i = base_i + markov_w2 . markov_w1[prev_i], d_i = argmax z_i (ties: lowest id),
   prev_{i+1} = d_i;
6. confidence c_i = sigmoid(proj . [x_post_i ; markov_w1[prev_i]]).

The trunk's building blocks (RMSNorm, mHC pre/post mix, RoPE, MoE, block, head) are train.py's `make_forward` ones.

  dspark_ref.py --dspark-fixture DIR [--seed N]   tiny random 0731-style checkpoint + reference drafter outputs
  dspark_ref.py --check                           only the self-checks (numpy loops, bidirectionality, causality)
"""

import argparse
import contextlib
import json
import math
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import train  # noqa: E402

GENERATOR = "python3 tools/train_demo/dspark_ref.py --dspark-fixture engine/tests/data/dspark-tiny"
ANCHORS = [1, 4, 9, 13, 19]


# ----------------------------------------------------------------------------------------------------------------------
# Config and parameters.

def tiny_config():
    """mtp-tiny's trunk shape with 3 layers (layer 0 hash-routed) and a 3-stage drafter (block 4, rank 16). The
    expert width is 16 (mtp-tiny: 32) so that six blocks fit the fixture's size budget."""
    c = train.model_config(vocab=288, d=64, n_layers=3, heads=2, head_dim=32, rope_dim=8, q_rank=32, o_groups=2,
                           o_rank=16, experts=4, topk=2, ffn=16, n_hash=1, window=8, swiglu_limit=1.0, mtp=False)
    c["num_nextn_predict_layers"] = 3
    c["compress_ratios"] = [0] * (c["num_hidden_layers"] + 3)
    c["dspark_block_size"] = 4
    c["dspark_noise_token_id"] = c["vocab_size"] - 1
    c["dspark_target_layer_ids"] = [0, 1, 2]
    c["dspark_markov_rank"] = 16
    return c


def trunk_config(c):
    """The config train.py's init/buffers see: the trunk only (no April MTP block)."""
    return dict(c, num_nextn_predict_layers=0)


def n_stages(c):
    return len(c["dspark_target_layer_ids"])


def stage_shapes(c):
    """Official names and shapes of the drafter's tensors (float parameters; gate biases are buffers)."""
    d, hc, V, r = c["hidden_size"], c["hc_mult"], c["vocab_size"], c["dspark_markov_rank"]
    S = n_stages(c)
    s = {}
    for st in range(S):
        p = f"mtp.{st}."
        s.update({p + k: v for k, v in train.block_shapes(c).items()})
        if st == 0:
            s[p + "main_proj.weight"] = (d, S * d)
            s[p + "main_norm.weight"] = (d,)
        if st == S - 1:
            s[p + "norm.weight"] = (d,)
            s[p + "hc_head_fn"] = (hc, hc * d)
            s[p + "hc_head_base"] = (hc,)
            s[p + "hc_head_scale"] = (1,)
            s[p + "markov_head.markov_w1.weight"] = (V, r)
            s[p + "markov_head.markov_w2.weight"] = (V, r)
            s[p + "confidence_head.proj.weight"] = (1, d + r)
    return s


def init_stage_params(c, rng):
    """Random drafter weights of sensible scale: norms 1 +- 0.1, projections N(0, 1/fan_in) (expert w1/w3 doubled, as
    the trunk's fixture weights, so that the SwiGLU clamp matters), mHC parameters as the trunk's fixture ones, sinks
    N(0, 0.3^2), Markov tables N(0, 0.3^2), confidence projection N(0, 1/(d+r)); gate biases N(0, 0.1^2)."""
    p, b = {}, {}
    for name, shape in stage_shapes(c).items():
        base = name.split(".", 2)[-1]
        if base.endswith("norm.weight"):
            v = 1.0 + 0.1 * rng.standard_normal(shape)
        elif base.endswith("_fn"):
            v = rng.standard_normal(shape) * (0.3 / math.sqrt(shape[1]) * 3)
        elif base.endswith("_base"):
            v = 0.5 * rng.standard_normal(shape)
        elif base.endswith("_scale"):
            v = 0.5 + rng.random(shape)
        elif base == "attn.attn_sink":
            v = 0.3 * rng.standard_normal(shape)
        elif base.startswith("markov_head."):
            v = 0.3 * rng.standard_normal(shape)
        else:  # projections, confidence_head.proj included (fan_in d + r)
            v = rng.standard_normal(shape) / math.sqrt(shape[1])
            if base.endswith(("w1.weight", "w3.weight")):
                v = v * 2.0
        p[name] = np.asarray(v, np.float32)
    for st in range(n_stages(c)):
        b[f"mtp.{st}.ffn.gate.bias"] = (0.1 * rng.standard_normal((c["n_routed_experts"],))).astype(np.float32)
    return p, b


# ----------------------------------------------------------------------------------------------------------------------
# The forward.

def make_dspark(c, jnp, jax):
    """Returns (trunk, features, draft) closures over the config (see the module docstring for the math)."""
    parts = train.make_forward(c, jnp, jax).parts
    rms, hc_pre, hc_post, rope = parts["rms"], parts["hc_pre"], parts["hc_post"], parts["rope"]
    moe, block, head = parts["moe"], parts["block"], parts["head"]
    d, hc, hc_eps = c["hidden_size"], c["hc_mult"], c["hc_eps"]
    H, hd, G, R = c["num_attention_heads"], c["head_dim"], c["o_groups"], c["o_lora_rank"]
    W, V = c["sliding_window"], c["vocab_size"]
    n_layers, n_hash = c["num_hidden_layers"], c["num_hash_layers"]
    Bk, m, L = c["dspark_block_size"], c["dspark_noise_token_id"], c["dspark_target_layer_ids"]
    S = n_stages(c)
    last = f"mtp.{S - 1}."

    def trunk(P, Bf, tokens):
        """tokens [T] -> (trunk logits [T, V], the streams after every layer: list of [T, hc, d])."""
        tokens = jnp.asarray(tokens)[None]
        T = tokens.shape[1]
        pos = jnp.arange(T)
        X = jnp.broadcast_to(P["embed.weight"][tokens][:, :, None, :], (1, T, hc, d))
        streams = []
        for il in range(n_layers):
            X, _ = block(P, Bf, f"layers.{il}.", X, tokens, pos, il < n_hash)
            streams.append(X[0])
        return head(P, "", X)[0], streams

    def features(streams):
        """f [T, k*d]: the mean over the hc streams after each target layer, concatenated in layer-id order."""
        return jnp.concatenate([streams[l].mean(axis=1) for l in L], axis=-1)

    def context_keys(P, f):
        """K_s [T, hd] for every stage s (RoPE at the row's own position t)."""
        ctx = rms(f @ P["mtp.0.main_proj.weight"].T, P["mtp.0.main_norm.weight"])  # [T, d]
        pos = jnp.arange(f.shape[0])
        return [rope(rms(ctx @ P[f"mtp.{s}.attn.wkv.weight"].T, P[f"mtp.{s}.attn.kv_norm.weight"])[None], pos,
                     1.0)[0] for s in range(S)]

    def stage_attention(P, pre, u, Kctx, a):
        """u [1, B, d] (the block rows after the mHC pre-mix), Kctx [n, hd] (the context rows a-n..a-1, RoPE'd) ->
        [1, B, d]. Every block row attends to all of Kctx and all block rows."""
        nb = u.shape[1]
        pos = a + jnp.arange(nb)
        xn = rms(u, P[pre + "attn_norm.weight"])
        qr = rms(xn @ P[pre + "attn.wq_a.weight"].T, P[pre + "attn.q_norm.weight"])
        q = rms((qr @ P[pre + "attn.wq_b.weight"].T).reshape(1, nb, H, hd))
        kb = rms(xn @ P[pre + "attn.wkv.weight"].T, P[pre + "attn.kv_norm.weight"])
        q, kb = rope(q, pos, 1.0), rope(kb, pos, 1.0)
        kv = jnp.concatenate([Kctx[None], kb], axis=1)  # [1, n + B, hd]
        s = jnp.einsum("bthd,bsd->bhts", q, kv) * (hd ** -0.5)
        sink = P[pre + "attn.attn_sink"].reshape(1, H, 1, 1)
        mx = jnp.maximum(jnp.max(s, axis=-1, keepdims=True), sink)
        ex = jnp.exp(s - mx)
        p = ex / (ex.sum(-1, keepdims=True) + jnp.exp(sink - mx))
        o = rope(jnp.einsum("bhts,bsd->bthd", p, kv), pos, -1.0)
        og = o.reshape(1, nb, G, H * hd // G)
        wa = P[pre + "attn.wo_a.weight"].reshape(G, R, H * hd // G)
        y = jnp.einsum("btgi,gri->btgr", og, wa).reshape(1, nb, G * R)
        return y @ P[pre + "attn.wo_b.weight"].T

    def stage(P, Bf, pre, X, Kctx, a, trace=None):
        u, post, comb = hc_pre(X, P[pre + "hc_attn_fn"], P[pre + "hc_attn_base"], P[pre + "hc_attn_scale"])
        if trace is not None:
            trace.append((pre, u, Kctx))
        X = hc_post(X, stage_attention(P, pre, u, Kctx, a), post, comb)
        u, post, comb = hc_pre(X, P[pre + "hc_ffn_fn"], P[pre + "hc_ffn_base"], P[pre + "hc_ffn_scale"])
        f, _ = moe(P, Bf, pre, u, None, False)  # learned routing (tokens unused)
        return hc_post(X, f, post, comb)

    def draft(P, Bf, f, a, x_a, ids=None, trace=None):
        """The block at anchor a (the target has processed 0..a-1; f holds at least rows 0..a-1) with anchor token
        x_a. `ids` overrides the block ids (checks only). Returns a dict of numpy arrays."""
        assert a >= 1
        if ids is None:
            ids = [int(x_a)] + [m] * (Bk - 1)
        Ks = context_keys(P, f[:a])
        lo = max(0, a - W)
        X = jnp.broadcast_to(P["embed.weight"][jnp.asarray(ids)][None, :, None, :], (1, Bk, hc, d))
        for s in range(S):
            X = stage(P, Bf, f"mtp.{s}.", X, Ks[s][lo:a], a, trace)
        flat = rms(X.reshape(1, Bk, hc * d))
        w = jax.nn.sigmoid(flat @ P[last + "hc_head_fn"].T * P[last + "hc_head_scale"] + P[last + "hc_head_base"])
        x_post = jnp.einsum("btj,btjd->btd", w + hc_eps, X)[0]  # [B, d]
        base = rms(x_post, P[last + "norm.weight"]) @ P["head.weight"].T  # [B, V]
        w1, w2 = P[last + "markov_head.markov_w1.weight"], P[last + "markov_head.markov_w2.weight"]
        proj = P[last + "confidence_head.proj.weight"]
        prev, z, conf, drafts = int(x_a), [], [], []
        for i in range(Bk):
            zi = base[i] + w2 @ w1[prev]
            ci = jax.nn.sigmoid(proj @ jnp.concatenate([x_post[i], w1[prev]]))[0]
            di = int(np.argmax(np.asarray(zi)))  # first maximum: ties go to the lowest id
            z.append(zi), conf.append(ci), drafts.append(di)
            prev = di
        return {"x_post": np.asarray(x_post), "base_logits": np.asarray(base), "markov_logits": np.asarray(jnp.stack(z)),
                "confidence": np.asarray(jnp.stack(conf)), "drafts": drafts}

    return trunk, features, draft, stage_attention, context_keys


@contextlib.contextmanager
def record_router_margins(jax, out):
    """Appends to `out` the gap between the k-th and (k+1)-th biased router score of every learned-routing choice
    made inside the block (train.py's MoE calls jax.lax.top_k for those; hash layers do not)."""
    real = jax.lax.top_k

    def spy(x, k):
        v = np.sort(np.asarray(x), axis=-1)[..., ::-1]
        out.append(float((v[..., k - 1] - v[..., k]).min()))
        return real(x, k)

    jax.lax.top_k = spy
    try:
        yield
    finally:
        jax.lax.top_k = real


def top2_gap(z):
    v = np.sort(np.asarray(z), axis=-1)[..., ::-1]
    return v[..., 0] - v[..., 1]


# ----------------------------------------------------------------------------------------------------------------------
# Independent checks.

def np_rms(x, eps, w=None):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y if w is None else y * w


def np_rope(v, pos, rd, theta, sign):
    """Interleaved RoPE on the last rd values of the vector v, pair by pair, as a rotation by sign * pos * freq."""
    v = np.array(v, np.float64)
    n = v.shape[-1]
    for j in range(rd // 2):
        ang = sign * pos * theta ** (-(2 * j) / rd)
        e, o = v[n - rd + 2 * j], v[n - rd + 2 * j + 1]
        v[n - rd + 2 * j] = e * math.cos(ang) - o * math.sin(ang)
        v[n - rd + 2 * j + 1] = o * math.cos(ang) + e * math.sin(ang)
    return v


def np_stage_attention(c, Pn, pre, u, f, a):
    """One stage's attention for one anchor with explicit loops (float64 numpy): u [B, d] the mHC pre-mixed block
    rows, f [T, k*d] the target features. Context keys are computed here from f, independently of the JAX code."""
    eps, rd, theta = c["rms_norm_eps"], c["qk_rope_head_dim"], c["rope_theta"]
    H, hd, G, R, W = c["num_attention_heads"], c["head_dim"], c["o_groups"], c["o_lora_rank"], c["sliding_window"]
    nb = u.shape[0]
    keys = []
    for t in range(max(0, a - W), a):
        ct = np_rms(Pn["mtp.0.main_proj.weight"] @ f[t], eps, Pn["mtp.0.main_norm.weight"])
        kt = np_rms(Pn[pre + "attn.wkv.weight"] @ ct, eps, Pn[pre + "attn.kv_norm.weight"])
        keys.append(np_rope(kt, t, rd, theta, 1.0))
    qs = []
    for i in range(nb):
        n = np_rms(u[i], eps, Pn[pre + "attn_norm.weight"])
        kb = np_rms(Pn[pre + "attn.wkv.weight"] @ n, eps, Pn[pre + "attn.kv_norm.weight"])
        keys.append(np_rope(kb, a + i, rd, theta, 1.0))
        qr = np_rms(Pn[pre + "attn.wq_a.weight"] @ n, eps, Pn[pre + "attn.q_norm.weight"])
        q = (Pn[pre + "attn.wq_b.weight"] @ qr).reshape(H, hd)
        qs.append([np_rope(np_rms(q[h], eps), a + i, rd, theta, 1.0) for h in range(H)])
    out = np.zeros((nb, c["hidden_size"]))
    for i in range(nb):
        heads = []
        for h in range(H):
            scores = [float(qs[i][h] @ k) / math.sqrt(hd) for k in keys]
            sink = float(Pn[pre + "attn.attn_sink"][h])
            mx = max(scores + [sink])
            den = sum(math.exp(s - mx) for s in scores) + math.exp(sink - mx)
            o = sum(math.exp(s - mx) / den * k for s, k in zip(scores, keys))
            heads.append(np_rope(o, a + i, rd, theta, -1.0))
        o = np.concatenate(heads)
        per = H * hd // G
        wa = Pn[pre + "attn.wo_a.weight"]
        low = np.concatenate([wa[g * R:(g + 1) * R] @ o[g * per:(g + 1) * per] for g in range(G)])
        out[i] = Pn[pre + "attn.wo_b.weight"] @ low
    return out


def self_checks(c, P, Bf, tokens, jnp, jax, log=print):
    """(a) each stage's attention against the numpy loops, for every anchor (<= 1e-10); the Markov/confidence head
    against numpy; (b) the block is bidirectional (row 0 changes when the last row's id does) and causal with
    respect to the target (tokens after the anchor, and features before the window, change nothing)."""
    trunk, features, draft, stage_attention, _ = make_dspark(c, jnp, jax)
    Pn = {k: np.asarray(v) for k, v in P.items()}
    _, streams = trunk(P, Bf, tokens)
    f = features(streams)
    fn = np.asarray(f)
    S, Bk, V = n_stages(c), c["dspark_block_size"], c["vocab_size"]
    last = f"mtp.{S - 1}."
    worst = 0.0
    for a in ANCHORS:
        trace = []
        out = draft(P, Bf, f, a, tokens[a], trace=trace)
        for pre, u, Kctx in trace:
            ref = np_stage_attention(c, Pn, pre, np.asarray(u[0]), fn, a)
            got = np.asarray(stage_attention(P, pre, u, Kctx, a)[0])
            worst = max(worst, float(np.abs(got - ref).max()))
        # Markov and confidence heads from x_post, in numpy.
        prev = int(tokens[a])
        w1, w2 = Pn[last + "markov_head.markov_w1.weight"], Pn[last + "markov_head.markov_w2.weight"]
        for i in range(Bk):
            base = Pn["head.weight"] @ np_rms(out["x_post"][i], c["rms_norm_eps"], Pn[last + "norm.weight"])
            z = base + w2 @ w1[prev]
            cf = 1.0 / (1.0 + math.exp(-float(Pn[last + "confidence_head.proj.weight"][0] @
                                              np.concatenate([out["x_post"][i], w1[prev]]))))
            assert np.abs(base - out["base_logits"][i]).max() < 1e-10
            assert np.abs(z - out["markov_logits"][i]).max() < 1e-10
            assert abs(cf - out["confidence"][i]) < 1e-12
            assert int(np.argmax(z)) == out["drafts"][i]
            prev = out["drafts"][i]
        # (b) bidirectional: the last block row's id reaches row 0.
        ids = [int(tokens[a])] + [c["dspark_noise_token_id"]] * (Bk - 2) + [c["dspark_noise_token_id"] - 1]
        alt = draft(P, Bf, f, a, tokens[a], ids=ids)
        dep = float(np.abs(alt["x_post"][0] - out["x_post"][0]).max())
        assert dep > 1e-6, f"anchor {a}: block row 0 does not see the last block row ({dep})"
        # (b) tokens after the anchor change nothing (context = tokens[0..a), anchor token tokens[a]).
        t2 = np.array(tokens)
        t2[a + 1:] = (t2[a + 1:] + 17) % V
        _, st2 = trunk(P, Bf, t2)
        alt = draft(P, Bf, features(st2), a, t2[a])
        for k in ("x_post", "base_logits", "markov_logits", "confidence"):
            assert np.array_equal(alt[k], out[k]), f"anchor {a}: {k} depends on tokens after the anchor"
        assert alt["drafts"] == out["drafts"]
        # Features before the window (t < a - W) and at/after the anchor change nothing.
        f2 = fn.copy()
        f2[: max(0, a - c["sliding_window"])] += 1.0
        f2[a:] -= 1.0
        alt = draft(P, Bf, jnp.asarray(f2), a, tokens[a])
        for k in ("x_post", "base_logits", "markov_logits", "confidence"):
            assert np.array_equal(alt[k], out[k]), f"anchor {a}: {k} depends on features outside the window"
    assert worst <= 1e-10, f"stage attention: JAX vs numpy loops max |diff| {worst}"
    log(f"self-checks passed: stage attention JAX vs numpy loops max |diff| {worst:.2e} over {len(ANCHORS)} anchors "
        f"x {S} stages; Markov/confidence heads match numpy; block rows see later rows; tokens after the anchor and "
        f"features outside the window have no influence")
    return worst


# ----------------------------------------------------------------------------------------------------------------------
# The fixture.

def build(c, seed, jnp, jax, T=20):
    """Random model for `seed`, its tokens, and every reference output (plus the router margins and z gaps)."""
    rng = np.random.default_rng(seed)
    ct = trunk_config(c)
    params = train.init_params(ct, rng, fixture=True)
    buffers = train.buffer_arrays(ct, rng)
    for k in buffers:
        if k.endswith(".bias"):
            buffers[k] = (0.1 * rng.standard_normal(buffers[k].shape)).astype(np.float32)
    sp, sb = init_stage_params(c, rng)
    params.update(sp)
    buffers.update(sb)
    tokens = np.concatenate([[0], rng.integers(2, c["vocab_size"], T - 1)]).astype(np.int32)
    P = {k: jnp.asarray(v.astype(np.float64)) for k, v in params.items()}
    Bf = {k: (jnp.asarray(v.astype(np.float64)) if v.dtype == np.float32 else v) for k, v in buffers.items()}
    trunk, features, draft, _, _ = make_dspark(c, jnp, jax)
    trunk_margins, stage_margins = [], []
    with record_router_margins(jax, trunk_margins):
        logits, streams = trunk(P, Bf, tokens)
    f = features(streams)
    outs = []
    with record_router_margins(jax, stage_margins):
        for a in ANCHORS:
            outs.append(draft(P, Bf, f, a, tokens[a]))
    return params, buffers, P, Bf, tokens, np.asarray(logits), np.asarray(f), outs, trunk_margins, stage_margins


def dspark_fixture(out, seed):
    import jax
    jax.config.update("jax_enable_x64", True)
    import jax.numpy as jnp
    c = tiny_config()
    T = 20
    for s in range(seed, seed + 200):
        params, buffers, P, Bf, tokens, logits, f, outs, tm, sm = build(c, s, jnp, jax, T)
        z_gap = [top2_gap(o["markov_logits"]) for o in outs]
        margin = min(tm + sm)
        zmin = float(min(g.min() for g in z_gap))
        # Clear of f32 rounding: the engine must pick the same experts and the same greedy drafts.
        if margin > 1e-3 and zmin > 1e-3:
            break
    self_checks(c, P, Bf, tokens, jnp, jax)
    S, Bk, V, d = n_stages(c), c["dspark_block_size"], c["vocab_size"], c["hidden_size"]
    A = len(ANCHORS)
    os.makedirs(out, exist_ok=True)
    train.save_checkpoint(out, c, params, buffers)

    def write(name, x):
        np.asarray(x, np.float32).astype("<f4").tofile(os.path.join(out, name))

    write("trunk_logits.f32", logits)
    write("features.f32", f)
    for k in ("base_logits", "markov_logits", "confidence", "x_post"):
        write(k + ".f32", np.stack([o[k] for o in outs]))
    meta = {
        "generator": GENERATOR + " (JAX, float64 forward of f32 weights; the math of the DSpark spec)",
        "seed": int(s), "tokens": tokens.tolist(), "vocab_size": V, "n_tokens": T, "hidden_size": d,
        "block_size": Bk, "noise_token_id": c["dspark_noise_token_id"],
        "target_layer_ids": c["dspark_target_layer_ids"], "markov_rank": c["dspark_markov_rank"],
        "sliding_window": c["sliding_window"],
        "anchors": ANCHORS, "anchor_tokens": [int(tokens[a]) for a in ANCHORS],
        "anchor_definition": "for anchor a the target has processed tokens[0..a) (context rows t in "
                             "max(0, a - sliding_window) .. a-1) and the anchor token is x_a = tokens[a]; block ids "
                             "[x_a, noise, ..., noise] at positions a .. a+block_size-1",
        "trunk_logits": {"file": "trunk_logits.f32", "shape": [T, V],
                         "definition": "the trunk's logits at every position (causal, window 8): a sanity anchor"},
        "features": {"file": "features.f32", "shape": [T, S * d],
                     "definition": "target features f_t: the mean over the hc streams of the trunk's streams after "
                                   "each target layer (after its FFN post-mix), concatenated in target_layer_ids order"},
        "x_post": {"file": "x_post.f32", "shape": [A, Bk, d],
                   "definition": "per anchor and block row i: the mHC head collapse (hc_head_* of the last stage) of "
                                 "the last stage's output streams, before the final RMSNorm"},
        "base_logits": {"file": "base_logits.f32", "shape": [A, Bk, V],
                        "definition": "head.weight . (RMSNorm(x_post_i) * mtp.2.norm.weight); predicts position a+i+1"},
        "markov_logits": {"file": "markov_logits.f32", "shape": [A, Bk, V],
                          "definition": "z_i = base_i + markov_w2 . markov_w1[prev_i], prev_0 = x_a, prev_{i+1} = d_i"},
        "drafts": {"shape": [A, Bk], "values": [o["drafts"] for o in outs],
                   "definition": "greedy drafts d_i = argmax z_i (ties: lowest id) for positions a+1 .. a+block_size"},
        "confidence": {"file": "confidence.f32", "shape": [A, Bk],
                       "definition": "c_i = sigmoid(confidence_head.proj . [x_post_i ; markov_w1[prev_i]])"},
        "router_margin_min": margin,
        "router_margin_min_trunk": float(min(tm)), "router_margin_min_stages": float(min(sm)),
        "router_margin_definition": "smallest gap between the k-th and (k+1)-th biased router score over every "
                                    "learned-routing choice (trunk layers 1-2 at all positions, the three stages for "
                                    "every anchor and block row)",
        "z_gap_min": zmin, "z_gap": [[float(x) for x in g] for g in z_gap],
        "z_gap_definition": "top-1 minus top-2 of each z_i (per anchor, block row): greedy drafts are not near-ties",
        "logit_std": {"trunk": float(logits.std()),
                      "base": float(np.stack([o["base_logits"] for o in outs]).std()),
                      "markov": float(np.stack([o["markov_logits"] for o in outs]).std())},
        "files_format": "little-endian f32, row-major",
    }
    with open(os.path.join(out, "fixture.json"), "w") as fh:
        json.dump(meta, fh, indent=1)
    print(json.dumps({k: meta[k] for k in ("seed", "router_margin_min", "z_gap_min", "logit_std")}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dspark-fixture", metavar="DIR")
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    if args.dspark_fixture:
        dspark_fixture(args.dspark_fixture, args.seed)
    elif args.check:
        import jax
        jax.config.update("jax_enable_x64", True)
        import jax.numpy as jnp
        _, _, P, Bf, tokens, *_ = build(tiny_config(), args.seed, jnp, jax)
        self_checks(tiny_config(), P, Bf, tokens, jnp, jax)
    else:
        ap.print_help()


if __name__ == "__main__":
    main()
