#!/bin/bash
# Whole GPU measurements, one device call per phase (docs/performance.md says what each found).
# Run from the tree to measure; wheels the GPU image lacks (starlette, msgspec, uvicorn, av, ...)
# in $WHEELS (default .whl). Each phase keeps to $BUDGET seconds (default 560) by skipping the
# levels that no longer fit; results go to $OUT/results_PHASE.tgz (phases can follow each other in one call); with SAVE_CACHE=1 the compile caches
# go to $OUT/cache.tgz.* (12-40 MB packed, 15 MB a part; restored from $CACHE, when given, so a
# later call's first server is ready in 70-110 s instead of ~230).
# $WHEELS may leave out PyAV's wheel (35 of its 37 MB): the API imports PyAV only for compressed
# formats, other rates or channels, and clips libsndfile cannot read, none of which a pass asks
# for; that leaves room in what a call carries (64 MiB) for the compile caches.
# PASSES=N gives every level of a `pair` (the phases that compare servers) N measured passes;
# a pass sends PER (3) prompts a client, or NP prompts in all; EVENTS_S=S keeps each measured
# pass's first S seconds of timeline events (events_NAME_cC.jsonl); WARM_WINDOW=1 summarises the
# first pass's timeline too.
#
#   bash docs/device_runs.sh timeline   # one server, C=128 then C=64, with the workers' timelines;
#                                       # then the codec's replay-cost grid and kernel profile and
#                                       # the talker step's kernel profile
#   BASE=DIR bash docs/device_runs.sh compare
#                                       # the build in DIR (the baseline) and this one, one server
#                                       # each, high-concurrency C=128 and 64 (this one with its
#                                       # timeline and C=1), low-latency C=1 and 64; first the GPU
#                                       # tests of the codec graphs
#   bash docs/device_runs.sh knobs      # this build's high-concurrency server as shipped (C=128, C=1)
#                                       # and with larger prefill and codec windows (C=128), each
#                                       # with its timeline; then the talker's prefill-step profile
#   bash docs/device_runs.sh prefill    # the GPU tests of the talker and codec graphs; then
#                                       # high-concurrency with and without talker.prefill_graphs
#                                       # and talker.capture_ahead (C=128, 64, 1, each level's
#                                       # first pass shown too; timelines), one server each
#   bash docs/device_runs.sh lazy       # high-concurrency with talker.prefill_graphs captured on first
#                                       # use (C=128, 64, 1), then also with the patient codec window
#                                       # (coalescing.patient_wait_ms 300, min_batch 64; C=128, 64)
#   bash docs/device_runs.sh codecserve # the codec's compile and ring-attention GPU tests, its replay grid
#                                       # (B=128, 1 and 15 frames) as shipped and with both, then the
#                                       # server with both and talker.prefill_graphs (C=128, 64)
#   bash docs/device_runs.sh prefillprof # the talker step with 7 new 170-row prompts beside 86 decoding
#                                       # requests (C=128's mean), eager and from prefill graphs: op tables
#   bash docs/device_runs.sh buckets    # high-concurrency with talker.prefill_graphs (captured at warm-up,
#                                       # one per token bucket), then without (C=128, 64, 1), timelines
#   bash docs/device_runs.sh codec      # the codec's replay grid (B=64, 128 x 1, 4, 15 frames): as
#                                       # shipped, compiled layers, ring attention in place, both;
#                                       # first its GPU tests
#   bash docs/device_runs.sh invtests   # the batch-invariant tests alone (GPU and interpreter)
#   bash docs/device_runs.sh codecsplit # the codec's B=128 replay grid (1, 4, 15 frames), compiled layers
#                                       # alone, then ring attention alone
#   BASE=DIR bash docs/device_runs.sh ringshort
#                                       # high-concurrency of the build in DIR, then this build with the
#                                       # codec's ring attention for chunks up to 4 frames (C=128, 64;
#                                       # each level's first pass shown); then MOSS-TTS-Realtime (full
#                                       # size) at C=1, 16
#   bash docs/device_runs.sh ringtune   # the codec's streaming attention per stage, copied vs in place
#                                       # over a grid of kernel tiles (B=128 x 1, 4, 8, 15 frames), then
#                                       # the B=128 replay grid copied and with ring attention everywhere
#   BASE=DIR bash docs/device_runs.sh coldvoices
#                                       # the GPU test of the encode graphs; this build's
#                                       # high-concurrency with prefill graphs, ring attention at
#                                       # every chunk length and encode graphs (C=128, 64, 256, 1),
#                                       # then the build in DIR as shipped (C=128, 64); each server
#                                       # with its own empty reference cache, so every level's first
#                                       # pass encodes its voices; timelines
#   bash docs/device_runs.sh prefix     # high-concurrency without and with talker.prefix_caching, one
#                                       # server each with its own empty reference cache: C=128 new
#                                       # voices and texts, the same prompts again, known voices with
#                                       # new texts (--text-shift); C=64 twice; talker counters and
#                                       # timelines; then the same with talker.priority_stream (first
#                                       # the GPU tests of both)
#   bash docs/device_runs.sh wide       # the first call of a session (cold compile caches): as
#                                       # `prefix`, one server each, high-concurrency as shipped,
#                                       # with talker.priority_stream, then with
#                                       # talker.prefill_graph_seqs 256 (every prefill step a
#                                       # replay); timelines (their longest talker step: no kernel
#                                       # compiled under load)
#   bash docs/device_runs.sh delayprime # MOSS-TTS 8B (delay), high-concurrency as shipped (no
#                                       # reference prime), then with codec.prime_continuation:
#                                       # C=16 and 64 each, timelines
#   bash docs/device_runs.sh lanes      # the codec's GPU graph tests (two decode lanes among them);
#                                       # the codec's replay grid (16, 32, 128 rows x 1, 4, 15 frames)
#                                       # without and with codec.fused_ring_writes; high-concurrency
#                                       # as shipped, with codec.decode_lanes 2, with
#                                       # coalescing.express_joins_dispatch, with all three (C=128
#                                       # only; timelines: the codec's calls and busy share)
#   bash docs/device_runs.sh levers     # the GPU tests of the priority stream and codec graphs;
#                                       # high-concurrency as shipped, with the talker's priority
#                                       # stream, with a prefill step every step
#                                       # (talker.prefill_interval 1), with every prefill step a
#                                       # replay (talker.prefill_graph_seqs 256), as time allows
#                                       # (a fresh machine: two servers) (C=128 and 64; timelines)
#   bash docs/device_runs.sh levers2    # high-concurrency as shipped, with the talker's priority
#                                       # stream, steady chunks of 30 frames (not 15), the codec's
#                                       # lanes and fused ring writes, final chunks due at once
#                                       # (coalescing.final_wait_ms 0), as time allows (C=128, 64)
#   bash docs/device_runs.sh finals     # the codec alone by batch and chunk length (graph replays);
#                                       # high-concurrency as shipped, with final chunks due at once,
#                                       # with the codec's lanes + fused ring writes (C=128, 64;
#                                       # PASSES=2 measured passes each)
#   bash docs/device_runs.sh peer       # high-concurrency as shipped at C=128 and 64, 3 prompts a
#                                       # client, then 1088 prompts a pass (the peers' protocol:
#                                       # the whole Seed-TTS EN set, first pass discarded); FLAGS
#                                       # (serve options) change the server
#   bash docs/device_runs.sh gputests   # the GPU-marked tests of TESTS (tests/stages), K: -k filter
#   bash docs/device_runs.sh kernels    # the codec's replays at the served shapes (plain, fused
#                                       # ring writes, + compiled layers), the talker step at 88
#                                       # rows and a served-size codec call, kernel by kernel
#   bash docs/device_runs.sh talkerstep # the talker step at 88 rows as shipped, with plain local
#                                       # attention, one step ahead, and both (no server)
#   bash docs/device_runs.sh clientprocs # one server as shipped, C=128 and 64, the default client
#                                       # processes against one per 8 clients: the client's share
#                                       # of first audio (the server's own from /metrics beside it)
#   bash docs/device_runs.sh attn       # the GPU test of the in-layer KV stores; the talker's paged
#                                       # attention alone (bf16 and float8 cache, tiles, warps,
#                                       # stages, key splits), then the step by ATTN_STEPS
#   bash docs/device_runs.sh fp8mm      # the GPU tests of the float8 matmuls; the step at 88 rows
#                                       # as shipped, with a float8 backbone, float8 everywhere
#                                       # (w8a16, then w8a8); each talker weight shape alone: a
#                                       # tile sweep at 88 rows, then bf16 / w8a16 (bench.fp8_matmul),
#                                       # then cuBLAS's float8 products by scales and operand order
#                                       # (bench.fp8_cublas)
#   bash docs/device_runs.sh layers     # the GPU tests of the one-kernel q/k norms, RoPE and KV stores
#                                       # and of the deferred residual sums; the step at 88 rows as
#                                       # shipped, with the kernel, and with the sums deferred too, each
#                                       # with one backbone layer's kernels in launch order
#   BASE=DIR bash docs/device_runs.sh buildstep
#                                       # the talker's step alone at 88 rows (high-concurrency's
#                                       # paths) from the build in DIR and from this one, ROUNDS (2);
#                                       # then this one's with EXTRA (--fused-sampling); then the
#                                       # GPU tests of the paths it changed (NOTESTS=1: none)
#   bash docs/device_runs.sh ceilings   # the stages alone at the issue's shapes, as high-concurrency
#                                       # runs them: the talker's step at 128 rows (CEIL_FLAGS added)
#                                       # and the codec's B=128 replays of 1 and 15 frames
#   BASE=DIR bash docs/device_runs.sh build
#                                       # the build in DIR (an earlier commit's tree, carried)
#                                       # against this one, PROFILE, C=128 and 64 (CS), PASSES (2)
#                                       # each: a changed code default, which no --set can switch
#   bash docs/device_runs.sh projstep   # the talker step at 88 rows as shipped and with the
#                                       # backbone's projections fused and KV stores in its layers
#   bash docs/device_runs.sh flags      # high-concurrency as shipped against it with FLAGS (and
#                                       # FLAGS2, FLAGS3: one server each), C=128 and 64, PASSES (2)
#   bash docs/device_runs.sh coldvoices2  # new voices under load at C=128: encode batches of 8, 2
#                                       # and 1 (ENCS) while streams are open, each server with an
#                                       # empty reference cache
#   bash docs/device_runs.sh r148       # high-concurrency as shipped, then with the ramp 1, 4, 8
#                                       # (C=128, 64; PASSES=2 measured passes each)
#   bash docs/device_runs.sh c256       # high-concurrency as shipped at C=256, PASSES=3 passes
#   bash docs/device_runs.sh split      # one C=128-like codec dispatch padded and cut into rows
#                                       # (codec.split_chunks), then high-concurrency without and
#                                       # with it (C=128, 64, 256; PASSES=2 measured passes each)
#   bash docs/device_runs.sh codecprof  # no server: the codec's kernels at the served shapes (24 rows
#                                       # x 1, 8, 15 frames, ring attention), by time and duration
#   bash docs/device_runs.sh smshare    # high-concurrency as shipped, with the codec held to 60% and
#                                       # to 40% of the SMs (codec.sm_percent, MPS) (C=128, 64;
#                                       # PASSES=2 measured passes each)
#   bash docs/device_runs.sh stall      # the codec-lane GPU tests; high-concurrency as shipped,
#                                       # C=128 measured three times on one server (its slow steps
#                                       # logged: graphs recorded, kernels compiled), C=64; then
#                                       # SoundEffect (8B, random) at C=1 and 16
#   bash docs/device_runs.sh mixlanes   # high-concurrency as before 2026-12-02 ($BEFORE) with mixed
#                                       # steps, then also with the codec's lanes, joins and fused
#                                       # writes; with the window 32 / 25 ms; with joins (C=128)
#   bash docs/device_runs.sh mixlevels  # the same at C=64 and 256: before, mixed steps, mixed steps
#                                       # with joins and the wider window (the shipped profile since)
#   bash docs/device_runs.sh windows    # the GPU tests of mixed steps; high-concurrency before 2026-12-02,
#                                       # with talker.mixed_step_tokens 256 (decode rows and new
#                                       # prompt chunks in one replay), with the ramp 1, 4, 8 frames
#                                       # (not 1, 2, 4, 8: fewer urgent chunks), with the codec
#                                       # window 32 streams / 25 ms (not 16 / 10), then mixed steps
#                                       # with a prefill step every step if time is left (C=128
#                                       # only, so more servers fit a call; timelines)
#   bash docs/device_runs.sh ramp       # overload: high-concurrency as shipped, then with the playout
#                                       # gate (admission.min_lead_s, LEAD=0.3 s), C=256 and 128; then
#                                       # at most 160 requests running, then the ramp 1, 4, 8 frames
#                                       # (fewer urgent chunks), C=256; timelines
#   bash docs/device_runs.sh delaystall # MOSS-TTS 8B (delay): the GPU tests of the backbone and prefill
#                                       # graphs; high-concurrency as shipped (prefill graphs), with a
#                                       # step budget (talker.max_step_ms 60; STEP_MS=...), then with
#                                       # eager prefill as before: C=16 and 64 each, timelines
#   bash docs/device_runs.sh localattn  # the local attention kernel (talker.local_attention: kernel):
#                                       # its GPU tests, the kernel alone by rows and heads a program,
#                                       # then the talker's step alone at ROWS (48) with the plain
#                                       # local attention and with the kernel
#   bash docs/device_runs.sh autotune   # the talker's step alone at ROWS (48) compiled as shipped, then
#                                       # with torch.compile's max-autotune (matmul templates timed
#                                       # against cuBLAS while compiling; its compile time printed)
#   bash docs/device_runs.sh gelu       # the decoder's GELU in its first matmul (codec.gelu_epilogue):
#                                       # GPU tests, codecmix's replays without and with it, the
#                                       # audio's distance from fp32 (bench.codec_gelu)
#   bash docs/device_runs.sh codecmix   # a C=64 dispatch alone as served: the served chunk mix padded
#                                       # and cut into rows, the replay grid at 16 and 64 rows x 1,
#                                       # 2, 15 frames, the kernel table of 64 rows x 2 frames
#   bash docs/device_runs.sh codecsmall # the codec's replay grid at the batches a C=128 dispatch has
#                                       # (16, 32 rows x 1, 4, 15 frames), ring attention in place,
#                                       # without and with compiled layers (the fixed cost per replay)
#   bash docs/device_runs.sh overlap    # the GPU tests of the talker one step ahead; high-concurrency
#                                       # as shipped, then with talker.overlap_steps (C=128, 64, 1),
#                                       # timelines
#   bash docs/device_runs.sh sweep      # high-concurrency C=1..256 and low-latency C=1..128
#                                       # (HC_LEVELS, LL_LEVELS: other levels; empty skips one)
#   bash docs/device_runs.sh delay      # MOSS-TTS 8B: backbone graphs on/off, and the GPU tests
#   bash docs/device_runs.sh invariant  # the batch-invariant GPU tests (8 seeded requests alone,
#                                       # together, mixed into 64; Local-v1.5 and Delay), then
#                                       # high-concurrency with talker.batch_invariant off and on
#                                       # (C=1, 64, 128), one server each; SKIP_TESTS=1: servers only
#   BUDGET=540 bash docs/device_runs.sh families [NAME...]
#                                       # every model family (default: delay = MOSS-TTS 8B, ttsd,
#                                       # sound-effect, realtime, voice-generator), full-size random
#                                       # weights, each its own server on its own GPU, all at once:
#                                       # bench serve C=1, 16, 64 with the prompt set in the model's
#                                       # own fields (--dataset auto), then one table of every run;
#                                       # each server's timelines (every pass) in timeline_NAME.*
#                                       # One call of the 8-GPU kind (one GPU per family; on 4 GPUs
#                                       # the last two share the last GPU, one after the other; on
#                                       # fewer, name fewer families). PROFILE (high-concurrency),
#                                       # CS ("1 16 64"), SIZE (full) and GPUS (counted) change it
set -u
PHASE=${1:?usage: device_runs.sh timeline|peer|gputests|flags|kernels|talkerstep|fp8|projstep|codecone|coldvoices2|levers|levers2|stall|finals|smshare|windows|mixlanes|mixlevels|compare|knobs|prefill|lazy|codecserve|prefillprof|buckets|invtests|codecsplit|codecmix|localattn|gelu|autotune|ringshort|ringtune|codecsmall|coldvoices|prefix|wide|delayprime|lanes|ramp|delaystall|overlap|codec|sweep|delay|invariant|families [NAME...]}
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
  grep -E "ERROR|Traceback|exited|captured|loaded in|warm-up requests|after loading|ms step|garbage collection" \
    "$R/serve_$1.log" | head -24 | cut -c1-300
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
# high-concurrency as shipped before 2026-12-02 (no mixed steps; codec window 16 streams / 10 ms,
# first chunks dispatched alone): the baseline of the phases that measured the change
BEFORE="--set talker.mixed_step_tokens=0 --set coalescing.min_batch=16 --set coalescing.max_wait_ms=10 --set coalescing.express_joins_dispatch=false"
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
known_voices() {  # known_voices PORT NAME SERVE_ARGS...: a high-concurrency server through C=128
  # with new voices and texts, the same prompts again, known voices with new texts, then C=64
  local port=$1 name=$2; shift 2
  start_server "$port" "$name" --profile high-concurrency --set engine.timeline_dir=/tmp/tl_$name \
    --set api.data_dir=/tmp/data_$name "$@"
  grep -E "captured" "$R/serve_$name.log" | cut -c1-200
  bench "$port" "${name}_new" 128 --no-warmup   # new voices, new texts
  a=$(mono); bench "$port" "$name" 128 --no-warmup; b=$(mono)   # the same prompts again (the protocol)
  echo "$name 128 $a $b" >> "$R/windows.txt"
  a=$(mono); bench "$port" "${name}_texts" 128 --no-warmup --text-shift 384; b=$(mono)   # known voices, new texts
  echo "${name}_texts 128 $a $b" >> "$R/windows.txt"
  pair "$port" "$name" "64"
  grep -E "talker_(prompt|cached)_rows_total " "$R/${name}_c64_metrics.txt"
  stop_server "$name"
}
talker_steps() {  # talker_steps "BENCH FLAGS"...: the talker's step alone at 88 rows, compiled, one
  # step ahead, plain local attention, once per argument (each line: the step, its kernels; the
  # file also one backbone layer's and one local position's kernels in launch order);
  # STEP_TREE=DIR: DIR's build (its lines in the file after a line naming it)
  local v tree=${STEP_TREE:-.}
  for v in "$@"; do
    [ "$(left)" -lt 100 ] && { el "no time left for the step with '$v'"; break; }
    [ "$tree" = . ] || echo "build of $tree:" | tee -a "$R/talker_steps.txt"
    (cd "$tree" && PYTHONPATH=/tmp/site:$PWD timeout $(( $(left) - 10 )) python3 -m bench.local_v15_profile_step \
      --batch 88 --attention triton --compile --compiled-only --top 12 --local-attention plain --overlap $v) 2>&1 \
      | grep -v -i warn | tee -a "$R/talker_steps.txt" | grep -E "^B=|kernel time|^build of"
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
      "| steps over 100 ms", t.get("steps_over_100ms"), "graphs recorded", t.get("graphs_recorded"),
      "compiles", t.get("compiles"), "triton kernels", t.get("triton_kernels"), "gc ms", round(t.get("gc_ms", 0.0), 1),
      "allocating steps", t.get("allocating_steps"), "longest", round(t.get("allocating_step_max_ms", 0.0), 1))
