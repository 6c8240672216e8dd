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
  $PY -m pip install -q --disable-pip-version-check openai anthropic pytest prometheus-client websocket-client jsonschema httpx >/dev/null
fi

log "cargo fmt --check"
cargo fmt --all -- --check
log "cargo clippy"
cargo clippy --workspace --all-targets -- -D warnings

log "cargo build (release binaries for the end-to-end tests)"
cargo build --release -p ds4-engine -p ds4-cli -p ds4-server -p ds4-bench

log "cargo test"
cargo test --workspace

if [ -d tests/python ]; then
  log "Python SDK tests"
  DS4_SERVER_BIN="$PWD/target/release/ds4-server" $PY -m pytest -q tests/python
fi
