#!/bin/bash
# The GPU measurements behind docs/performance.md's figures, one phase a run, from the tree to
# measure (its root as the working directory). Results go to $OUT/r and $OUT/results_PHASE.tgz
# (OUT defaults to ./device_results); phases can follow each other with the same OUT.
#
#   bash bench/device_runs.sh table     # the headline table: high-concurrency at HC_LEVELS
#                                       # (1 16 64 128 256), low-latency at LL_LEVELS (1 64),
#                                       # PASSES (2) measured passes a level after a discarded one
#   bash bench/device_runs.sh ceilings  # the stages alone at the served shapes: the codec's B=128
#                                       # replays of 1 and 15 frames, the talker's step at ROWS
#                                       # (128) rows of CONTEXT (300) keys
#   bash bench/device_runs.sh sweep     # high-concurrency C=1..256 and low-latency C=1..128
#                                       # (HC_LEVELS, LL_LEVELS: other levels; empty skips one)
#   bash bench/device_runs.sh peer      # high-concurrency at C=128 and 64, 3 prompts a client,
#                                       # then 1088 prompts a pass (the peers' protocol: the whole
#                                       # Seed-TTS EN set, first pass discarded); FLAGS changes it
#   bash bench/device_runs.sh newvoices # every voice new: PROFILE (high-concurrency) from its start,
#                                       # NP (1088) prompts a pass at CS (128 64), then known voices
#   FLAGS="--set k=v" bash bench/device_runs.sh nvcompare
#                                       # every voice new, the shipped server against FLAGS
#   bash bench/device_runs.sh startup   # PROFILES (default low-latency) each from its start, a short
#                                       # pass, then the refusal of a 24 and a 48 GB card; FLAGS:
#                                       # serve options; COLD=1: empty compile caches a profile;
#                                       # TWICE=1: each started again on the first start's caches
#   bash bench/device_runs.sh encoder   # the reference encoder alone (bench.encoder): BATCHES (1,8,16,32)
#                                       # of 6 s clips in MODES (eager,fused,graphs,fused+graphs), a
#                                       # kernel profile of each batch, a small loop beside each mode
#   bash bench/device_runs.sh gputests  # the GPU-marked tests of TESTS (tests/stages), K: -k filter
#   bash bench/device_runs.sh families [NAME...]
#                                       # every model family (default: delay, ttsd, sound-effect,
#                                       # realtime, voice-generator), full-size random weights,
#                                       # one server a GPU, all at once: C=1, 16, 64 with the
#                                       # prompt set in the model's own fields, one table of every
#                                       # run (on fewer GPUs than families the last ones queue;
#                                       # PROFILE, CS, SIZE and GPUS change it)
#   bash bench/device_runs.sh invariant # the batch-invariant GPU tests, then high-concurrency with
#                                       # talker.batch_invariant off and on (C=1, 64, 128);
#                                       # SKIP_TESTS=1: servers only
#   BASE=DIR bash bench/device_runs.sh build
#                                       # the build in DIR (an earlier tree) against this one,
#                                       # PROFILE, CS (128 64), PASSES (2): a changed code default
#   bash bench/device_runs.sh faults    # each process kind killed under load (PROFILE at C (64)):
#                                       # FAULTS (codec talker api stop: SIGKILL of the codec, of the
#                                       # talker, of an API process, SIGSTOP of the codec), each with
#                                       # its downtime, the restart's phases, what the clients saw and
#                                       # GPU memory before and after; then KILLS (5) codec kills in a
#                                       # row without load, GPU memory after each (no leak)
#   bash bench/device_runs.sh agents    # a voice agent's first audio after its first sentence's last
#                                       # word over ElevenLabs' multi-context socket, the speech
#                                       # WebSocket and HTTP (bench.agent_latency): PROFILE
#                                       # (low-latency here) at CS (1 16 64), REPLIES (4) a client
#   FLAGS="--set k=v" bash bench/device_runs.sh flags
#                                       # the shipped profile against it with FLAGS (and FLAGS2,
#                                       # FLAGS3: one server each), CS (128 64), PASSES (2)
#   bash bench/device_runs.sh precision # mossvox check-precision of the opt-in float8 backbone
#                                       # (FP8_FLAGS) on a full-size random checkpoint with outlier
#                                       # channels, then on the plain one; eager unless COMPILED=1
#
# Common settings: PROFILE (high-concurrency) the profile served; PASSES measured passes a level
# (one server's passes differ by ~2%, servers by up to ~8%, so a change under ~5% needs several);
# a pass sends PER (3) prompts a client, or NP prompts in all; BUDGET (560) seconds a phase,
# levels that no longer fit skipped; EVENTS_S=S keeps each measured pass's first S seconds of
# timeline events; WARM_WINDOW=1 summarises the discarded first pass's timeline too.
# Wheels the GPU image lacks (starlette, msgspec, uvicorn, ...) are installed from $WHEELS
# (default .whl) when it holds any. Compile caches: SAVE_CACHE=1 packs them to $OUT/cache.tgz.*
# (15 MB parts), CACHE=DIR restores them, so a later run's first server is ready in 70-110 s
# instead of ~230. These variables, set below for every server, take the place of the servers'
# engine.compile_cache_dir.
set -u
PHASE=${1:?usage: device_runs.sh table|ceilings|sweep|peer|newvoices|nvcompare|startup|encoder|gputests|families [NAME...]|invariant|faults|build|flags|agents|precision}
OUT=${OUT:-$PWD/device_results}
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 PYTHONUNBUFFERED=1
export TORCHINDUCTOR_CACHE_DIR=/tmp/cache/inductor TRITON_CACHE_DIR=/tmp/cache/triton
WHEELS=${WHEELS:-.whl}
if ls "$WHEELS"/*.whl >/dev/null 2>&1; then  # none: the environment has them all already
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
    "$WHEELS"/*.whl || exit 1
fi
export PYTHONPATH=/tmp/site:$PWD
mkdir -p /tmp/cache
if [ -n "${CACHE:-}" ] && ls "$CACHE"/cache.tgz.* >/dev/null 2>&1; then
  cat "$CACHE"/cache.tgz.* | tar xzf - -C /tmp/cache && echo "compile caches restored: $(du -sh /tmp/cache | cut -f1)"
fi
mkdir -p /tmp/bin && export PATH=/tmp/bin:$PATH  # a command, not a function: `timeout` runs it
printf '#!/bin/sh\nexec python3 -c "import sys; from cli.main import main; sys.argv[0] = %s; sys.exit(main())" "$@"\n' \
  "'mossvox'" > /tmp/bin/mossvox && chmod +x /tmp/bin/mossvox
mono() { python3 -c 'import time; print(time.monotonic())'; }
R=$OUT/r; mkdir -p "$R"
T0=$(date +%s); el() { echo "[t=$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( ${BUDGET:-560} - ($(date +%s) - T0) )); }
finish() {
  el "done"
  tar czf "$OUT/results_$PHASE.tgz" -C "$OUT" r
  [ -n "${SAVE_CACHE:-}" ] && (cd /tmp/cache && tar czf - inductor triton 2>/dev/null | split -b 15m - "$OUT/cache.tgz.")
  ls -la "$OUT"
}
trap finish EXIT
python3 -c 'import torch, triton; print("torch", torch.__version__, "triton", triton.__version__, torch.cuda.device_count(), "GPU")'

start_server() {  # start_server PORT NAME SERVE_ARGS... ; sets SPID. SERVER_TREE=DIR: serve DIR's build
  local port=$1 name=$2; shift 2
  # from inside the tree served: `python -c` puts the working directory ahead of PYTHONPATH
  (cd "${SERVER_TREE:-.}" && PYTHONPATH=/tmp/site:$PWD exec mossvox serve "${MODEL:-/tmp/l15}" --port "$port" "$@") \
    > "$R/serve_$name.log" 2>&1 &
  SPID=$!
  for _ in $(seq 1 400); do
    curl -sf "localhost:$port/ready" >/dev/null && break
    kill -0 $SPID 2>/dev/null || break; [ "$(left)" -lt 30 ] && break; sleep 1
  done
  el "$name ready: $(curl -s "localhost:$port/ready")"
}
stop_server() {
  kill -INT $SPID; for _ in $(seq 1 30); do kill -0 $SPID 2>/dev/null || break; sleep 1; done; kill -9 $SPID 2>/dev/null
  grep -E "ERROR|Traceback|exited|captured|loaded in|warm-up batch|compile [0-9]+:|ready in|weights:|ms step|garbage collection" \
    "$R/serve_$1.log" | head -48 | cut -c1-300
}
bench() {  # bench PORT NAME C [extra bench args]
  local port=$1 name=$2 c=$3; shift 3
  local n=${NP:-$(( c * ${PER:-3} ))}; [ $n -lt 8 ] && n=8
  timeout $(( $(left) - 10 )) mossvox bench serve --url "http://127.0.0.1:$port" --concurrency "$c" \
    --num-prompts $n --no-progress --out "$R/${name}_c$c.json" "$@" > "$R/${name}_c$c.txt" 2>&1
  el "$name C=$c rc=$?"; grep -E "^\| [0-9]|client CPU|at full load|gap over|failed request" "$R/${name}_c$c.txt" | head -6
  curl -s "localhost:$port/metrics" > "$R/${name}_c${c}_metrics.txt"
}
sweep() {  # sweep PORT NAME "CS" SERVE_ARGS...
  local port=$1 name=$2 cs=$3; shift 3
  start_server "$port" "$name" "$@"
  for c in $cs; do
    [ "$(left)" -lt 40 ] && { el "$name: no time left for C=$c"; break; }
    bench "$port" "$name" "$c"
  done
  nvidia-smi --query-gpu=memory.used --format=csv,noheader ${CUDA_VISIBLE_DEVICES:+-i $CUDA_VISIBLE_DEVICES} \
    | sed "s/^/$name GPU memory: /"
  stop_server "$name"
}
pair() {  # pair PORT NAME "CS": per level a first pass (shown) and the measured pass, its window
  # kept; PASSES=N: N measured passes (NAME, NAME_r2, ...: one server's passes differ by ~2%,
  # servers by up to ~8%, so a lever under ~5% needs several)
  local port=$1 name=$2 cs=$3 i run
  for c in $cs; do
    [ "$(left)" -lt 60 ] && { el "$name: no time left for C=$c"; break; }
    a=$(mono); bench "$port" "${name}_warm" "$c" --no-warmup; b=$(mono)
    [ -n "${WARM_WINDOW:-}" ] && echo "${name}_warm $c $a $b" >> "$R/windows.txt"
    for i in $(seq 1 "${PASSES:-1}"); do
      run=$name; [ "$i" -gt 1 ] && run=${name}_r$i
      [ "$i" -gt 1 ] && [ "$(left)" -lt 40 ] && break
      a=$(mono); bench "$port" "$run" "$c" --no-warmup; b=$(mono)
      echo "$run $c $a $b" >> "$R/windows.txt"
    done
  done
}
compare() {  # compare "CS" NAME "FLAGS" [NAME "FLAGS"]...: a server of PROFILE (high-concurrency) per
  # NAME in turn (with its timeline), each through `pair` at the levels CS, while the budget allows one
  local -; set -f  # flags such as chunking.ramp=[4,8] stay words, never file patterns
  local cs=$1; shift
  while [ $# -ge 2 ]; do
    local name=$1 flags=$2; shift 2
    [ "$(left)" -lt 150 ] && { el "$name: no time left"; break; }
    start_server 8000 "$name" --profile "${PROFILE:-high-concurrency}" --set engine.timeline_dir=/tmp/tl_$name $flags
    pair 8000 "$name" "$cs"
    stop_server "$name"
  done
}
steps_as_shipped() {  # steps_as_shipped "BENCH FLAGS"...: the talker's step alone at ROWS (48; a list: each) rows
  # with high-concurrency's paths (compiled, one step ahead, the local attention and sampling
  # kernels, fused projections, the layer kernel, the sums deferred), once per argument, into
  # talker_steps.txt
  local v
  for v in "$@"; do
    [ "$(left)" -lt ${STEP_MIN_S:-150} ] && { el "no time left for the step with '$v'"; break; }
    timeout $(( $(left) - 10 )) python3 -m bench.local_v15_profile_step --batch ${ROWS:-48} --context ${CONTEXT:-200} \
      --attention triton --compile --compiled-only --top 14 --local-attention kernel --fused-sampling --overlap \
      --fused-projections --qk-rope-store --deferred-residuals $v 2>&1 | grep -v -i warn | tee -a "$R/talker_steps.txt" \
      | grep -E "^B=|kernel time|compilation"
  done
}
summaries() {  # per line of windows.txt (NAME C START END): its timeline over that window, one line
  while read -r name c a b; do
    python3 -m bench.timeline "/tmp/tl_${name%%_*}" --window "$a" "$b" --first-wave "$c" \
      --json "$R/timeline_${name}_c$c.json" ${EVENTS_S:+--events "$R/events_${name}_c$c.jsonl" --events-s "$EVENTS_S"} > /dev/null
    python3 - "$R/timeline_${name}_c$c.json" "$name C=$c" <<'PY'
import json, sys
d = json.load(open(sys.argv[1]))[0]
t, k, g = d.get("talker", {}), d.get("codec", {}), d["gpu"]
ms = lambda s, key="mean": round(s.get(key, 0.0), 1)
print(sys.argv[2], "| talker step", ms(t["step_ms"]), "max", ms(t["step_ms"], "max"), "decode-only",
      ms(t["decode_only_step_ms"]), "rows", round(t["rows_per_step"], 1), "| prefill", t["prefill_steps"], "x",
      ms(t["prefill_step_ms"]), "ms,", t.get("prefill_tokens"), "tokens,", t.get("cached_prompt_tokens"), "cached",
      "| codec", k.get("dispatches"), "x", ms(k.get("decode_ms", {})), "ms,", round(k.get("chunks_per_dispatch", 0), 1),
      "chunks,", round(k.get("calls_per_dispatch", 0), 2),
      "calls of", round(k.get("rows_per_call", 0), 1), "rows,", round(100 * k.get("padding_share", 0)), "% padding,",
      round(k.get("decode_us_per_frame", 0)),
      "us/frame | busy", round(g["talker_busy"], 2), round(g["codec_busy"], 2),
      "| talker on the GPU: step", ms(t.get("gpu_step_ms", {})), "p90", ms(t.get("gpu_step_ms", {}), "p90"),
      "idle before it", ms(t.get("gpu_idle_ms_per_step", {})), "p90", ms(t.get("gpu_idle_ms_per_step", {}), "p90"),
      "busy", round(t.get("gpu_busy", 0.0), 2), "idle", round(t.get("gpu_idle_share", 0.0), 2),
      "| on the GPU: prefill steps", ms(t.get("gpu_prefill_step_ms", {})), "decode-only", ms(t.get("gpu_decode_only_step_ms", {})),
      "a step =", *(f"{f['fixed_ms']:.2f} ms + {f['ms_per_decode_row']:.3f} ms a decode row + {f['us_per_prompt_token']:.1f} us a prompt token"
                    for f in [t["gpu_step_fit"]] if "gpu_step_fit" in t),
      "| steps over 100 ms", t.get("steps_over_100ms"), "graphs recorded", t.get("graphs_recorded"),
      "compiles", t.get("compiles"), "triton kernels", t.get("triton_kernels"), "gc ms", round(t.get("gc_ms", 0.0), 1),
      "allocating steps", t.get("allocating_steps"), "longest", round(t.get("allocating_step_max_ms", 0.0), 1))
e = d.get("encode")
if e:
    print("   ", sys.argv[2], "encode |", e["batches"], "batches of", round(e["clips_per_batch"], 1), "clips,",
          ms(e["batch_ms"]), "ms a batch (p90", ms(e["batch_ms"], "p90"), "max", ms(e["batch_ms"], "max"), "),",
          round(e["ms_per_clip"], 1), "ms a clip, in flight", round(e["busy"], 2), "of the pass | queued",
          round(e.get("queued_ms_per_clip", 0), 1), "ms a clip (max", round(e.get("queued_max_ms", 0), 1), "),",
          round(e.get("left_waiting", 0), 1), "left waiting, handed", ms(e.get("handed_ms", {})),
          "ms | round trip", ms(e.get("round_trip_ms", {})), "p90", ms(e.get("round_trip_ms", {}), "p90"))
for part in ("requests", "requests_first_wave", "requests_later"):
    r = d.get(part, {})
    parts = (f"(parsed {ms(r.get('received_to_parsed_ms', {}))}, voice {ms(r.get('parsed_to_voice_ms', {}))}"
             f" = loaded {ms(r.get('parsed_to_loaded_ms', {}))} + codes {ms(r.get('loaded_to_voice_ms', {}))},"
             f" submit {ms(r.get('voice_to_submit_ms', {}))})")
    print("   ", sys.argv[2], part, "ms | received to submit", ms(r.get("received_to_submit_ms", {})), parts,
          "| submit to admit", ms(r.get("submit_to_admit_ms", {})),
          "| admit to first frame", ms(r.get("admit_to_first_frame_ms", {})),
          "| first frame to first chunk", ms(r.get("first_frame_to_first_chunk_ms", {})),
          "| first chunk to client", ms(r.get("first_chunk_to_client_ms", {})),
          "| taken", ms(r.get("first_chunk_in_client_to_taken_ms", {})),
          "| out", ms(r.get("first_chunk_taken_to_out_ms", {})),
          "| last frame to final chunk", ms(r.get("last_frame_to_final_chunk_ms", {})),
          "| final chunk to client", ms(r.get("final_chunk_to_client_ms", {})))
PY
  done < "$R/windows.txt"
  python3 -m bench.passes "$R" | tee "$R/passes.md"  # the measured passes, server against server
}
gpumem() { nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits | head -1; }  # MiB
live_pid() {  # live_pid PATTERN LOG: the pid (grep -o group) of the last line matching, still alive
  local pid
  for pid in $(grep -oE "$1" "$2" | grep -oE '[0-9]+' | tac); do
    kill -0 "$pid" 2>/dev/null && { echo "$pid"; return; }
  done
}
clients_saw() {  # clients_saw JSON: the bench's failed requests by what the client got
  python3 - "$1" <<'PY'
import collections, json, re, sys
try:
    runs = json.load(open(sys.argv[1]))["runs"]
except (OSError, ValueError, KeyError) as exc:
    print(f"  no bench results ({exc})"); sys.exit()
for run in runs:
    failed = [r for r in run.get("requests", []) if r.get("error")]
    kinds = collections.Counter(re.sub(r"[0-9.]+ (s|bytes)", "N \\1", r["error"])[:90] for r in failed)
    print(f"  C={run['concurrency']}: {run['num_requests']} requests, {run['num_failed']} failed")
    for kind, n in kinds.most_common(6):
        print(f"    {n} x {kind}")
PY
}
fault() {  # fault NAME SIGNAL PID: SIGNAL to PID while C (64) clients stream; the downtime (kill to
  # /ready 200 again, and the coordinator's own figure), the restart's phases, what the clients saw
  local name=$1 sig=$2 pid=$3 c=${C:-64} t0 t1 m0 bpid
  [ -n "$pid" ] || { el "$name: no pid to signal"; return; }
  m0=$(gpumem)
  NP=$(( c * ${PER_FAULT:-8} )) bench 8000 "fault_$name" "$c" --no-warmup > "$R/fault_${name}_bench.txt" &
  bpid=$!
  sleep "${LOAD_S:-15}"
  t0=$(mono); kill "-$sig" "$pid"; el "$name: SIG$sig to pid $pid under C=$c"
  if [ "$name" != api ]; then  # an API process's death leaves /ready 200 (the other one answers)
    for _ in $(seq 1 100); do curl -sf localhost:8000/ready >/dev/null || break; sleep 0.1; done
    for _ in $(seq 1 1200); do curl -sf localhost:8000/ready >/dev/null && break; sleep 0.1; done
    t1=$(mono)
    el "$name: /ready 200 again $(python3 -c "print(round($t1 - $t0, 1))") s after the signal"
  fi
  wait $bpid; cat "$R/fault_${name}_bench.txt"
  grep -E "back in service|replaced in|replaced by pid|has not beaten|captured|loaded in|ready in|warm-up batch|attached the new" \
    "$R/serve_faults.log" | tail -12 | cut -c1-260
  clients_saw "$R/fault_${name}_c$c.json"
  el "$name: GPU memory ${m0} MiB before, $(gpumem) MiB after; 500s in the log: $(grep -c '" 500\|status 500\|HTTP 500' "$R/serve_faults.log"), tracebacks: $(grep -c Traceback "$R/serve_faults.log")"
}

new_voices() {  # new_voices NAME "FLAGS": a PROFILE (high-concurrency) server from its start, NP
  # (1088) prompts a pass with every voice new at CS (128 64), then (KNOWN=1, or phase newvoices)
  # known voices: NP_KNOWN (384) prompts sent twice, the second measured; timelines
  local -; set -f
  local name=$1 flags=$2 s0 a b c
  [ "$(left)" -lt 150 ] && { el "$name: no time left"; return; }
  s0=$(date +%s)
  start_server 8000 "$name" --profile "${PROFILE:-high-concurrency}" --set engine.timeline_dir=/tmp/tl_$name $flags
  el "$name: /ready $(( $(date +%s) - s0 )) s after the start"
  grep -E "memory plan|planned|captured|ready .* after" "$R/serve_$name.log" | cut -c1-400 | head -12
  for c in ${CS:-128 64}; do
    [ "$(left)" -lt 60 ] && { el "$name: no time left for C=$c"; break; }
    a=$(mono); NP=${NP:-1088} bench 8000 "$name" "$c" --no-warmup; b=$(mono)
    echo "$name $c $a $b" >> "$R/windows.txt"
  done
  if [ -n "${KNOWN:-}" ] && [ "$(left)" -gt 70 ]; then
    NP=${NP_KNOWN:-384} bench 8000 "${name}_knownfirst" 128 --no-warmup --voices known
    a=$(mono); NP=${NP_KNOWN:-384} bench 8000 "${name}_known" 128 --no-warmup --voices known; b=$(mono)
    echo "${name}_known 128 $a $b" >> "$R/windows.txt"
  fi
  nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
  grep -E "memory_(card|usable)|memory_(planned|peak)|kv_tokens" "$R/${name}_c128_metrics.txt" | grep -v "^#"
  stop_server "$name"
}
checkpoint() {
  [ -f /tmp/l15/config.json ] || mossvox make-checkpoint --variant local-v1.5 --size full --out /tmp/l15 > "$R/mkck.log" 2>&1 || { tail "$R/mkck.log"; exit 1; }
  el "checkpoint written"
}

case $PHASE in
table)  # the headline table as shipped: high-concurrency at HC_LEVELS (1 16 64 128 256), then
  # low-latency at LL_LEVELS (1 64), PASSES (2) measured passes a level after a discarded one
  checkpoint
  PASSES=${PASSES:-2} compare "${HC_LEVELS:-1 16 64 128 256}" hc ""
  PROFILE=low-latency PASSES=${PASSES:-2} compare "${LL_LEVELS:-1 64}" ll ""
  summaries
  ;;
ceilings)  # the stage ceilings beside the server's figures, as high-concurrency ships them: the codec's
  # B=128 replays of 1 and 15 frames (ring attention in place, fused ring writes and norms), then
  # the talker's decode step alone at ROWS (128) rows of CONTEXT (300) keys (steps_as_shipped, bf16
  # weights; CEIL_FLAGS adds flags, e.g. the opt-in float8 backbone's
  # "--fp8 backbone --fp8-scheme w8a8 --fp8-swiglu --fp8-scales")
  timeout $(( $(left) * 2 / 5 )) python3 -m bench.codec --version v2 --size full --batches 128 --grid 1,15 --iters 5 \
    --ring-attention --fused-writes --fused-norms 2>&1 | grep -v "^exactness" | tee "$R/ceiling_codec.txt" | tail -6
  ROWS=${ROWS:-128} CONTEXT=${CONTEXT:-300} steps_as_shipped \
    "${CEIL_FLAGS-}"
  ;;
sweep)  # both profiles over their levels (HC_LEVELS, LL_LEVELS; empty skips a profile)
  checkpoint
  [ -n "${HC_LEVELS-1 16 64 128 256}" ] && sweep 8000 hc "${HC_LEVELS-1 16 64 128 256}" --profile high-concurrency
  [ -n "${LL_LEVELS-1 16 64 128}" ] && sweep 8001 ll "${LL_LEVELS-1 16 64 128}" --profile low-latency
  ;;
peer)  # the shipped profile at the peers' pass size (NP=1088, the whole Seed-TTS EN set a pass,
  # first pass discarded) beside ours (3 prompts a client), C=128 and 64, PASSES (1) each
  checkpoint
  start_server 8000 shipped --profile high-concurrency --set engine.timeline_dir=/tmp/tl_shipped ${FLAGS:-}
  pair 8000 shipped "128 64"
  WARM_WINDOW=1 NP=1088 pair 8000 shipped_np1088 "128 64"  # the first 1088 pass meets ~700 new voices
  stop_server shipped
  summaries
  ;;
newvoices)  # the headline protocol: every voice new to the server. PROFILE (high-concurrency) from
  # its start (time to /ready and the memory plan in the log), NP (1088) prompts a pass, every
  # voice new, at CS (128 64), no discarded pass, timelines; then known voices: NP_KNOWN (384)
  # prompts sent once (--voices known) and again (measured). FLAGS changes the server.
  checkpoint
  KNOWN=1 new_voices nv "${FLAGS:-}"
  summaries
  ;;
nvcompare)  # every voice new, server against server: PROFILE as shipped (nv), then with FLAGS (alt)
  # and FLAGS2 (alt2) when set, each from its start, NP (1088) prompts at CS (128 64); KNOWN=1
  # adds the known-voice passes
  checkpoint
  new_voices nv ""
  new_voices alt "${FLAGS:?serve options}"
  [ -n "${FLAGS2:-}" ] && new_voices alt2 "$FLAGS2"
  summaries
  ;;
startup)  # each of PROFILES (default low-latency) from its start, with FLAGS (serve options) when
  # set: time to /ready and where it went (the workers' weights, warm-up batches, compiles,
  # captures and the engine's breakdown line), its memory plan and use, one short pass of C (16)
  # new voices; COLD=1: each server with empty compile caches of its own (a fresh machine's
  # start), TWICE=1: each started again after, finding the first start's caches; then the
  # refusal of a card too small: the default profile with memory.gpu_utilization set so the plan
  # sees 24 and 48 GB
  checkpoint
  for p in ${PROFILES:-default low-latency}; do
    for round in 1 ${TWICE:+2}; do
      n=$p${FLAGS:+_flags}${TWICE:+_start$round}
      [ "$(left)" -lt 120 ] && { el "$n: no time left to start it"; break 2; }
      if [ -n "${COLD:-}" ]; then  # the caches of this profile's first start, empty then
        export TORCHINDUCTOR_CACHE_DIR=/tmp/cold/$p${FLAGS:+_flags}/inductor TRITON_CACHE_DIR=/tmp/cold/$p${FLAGS:+_flags}/triton
        [ "$round" = 1 ] && rm -rf "/tmp/cold/$p${FLAGS:+_flags}"
      fi
      s0=$(date +%s)
      start_server 8000 "$n" --profile "$p" ${FLAGS:-}
      el "$n: /ready $(( $(date +%s) - s0 )) s after the start"
      grep -E "engine ready in|warm-up batch|compile [0-9]+:|: captured|weights:|memory plan|planned" \
        "$R/serve_$n.log" | cut -c1-400 | head -60
      NP=$(( ${C:-16} * 2 )) bench 8000 "$n" "${C:-16}" --no-warmup
      nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader
      stop_server "$n"
    done
  done
  export TORCHINDUCTOR_CACHE_DIR=/tmp/cache/inductor TRITON_CACHE_DIR=/tmp/cache/triton
  total=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits | head -1)  # MiB
  for gb in 24 48; do
    u=$(python3 -c "print(round($gb * 1e9 / ($total * 2**20), 4))")
    s0=$(date +%s)
    timeout 120 mossvox serve "${MODEL:-/tmp/l15}" --port 8009 --profile default \
      --set memory.gpu_utilization=$u > "$R/serve_refuse$gb.log" 2>&1
    el "a ${gb} GB card (gpu_utilization $u): exit $? after $(( $(date +%s) - s0 )) s"
    grep -E "MemoryPlanError|needs at least|memory plan" "$R/serve_refuse$gb.log" | cut -c1-500 | head -3
  done
  ;;
encoder)  # the reference encoder alone, full size: BATCHES of 6 s clips in MODES, profiles, a loop beside
  timeout $(( $(left) - 10 )) python3 -m bench.encoder --size full --batches "${BATCHES:-1,8,16,32}" \
    --modes "${MODES:-eager,fused,graphs,fused+graphs}" --profile --top 8 --beside 5 2>&1 | grep -v -i warn | tee "$R/encoder.txt"
  ;;
gputests)  # GPU-marked tests: TESTS (tests/stages) filtered by K (every test when empty)
  timeout $(( $(left) - 10 )) python3 -m pytest -q -p no:cacheprovider -m gpu ${TESTS:-tests/stages} \
    ${K:+-k "$K"} 2>&1 | tee "$R/gpu_tests_full.txt" | tail -12 | tee "$R/gpu_tests.txt"
  ;;
families)
  shift
  NAMES=(${*:-delay ttsd sound-effect realtime voice-generator})
  NGPU=${GPUS:-$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')}; [ "$NGPU" -ge 1 ] || NGPU=1
  # the first NGPU families get a GPU each; the others queue behind them from the last GPU back
  # (named last: the 1.7B models). CUDA_VISIBLE_DEVICES, not engine.devices: each server's private
  # MPS daemon must see its GPU only.
  declare -A QUEUE
  for i in "${!NAMES[@]}"; do
    g=$(( i < NGPU ? i : NGPU - 1 - (i - NGPU) % NGPU ))
    QUEUE[$g]="${QUEUE[$g]:-} $i"
  done
  for g in "${!QUEUE[@]}"; do
    (
      export CUDA_VISIBLE_DEVICES=$g
      for i in ${QUEUE[$g]}; do
        name=${NAMES[$i]}
        [ "$(left)" -lt 120 ] && { el "$name: no time left to start it"; continue; }
        mossvox make-checkpoint --variant "$name" --size "${SIZE:-full}" --out "/tmp/fam_$name" \
          > "$R/mkck_$name.log" 2>&1 || { el "$name: make-checkpoint failed"; tail -3 "$R/mkck_$name.log"; continue; }
        el "$name checkpoint written; serving it on GPU $g"
        MODEL=/tmp/fam_$name sweep $(( 8000 + i )) "$name" "${CS:-1 16 64}" --profile "${PROFILE:-high-concurrency}" \
          --set engine.timeline_dir=/tmp/tl_$name
        python3 -m bench.timeline /tmp/tl_$name --json "$R/timeline_$name.json" > "$R/timeline_$name.txt" 2>&1
        cp -r /tmp/tl_$name "$R/"
        rm -rf "/tmp/fam_$name"
      done
    ) &
  done
  wait
  el "every family's runs (profile ${PROFILE:-high-concurrency}; smooth: no stall over 100 ms)"
  python3 - "$R" "${NAMES[@]}" <<'PY'
import json, pathlib, sys
root, names = pathlib.Path(sys.argv[1]), sys.argv[2:]
print("| family | C | audio-s/s | TTFA mean / p50 / p99 | smooth | failed | ignored fields |")
print("|---|---:|---:|---|---:|---:|---|")
for name in names:
    outs = sorted(root.glob(f"{name}_c*.json"), key=lambda p: int(p.stem.rsplit("_c", 1)[1]))
    if not outs:
        print(f"| {name} | - | no run | | | | |")
    for out in outs:
        for r in json.loads(out.read_text())["runs"]:
            t = r["ttfa_ms"]
            ttfa = " / ".join("-" if t.get(k) is None else f"{t[k]:.1f}" for k in ("mean", "p50", "p99"))
            print(f"| {name} | {r['concurrency']} | {r['audio_s_per_s']} | {ttfa} ms "
                  f"| {100 * r['share_smooth']:.0f}% | {r['num_failed']} of {r['num_requests']} "
                  f"| {', '.join(f'{k} ({n})' for k, n in r['ignored_fields'].items()) or '-'} |")
PY
  ;;
invariant)  # batch invariance needs the paths it has kernels for: bf16 weights (as shipped), sdpa
  # local attention, codec chunks decoded uncut; both servers run those, one with it off, one on
  checkpoint
  inv="--set talker.local_attention=sdpa --set codec.split_chunks=false"
  [ -z "${SKIP_TESTS:-}" ] && timeout 300 python3 -m pytest -q -s -p no:cacheprovider \
    tests/stages/test_batch_invariant_gpu.py tests/stages/test_batch_invariant.py \
    tests/stages/test_attention_triton.py 2>&1 | tail -8 | tee "$R/invariant_tests.txt"
  start_server 8000 inv_off --profile high-concurrency $inv
  pair 8000 inv_off "1 64 128"
  stop_server inv_off
  start_server 8001 inv_on --profile high-concurrency $inv --set talker.batch_invariant=true
  pair 8001 inv_on "1 64 128"
  stop_server inv_on
  ;;
precision)  # the opt-in float8 backbone (FP8_FLAGS) against bf16 by mossvox check-precision: 8 prompts
  # x 256 frames, fp32's sampled codes read by each way, PASS when the mean KL from bf16 is at most
  # 1e-3 nats a code; a full-size checkpoint with outlier channels (/tmp/l15o), then the plain one
  [ -f /tmp/l15o/config.json ] || mossvox make-checkpoint --variant local-v1.5 --size full --out /tmp/l15o \
    --outlier-channels > "$R/mkck_outliers.log" 2>&1 || { tail "$R/mkck_outliers.log"; exit 1; }
  el "checkpoint with outlier channels written"
  fp8="--set talker.fp8_weights=backbone --set talker.fp8_scheme=w8a8 --set talker.fp8_fused_swiglu=true"
  fp8=${FP8_FLAGS:-"$fp8 --set talker.fp8_fused_scales=true"}
  [ -z "${COMPILED:-}" ] && fp8="$fp8 --set talker.compile=false"
  timeout $(( $(left) * 3 / 5 )) mossvox check-precision /tmp/l15o --profile high-concurrency $fp8 --device cuda \
    2>&1 | grep -v -i warn | tee "$R/precision_outliers.txt" | tail -12
  el "outlier channels: rc=${PIPESTATUS[0]}"
  checkpoint
  timeout $(( $(left) - 10 )) mossvox check-precision /tmp/l15 --profile high-concurrency $fp8 --device cuda \
    2>&1 | grep -v -i warn | tee "$R/precision_plain.txt" | tail -12
  el "plain: rc=${PIPESTATUS[0]}"
  ;;
faults)  # each process kind killed under load: PROFILE (high-concurrency) with API_SERVERS (2) API
  # processes and engine.liveness_timeout_s LIVENESS (10), C (64) clients; FAULTS (codec talker api
  # stop) in turn, then KILLS (5) codec kills in a row without load, GPU memory after each
  checkpoint
  start_server 8000 faults --profile "${PROFILE:-high-concurrency}" --set "api.api_servers=${API_SERVERS:-2}" \
    --set "engine.liveness_timeout_s=${LIVENESS:-10}" --set engine.restart_backoff_s=0 --set engine.restart_limit=20
  log=$R/serve_faults.log
  for f in ${FAULTS:-codec talker api stop}; do
    [ "$(left)" -lt 90 ] && { el "$f: no time left"; break; }
    case $f in
      codec) fault codec KILL "$(live_pid 'codec0\[[0-9]+\]' "$log")" ;;
      talker) fault talker KILL "$(live_pid 'talker0\[[0-9]+\]' "$log")" ;;
      api) fault api KILL "$(live_pid 'Started server process \[[0-9]+\]' "$log")" ;;
      stop) fault stop STOP "$(live_pid 'codec0\[[0-9]+\]' "$log")" ;;
    esac
  done
  el "codec kills in a row, no load: GPU memory $(gpumem) MiB before"
  for i in $(seq 1 "${KILLS:-5}"); do
    [ "$(left)" -lt 40 ] && { el "kill $i: no time left"; break; }
    t0=$(mono); kill -KILL "$(live_pid 'codec0\[[0-9]+\]' "$log")"; sleep 0.5
    for _ in $(seq 1 600); do curl -sf localhost:8000/ready >/dev/null && break; sleep 0.1; done
    el "kill $i: ready again after $(python3 -c "print(round($(mono) - $t0, 1))") s, GPU memory $(gpumem) MiB"
  done
  curl -s localhost:8000/metrics | grep -E "^mossvox_(engine_(restarts|talker_restarts|codec_restarts|hung_workers|api_restarts|restart_last_s|ready)|streams_cut)" \
    | tee "$R/faults_metrics.txt"
  stop_server faults
  ;;
build)  # the build in BASE against this one, one server each (base, shipped), both with PROFILE
  checkpoint
  SERVER_TREE=${BASE:?a tree of the earlier build} PASSES=${PASSES:-2} compare "${CS:-128 64}" base ""
  PASSES=${PASSES:-2} compare "${CS:-128 64}" shipped ""
  summaries
  ;;
flags)  # the shipped profile (PROFILE, high-concurrency) against it with FLAGS (serve options), then
  # with FLAGS2 and FLAGS3 when set (servers alt, alt2, alt3), at CS (128 64), PASSES (2) each
  checkpoint
  PASSES=${PASSES:-2} compare "${CS:-128 64}" shipped "" alt "${FLAGS:?serve options}" \
    ${FLAGS2:+alt2 "$FLAGS2"} ${FLAGS3:+alt3 "$FLAGS3"}
  summaries
  ;;
agents)  # first audio after the first sentence's last word, three protocols (bench.agent_latency):
  # PROFILE (low-latency) with lengths forced from the text, CS (1 16 64), REPLIES (4) a client
  checkpoint
  start_server 8000 agents --profile "${PROFILE:-low-latency}" --set model.force_length_from_text=true
  timeout $(( $(left) - 30 )) python3 -m bench.agent_latency --url http://127.0.0.1:8000 \
    --concurrency "$(echo "${CS:-1 16 64}" | tr ' ' ,)" --replies "${REPLIES:-4}" --json "$R/agents.json" 2>&1 | tee "$R/agents.txt"
  stop_server agents
  ;;
*) echo "unknown phase $PHASE"; exit 2 ;;
esac