for part in ("requests", "requests_first_wave", "requests_later"):
    r = d.get(part, {})
    parts = (f"(parsed {ms(r.get('received_to_parsed_ms', {}))}, voice {ms(r.get('parsed_to_voice_ms', {}))},"
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
checkpoint() {
  [ -f /tmp/l15/config.json ] || mossvox make-checkpoint --variant local-v1.5 --size full --out /tmp/l15 > "$R/mkck.log" 2>&1 || { tail "$R/mkck.log"; exit 1; }
  el "checkpoint written"
}

case $PHASE in
timeline)
  checkpoint
  TL=/tmp/timeline
  start_server 8000 hc --profile high-concurrency --set engine.timeline_dir=$TL
  for c in 128 64; do
    [ "$(left)" -lt 90 ] && break
    bench 8000 "hc_warm" "$c" --no-warmup
    a=$(mono); bench 8000 hc "$c" --no-warmup; b=$(mono)
    echo "$c $a $b" >> "$R/windows.txt"
  done
  stop_server hc
  cp -r $TL "$R/timeline"
  while read -r c a b; do
    echo "== timeline of the measured C=$c pass"
    python3 -m bench.timeline $TL --window "$a" "$b" --json "$R/timeline_c$c.json"
  done < "$R/windows.txt"
  [ -z "${SERVE_ONLY:-}" ] && [ "$(left)" -gt 150 ] && timeout $(( $(left) - 100 )) python3 -m bench.codec --version v2 --size full \
    --batches 16,64,128 --grid 1,2,4,8,15 --iters 5 --profile 2>&1 | grep -v "^exactness" | tee "$R/codec_grid.txt" | head -60
  [ -z "${SERVE_ONLY:-}" ] && [ "$(left)" -gt 80 ] && timeout $(( $(left) - 20 )) python3 -m bench.local_v15_profile_step --batch 128 \
    --attention triton --compile 2>&1 | tee "$R/talker_profile.txt" | tail -40
  ;;
