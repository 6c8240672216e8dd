#!/usr/bin/env bash
# The whole ds4 test suite. Installs what it needs (Vulkan software driver for the wgpu tests, Python SDK clients for
# the server tests, headless Chromium + websocket-client for the web page test), then runs: formatting and lint
# checks, every Rust test in the workspace (golden checkpoints, quant fixtures, GGUF fuzz, server, kv faults, wgpu on
# lavapipe), and the Python SDK and web page tests against a live server.
#
# Needs ../shared (golden checkpoints, client fixtures) beside the repository; with CI=true a missing ../shared fails.
set -euo pipefail
cd "$(dirname "$0")/.."

log() { printf '\n== %s\n' "$*"; }

if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  if ! ldconfig -p 2>/dev/null | grep -q libvulkan.so.1 || [ ! -e /usr/share/vulkan/icd.d/lvp_icd.x86_64.json ]; then
    log "installing Mesa software Vulkan (lavapipe)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq mesa-vulkan-drivers libvulkan1 >/dev/null
  fi
fi
# Redis and nginx for the shared KV tier and two-replica tests (server/tests/kv_remote.rs; they fail under CI=true
# without them).
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  if [ ! -x /usr/bin/redis-server ] || [ ! -x /usr/sbin/nginx ]; then
    log "installing redis-server and nginx-light (shared KV tier tests)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server nginx-light >/dev/null
  fi
fi
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1 && [ -d tests/python ]; then
  if ! command -v chromium >/dev/null 2>&1; then
    log "installing headless Chromium (web page test)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive timeout 900 apt-get install -y -qq chromium >/dev/null
  fi
fi
export WGPU_BACKEND="${WGPU_BACKEND:-vulkan}"
export XDG_RUNTIME_DIR="${XDG_RUNTIME_DIR:-/tmp}"

# The real coding agents for tests/python/test_agents.py: pinned versions from npm into a cache folder, installed
# once (node/npm from apt when absent). The tests talk to them only through 127.0.0.1.
AGENTS_DIR="${DS4_CACHE_DIR:-$HOME/.cache/ds4}/npm"
AGENT_PKGS=(@anthropic-ai/claude-code@2.1.332 @openai/codex@0.171.0 opencode-ai@1.18.33)
if ! command -v npm >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  log "installing node and npm"
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null
fi
agents_stamp="$AGENTS_DIR/.installed-$(printf '%s\n' "${AGENT_PKGS[@]}" | cksum | cut -d' ' -f1)"
if [ ! -e "$agents_stamp" ] && command -v npm >/dev/null 2>&1; then
  log "installing coding agents (${AGENT_PKGS[*]}) into $AGENTS_DIR"
  mkdir -p "$AGENTS_DIR"
  timeout 900 npm install --prefix "$AGENTS_DIR" --no-audit --no-fund --loglevel=error "${AGENT_PKGS[@]}" >/dev/null \
    && touch "$agents_stamp"
fi
export DS4_AGENTS_DIR="$AGENTS_DIR"

PY=python3
if [ -d tests/python ]; then
  log "installing Python test clients"
  # jax (CPU build), safetensors, numpy: the demo model's training script (tools/train_demo), smoke-tested.
  $PY -m pip install -q --disable-pip-version-check openai anthropic pytest prometheus-client websocket-client jsonschema httpx \
    jax==0.10.2 jaxlib==0.10.2 safetensors numpy >/dev/null
fi

# The CUDA compile check (kernels-native/tests/cuda_compile.rs; no GPU needed): NVRTC and ptxas from PyPI wheels,
# pinned to CUDA 13.0 (13.5's PTX ISA is refused by the 580 drivers we can borrow), ~330 MB, installed once.
CUDA_WHEELS_DIR="${DS4_CACHE_DIR:-$HOME/.cache/ds4}/cuda-wheels-13.0.88"
if [ ! -x "$CUDA_WHEELS_DIR/nvidia/cu13/bin/ptxas" ] || [ ! -e "$CUDA_WHEELS_DIR/nvidia/cu13/lib/libnvrtc.so.13" ]; then
  log "installing the CUDA compile-check wheels (NVRTC, ptxas) into $CUDA_WHEELS_DIR"
  $PY -m pip install -q --disable-pip-version-check --no-deps --upgrade --target "$CUDA_WHEELS_DIR" \
    nvidia-cuda-nvrtc==13.0.88 nvidia-cuda-nvcc==13.0.88 >/dev/null
fi
export DS4_CUDA_WHEELS="$CUDA_WHEELS_DIR/nvidia/cu13"

log "cargo fmt --check"
cargo fmt --all -- --check
log "cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings
cargo clippy -p ds4-kernels-native -p ds4-bench --features ds4-kernels-native/cuda,ds4-bench/cuda --all-targets -- -D warnings

log "cargo clippy (the server's test build, feature test-model)"
cargo clippy -p ds4-server --features test-model --all-targets -- -D warnings

log "cargo build (release binaries for the end-to-end tests)"
# The scripted test model's server first: building it relinks nothing but ds4-test-server, and the production
# ds4-server built after it carries no test-model flags (checked below).
cargo build --release -p ds4-server --features test-model --bin ds4-test-server
# ds4-bench with `cuda` (builds without CUDA): the binary scripts/gpu-check.sh runs on a GPU machine.
cargo build --release -p ds4-engine -p ds4-cli -p ds4-server -p ds4-bench --features ds4-bench/cuda
if target/release/ds4-server --help | grep -q -- '--fake'; then
  echo "the release ds4-server offers test-model options:" >&2
  target/release/ds4-server --help | grep -- '--fake' >&2
  exit 1
fi

log "cargo test"
cargo test --workspace

log "library examples: a custom scheduler and a cross-backend check on the golden model"
GOLDEN=../shared/golden/tiny-a
if [ ! -d "$GOLDEN" ]; then
  if [ "${CI:-}" = true ]; then echo "missing $GOLDEN" >&2; exit 1; fi
  GOLDEN=""   # outside CI without ../shared: the built-in demo model
fi
cargo run -q -p ds4-engine --example scheduler -- $GOLDEN
cargo run -q -p ds4-engine --example cross_backend -- $GOLDEN

log "cargo doc (library crates, warnings are errors)"
RUSTDOCFLAGS="-D warnings" cargo doc -q --no-deps -p ds4-engine -p ds4-kv -p ds4-server -p ds4-kernels-native \
  -p ds4-shaders-wgsl

if [ -d tests/python ]; then
  log "Python SDK tests"
  DS4_SERVER_BIN="$PWD/target/release/ds4-server" DS4_TEST_SERVER_BIN="$PWD/target/release/ds4-test-server" \
    DS4_BIN="$PWD/target/release/ds4" $PY -m pytest -q tests/python
fi
