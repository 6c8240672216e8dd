"""The demo model's training script (`tools/train_demo/train.py`) works on this machine, and the committed artefacts
come from it:

- `--fixture DIR` rebuilds `engine/tests/data/mtp-tiny` byte for byte (the reference the engine's MTP and trunk
  forward are checked against in `engine/tests/mtp_fixture.rs`);
- `dspark_ref.py --dspark-fixture DIR` rebuilds `engine/tests/data/dspark-tiny` byte for byte (the reference for the
  engine's DSpark drafter: a tiny random 0731-style checkpoint and the drafter's outputs at five anchors);
- a 2-step training run writes a checkpoint in the official layout that `ds4 convert` turns into a GGUF with the MTP
  block, which `ds4 generate` runs with MTP speculation, giving the same ids as without.

Needs `pip install jax safetensors numpy` (skipped without them unless CI=true) and the `ds4` binary (`$DS4_BIN` or
`target/debug/ds4`). The full run (36 minutes) is not repeated here; its command and results are in
tools/train_demo/README.md.
"""

import json
import os
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


def test_the_fixture_is_what_the_script_writes(tmp_path):
    need_jax()
    out = tmp_path / "fixture"
    run([sys.executable, SCRIPT, "--fixture", str(out)], 600)
    for name in ["model.safetensors", "trunk_logits.f32", "mtp_logits.f32", "config.json", "fixture.json"]:
        with open(out / name, "rb") as a, open(os.path.join(FIXTURE, name), "rb") as b:
            assert a.read() == b.read(), f"{name} differs from the committed fixture"


DSPARK_FILES = ["model.safetensors", "config.json", "fixture.json", "trunk_logits.f32", "features.f32",
                "base_logits.f32", "markov_logits.f32", "confidence.f32", "x_post.f32"]


def test_the_dspark_fixture_is_what_the_script_writes(tmp_path):
    need_jax()
    out = tmp_path / "dspark"
    run([sys.executable, DSPARK_SCRIPT, "--dspark-fixture", str(out)], 900)
    assert sorted(os.listdir(out)) == sorted(os.listdir(DSPARK_FIXTURE)) == sorted(DSPARK_FILES)
    for name in DSPARK_FILES:
        with open(out / name, "rb") as a, open(os.path.join(DSPARK_FIXTURE, name), "rb") as b:
            assert a.read() == b.read(), f"{name} differs from the committed DSpark fixture"
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