compare)
  checkpoint
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/stages/test_codec_graphs.py 2>&1 | tail -3
  SERVER_TREE=$BASE start_server 8000 base --profile high-concurrency
  pair 8000 base "128 64"
  stop_server base
  TL=/tmp/timeline
  start_server 8001 hc --profile high-concurrency --set engine.timeline_dir=$TL
  pair 8001 hc "128 64 1"
  stop_server hc
  start_server 8002 ll --profile low-latency
  pair 8002 ll "1 64"
  stop_server ll
  cp -r $TL "$R/timeline"
  grep hc "$R/windows.txt" | while read -r name c a b; do
    echo "== timeline of the measured C=$c pass ($name)"
    python3 -m bench.timeline $TL --window "$a" "$b" --json "$R/timeline_c$c.json"
  done
  ;;
knobs)
  checkpoint
  start_server 8000 hc --profile high-concurrency --set engine.timeline_dir=/tmp/tl_hc
  pair 8000 hc "128 1"
  stop_server hc
  start_server 8001 wide --profile high-concurrency --set engine.timeline_dir=/tmp/tl_wide \
    --set talker.prefill_interval=6 --set coalescing.min_batch=64 --set coalescing.max_wait_ms=40
  pair 8001 wide "128"
  stop_server wide
  while read -r name c a b; do
    echo "== timeline of the measured C=$c pass ($name)"
    python3 -m bench.timeline /tmp/tl_$name --window "$a" "$b" --json "$R/timeline_${name}_c$c.json" \
      | grep -vE "_ms_by_index|chunks_by_frames"
  done < "$R/windows.txt"
  cp -r /tmp/tl_hc /tmp/tl_wide "$R/"
  [ "$(left)" -gt 60 ] && timeout $(( $(left) - 10 )) python3 -m bench.local_v15_profile_step --batch 1 64 \
    --attention triton --compile --prefill 170 2>&1 | grep -v Warning | tee "$R/prefill_profile.txt" | tail -70
  ;;
prefill)
  checkpoint
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/stages/test_local_v15_runner.py \
    tests/stages/test_codec_graphs.py 2>&1 | tail -3
  start_server 8000 off --profile high-concurrency --set engine.timeline_dir=/tmp/tl_off
  pair 8000 off "128 64 1"
  stop_server off
  start_server 8001 on --profile high-concurrency --set engine.timeline_dir=/tmp/tl_on \
    --set talker.prefill_graphs=true --set talker.capture_ahead=true
  pair 8001 on "128 64 1"
  stop_server on
  while read -r name c a b; do
    echo "== timeline of the measured C=$c pass ($name)"
    python3 -m bench.timeline /tmp/tl_$name --window "$a" "$b" --json "$R/timeline_${name}_c$c.json" \
      | grep -vE "_ms_by_index|chunks_by_frames"
  done < "$R/windows.txt"
  cp -r /tmp/tl_off /tmp/tl_on "$R/"
  ;;
lazy)
  checkpoint
  start_server 8000 lazy --profile high-concurrency --set engine.timeline_dir=/tmp/tl_lazy \
    --set talker.prefill_graphs=true
  pair 8000 lazy "128 64 1"
  stop_server lazy
  start_server 8001 patient --profile high-concurrency --set engine.timeline_dir=/tmp/tl_patient \
    --set talker.prefill_graphs=true --set coalescing.patient_wait_ms=300 --set coalescing.min_batch=64
  pair 8001 patient "128 64"
  stop_server patient
  while read -r name c a b; do
    echo "== timeline of the measured C=$c pass ($name)"
    python3 -m bench.timeline /tmp/tl_$name --window "$a" "$b" --json "$R/timeline_${name}_c$c.json" \
      | grep -E "window|pass|step_ms|rows_per|busy|prefill|dispatches|chunks_per_d|decode_ms|admit|first_frame_to|last_frame"
  done < "$R/windows.txt"
  ;;
codecserve)
  checkpoint > "$R/checkpoint.txt" 2>&1 &
  CK=$!
  timeout 170 python3 -m pytest -q -p no:cacheprovider -m gpu tests/stages/test_codec_compile.py \
    tests/stages/test_codec_ring_attention.py 2>&1 | tail -3
  for flag in "" "--compile --ring-attention"; do
    timeout 90 python3 -m bench.codec --version v2 --size full --batches 128 --grid 1,15 --iters 5 $flag 2>&1 \
      | grep -v "^exactness" | tee "$R/codec_grid${flag// /}.txt" | tail -6
  done
  wait $CK; cat "$R/checkpoint.txt"
  start_server 8000 both --profile high-concurrency --set engine.timeline_dir=/tmp/tl_both \
    --set talker.prefill_graphs=true --set codec.compile=true --set codec.ring_attention=true
  pair 8000 both "128 64"
  stop_server both
  while read -r name c a b; do
    echo "== timeline of the measured C=$c pass ($name)"
    python3 -m bench.timeline /tmp/tl_$name --window "$a" "$b" --json "$R/timeline_${name}_c$c.json" > /dev/null
  done < "$R/windows.txt"
  ;;
