"""The demo model's training script (`tools/train_demo/train.py`) works on this machine, and the committed artefacts
come from it:

- `--fixture DIR` rebuilds `engine/tests/data/mtp-tiny` (the reference the engine's MTP and trunk forward are
  checked against in `engine/tests/mtp_fixture.rs`);
- `dspark_ref.py --dspark-fixture DIR` rebuilds `engine/tests/data/dspark-tiny` (the reference for the engine's
  DSpark drafter: a tiny random 0731-style checkpoint and the drafter's outputs at five anchors);

"Rebuilds" means: the checkpoint and its config byte for byte (seeded), every id and shape exactly, and the
computed values up to the last bits of their float64 forward, which XLA's CPU code may round differently on
another instruction set (`same_values`: float64 numbers within 1e-12 relative, f32 files within 1 ulp);
- a 2-step training run writes a checkpoint in the official layout that `ds4 convert` turns into a GGUF with the MTP
  block, which `ds4 generate` runs with MTP speculation, giving the same ids as without.

Needs `pip install jax safetensors numpy` (skipped without them unless CI=true) and the `ds4` binary (`$DS4_BIN` or
`target/debug/ds4`). The full run (36 minutes) is not repeated here; its command and results are in
tools/train_demo/README.md.
"""

import array
import json
import math
import os
import struct
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT = os.path.join(ROOT, "tools", "train_demo", "train.py")
FIXTURE = os.path.join(ROOT, "engine", "tests", "data", "mtp-tiny")
DSPARK_SCRIPT = os.path.join(ROOT, "tools", "train_demo", "dspark_ref.py")
DSPARK_FIXTURE = os.path.join(ROOT, "engine", "tests", "data", "dspark-tiny")
DS4 = os.environ.get("DS4_BIN", os.path.join(ROOT, "target", "debug", "ds4"))


def need_jax():
    try:
        import jax  # noqa: F401
        import safetensors  # noqa: F401
    except ImportError:
        if os.environ.get("CI") == "true":
            raise
        pytest.skip("jax / safetensors not installed")


def run(args, timeout):
    r = subprocess.run(args, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{args}: {r.stderr[-4000:]}"
    return r


def close_json(a, b, path="$"):
    """Where JSON values `a` and `b` differ beyond float64 rounding (1e-12 relative), or None."""
    if isinstance(a, bool) or isinstance(b, bool) or isinstance(a, int) and isinstance(b, int):
        return None if a == b else path
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return None if math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-300) else f"{path}: {a} vs {b}"
    if isinstance(a, dict) and isinstance(b, dict):
        if sorted(a) != sorted(b):
            return f"{path}: keys {sorted(a)} vs {sorted(b)}"
        return next((d for k in a if (d := close_json(a[k], b[k], f"{path}.{k}"))), None)
    if isinstance(a, list) and isinstance(b, list):
        if len(a) != len(b):
            return f"{path}: {len(a)} vs {len(b)} items"
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := close_json(x, y, f"{path}[{i}]"))), None)
    return None if a == b else f"{path}: {a!r} vs {b!r}"


def same_values(name, got, want):
    """Problems with file `name` rebuilt as `got` against the committed `want` (bytes), or None (module docs)."""
    if name.endswith(".json"):
        return close_json(json.loads(got), json.loads(want))
    if name.endswith(".f32"):
        if len(got) != len(want):
            return f"{len(got)} vs {len(want)} bytes"
        a, b = array.array("f", got), array.array("f", want)
        for i, (x, y) in enumerate(zip(a, b)):
            # 1 ulp at f32: the two values' bit patterns (same sign) are at most one apart.
            bx, by = struct.unpack("<i", struct.pack("<f", x))[0], struct.unpack("<i", struct.pack("<f", y))[0]
            if x != y and (math.copysign(1, x) != math.copysign(1, y) or abs(bx - by) > 1):
                return f"value {i}: {x!r} vs {y!r}"
        return None
    return None if got == want else "bytes differ"


def test_value_comparison_rejects_real_differences():
    assert close_json({"a": [1, 0.1]}, {"a": [1, 0.1 + 1e-16]}) is None
    assert close_json({"a": [1, 0.1]}, {"a": [1, 0.1001]}) == "$.a[1]: 0.1 vs 0.1001"
    assert close_json({"a": [1, 2]}, {"a": [1, 3]}) == "$.a[1]"
    assert close_json({"a": "x"}, {"b": "x"}) is not None
    one = struct.pack("<f", 1.0)
    next_up = struct.pack("<i", struct.unpack("<i", one)[0] + 1)
    two_up = struct.pack("<i", struct.unpack("<i", one)[0] + 2)
    assert same_values("v.f32", one, next_up) is None
    assert same_values("v.f32", one, two_up) is not None
    assert same_values("v.f32", struct.pack("<f", 0.0), struct.pack("<f", -0.0)) is None
    assert same_values("m.safetensors", b"ab", b"ac") == "bytes differ"


def test_the_fixture_is_what_the_script_writes(tmp_path):
    need_jax()
    out = tmp_path / "fixture"
    run([sys.executable, SCRIPT, "--fixture", str(out)], 600)
    for name in ["model.safetensors", "trunk_logits.f32", "mtp_logits.f32", "config.json", "fixture.json"]:
        with open(out / name, "rb") as a, open(os.path.join(FIXTURE, name), "rb") as b:
            problem = same_values(name, a.read(), b.read())
            assert problem is None, f"{name} differs from the committed fixture: {problem}"


DSPARK_FILES = ["model.safetensors", "config.json", "fixture.json", "trunk_logits.f32", "features.f32",
                "base_logits.f32", "markov_logits.f32", "confidence.f32", "x_post.f32"]


def test_the_dspark_fixture_is_what_the_script_writes(tmp_path):
    need_jax()
    out = tmp_path / "dspark"
    run([sys.executable, DSPARK_SCRIPT, "--dspark-fixture", str(out)], 900)
    assert sorted(os.listdir(out)) == sorted(os.listdir(DSPARK_FIXTURE)) == sorted(DSPARK_FILES)
    for name in DSPARK_FILES:
        with open(out / name, "rb") as a, open(os.path.join(DSPARK_FIXTURE, name), "rb") as b:
            problem = same_values(name, a.read(), b.read())
            assert problem is None, f"{name} differs from the committed DSpark fixture: {problem}"
    meta = json.loads((out / "fixture.json").read_text())
    assert meta["router_margin_min"] > 1e-3 and meta["z_gap_min"] > 1e-3


def test_a_short_training_run_converts_and_speculates(tmp_path):
    need_jax()
    ckpt = tmp_path / "ckpt"
    r = run([sys.executable, SCRIPT, "--out", str(ckpt), "--steps", "2", "--eval-every", "0"], 900)
    summary = json.loads((ckpt / "train_summary.json").read_text())
    assert summary["steps"] == 2 and summary["train_loss_trunk_ema"] > 0, r.stdout[-2000:]
    gguf = tmp_path / "demo.gguf"
    run([DS4, "convert", "--input", str(ckpt), "--output", str(gguf), "--recipe", "f16",
         "--tokenizer", str(ckpt / "tokenizer.json")], 300)
    ids = lambda spec: run([DS4, "generate", "-m", str(gguf), "--tokens", "0,75,100,115,101,32", "-n", "12",
                            "--temperature", "0", "--print-ids", "--speculative", spec, "--threads", "1"], 120)
    plain, mtp = ids("off"), ids("mtp")
    assert plain.stdout.strip() and plain.stdout == mtp.stdout
    assert "speculative decoding" in mtp.stderr, "the converted model's MTP block drafted"
