#!/usr/bin/env bash
# Side-by-side prefill/decode throughput: ds4 (`ds4-bench -m FILE`) vs llama.cpp on the SAME GGUF file, in
# alternating pairs, with each pair's load average (issue 16). Not part of scripts/test.sh.
#
# llama.cpp is the tree vendored by the PyPI sdist llama-cpp-python==0.3.36 (llama.cpp commit 0c1e570), built CPU-only
# with -march=native into ${DS4_CACHE_DIR:-$HOME/.cache/ds4}/llama.cpp — the same cached build scripts/llama-cpp-check.sh
# makes (reused when present; ~30 min cold on 2 cores). Its side is benches/peer/llama-timing.c, linked against that
# libllama: llama-bench's method (warm-up, prompt in batches of 2048, f16 KV cache, default context settings) in a
# 100-line program, so the cache needs no llama.cpp `common`/tools build. No llama.cpp code or binary is committed.
#
# Usage: benches/peer/llama-cpp.sh [MODEL.gguf]
#   Without MODEL: writes the Flash-shaped 2-bit file (`ds4-bench --synthetic flash:layers=2:from=2 --write`, 5.2 GiB:
#   Flash sizes, one CSA ratio-4 layer with indexer, one HCA ratio-128 layer, IQ2_XXS/Q2_K routed experts) once to
#   $CACHE/flash-2-from-2.gguf and uses that.
# Env: PAIRS (default 6), PROMPT (prefill tokens, default 64; e.g. 512, 4096), GEN (decode tokens after the prompt,
#   default 32), THREADS (default 2), DS4_BATCH_TOKENS (ds4 prefill chunk, default 256), DS4_BENCH_BIN (default target/release/ds4-bench, built if missing),
#   DS4_CACHE_DIR, OPS_LOG (a file: ds4's per-op split of each pair, the `# ctx N: prefill/decode tick by op`
#   lines, appended there prefixed with the pair number).
# Output: one line per pair (ds4 and llama.cpp prefill/decode t/s, ratios ds4/llama.cpp, load average before the
# pair), then the median ratios. The ds4 run goes first in odd pairs, llama.cpp in even ones.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/../.." && pwd)
HERE=$ROOT/benches/peer
VER=0.3.36
CACHE=${DS4_CACHE_DIR:-$HOME/.cache/ds4}/llama.cpp
SRC=$CACHE/llama_cpp_python-$VER/vendor/llama.cpp
BUILD=$CACHE/build
PAIRS=${PAIRS:-6}
PROMPT=${PROMPT:-64}
GEN=${GEN:-32}
THREADS=${THREADS:-2}
JOBS=${CARGO_BUILD_JOBS:-2}
BENCH=${DS4_BENCH_BIN:-$ROOT/target/release/ds4-bench}

log() { echo "llama-cpp peer: $*" >&2; }

# The llama.cpp library: scripts/llama-cpp-check.sh fetches and builds it (cached; a no-op when present).
if ! find "$BUILD" -name libllama.a 2>/dev/null | grep -q .; then
  log "no cached llama.cpp build in $BUILD: building it with scripts/llama-cpp-check.sh"
  "$ROOT/scripts/llama-cpp-check.sh"
fi
TIMING=$BUILD/llama-timing
if [ ! -x "$TIMING" ] || [ "$HERE/llama-timing.c" -nt "$TIMING" ]; then
  libs=$(find "$BUILD" -name 'libllama.a' -o -name 'libggml*.a' | sort -r | tr '\n' ' ')
  # shellcheck disable=SC2086
  g++ -O2 -x c "$HERE/llama-timing.c" -x none -I"$SRC/include" -I"$SRC/ggml/include" \
    -Wl,--start-group $libs -Wl,--end-group -lpthread -lm -ldl -o "$TIMING"
fi
if [ ! -x "$BENCH" ]; then
  log "building ds4-bench"
  (cd "$ROOT" && cargo build --release -p ds4-bench -j "$JOBS")
fi

MODEL=${1:-}
if [ -z "$MODEL" ]; then
  MODEL=$CACHE/flash-2-from-2.gguf
  if [ ! -f "$MODEL" ]; then
    log "writing the Flash-shaped file to $MODEL"
    "$BENCH" --synthetic flash:layers=2:from=2 --write "$MODEL.part" --quiet >&2
    mv "$MODEL.part" "$MODEL"
  fi
fi
[ -f "$MODEL" ] || { log "no such model file: $MODEL"; exit 1; }

ds4_run() { # $1 = pair number -> "prefill_tps decode_tps"; the per-op lines go to OPS_LOG when set
  local out
  out=$(timeout 3600 "$BENCH" -m "$MODEL" --threads "$THREADS" --ctx-start "$PROMPT" --ctx-max "$PROMPT" --step 0 \
    --gen-tokens "$GEN" --batch-tokens "${DS4_BATCH_TOKENS:-256}" --quiet 2>/dev/null) || true
  if [ -n "${OPS_LOG:-}" ]; then
    grep 'tick by op' <<<"$out" | sed "s/^/pair $1 /" >>"$OPS_LOG" || true
  fi
  awk -F, '/^[0-9]/ { print $3, $5 }' <<<"$out" | tail -1
}
llama_run() {
  timeout 3600 "$TIMING" "$MODEL" "$PROMPT" "$GEN" "$THREADS" 2>/dev/null \
    | sed -n 's/^prefill_tps=\([0-9.]*\) decode_tps=\([0-9.]*\)$/\1 \2/p'
}

echo "# model: $MODEL; prompt $PROMPT, decode $GEN after it, $THREADS threads, $PAIRS alternating pairs"
echo "pair,load1,ds4_prefill_tps,llama_prefill_tps,prefill_ratio,ds4_decode_tps,llama_decode_tps,decode_ratio"
ratios=$(mktemp)
trap 'rm -f "$ratios"' EXIT
for i in $(seq 1 "$PAIRS"); do
  load=$(cut -d' ' -f1 /proc/loadavg)
  if [ $((i % 2)) = 1 ]; then d=$(ds4_run "$i"); l=$(llama_run); else l=$(llama_run); d=$(ds4_run "$i"); fi
  [ -n "$d" ] || { log "ds4-bench produced no result"; exit 1; }
  [ -n "$l" ] || { log "llama-timing produced no result"; exit 1; }
  read -r dp dd <<<"$d"
  read -r lp ld <<<"$l"
  pr=$(awk -v a="$dp" -v b="$lp" 'BEGIN { printf "%.3f", a / b }')
  dr=$(awk -v a="$dd" -v b="$ld" 'BEGIN { printf "%.3f", a / b }')
  echo "$i,$load,$dp,$lp,$pr,$dd,$ld,$dr"
  echo "$pr $dr" >>"$ratios"
done
median() { sort -g | awk '{ v[NR] = $1 } END { if (NR % 2) print v[(NR + 1) / 2]; else printf "%.3f\n", (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }
echo "# median ratio ds4/llama.cpp: prefill $(cut -d' ' -f1 "$ratios" | median), decode $(cut -d' ' -f2 "$ratios" | median) (load average now: $(cut -d' ' -f1-3 /proc/loadavg))"