prefillprof)
  for g in "" --prefill-graphs; do
    timeout $(( $(left) - 10 )) python3 -m bench.local_v15_profile_step --batch 86 --attention triton --compile \
      --prefill 170 --prefill-seqs 7 $g 2>&1 | grep -v Warning | tee "$R/prefillprof$g.txt" | cut -c1-190 | tail -62
  done
  ;;
buckets)
  checkpoint
  start_server 8000 on --profile high-concurrency --set engine.timeline_dir=/tmp/tl_on --set talker.prefill_graphs=true
  grep -E "prefill graphs|decode graphs" "$R/serve_on.log" | cut -c1-200
  pair 8000 on "128 64 1"
  stop_server on
  start_server 8001 off --profile high-concurrency --set engine.timeline_dir=/tmp/tl_off
  pair 8001 off "128 64 1"
  stop_server off
  summaries
  ;;
invtests)
  timeout $(( $(left) - 10 )) python3 -m pytest -q -s -p no:cacheprovider tests/stages/test_batch_invariant_gpu.py \
    tests/stages/test_batch_invariant.py tests/stages/test_attention_triton.py 2>&1 | tail -12 | tee "$R/invariant_tests.txt"
  ;;
codecsplit)
  for flag in --compile --ring-attention; do
    [ "$(left)" -lt 60 ] && break
    timeout $(( $(left) - 10 )) python3 -m bench.codec --version v2 --size full --batches 128 \
      --grid 1,4,15 --iters 5 $flag 2>&1 | grep -v "^exactness" | tee "$R/codec_grid${flag// /}.txt" | tail -5
  done
  ;;
codecsmall)
  for flag in "" --compile; do
    [ "$(left)" -lt 60 ] && break
    timeout $(( $(left) - 10 )) python3 -m bench.codec --version v2 --size full --batches 16,32 \
      --grid 1,4,15 --iters 5 --ring-attention $flag 2>&1 | grep -v "^exactness" | tee "$R/codec_small${flag// /}.txt" | tail -5
  done
  ;;
windows)  # fewer fixed costs: prefill steps in one replay, fewer urgent codec chunks, larger dispatches
  checkpoint > "$R/checkpoint.txt" 2>&1 &
  CK=$!
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/stages/test_mixed_steps.py 2>&1 | tail -3
  wait $CK; cat "$R/checkpoint.txt"
  compare "128" shipped "$BEFORE" mixed "$BEFORE --set talker.mixed_step_tokens=256" r48 "$BEFORE --set chunking.ramp=[4,8]" \
    cw "$BEFORE --set coalescing.max_wait_ms=25 --set coalescing.min_batch=32" \
    mixed1 "$BEFORE --set talker.mixed_step_tokens=256 --set talker.prefill_interval=1"
  summaries
  ;;
levers)  # the shipped profile against one switch each: a prefill step every step, the talker's
  # priority stream, the codec's lanes with fused ring writes (C=128 and 64; first the GPU tests)
  checkpoint > "$R/checkpoint.txt" 2>&1 &
  CK=$!
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/stages/test_priority_stream.py \
    tests/stages/test_codec_graphs.py 2>&1 | tail -3
  wait $CK; cat "$R/checkpoint.txt"
  compare "128 64" shipped "" prio "--set talker.priority_stream=true" pi1 "--set talker.prefill_interval=1" \
    pgs256 "--set talker.prefill_graph_seqs=256"
  summaries
  ;;
stall)  # the shipped profile at C=128 three times on one server (the ~700 ms step: every pass or
  # some, and did it record a graph or compile a kernel?), C=64; then SoundEffect at C=1 and 16
  checkpoint > "$R/checkpoint.txt" 2>&1 &
  CK=$!
  mossvox make-checkpoint --variant sound-effect --size full --out /tmp/fam_se > "$R/mkck_se.log" 2>&1 &
  SE=$!
  timeout 150 python3 -m pytest -x -q -p no:cacheprovider tests/stages/test_codec_graphs.py -k lanes 2>&1 | tail -40
  wait $CK; cat "$R/checkpoint.txt"
  start_server 8000 shipped --profile high-concurrency --set engine.timeline_dir=/tmp/tl_shipped
  bench 8000 shipped_warm 128 --no-warmup
  for i in 1 2 3; do
    a=$(mono); bench 8000 "shipped_r$i" 128 --no-warmup; b=$(mono); echo "shipped_r$i 128 $a $b" >> "$R/windows.txt"
  done
  a=$(mono); bench 8000 shipped 64 --no-warmup; b=$(mono); echo "shipped 64 $a $b" >> "$R/windows.txt"
  stop_server shipped
  summaries
  wait $SE || { tail -3 "$R/mkck_se.log"; exit 1; }
  MODEL=/tmp/fam_se sweep 8001 sound-effect "1 16" --profile high-concurrency --set engine.timeline_dir=/tmp/tl_se
  ;;
finals)  # the codec alone at the batches it is served (graph replay ms by rows and chunk length,
  # against ~160 us a frame served beside the talker), then the shipped profile against final
  # chunks due at once and against the codec's lanes with fused ring writes, PASSES (2) each
  checkpoint > "$R/checkpoint.txt" 2>&1 &
  CK=$!
  timeout 150 python3 -m bench.codec --version v2 --size full --batches 8,16,24,32,128 --grid 1,4,8,15 \
    --iters 5 2>&1 | grep -v "^exactness" | tee "$R/codec_alone.txt" | tail -30
  wait $CK; cat "$R/checkpoint.txt"
  PASSES=${PASSES:-2} compare "128 64" shipped "" fin0 "--set coalescing.final_wait_ms=0" \
    lanes "--set codec.decode_lanes=2 --set codec.fused_ring_writes=true"
  summaries
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
smshare)  # the shipped profile against the codec held to a share of the GPU's SMs under MPS (the
  # talker's step is ~20% longer beside the codec than alone), PASSES (2) each
  checkpoint
  PASSES=${PASSES:-2} compare "128 64" shipped "" csm60 "--set codec.sm_percent=60" csm40 "--set codec.sm_percent=40"
  summaries
  ;;
levers2)  # the shipped profile against longer steady chunks, final chunks due at once, the codec's lanes
  checkpoint
  compare "128 64" shipped "" prio "--set talker.priority_stream=true" c30 "--set chunking.chunk_frames=30" \
    lanes "--set codec.decode_lanes=2 --set codec.fused_ring_writes=true" fin0 "--set coalescing.final_wait_ms=0"
  summaries
  ;;
mixlanes)  # mixed steps, then with the codec's lanes + joins + fused writes, the wider window, joins
  checkpoint
  M="$BEFORE --set talker.mixed_step_tokens=256"
  compare "128" mixed "$M" mixall "$M --set codec.decode_lanes=2 --set coalescing.express_joins_dispatch=true --set codec.fused_ring_writes=true" \
    mixcw "$M --set coalescing.max_wait_ms=25 --set coalescing.min_batch=32" mixjoin "$M --set coalescing.express_joins_dispatch=true"
  summaries
  ;;
mixlevels)  # C=64 and 256: before, mixed steps, mixed steps with joins and the wider window (now shipped)
  checkpoint
  M="$BEFORE --set talker.mixed_step_tokens=256"
  compare "64 256" shipped "$BEFORE" mixed "$M" mixjw "$M --set coalescing.express_joins_dispatch=true --set coalescing.max_wait_ms=25 --set coalescing.min_batch=32"
  summaries
  ;;
lanes)  # fewer codec replays or side by side: GPU tests, then high-concurrency four ways
  checkpoint > "$R/checkpoint.txt" 2>&1 &
  CK=$!
  timeout 150 python3 -m pytest -q -p no:cacheprovider tests/stages/test_codec_graphs.py \
    tests/stages/test_codec_ring_attention.py 2>&1 | tail -3   # on the GPU: lanes, fused ring writes
  for flag in "" --fused-writes; do  # the replay grid at a dispatch's sizes, without and with the fused writes
    timeout 60 python3 -m bench.codec --version v2 --size full --batches 16,32,128 --grid 1,4,15 --iters 5 \
      --ring-attention $flag 2>&1 | grep -v "^exactness" | tee "$R/codec_grid${flag// /}.txt" | tail -5
  done
  wait $CK; cat "$R/checkpoint.txt"
  compare "128" shipped "" lanes "--set codec.decode_lanes=2" join "--set coalescing.express_joins_dispatch=true" \
    all "--set codec.decode_lanes=2 --set coalescing.express_joins_dispatch=true --set codec.fused_ring_writes=true"
  summaries
  ;;
