#!/usr/bin/env bash
# One GPU call that checks the engine on a fresh machine before anything is measured under load: the fast
# paths against the plain one (pdserve-bench paths: tiny in float32, the model in bf16), the worker's start
# cold and then warm on the same compile caches (pdserve-bench start), and a long prompt arriving beside
# running decodes, chunked against unchunked, with the prompt's steps profiled (chunks over a prefix; the whole
# prompt's step in chunk-profile/unchunked), and decode at batch 1 (1k, 16k
# contexts) with its batch-1 steps at 1k and 16k profiled (pdserve-bench engine). The part "cut" (not in the default set: a
# call of its own, ~7 minutes) A/Bs what the decode graphs run: a cold and a warm start with
# --decode-graph-forward cut on caches of their own, and the decode part's points with it, beside the
# default's (layers) start and decode parts.
# About 8 minutes on an H100/H200. Each part has its own time limit; a part that fails does not stop the
# next. Everything lands in RESULTS (default bench/results/check-gpu-<commit>) and, on the device, in
# $OUT/check-gpu.tgz.
#
#   bench/run_check_gpu.sh                       # every part
#   PARTS=paths,start bench/run_check_gpu.sh     # some (paths, start, chunk, decode, cut, lazy, fuse, offline, engine)
#   PARTS=offline,engine bench/run_check_gpu.sh  # the offline bench (default and unchunked, greedy and sampled,
#                                                # ~5 min) and `pdserve-bench engine` with no flags (~2 min)
#   PARTS=decode,fuse bench/run_check_gpu.sh     # the decode step with two gate/up products, then one
#   PARTS=start,lazy bench/run_check_gpu.sh      # the start with every graph, then --graphs lazy
#   CHUNK_PROMPT=32k CHUNK_TOKENS=8192 bench/run_check_gpu.sh
source "$(dirname "$0")/run_gpu_common.sh"  # PYTHON, MODEL, DEVICES
set +e  # every part runs; their exit codes are collected in RESULTS/parts.txt
PARTS=${PARTS:-paths,start,chunk,decode}
CHUNK_PROMPT=${CHUNK_PROMPT:-32k}
CHUNK_TOKENS=${CHUNK_TOKENS:-8192}
COMMIT=${PDSERVE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
RESULTS=${RESULTS:-bench/results/check-gpu-$COMMIT}
mkdir -p "$RESULTS"
DEVICE=${DEVICES%%,*}
part() {  # part NAME SECONDS COMMAND...: run it, log it, record its exit code
  local name=$1 limit=$2; shift 2
  echo "== $name (limit $limit s): $*"
  local t0=$SECONDS
  timeout "$limit" "$@" > "$RESULTS/$name.log" 2>&1
  local rc=$?
  tail -8 "$RESULTS/$name.log"
  echo "$name rc=$rc $((SECONDS - t0)) s" | tee -a "$RESULTS/parts.txt"
  if [ -n "${OUT:-}" ] && [ -d "${OUT}" ]; then tar czf "$OUT/check-gpu.tgz" -C "$(dirname "$RESULTS")" "$(basename "$RESULTS")"; fi
}
has() { [[ ",$PARTS," == *",$1,"* ]]; }
if has paths; then
  part paths-tiny 120 "$PYTHON" -m pdserve.bench.cli paths --model tiny --device "$DEVICE" --out "$RESULTS/paths-tiny.json"
  part paths-model 300 "$PYTHON" -m pdserve.bench.cli paths --model "$MODEL" --device "$DEVICE" --dtype bfloat16 \
    --atol 0.5 --requests 8 --out "$RESULTS/paths-model.json"
fi
if has start; then
  CACHE=$(mktemp -d)
  part start-cold 240 "$PYTHON" -m pdserve.bench.cli start --model "$MODEL" --device "$DEVICE" --cache-dir "$CACHE" \
    --profile "$RESULTS/start-profile" --out "$RESULTS/start-cold.json"
  part start-warm 180 "$PYTHON" -m pdserve.bench.cli start --model "$MODEL" --device "$DEVICE" --cache-dir "$CACHE" \
    --out "$RESULTS/start-warm.json"
fi
if has chunk; then
  part chunk 300 "$PYTHON" -m pdserve.bench.cli engine --model "$MODEL" --device "$DEVICE" --lengths "$CHUNK_PROMPT" \
    --pairs 2 --batches 1 --contexts 1k --mixed-batch 0 --hf-decode-context 0 --chunk-prompt "$CHUNK_PROMPT" \
    --chunk-tokens "$CHUNK_TOKENS" --profile "$RESULTS/chunk-profile" --out "$RESULTS/chunk.json"
fi
if has decode; then
  part decode 240 "$PYTHON" -m pdserve.bench.cli engine --model "$MODEL" --device "$DEVICE" --lengths 1k --pairs 1 \
    --batches 1,32 --contexts 1k,16k --mixed-batch 0 --hf-decode-context 0 --chunk-decodes 0 --mixed-step '' \
    --repeats 20 --profile-decode "$RESULTS/decode-profile" --out "$RESULTS/decode.json"
fi
if has lazy; then  # every graph at start (the default) against the largest of each kind at start, the rest while idle
  LAZY_CACHE=$(mktemp -d)
  part lazy-start-cold 240 "$PYTHON" -m pdserve.bench.cli start --model "$MODEL" --device "$DEVICE" \
    --graphs lazy --cache-dir "$LAZY_CACHE" --out "$RESULTS/lazy-start-cold.json"
  part lazy-start-warm 150 "$PYTHON" -m pdserve.bench.cli start --model "$MODEL" --device "$DEVICE" \
    --graphs lazy --cache-dir "$LAZY_CACHE" --out "$RESULTS/lazy-start-warm.json"
fi
if has fuse; then  # the decode step with one gate/up projection per MLP, against the decode part's (two)
  part fuse-decode 240 "$PYTHON" -m pdserve.bench.cli engine --model "$MODEL" --device "$DEVICE" --lengths 1k \
    --pairs 1 --batches 1,32 --contexts 1k,16k --mixed-batch 0 --hf-decode-context 0 --chunk-decodes 0 \
    --mixed-step '' --repeats 20 --fuse-gate-up --out "$RESULTS/fuse-decode.json"
fi
if has cut; then
  CUT_CACHE=$(mktemp -d)
  part cut-start-cold 240 "$PYTHON" -m pdserve.bench.cli start --model "$MODEL" --device "$DEVICE" \
    --decode-graph-forward cut --cache-dir "$CUT_CACHE" --out "$RESULTS/cut-start-cold.json"
  part cut-start-warm 150 "$PYTHON" -m pdserve.bench.cli start --model "$MODEL" --device "$DEVICE" \
    --decode-graph-forward cut --cache-dir "$CUT_CACHE" --out "$RESULTS/cut-start-warm.json"
  part cut-decode 200 "$PYTHON" -m pdserve.bench.cli engine --model "$MODEL" --device "$DEVICE" --lengths 1k --pairs 1 \
    --batches 1,32 --contexts 1k,16k --mixed-batch 0 --hf-decode-context 0 --chunk-decodes 0 --mixed-step '' \
    --repeats 20 --decode-graph-forward cut --out "$RESULTS/cut-decode.json"
fi
if has offline; then  # issue 33 item 4: greedy and sampled, the default config and unchunked, beside the floor and transformers
  part offline 420 "$PYTHON" -m pdserve.bench.cli offline --model "$MODEL" --device "$DEVICE" --configs default,unchunked \
    --out "$RESULTS/offline.json"
fi
if has engine; then  # issue 33 item 6: the engine bench's command with no flag at all, as a user first runs it
  before=$(ls bench/results/engine-*.json 2>/dev/null | sort)
  part engine-no-flags 480 "$PYTHON" -m pdserve.bench.cli engine
  for f in $(ls bench/results/engine-*.json 2>/dev/null | sort); do  # the file it wrote, kept with the rest
    if ! grep -qxF "$f" <<< "$before"; then cp "$f" "$RESULTS/engine-no-flags.json"; fi
  done
fi
cat "$RESULTS/parts.txt"
