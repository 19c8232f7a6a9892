#!/bin/bash
# The GPU runs still owed, as whole device calls (docs/performance.md, "Runs left").
# Each phase is one call: it keeps to $BUDGET s (540) by skipping the levels that no longer fit (the
# script has not run yet: it follows the last session's call scripts); results go to $OUT/results.tgz
# plus summary lines.
#
#   (once: wheels of the dependencies the GPU image lacks - starlette, msgspec, uvicorn, ... - in .whl/)
#   run(command="bash docs/device_runs.sh serve", kind="nvidia-h200-x2", carry=[".whl"])
#   run(command="bash docs/device_runs.sh delay", kind="nvidia-h200-x2", carry=[".whl"])
#
# serve: Local-v1.5 full size (random bf16). GPU 0: high-concurrency sweep C=1..256; GPU 1:
#        low-latency sweep C=1..128, then the eager build (no graphs, no compile, padded
#        attention) at C=1,16 as the same-call baseline; then two replicas over both GPUs at
#        C=256 (target: >= 0.9 x 2 x one GPU's C=128 figure).
# delay: MOSS-TTS 8B Delay talker (random bf16): TP=1 with and without backbone graphs, TP=2,
#        batches 1/16/64; reference encoding eager vs encode graphs (full-size codec); then the
#        GPU tests (graph capture of every runner and of encoding, Triton, codec graphs).
set -u
PHASE=${1:?usage: device_runs.sh serve|delay}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  && export PYTHONPATH=/tmp/site:$PWD || exit 1
mossvox() { python3 -c "import sys; from cli.main import main; sys.argv[0] = 'mossvox'; sys.exit(main())" "$@"; }
R=$OUT/r; mkdir -p "$R"
T0=$(date +%s); el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( ${BUDGET:-540} - ($(date +%s) - T0) )); }
finish() { el "done"; tar czf "$OUT/results.tgz" -C "$OUT" r; }
trap finish EXIT
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.device_count(), "GPUs")'

sweep() {  # sweep GPUS PORT NAME SERVE_ARGS... ; concurrencies from $CS, prompts per client $PER
  local gpus=$1 port=$2 name=$3; shift 3
  CUDA_VISIBLE_DEVICES=$gpus mossvox serve /tmp/l15 --port "$port" "$@" > "$R/serve_$name.log" 2>&1 &
  local spid=$!
  for _ in $(seq 1 300); do
    curl -sf "localhost:$port/ready" >/dev/null && break
    kill -0 $spid 2>/dev/null || break; [ "$(left)" -lt 30 ] && break; sleep 1
  done
  el "$name ready: $(curl -s "localhost:$port/ready")"
  for c in $CS; do
    [ "$(left)" -lt 25 ] && { el "$name: no time left for C=$c"; break; }
    n=$(( c * ${PER:-3} )); [ $n -lt 8 ] && n=8
    timeout $(( $(left) - 10 )) mossvox bench serve --url "http://127.0.0.1:$port" --concurrency "$c" \
      --num-prompts $n --no-progress --out "$R/${name}_c$c.json" > "$R/${name}_c$c.txt" 2>&1
    el "$name C=$c rc=$?"; grep -E "^\| [0-9]|RESULT|client CPU|failed request" "$R/${name}_c$c.txt" | head -4
    curl -s "localhost:$port/metrics" > "$R/${name}_c${c}_metrics.txt"
    grep -E "^mossvox_engine_(codec_decode_s|talker_step_s)_total|^mossvox_codec_coalesce_wait_seconds_(sum|count)" \
      "$R/${name}_c${c}_metrics.txt" | head -6
    nvidia-smi --query-gpu=index,memory.used --format=csv,noheader | tr '\n' ' ' | sed "s/^/$name C=$c GPU memory: /"; echo
  done
  kill -INT $spid; for _ in $(seq 1 20); do kill -0 $spid 2>/dev/null || break; sleep 1; done; kill -9 $spid 2>/dev/null
  grep -E "ERROR|Traceback|exited|RANDOM|captured" "$R/serve_$name.log" | head -8 | cut -c1-300
}

case $PHASE in
serve)
  mossvox make-checkpoint --variant local-v1.5 --size full --out /tmp/l15 > "$R/mkck.log" 2>&1 || { tail "$R/mkck.log"; exit 1; }
  el "checkpoint written"
  laneA() { CS="1 16 64 128 256" sweep 0 8000 hc --profile high-concurrency; }
  laneB() {
    CS="1 16 64 128" sweep 1 8001 ll --profile low-latency
    [ "$(left)" -gt 150 ] && PER=1 CS="1 16" sweep 1 8002 eager --profile default --set talker.cuda_graphs=false \
      --set codec.cuda_graphs=false --set talker.compile=false --set talker.attention=padded \
      --set codec.prime_continuation=false
  }
  laneA > "$R/laneA.txt" 2>&1 &
  laneB > "$R/laneB.txt" 2>&1
  wait
  cat "$R/laneA.txt" "$R/laneB.txt"
  [ "$(left)" -gt 120 ] && CS="256" sweep 0,1 8003 rep2 --profile high-concurrency --set engine.replicas=2 2>&1 | tee "$R/rep2.txt"
  ;;
delay)
  mossvox make-checkpoint --variant delay --size full --out /tmp/d8 > "$R/mkck.log" 2>&1 || { tail "$R/mkck.log"; exit 1; }
  el "checkpoint written"
  args="--model /tmp/d8 --batch 1 16 64 --frames 24 --attention auto"
  timeout 200 python3 -m bench.tensor_parallel $args --tp 1 2 2>&1 | grep '^{' | tee "$R/delay_tp.jsonl"
  el "TP=1 (graphs) and TP=2"
  timeout 120 python3 -m bench.tensor_parallel $args --tp 1 --no-graphs 2>&1 | grep '^{' | tee "$R/delay_eager.jsonl"
  el "TP=1 eager"
  [ "$(left)" -gt 150 ] && timeout 120 python3 -m bench.codec --version v2 --size full --batches 1,8 \
    --iters 3 --encode 2>&1 | grep -E "^batch|codec" | tee "$R/codec_encode.txt"
  el "codec encode: eager vs graphs"
  [ "$(left)" -gt 40 ] && timeout $(( $(left) - 10 )) python3 -m pytest -q -p no:cacheprovider -m gpu tests/stages 2>&1 | tail -12 | tee "$R/gpu_tests.txt"
  ;;
*) echo "unknown phase $PHASE"; exit 2 ;;
esac