ringtune)
  timeout $(( $(left) / 2 )) python3 -m bench.codec_ring --batch 128 --frames 1,4,8,15 2>&1 | tee "$R/codec_ring.txt" | tail -40
  for flag in "" --ring-attention; do
    [ "$(left)" -lt 60 ] && break
    timeout $(( $(left) - 10 )) python3 -m bench.codec --version v2 --size full --batches 128 \
      --grid 1,4,8,15 --iters 5 $flag 2>&1 | grep -v "^exactness" | tee "$R/codec_grid${flag// /}.txt" | tail -4
  done
  ;;
codec)
  timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/stages/test_codec_compile.py \
    tests/stages/test_codec_graphs.py tests/stages/test_codec_streaming.py 2>&1 | tail -3
  timeout 100 python3 -m pytest -q -p no:cacheprovider tests/stages/test_codec_ring_attention.py 2>&1 | tail -2
  for flag in "" --compile --ring-attention "--compile --ring-attention"; do
    [ "$(left)" -lt 60 ] && break
    timeout $(( $(left) - 20 )) python3 -m bench.codec --version v2 --size full --batches 64,128 \
      --grid 1,4,15 --iters 5 $flag 2>&1 | grep -v "^exactness" | tee "$R/codec_grid${flag// /}.txt" | tail -5
  done
  ;;
ringshort)
  mossvox make-checkpoint --variant realtime --size full --out /tmp/fam_realtime > "$R/mkck_realtime.log" 2>&1 &
  RT=$!
  checkpoint
  SERVER_TREE=$BASE start_server 8000 base --profile high-concurrency
  pair 8000 base "128 64"
  stop_server base
  start_server 8001 ring4 --profile high-concurrency --set codec.ring_attention=true \
    --set codec.ring_attention_max_frames=4
  grep -E "captured|decode call cost" "$R/serve_ring4.log" | cut -c1-200
  pair 8001 ring4 "128 64"
  stop_server ring4
  wait $RT
  [ "$(left)" -gt 100 ] && MODEL=/tmp/fam_realtime sweep 8002 realtime "1 16" --profile high-concurrency
  ;;
coldvoices)
  checkpoint > "$R/checkpoint.txt" 2>&1 &
  CK=$!
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/stages/test_codec_encode_graphs.py 2>&1 | tail -3
  wait $CK; cat "$R/checkpoint.txt"
  start_server 8000 new --profile high-concurrency --set engine.timeline_dir=/tmp/tl_new --set api.data_dir=/tmp/data_new \
    --set talker.prefill_graphs=true --set codec.ring_attention_max_frames=null --set codec.encode_graphs=true
  grep -E "captured|decode call cost" "$R/serve_new.log" | cut -c1-200
  pair 8000 new "128 64 256 1"
  stop_server new
  SERVER_TREE=$BASE start_server 8001 base --profile high-concurrency --set engine.timeline_dir=/tmp/tl_base \
    --set api.data_dir=/tmp/data_base
  pair 8001 base "128 64"
  stop_server base
  summaries
  ;;
coldvoices2)  # new voices under load: each server with its own empty reference cache, its first
  # C=128 pass (the `_warm` row) encoding every voice beside the decodes; encode batches of
  # ENCS (8 2 1) while streams are open (codec.encode_batch_streaming)
  checkpoint
  port=8000
  for n in ${ENCS:-8 2 1}; do
    name=enc$n
    [ "$(left)" -lt 120 ] && { el "$name: no time left"; break; }
    flags="--set codec.encode_batch_streaming=$n"
    start_server $port $name --profile high-concurrency --set engine.timeline_dir=/tmp/tl_$name \
      --set api.data_dir=/tmp/data_$name $flags
    WARM_WINDOW=1 pair $port $name "128"
    stop_server $name
    port=$((port + 1))
  done
  summaries
  ;;
prefix)
  checkpoint > "$R/checkpoint.txt" 2>&1 &
  CK=$!
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/stages/test_prefix_cache.py \
    tests/stages/test_priority_stream.py 2>&1 | tail -3
  wait $CK; cat "$R/checkpoint.txt"
  for name in nocache cache prio; do
    [ "$(left)" -lt 150 ] && { el "$name: no time left"; break; }
    flags="--set talker.prefix_caching=$([ $name = nocache ] && echo false || echo true)"
    [ $name = prio ] && flags="$flags --set talker.priority_stream=true"
    known_voices 8000 $name $flags
  done
  summaries
  ;;
wide)  # the first call of a session: compile caches as cold as a new deployment's
  checkpoint
  for name in shipped prio seqs; do
    [ "$(left)" -lt 150 ] && { el "$name: no time left"; break; }
    case $name in
      shipped) flags="" ;;  # 32 chunks a prefill replay; the warm-up runs the eager call of more
      seqs) flags="--set talker.prefill_graph_seqs=256" ;;  # every prefill step a replay
      prio) flags="--set talker.priority_stream=true" ;;
    esac
    known_voices 8000 $name $flags
  done
  summaries
  ;;
delayprime)  # the 8B as shipped (no reference prime in high-concurrency) and with the prime
  mossvox make-checkpoint --variant delay --size full --out /tmp/d8 > "$R/mkck.log" 2>&1 || { tail "$R/mkck.log"; exit 1; }
  el "checkpoint written"
  port=8000
  for name in noprime prime; do
    [ "$(left)" -lt 150 ] && { el "$name: no time left"; break; }
    flags=$([ $name = prime ] && echo "--set codec.prime_continuation=true")
    MODEL=/tmp/d8 start_server $port $name --profile high-concurrency --set engine.timeline_dir=/tmp/tl_$name $flags
    pair $port $name "16 64"
    stop_server $name
    port=$((port + 1))
  done
  summaries
  cp -r /tmp/tl_* "$R/"
  ;;
kernels)  # the served shapes kernel by kernel, no server: the fused kernels' tests on the GPU; the
  # codec's replays at ROWS (80) rows of 1, 2, 3 and 15 frames as served (ring attention), with
  # fused ring writes and residual norms, and with fused ring writes and compiled layers; the
  # talker step at 88 rows (compiled, its frame graph's table too, and a mixed step taking 6 new
  # 40-row prompts beside them, as served), then with each head sampling in one kernel; one
  # served-size codec call's kernel table (ROWS x 2 frames)
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/stages/test_codec_ring_attention.py \
    tests/stages/test_sampling_kernel.py tests/stages/test_talker_compile.py 2>&1 | tail -4 \
    | tee "$R/tests_kernels.txt"  # against the torch ops; the sampling kernel compiled into the local loop
  for v in "" "--fused-writes --fused-norms" "--fused-writes --compile"; do
    [ "$(left)" -lt 100 ] && { el "kernels: no time left for codec $v"; break; }
    timeout 200 python3 -m bench.codec --version v2 --size full --batches "${ROWS:-80}" --grid 1,2,3,15 \
      --iters 5 --ring-attention $v 2>&1 | grep -v "^exactness" | tee -a "$R/codec_variants.txt" | tail -4
  done
  [ "$(left)" -gt 140 ] && timeout $(( $(left) - 30 )) python3 -m bench.local_v15_profile_step --batch 88 \
    --attention triton --compile --top 25 --prefill 40 --prefill-seqs 6 --mixed 256 --prefill-graphs 2>&1 \
    | grep -v -i warn | tee "$R/talker_profile.txt" | grep -E "^B=|kernel time|step with"
  [ "$(left)" -gt 100 ] && timeout $(( $(left) - 20 )) python3 -m bench.local_v15_profile_step --batch 88 \
    --attention triton --compile --top 25 --fused-sampling 2>&1 | grep -v -i warn \
    | tee "$R/talker_profile_fused_sampling.txt" | grep -E "^B=|kernel time" 
  [ "$(left)" -gt 60 ] && timeout $(( $(left) - 10 )) python3 -m bench.codec --version v2 --size full \
    --batches "${ROWS:-80}" --chunk 2 --iters 3 --ring-attention --profile 2>&1 | grep -v "^exactness" \
    | tee "$R/codec_prof_${ROWS:-80}x2.txt" | tail -40
  ;;
codecone)  # the codec's ring attention in the ring writes' kernel (codec.fused_attention): its GPU tests
  # (the kernels against the torch ops and each other, cut chunks under recorded graphs), then the
  # replays at ROWS (80) rows of 1, 2, 3 and 15 frames as shipped and with it
  timeout 200 python3 -m pytest -q -p no:cacheprovider tests/stages/test_codec_ring_attention.py \
    "tests/stages/test_codec_graphs.py::test_cuda_graphs_of_cut_chunks_equal_the_plain_runner" 2>&1 | tail -4 \
    | tee "$R/tests_codecone.txt"
  for v in "" "--fused-attention"; do
    [ "$(left)" -lt 100 ] && { el "codecone: no time left for codec $v"; break; }
    timeout 200 python3 -m bench.codec --version v2 --size full --batches "${ROWS:-80}" --grid 1,2,3,15 \
      --iters 5 --ring-attention --fused-writes --fused-norms $v 2>&1 | grep -v "^exactness" \
      | tee -a "$R/codec_variants.txt" | tail -4
  done
  ;;
talkerstep)  # the talker's step at 88 rows, compiled, no server: first the GPU tests of a runner one
  # step ahead that never waits for the GPU and of the Triton kernel counter; then the step as
  # shipped, with the local steps attending plainly, one step ahead, and both (each line: the
  # step, its frame graph's kernels)
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/stages/test_overlap_steps.py \
    tests/stages/test_triton_kernel_counter.py tests/stages/test_talker_compile.py 2>&1 | tail -6 \
    | tee "$R/tests_talkerstep.txt"
  for v in "" "--local-attention plain" "--overlap" "--local-attention plain --overlap"; do
    [ "$(left)" -lt 130 ] && { el "talkerstep: no time left for '$v'"; break; }
    timeout $(( $(left) - 10 )) python3 -m bench.local_v15_profile_step --batch 88 --attention triton \
      --compile --top 12 $v 2>&1 | grep -v -i warn | tee -a "$R/talker_steps.txt" | grep -E "^B=|kernel time"
  done
  ;;
fp8)  # float8 weights and KV cache (talker.fp8_weights, talker.kv_cache_dtype): their GPU tests,
  # their distance from fp32 beside bf16's on the random full-size talker, then the step at 88
  # rows as shipped and with both (EACH=1: each alone too), compiled, one step ahead, plain local attention
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/stages/test_fp8_weights.py 2>&1 | tail -4 \
    | tee "$R/tests_fp8.txt"
  timeout 60 python3 -m pytest -q -p no:cacheprovider tests/stages/test_attention_triton.py -k float8 2>&1 \
    | tail -4 | tee -a "$R/tests_fp8.txt"
  timeout 150 python3 -m bench.fp8_fidelity 2>&1 | grep -v -i warn | tee "$R/fp8_fidelity.txt"
  variants=("" "--fp8 all --kv-fp8")
  [ -n "${EACH:-}" ] && variants+=("--fp8 all" "--kv-fp8")
  talker_steps "${variants[@]}"
  ;;
fp8kernels)  # the float8 layer's own kernels (talker.fp8_fused_swiglu, fp8_fused_scales, fp8_fused_norms):
  # their GPU tests, the two kernels by warps against inductor's (bench.fp8_kernels), then the step
  # alone at ROWS (48) with high-concurrency's paths: as shipped (the first two), then with the
  # sums, norms and quantization in one kernel too
  timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu tests/stages/test_fp8_swiglu.py \
    tests/stages/test_qk_rope_store.py tests/stages/test_fp8_weights.py tests/stages/test_fp8_norm.py -k "not w8a16" 2>&1 \
    | tee "$R/gpu_tests_full.txt" | tail -6 | tee "$R/gpu_tests.txt"
  timeout 120 python3 -m bench.fp8_kernels 2>&1 | grep -v -i warn | tee "$R/fp8_kernels.txt"
  F8="--fp8 backbone --fp8-scheme w8a8"
  steps_as_shipped "$F8 --fp8-swiglu --fp8-scales" "$F8 --fp8-swiglu --fp8-scales --fp8-norms"
  ;;
clientprocs)  # how much of a pass's first audio is the bench client's own: one server as shipped,
  # C in CS (128 64), passes alternating between the default client processes (ceil(C/32)) and
  # one process per CP_PER (8) clients, PASSES (2) of each; per pass the server's own first audio
  # (its handler's start to the first bytes handed to HTTP, from /metrics) beside the client's
  # (and each pass's timeline: received to submit, the first chunk taken and handed over)
  checkpoint
  start_server 8000 shipped --profile high-concurrency --set engine.timeline_dir=/tmp/tl_shipped
  ln -sfn /tmp/tl_shipped /tmp/tl_manyclients  # one server: the summaries read its timeline for both
  order=()
  for c in ${CS:-128 64}; do
    [ "$(left)" -lt 60 ] && break
    bench 8000 shipped_warm "$c" --no-warmup; order+=("shipped_warm_c$c")
    for i in $(seq 1 "${PASSES:-2}"); do
      [ "$(left)" -lt 40 ] && break
      run=shipped; many=manyclients; [ "$i" -gt 1 ] && run=shipped_r$i && many=manyclients_r$i
      a=$(mono); bench 8000 "$run" "$c" --no-warmup; b=$(mono); order+=("${run}_c$c")
      echo "$run $c $a $b" >> "$R/windows.txt"
      a=$(mono); bench 8000 "$many" "$c" --no-warmup --client-procs $(( (c + ${CP_PER:-8} - 1) / ${CP_PER:-8} ))
      b=$(mono); order+=("${many}_c$c"); echo "$many $c $a $b" >> "$R/windows.txt"
    done
  done
  stop_server shipped
  python3 - "$R" "${order[@]}" <<'PY' | tee "$R/client_share.txt"
import json, re, sys
root, names = sys.argv[1], sys.argv[2:]
def metric(name, key):
    text = open(f"{root}/{name}_metrics.txt").read()
    m = re.search(rf"^mossvox_{key} (\S+)", text, re.M)
    return float(m.group(1)) if m else 0.0
KEYS = ("time_to_first_audio_seconds_sum", "time_to_first_audio_seconds_count",
        "api_loop_lag_seconds_sum", "api_loop_lag_seconds_count")
prev = dict.fromkeys(KEYS, 0.0)
for name in names:
    now = {k: metric(name, k) for k in KEYS}
    d = {k: now[k] - prev[k] for k in KEYS}
    run = json.load(open(f"{root}/{name}.json"))["runs"][0]
    server = 1000 * d[KEYS[0]] / max(1.0, d[KEYS[1]])
    lag = 1000 * d[KEYS[2]] / max(1.0, d[KEYS[3]])
    print(f"{name}: client procs {run['client_procs']}, {run['audio_s_per_s']:.2f} audio-s/s, first audio "
          f"{run['ttfa_ms']['mean']:.1f} ms at the client, {server:.1f} ms in the server's handler, "
          f"API loop lag {lag:.2f} ms a 20 ms timer, client CPU max {run['client_cpu_max_s']} s "
          f"of {run['wall_s']:.2f} s")
    prev = now
PY
  summaries
  ;;
ceilings)  # the stage ceilings beside the server's figures, as high-concurrency ships them: the codec's
  # B=128 replays of 1 and 15 frames (ring attention in place, fused ring writes and norms), then
  # the talker's decode step alone at ROWS (128) rows of CONTEXT (300) keys (steps_as_shipped with
  # the float8 backbone and its kernels; CEIL_FLAGS replaces those flags)
  timeout $(( $(left) * 2 / 5 )) python3 -m bench.codec --version v2 --size full --batches 128 --grid 1,15 --iters 5 \
    --ring-attention --fused-writes --fused-norms 2>&1 | grep -v "^exactness" | tee "$R/ceiling_codec.txt" | tail -6
  ROWS=${ROWS:-128} CONTEXT=${CONTEXT:-300} steps_as_shipped \
    "${CEIL_FLAGS:---fp8 backbone --fp8-scheme w8a8 --fp8-swiglu --fp8-scales}"
  ;;
fp8mm)  # float8 weights by the Triton kernel for few rows (talker.fp8_scheme): its GPU tests (eager,
  # compiled, graphs; the float8 linear and the compiled talker against eager), the step at 88 rows
  # per flag set of FP8_STEPS ('|' between sets; by default as shipped, a float8 backbone, float8
  # everywhere by w8a16 and by w8a8), then the talker's weight shapes alone (FP8MM_ROWS; first a
  # tile sweep at SWEEP_ROWS), at most FP8MM_S (200) seconds; then cuBLAS's float8 ways (bench.fp8_cublas)
  [ -n "${NOTESTS:-}" ] || timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/stages/test_fp8_matmul.py tests/stages/test_fp8_weights.py > "$R/tests_fp8mm.txt" 2>&1
  [ -n "${NOTESTS:-}" ] || grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$R/tests_fp8mm.txt" | head -30
  IFS='|' read -r -a steps <<< "${FP8_STEPS:---fused-projections|--fused-projections --fp8 backbone|--fused-projections --fp8 all|--fused-projections --fp8 all --fp8-scheme w8a8}"
  talker_steps "${steps[@]}"
  t=$(( $(left) - 10 )); [ "$t" -gt "${FP8MM_S:-200}" ] && t=${FP8MM_S:-200}
  [ "$t" -gt 30 ] && timeout "$t" python3 -m bench.fp8_matmul --rows ${FP8MM_ROWS:-1 44 88 344 2048} \
    --sweep ${SWEEP_ROWS:-88} 2>&1 | grep -v -i warn | tee "$R/fp8_matmul.txt"
  [ "$(left)" -gt 60 ] && timeout $(( $(left) - 10 )) python3 -m bench.fp8_cublas 2>&1 | grep -v -i warn \
    | tee "$R/fp8_cublas.txt"
  ;;
layers)  # a backbone layer's launches: the GPU tests of the q/k norm, RoPE and KV store kernel, of the
  # deferred residual sums (no addmm) and of the attention's kernels, then the step at 88 rows once per
  # flag set of LAYER_STEPS ('|' between sets; by default as shipped, with the kernel, with the kernel
  # and the sums deferred), each with one layer's kernels in launch order in talker_steps.txt
  [ -n "${NOTESTS:-}" ] || timeout 300 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/stages/test_qk_rope_store.py tests/stages/test_attention_triton.py tests/stages/test_fp8_matmul.py \
    tests/stages/test_fp8_weights.py \
    > "$R/tests_layers.txt" 2>&1
  [ -n "${NOTESTS:-}" ] || grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$R/tests_layers.txt" | head -30
  IFS='|' read -r -a steps <<< "${LAYER_STEPS:---fused-projections|--fused-projections --qk-rope-store|--fused-projections --qk-rope-store --deferred-residuals}"
  talker_steps "${steps[@]}"
  ;;
buildstep)  # the talker's step alone at 88 rows, high-concurrency's paths (the kernel, the deferred sums),
  # from the build in BASE and from this one, alternating, ROUNDS (2) each: a code change no flag switches;
  # then this build's step with EXTRA added (default --fused-sampling; EXTRA=none: not); last, unless
  # NOTESTS=1, the GPU tests of the compiled talker (its local loop plain and by SDPA) and the steps one
  # ahead (the step timing of the timelines), in the time left: on a fresh machine they compile for
  # over four minutes, which first took the whole 240 s they had before the steps (twentieth session)
  v="--fused-projections --qk-rope-store --deferred-residuals"
  for i in $(seq "${ROUNDS:-2}"); do
    STEP_TREE=${BASE:?a tree of the earlier build} talker_steps "$v"
    talker_steps "$v"
  done
  [ "${EXTRA:-}" = none ] || talker_steps "$v ${EXTRA:---fused-sampling}"
  [ -n "${NOTESTS:-}" ] || timeout $(( $(left) - 10 )) python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/stages/test_talker_compile.py tests/stages/test_overlap_steps.py \
    > "$R/tests_buildstep.txt" 2>&1
  [ -n "${NOTESTS:-}" ] || grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$R/tests_buildstep.txt" | head -30
  ;;
attn)  # the talker's paged attention alone, a decode layer (no server, no checkpoint; NOKERNELS=1
  # skips it): the cache in bf16 and float8, keys per tile, warps, stages and key splits
  # (ATTN_VARIANTS: its --variants); then, unless NOSTEP=1, the step at 88 rows once per flag set
  # of ATTN_STEPS ('|' between sets; by default as shipped, with the decode rows' keys split 2 and
  # 4 ways, and with a float8 KV cache stored from inside the layers); first, unless NOTESTS=1,
  # the GPU test of the compiled layer half's KV stores (no pool copied, a float8 pool too)
  [ -n "${NOTESTS:-}" ] || timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu \
    tests/stages/test_fused_kv_writes.py > "$R/tests_attn.txt" 2>&1
  [ -n "${NOTESTS:-}" ] || grep -E "^(FAILED|ERROR)|^E  |passed|failed" "$R/tests_attn.txt" | head -30
  [ -n "${NOKERNELS:-}" ] || timeout $(( $(left) - 20 )) python3 -m bench.paged_attention \
    ${ATTN_VARIANTS:+--variants "$ATTN_VARIANTS"} 2>&1 | grep -v -i warn | tee "$R/paged_attention.txt"
  if [ -z "${NOSTEP:-}" ]; then
    IFS='|' read -r -a steps <<< "${ATTN_STEPS:---fused-projections|--fused-projections --decode-splits 2|--fused-projections --decode-splits 4|--fused-projections --fused-kv-writes --kv-fp8}"
    talker_steps "${steps[@]}"
  fi
  ;;
projstep)  # the talker's step at 88 rows, compiled, no server, as shipped (plain local attention, one
  # step ahead) and with the backbone's projections fused and its KV stores in the layers
  # (talker.fused_projections, talker.fused_kv_writes; each alone too with EACH=1): first their GPU
  # tests (compiled and fused against eager), then each line: the step, its frame graph's kernels
  [ -n "${NOTESTS:-}" ] || timeout 200 python3 -m pytest -q -p no:cacheprovider -m gpu tests/stages/test_talker_compile.py \
    -k fused_backbone 2>&1 | tail -4 | tee "$R/tests_projstep.txt"
  variants=("" "--fused-projections --fused-kv-writes")
  [ -n "${EACH:-}" ] && variants+=("--fused-projections" "--fused-kv-writes")
  [ -n "${VARIANTS:-}" ] && IFS='|' read -r -a variants <<< "$VARIANTS"  # e.g. "|--fp8 all|--kv-fp8"
  talker_steps "${variants[@]}"
  ;;
codecprof)  # where a served codec call's time goes: the kernel table and the kernels by duration of
  # the shapes a C=128 dispatch has (ROWS (24) rows x FRAMES (1 8 15)), ring attention in place as served
  for t in ${FRAMES:-1 8 15}; do
    [ "$(left)" -lt 60 ] && { el "codecprof: no time left for $t frames"; break; }
    timeout $(( $(left) - 20 )) python3 -m bench.codec --version v2 --size full --batches "${ROWS:-24}" \
      --chunk "$t" --iters 3 --ring-attention --profile 2>&1 | grep -v "^exactness" \
      | tee "$R/codec_prof_${ROWS:-24}x$t.txt" | tail -36
  done
  ;;
localattn)  # the local attention kernel: the compiled talker's GPU tests with it, the kernel alone
  # (bench.local_attend), then the step alone at ROWS rows (C=64 serves ~43) plain, then kernel
  timeout 240 python3 -m pytest -q -p no:cacheprovider -m gpu tests/stages/test_talker_compile.py -k kernel 2>&1 \
    | tail -4 | tee "$R/tests_localattn.txt"
  timeout 120 python3 -m bench.local_attend --rows 48 88 2>&1 | grep -v -i warn | tee "$R/local_attend.txt"
  for v in "--local-attention plain" "--local-attention kernel"; do
    [ "$(left)" -lt 130 ] && { el "localattn: no time left for '$v'"; break; }
    timeout $(( $(left) - 10 )) python3 -m bench.local_v15_profile_step --batch ${ROWS:-48} --context ${CONTEXT:-200} \
      --attention triton --compile --compiled-only --top 14 --overlap --fused-projections --qk-rope-store \
      --deferred-residuals $v 2>&1 | grep -v -i warn | tee -a "$R/talker_steps.txt" | grep -E "^B=|kernel time"
  done
  ;;
autotune)  # the step alone at ROWS rows (C=64 serves ~43): compiled as shipped, then max-autotune
  steps_as_shipped "" "--compile-mode max-autotune-no-cudagraphs"
  ;;
gelu)  # the decoder's FFN GELU (tanh) in the first matmul's epilogue: its GPU tests, then the
  # codecmix replays (ROWS, MIX) without and with it, then its distance from fp32 beside bf16's
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/stages/test_codec_gelu_epilogue.py 2>&1 \
    | tail -3 | tee "$R/tests_gelu.txt"
  for v in "" "--gelu-epilogue"; do
    timeout $(( $(left) - 20 )) python3 -m bench.codec --version v2 --size full --batches "${ROWS:-16,64}" \
      --chunk 2 --iters 5 --grid 1,2,15 --ring-attention --fused-writes --fused-norms --profile \
      --dispatch "${MIX:-1x3,2x3,4x3,8x3,15x5}" $v 2>&1 | grep -v "^exactness" | tee -a "$R/codec_gelu.txt" \
      | grep -E "codec,|batch|dispatch|cut|kernels|aten::mm|gelu|nvjet"
  done
  timeout $(( $(left) - 5 )) python3 -m bench.codec_gelu --device cuda 2>&1 | tee "$R/gelu_fidelity.txt"
  ;;
codecmix)  # a C=64 dispatch alone, as served (ring attention in place, fused ring writes and norms): the
  # served mix (MIX: chunks of 1-15 frames, ~17 a dispatch) padded and cut into rows, the replay
  # grid at ROWS (16,64) x 1, 2, 15 frames (fixed part, per row, per frame), then the kernel table
  # of ROWS' last x 2 frames, the shape a cut C=64 dispatch replays (~60 rows of 2 frames)
  timeout $(( $(left) - 20 )) python3 -m bench.codec --version v2 --size full --batches "${ROWS:-16,64}" \
    --chunk 2 --iters 5 --grid 1,2,15 --ring-attention --fused-writes --fused-norms --profile \
    --dispatch "${MIX:-1x3,2x3,4x3,8x3,15x5}" 2>&1 | grep -v "^exactness" | tee "$R/codec_mix.txt" | tail -60
  ;;
split)  # chunks cut into shorter replays (codec.split_chunks): first one C=128-like dispatch through
  # the runner, padded and cut (no server), then the shipped profile against it, PASSES (2) each
  # (C=256 too: a shorter codec period brings the ramp's next chunks sooner, where its stalls are)
  checkpoint > "$R/checkpoint.txt" 2>&1 &
  CK=$!
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/stages/test_codec_graphs.py -k cut 2>&1 | tail -3 \
    | tee "$R/gpu_tests_cut.txt"
  timeout 150 python3 -m bench.codec --version v2 --size full --batches 16 --iters 5 --ring-attention \
    --dispatch 1x5,2x5,4x5,8x5,15x7 --grid 1,2,4,15 2>&1 | grep -v "^exactness" | tee "$R/codec_dispatch.txt" | tail -12
  wait $CK; cat "$R/checkpoint.txt"
  PASSES=${PASSES:-2} compare "128 64 256" shipped "" split "--set codec.split_chunks=true"
  summaries
  ;;
flags)  # the shipped profile (PROFILE, high-concurrency) against it with FLAGS (serve options), then
  # with FLAGS2 and FLAGS3 when set (servers alt, alt2, alt3), at CS (128 64), PASSES (2) each
  checkpoint
  PASSES=${PASSES:-2} compare "${CS:-128 64}" shipped "" alt "${FLAGS:?serve options}" \
    ${FLAGS2:+alt2 "$FLAGS2"} ${FLAGS3:+alt3 "$FLAGS3"}
  summaries
  ;;
table)  # the issue's table as shipped: high-concurrency at HC_LEVELS (1 16 64 128 256), then
  # low-latency at LL_LEVELS (1 64), PASSES (2) measured passes a level after a discarded one
  checkpoint
  PASSES=${PASSES:-2} compare "${HC_LEVELS:-1 16 64 128 256}" hc ""
  PROFILE=low-latency PASSES=${PASSES:-2} compare "${LL_LEVELS:-1 64}" ll ""
  summaries
  ;;
shipped)  # the shipped profile (PROFILE, high-concurrency) alone at CS (64), PASSES (3) measured passes
  checkpoint
  PASSES=${PASSES:-3} compare "${CS:-64}" shipped ""
  summaries
  ;;
attnsweep)  # the decode attention's configurations at the served shapes, from CUDA graphs over copies
  # of the cache beyond L2 (no server, no checkpoint): SEQS (16 48 88) x CONTEXT (200 300)
  timeout $(( $(left) - 10 )) python3 -m bench.paged_attention --seqs ${SEQS:-16 48 88} --context ${CONTEXT:-200 300} \
    --variants "${VARIANTS:-bf16,-,4,- bf16,32,4,- bf16,16,4,- bf16,64,4,2 bf16,64,4,4 bf16,64,2,- bf16,64,8,- bf16,128,8,3 bf16,32,2,2 bf16,32,4,2 bf16,64,4,-,2 bf16,32,4,-,2 bf16,64,4,-,4 fp8,-,4,-}" \
    2>&1 | grep -v -i warn | tee "$R/attention.txt"
  ;;
build)  # the build in BASE against this one, one server each (base, shipped), both with PROFILE
  checkpoint
  SERVER_TREE=${BASE:?a tree of the earlier build} PASSES=${PASSES:-2} compare "${CS:-128 64}" base ""
  PASSES=${PASSES:-2} compare "${CS:-128 64}" shipped ""
  summaries
  ;;
gputests)  # GPU-marked tests: TESTS (tests/stages) filtered by K (every test when empty)
  timeout $(( $(left) - 10 )) python3 -m pytest -q -p no:cacheprovider -m gpu ${TESTS:-tests/stages} \
    ${K:+-k "$K"} 2>&1 | tee "$R/gpu_tests_full.txt" | tail -12 | tee "$R/gpu_tests.txt"
  ;;
r148)  # the ramp 1, 4, 8 (one chunk fewer a request) against the shipped 1, 2, 4, 8, PASSES (2) each
  checkpoint
  PASSES=${PASSES:-2} compare "128 64" hc "" r148 "--set chunking.ramp=[4,8]"
  summaries
  ;;
c256)  # overload smoothness: the shipped profile at C=256, PASSES (3) measured passes
  checkpoint
  PASSES=${PASSES:-3} compare "256" hc ""
  grep -E "^mossvox_engine_admission_hold" "$R"/*_c256_metrics.txt
  summaries
  ;;
ramp)  # overload: C=256 (and 128) as shipped, with the playout gate, with a cap, with a shorter ramp
  checkpoint
  compare "256 128" hc "" gate "--set admission.min_lead_s=${LEAD:-0.3}"
  compare "256" cap "--set admission.max_running=160 --set talker.max_running=160" r148 "--set chunking.ramp=[4,8]"
  grep -E "^mossvox_engine_admission_hold" "$R"/*_c256_metrics.txt
  summaries
  ;;
delaystall)
  mossvox make-checkpoint --variant delay --size full --out /tmp/d8 > "$R/mkck.log" 2>&1 &
  CK=$!
  timeout 150 python3 -m pytest -q -p no:cacheprovider -m gpu tests/stages/test_backbone_graphs_gpu.py 2>&1 | tail -3
  wait $CK || { tail "$R/mkck.log"; exit 1; }
  el "checkpoint written"
  port=8000
  for name in graphs budget eager; do
    [ "$(left)" -lt 150 ] && { el "$name: no time left"; break; }
    case $name in
      graphs) flags="" ;;  # as shipped: prefill graphs
      budget) flags="--set talker.max_step_ms=${STEP_MS:-60}" ;;
      eager) flags="--set talker.prefill_graphs=false" ;;  # as in the earlier calls
    esac
    MODEL=/tmp/d8 start_server $port $name --profile high-concurrency --set engine.timeline_dir=/tmp/tl_$name $flags
    grep -E "captured" "$R/serve_$name.log" | cut -c1-200
    pair $port $name "16 64"
    stop_server $name
    port=$((port + 1))
  done
  summaries
  cp -r /tmp/tl_* "$R/"
  ;;
overlap)
  checkpoint > "$R/checkpoint.txt" 2>&1 &
  CK=$!
  timeout 120 python3 -m pytest -q -p no:cacheprovider -m gpu tests/stages/test_overlap_steps.py 2>&1 | tail -3
  wait $CK; cat "$R/checkpoint.txt"
  start_server 8000 step --profile high-concurrency --set engine.timeline_dir=/tmp/tl_step
  pair 8000 step "128 64 1"
  stop_server step
  start_server 8001 ahead --profile high-concurrency --set engine.timeline_dir=/tmp/tl_ahead --set talker.overlap_steps=true
  pair 8001 ahead "128 64 1"
  stop_server ahead
  summaries
  ;;
sweep)  # both profiles over their levels (HC_LEVELS, LL_LEVELS; empty skips a profile)
  checkpoint
  [ -n "${HC_LEVELS-1 16 64 128 256}" ] && sweep 8000 hc "${HC_LEVELS-1 16 64 128 256}" --profile high-concurrency
  [ -n "${LL_LEVELS-1 16 64 128}" ] && sweep 8001 ll "${LL_LEVELS-1 16 64 128}" --profile low-latency
  ;;
delay)
  mossvox make-checkpoint --variant delay --size full --out /tmp/d8 > "$R/mkck.log" 2>&1 || { tail "$R/mkck.log"; exit 1; }
  el "checkpoint written"
  args="--model /tmp/d8 --batch 1 16 64 --frames 24 --attention auto"
  timeout 200 python3 -m bench.tensor_parallel $args --tp 1 2>&1 | grep '^{' | tee "$R/delay_tp.jsonl"
  timeout 120 python3 -m bench.tensor_parallel $args --tp 1 --no-graphs 2>&1 | grep '^{' | tee "$R/delay_eager.jsonl"
  [ "$(left)" -gt 40 ] && timeout $(( $(left) - 10 )) python3 -m pytest -q -p no:cacheprovider -m gpu tests/stages 2>&1 | tail -12 | tee "$R/gpu_tests.txt"
  ;;
invariant)
  checkpoint
  [ -z "${SKIP_TESTS:-}" ] && timeout 300 python3 -m pytest -q -s -p no:cacheprovider \
    tests/stages/test_batch_invariant_gpu.py tests/stages/test_batch_invariant.py \
    tests/stages/test_attention_triton.py 2>&1 | tail -8 | tee "$R/invariant_tests.txt"
  start_server 8000 inv_off --profile high-concurrency
  pair 8000 inv_off "1 64 128"
  stop_server inv_off
  start_server 8001 inv_on --profile high-concurrency --set talker.batch_invariant=true
  pair 8001 inv_on "1 64 128"
  stop_server inv_on
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
*) echo "unknown phase $PHASE"; exit 2 ;;
esac
