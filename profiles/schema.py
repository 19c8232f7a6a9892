"""The deploy profile: one frozen, strict msgspec tree.

Every section is a frozen Struct that rejects unknown fields; every field carries its constraint
and a description (`msgspec.Meta`) that says what it does. The schema defaults ARE the `default`
profile (GPU-oriented); `profiles/*.yaml` only state differences.

Lists are tuples so the whole tree is immutable. Per-process copies come from
`msgspec.structs.replace`, which re-runs the cross-field checks in `Profile.__post_init__`.

Adding a field: one line in its section with `Annotated[type, doc("what it does", ...)]` and a
default; `tests/profiles/test_profile_schema.py` fails if the description is missing.
"""

from __future__ import annotations

import hashlib
from typing import Annotated, Literal

import msgspec
import yaml


def doc(description: str, **constraints: object) -> msgspec.Meta:
    """A field's description plus its msgspec constraints (ge, gt, le, min_length, ...)."""
    return msgspec.Meta(description=description, **constraints)


class ProfileError(Exception):
    """A profile that cannot be loaded; the message names the key path and the file(s)."""

    def __init__(self, message: str, *, key_path: str = "", sources: tuple[str, ...] = ()):
        super().__init__(message)
        self.key_path = key_path
        self.sources = sources


class CrossFieldError(ProfileError):
    """Two or more fields that are valid alone but not together; `paths` names all of them.

    Not a ValueError on purpose: msgspec would fold a ValueError raised in `__post_init__` into a
    ValidationError and lose `paths`, which the loader needs to name the files.
    """

    def __init__(self, message: str, paths: tuple[str, ...]):
        super().__init__(message, key_path=paths[0])
        self.paths = paths


class _Section(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Base of every profile section: immutable, keyword-only, strict."""


REDACTED = "<redacted>"  # what a secret (api.keys) reads as in logs and printed profiles
SECRET_FIELDS = ("api.keys",)
PositiveInt = Annotated[int, msgspec.Meta(ge=1)]
Percent = Annotated[int, msgspec.Meta(ge=1, le=100)]
SM_PERCENT_DOC = (
    "on cuda under MPS (engine.mps), the share of the GPU's streaming multiprocessors this "
    "stage's kernels may occupy at once, in percent (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE, set "
    "before CUDA initialises): the two stages then contend for fewer SMs, each step or decode "
    "on its own share; ignored without MPS; null = all of them. The codec at 60% on an H200: "
    "the same audio-s/s at C=128 with 1.45-2x the first audio, 1.04-1.05x at C=64; at 40% it "
    "fell behind (88-91% smooth), so all")
MpsPriority = Literal["normal", "below_normal"]
MPS_PRIORITY_DOC = (
    "on cuda under MPS (engine.mps), this stage's MPS client priority (CUDA_MPS_CLIENT_PRIORITY, "
    "set before CUDA initialises): below_normal lets the other stage's ready kernels go first "
    "(the codec below the talker: its dispatches slow the talker's steps less, its own calls "
    "take longer); ignored without MPS. The codec below_normal on an H200 (high-concurrency): "
    "the talker's step 0.91x at C=128 and 0.93x at C=64, the codec's dispatches fewer and "
    "longer; audio-s/s 1.03x and 1.00x, first audio 1.33x and 1.20x later, so normal")
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
Bytes = Annotated[int, msgspec.Meta(ge=4096)]
Device = Annotated[str, msgspec.Meta(pattern=r"^(cpu|cuda(:[0-9]+)?)$")]


class ModelConfig(_Section):
    """Which checkpoint to serve and how to run it."""

    path: Annotated[str | None, doc(
        "checkpoint directory (config.json, *.safetensors, tokenizer files); null = the embedded "
        "tiny random-weight demo model, created on first use")] = None
    codec_path: Annotated[str | None, doc(
        "audio tokenizer checkpoint directory; null = <model.path>/audio_tokenizer")] = None
    device: Annotated[Literal["auto", "cpu", "cuda"], doc(
        "where the talker and codec run; auto = cuda when available, else cpu")] = "auto"
    dtype: Annotated[Literal["auto", "float32", "bfloat16"], doc(
        "weight and activation dtype; auto = bfloat16 on cuda, float32 on cpu")] = "auto"
    variant: Annotated[Literal["moss-tts", "ttsd", "sound-effect", "voice-generator"] | None, doc(
        "which Delay-family model a moss_tts_delay checkpoint is; null = config.json's "
        "mossvox_variant, else n_vq 32 = moss-tts (16-codebook checkpoints must be named)")] = None
    served_name: Annotated[str, doc(
        "model name accepted in requests and listed by /v1/models", min_length=1)] = "mossvox"
    aliases: Annotated[tuple[Annotated[str, msgspec.Meta(min_length=1)], ...], doc(
        "other model names requests may use for the served model, listed by /v1/models after "
        "served_name; by default OpenAI's speech model names, which many clients hard-code")] = (
        "tts-1", "tts-1-hd", "gpt-4o-mini-tts")
    force_length_from_text: Annotated[bool, doc(
        "force each request's frame count from its text (frames_per_char); random weights never "
        "stop by themselves; a benchmark/demo feature, logged when on")] = False
    frames_per_char: Annotated[float, doc(
        "frames (80 ms) per input character when the length is forced", gt=0)] = 0.87
    max_new_frames: Annotated[int, doc(
        "runaway guard: a request stops with finish_reason=length after this many frames", ge=1)] = 4096
    demo_cache_dir: Annotated[str, doc(
        "where the embedded demo checkpoint is written on first use (~ expanded)",
        min_length=1)] = "~/.cache/mossvox"


class TalkerConfig(_Section):
    """The talker worker: continuous batching, KV cache, graphs."""

    max_running: Annotated[int, doc(
        "streams decoded together at most (the talker's batch capacity)", ge=1)] = 256
    kv_block_size: Annotated[int, doc("tokens per KV-cache block", ge=1)] = 16
    kv_blocks: Annotated[PositiveInt | None, doc(
        "KV-cache blocks to allocate; null = derive from kv_memory_fraction")] = None
    kv_memory_fraction: Annotated[float, doc(
        "share of free device memory given to the KV cache when kv_blocks is null",
        gt=0, le=1)] = 0.5
    prefill_chunk_tokens: Annotated[int, doc(
        "a long prompt is prefilled in chunks of at most this many tokens so running streams "
        "keep their cadence", ge=1)] = 512
    max_prefill_tokens_per_step: Annotated[int, doc(
        "prompt tokens prefilled per scheduler step across all new requests",
        ge=1)] = 2048
    cuda_graphs: Annotated[bool, doc(
        "capture the decode step in CUDA graphs per batch bucket")] = True
    backbone_graphs: Annotated[bool, doc(
        "Delay and Realtime talkers: replay the decoding rows' backbone step (and Realtime's depth loop) "
        "from CUDA graphs (with cuda_graphs, CUDA only; the 8B Delay step: 32.8 ms eager, 9.5 ms from graphs on "
        "an H200 at one stream)")] = True
    prefill_graphs: Annotated[bool, doc(
        "with cuda_graphs (and backbone_graphs for Delay and Realtime), a step's prompt chunks "
        "replay a CUDA graph per token bucket, captured at warm-up, instead of one eager call "
        "(an eager prefill step is bound by host time: for Local-v1.5 on an H200 it halves first "
        "audio at one stream, ~68 to ~34 ms, and gave +8% audio-s/s at 128 streams); on in "
        "low-latency and high-concurrency")] = False
    prefill_graph_seqs: Annotated[int, doc(
        "with prefill_graphs, the most prompt chunks one prefill-graph replay takes (padding "
        "chunks cost idle attention programs), and so a step: more wait for the next step (as many "
        "prefix-cache hits admitted together make, up to max_running chunks of a few rows each; "
        "one eager call for them all, bound by the host's launches, held a C=256 first wave's "
        "streams for 53-74 ms a step on an H200)",
        ge=1)] = 32
    mixed_step_tokens: Annotated[int, doc(
        "Local-v1.5 with cuda_graphs and the Triton attention: a step that decodes at least 16 "
        "requests and takes at most 8 prompt chunks of this many tokens in all replays one graph "
        "for both (decode rows and chunk tokens through one backbone call, then one local loop) "
        "instead of a decode graph and a prefill graph. Graphs: decode buckets from 16 x token "
        "buckets (powers of two) to this, per sampler mode, made at warm-up (on an H200 at "
        "C=128: 1.15x audio-s/s). 0 = off; 256 in high-concurrency", ge=0)] = 0
    capture_ahead: Annotated[bool, doc(
        "with cuda_graphs, record at warm-up every decode, local-loop and prefill graph bucket "
        "serving can meet (every sampler mode, block tables up to 2048 tokens), so the first "
        "requests after /ready never wait for a capture; off: on an H200 it made 150 graphs in "
        "197 s of start-up")] = False
    prefix_caching: Annotated[bool, doc(
        "keep the full KV blocks of prompts by content, so a request whose prompt begins like an "
        "earlier one (same voice: template prefix and reference frames) prefills only the rest; "
        "idle cached blocks are reused for new tokens when no free block is left, so it costs no "
        "capacity")] = True
    compile: Annotated[bool, doc(
        "on CUDA, run the backbone layers, row embedding and the local loop + sampling through "
        "torch.compile (fused kernels; compiled at warm-up, tens of seconds)")] = True
    prefill_interval: Annotated[int, doc(
        "while streams are decoding, new prompts are prefilled at most every this many steps "
        "(1 = every step; larger = more decode steps replayed from graphs between prefills, "
        "more throughput, later first audio for new requests)", ge=1)] = 1
    overlap_steps: Annotated[bool, doc(
        "Local-v1.5 talker: plan and launch each step before reading back the one before, so the "
        "host's work of a step runs while the GPU computes (a frame whose stop head fires is "
        "computed once more and dropped); not with max_step_ms; on in high-concurrency (an H200 "
        "at C=128 and 64: 1.15x audio-s/s)")] = False
    fused_sampling: Annotated[bool, doc(
        "Local-v1.5 talker: each of a frame's 13 heads samples in one Triton kernel (penalty, "
        "ranking, temperature, top-k, top-p and the seeded draw in registers per row) instead of "
        "the torch sampler's chain of small kernels; the same tokens but where float rounding "
        "decides, each still a function of its own row (CUDA, or Triton's CPU interpreter); on in "
        "high-concurrency with prefill_interval 1, final_wait_ms 0 and the local attention "
        "kernel (an H200 at C=64: 1.03x audio-s/s, first audio 0.85x)")] = False
    local_attention: Annotated[Literal["sdpa", "plain", "kernel"], doc(
        "Local-v1.5 talker: how a frame's local steps attend (one query over at most 12 keys): "
        "\"sdpa\" (scaled_dot_product_attention: on CUDA a flash kernel a position, 0.68 of the "
        "2.17 ms of an H200's compiled local loop at 88 rows), \"plain\" (elementwise products "
        "and sums in float32, which torch.compile fuses into a few small kernels) or \"kernel\" "
        "(one Triton kernel a position: the rotations, scores, softmax and weighted values from the "
        "input projection's outputs; CUDA, or Triton's CPU interpreter; kernel in high-concurrency "
        "with three other small levers, C=64 1.03x); plain and kernel not with batch_invariant "
        "(plain on an H200 at 88 rows: the compiled local loop 1.57 against sdpa's 2.11 ms of "
        "kernels; served one step ahead, 1.20-1.26x audio-s/s at C=128)")] = "sdpa"
    fused_projections: Annotated[bool, doc(
        "Local-v1.5 talker: each backbone layer's q, k and v projections run as one matmul and "
        "the MLP's gate and up as another (weights stacked after loading): three kernels fewer a "
        "layer, each wider; the same products, summed in the order the wider kernel picks (an "
        "H200's step alone at 88 rows: 0.52 ms fewer kernels, 6.10 against 6.62; served at C=128 "
        "1.08x audio-s/s in two calls; at C=1 in low-latency 1.13x); on in high-concurrency and "
        "low-latency")] = False
    fused_kv_writes: Annotated[bool, doc(
        "Local-v1.5 talker: each backbone layer's new keys and values are stored in the paged cache "
        "by the compiled kernels that compute them (the layer's first half) instead of two copies "
        "after it: the same values in the same slots. Measured on an H200 with the stores as "
        "index_copy_ into a flat view, the compiled layer also copied the layer's whole cache back "
        "(88 rows: 5.4 ms more kernels a step; a C=128 server's steps 5x longer); the stores are "
        "now an in-place index_put_ at (block, row), which a GPU test holds to no copy; off "
        "until measured again")] = False
    fused_qk_rope_store: Annotated[bool, doc(
        "Local-v1.5 talker: each backbone layer's q/k RMSNorms, RoPE and KV stores in one Triton "
        "kernel (a program a token and head) after the compiled projections, instead of the "
        "compiled norms and rotation and two index_copy launches (on an H200 at 88 rows: 72 "
        "launches and 0.21 ms of the 7.2 ms step for the stores alone); the same values up to "
        "the rounding of the rotation's products; takes precedence over fused_kv_writes; CUDA "
        "(the torch ops elsewhere); on in both tuned profiles with deferred_residuals (an H200's "
        "step at 88 rows: 6.69 ms against 7.46 alone, 6.54 with the sums deferred)")] = False
    deferred_residuals: Annotated[bool, doc(
        "Local-v1.5 talker, with fused_qk_rope_store: each backbone layer leaves its two residual "
        "sums to the next layer's input norm (the last layer's to the final norm), so the sums "
        "ride in the norms' kernels; compiled for CUDA, x + o_proj(o) and x + down(h) were each an "
        "addmm that first copied x into its output (74 device copies a step at 88 rows on an "
        "H200); the same sums rounded once instead of twice; on in both tuned profiles (served with "
        "the kernel in high-concurrency at C=64 1.03-1.08x audio-s/s, at C=128 1.02-1.06x; in "
        "low-latency at C=1 1.05x with first audio 0.95x, C=16 1.04-1.08x, C=128 1.08x)")] = False
    kv_cache_dtype: Annotated[Literal["auto", "fp8"], doc(
        "the talker's paged KV cache: \"auto\" (model.dtype) or \"fp8\" (float8 e4m3 without "
        "a scale, values saturated at its range: half the bytes attention reads and twice the "
        "tokens in the same memory; a precision change, its distance from the bf16 outputs is "
        "measured in docs/performance.md: on random full-size weights it adds ~0.1% to bf16's "
        "~1.5% hidden-state distance from fp32); auto: served on an H200 beside the fused "
        "projections it gave 0.96x their audio-s/s at C=128")] = "auto"
    fp8_weights: Annotated[Literal["none", "backbone", "all"], doc(
        "Local-v1.5 talker: matmuls from float8 e4m3 weights (one scale per output channel), "
        "half the bytes a step reads: \"backbone\" (the Qwen3 layers' projections), \"all\" "
        "(the local block's too); embeddings, heads and norms stay in model.dtype; how they "
        "multiply: fp8_scheme. A precision change, measured in docs/performance.md on random "
        "full-size weights: backbone by w8a8 moves the sampled distribution's KL from fp32 from "
        "2.09e-3 (bf16) to 2.11e-3, all by w8a8 to 8.5e-3 (a checkpoint with outlier channels "
        "can lose more). On an H200 backbone by w8a8 took the step at 48 rows from 5.46 to 4.93 "
        "ms and served C=64 1.03-1.04x, C=128 1.03x; w8a16 is slower than bf16 (its Triton "
        "kernel reads 0.4-0.95 TB/s at 88 rows). CUDA (sm89 and later) or the CPU; on an older GPU "
        "the weights stay as loaded, with a warning")] = "none"
    fp8_scheme: Annotated[Literal["w8a16", "w8a8"], doc(
        "with fp8_weights: w8a8 quantizes the inputs per row too and multiplies float8 by "
        "float8 in cuBLAS's per-tensor kernel with unit scales, the row and channel scales "
        "applied to its output after (compiled: in the kernel that follows); w8a16 multiplies "
        "the inputs as they are by the upcast weights (on CUDA a Triton kernel for few rows "
        "that reads the float8 tiles and splits the inputs when the channels are few; only the "
        "weights rounded)")] = "w8a16"
    fp8_fused_swiglu: Annotated[bool, doc(
        "with fp8_weights by w8a8 and fused_projections: each backbone MLP's SiLU product and its "
        "per-row quantization for down in one Triton kernel that reads gate|up's product once, a "
        "program a row (CUDA; the torch ops elsewhere), instead of the compiled reduction that "
        "passes over each row twice (6.9 us a layer at 48 rows on an H200); the same arithmetic, "
        "the scaled product kept in fp32 before the SiLU")] = False
    fp8_fused_scales: Annotated[bool, doc(
        "with fp8_weights by w8a8, fused_qk_rope_store and deferred_residuals: each layer's q|k|v "
        "product's row and channel scales applied by the q/k norm, RoPE and store kernel as it "
        "loads the product, and down's inside the next layer's input norm, instead of a kernel "
        "each after the matmul (1.6 and 1.3 us a layer at 48 rows on an H200); the same scales, "
        "the scaled q|k|v no longer rounded to model.dtype before the norms")] = False
    fp8_fused_norms: Annotated[bool, doc(
        "with fp8_fused_swiglu and fp8_fused_scales: each layer's two residual sums, the norm after "
        "each and the rows' quantization for the float8 matmul next in one Triton kernel, a program "
        "a row (stages.runtime.fp8_norm), instead of the compiled reductions (3.6 and 4.25-5.5 us "
        "a layer at 48 rows on an H200); the sum after attention written as the residual, so each "
        "half layer's sum is rounded to model.dtype once")] = False
    priority_stream: Annotated[bool, doc(
        "on CUDA, the talker's work (its graph replays, compiled kernels and copies) goes to a "
        "stream of the highest priority, so where it shares a GPU with the codec (MPS) the GPU "
        "schedules its short step kernels ahead of the codec's long ones (on an H200 at C=128 beside the "
        "shipped high-concurrency profile: within the spread between servers, so off)")] = False
    max_step_ms: Annotated[PositiveFloat | None, doc(
        "while streams are decoding, a step prefills no more prompt tokens than fit in this many "
        "ms by the talker's measured step costs (at least 64 tokens), so a burst of long prompts "
        "is prefilled over several steps instead of one that stalls every stream (not with "
        "overlap_steps: its costs are measured step by step); null = only "
        "max_prefill_tokens_per_step limits it")] = None
    attention: Annotated[Literal["auto", "padded", "triton"], doc(
        "attention kernel over the paged KV cache: padded (gather blocks, torch SDPA-like), "
        "triton (paged decode kernel, CUDA only), auto = triton on CUDA when available, else "
        "padded")] = "auto"
    torch_threads: Annotated[PositiveInt | None, doc(
        "torch intra-op threads in the talker process; null = torch's default")] = None
    sm_percent: Annotated[Percent | None, doc(SM_PERCENT_DOC)] = None
    mps_priority: Annotated[MpsPriority, doc(MPS_PRIORITY_DOC)] = "normal"
    batch_invariant: Annotated[bool, doc(
        "a request's logits do not depend on the batch it shares, so a seed gives the same speech "
        "at any load: the talker's linears, norms, sampling scans and small attention run Triton "
        "kernels with a fixed tiling (stages/runtime/batch_invariant.py), the paged attention one "
        "split with decode rows as prefill tiles, and torch.compile is off; needs CUDA (Triton) and "
        "triton attention, one GPU per talker. Off in every profile: on an H200 it halved "
        "throughput at one stream and cost 40% of it at 128 (docs/performance.md)")] = False
    tensor_parallel: Annotated[int, doc(
        "GPUs one Delay talker is split over (tensor parallelism: heads, KV cache and FFN "
        "sharded, embeddings and heads replicated); 1 = one device", ge=1)] = 1


class CodecConfig(_Section):
    """The codec worker: streaming decode slots and reference encoding."""

    max_slots: Annotated[int, doc(
        "streaming-decode slots (one per live request)", ge=1)] = 256
    cuda_graphs: Annotated[bool, doc(
        "capture decode in CUDA graphs per (batch bucket, chunk length)")] = True
    prime_continuation: Annotated[bool, doc(
        "continuation requests (reference audio + its transcript): decode the reference codes "
        "first, audio dropped, so the new audio has the reference as left context as upstream's "
        "decode-then-trim does (exact); false skips that prime (first audio sooner, the first "
        "frames decoded without left context, as vLLM-Omni does)")] = True
    compile: Annotated[bool, doc(
        "on CUDA, run the codec's transformer layers (norms, projections, RoPE, FFN) through "
        "torch.compile, attention and ring writes eager; off: on an H200 it changed no replay's "
        "time measurably (CPU-tested through dynamo's eager backend)")] = False
    ring_attention: Annotated[bool, doc(
        "on CUDA, streaming decode attends over the slots' ring caches in place (a Triton kernel "
        "applying the window) instead of copying each row's rings out and masking (up to "
        "`ring_attention_max_frames`); on in high-concurrency and low-latency")] = False
    ring_attention_max_frames: Annotated[PositiveInt | None, doc(
        "with `ring_attention`: only chunks of at most this many frames attend in place, longer "
        "ones copy the rings out (on an H200, 128 rows: a 1-frame replay 23.4 -> 10.8 ms in "
        "place, a 15-frame one 107.9 -> 98.7 ms); null = every length")] = None
    decode_lanes: Annotated[int, doc(
        "with cuda_graphs, the replays of one dispatch (one per group of chunk lengths) run on up "
        "to this many CUDA streams at once, each lane with graphs and a memory pool of its own "
        "(captured once per lane at start-up): a replay of small chunks is bound by its thousands "
        "of small kernels, not by the chip, so replays side by side may fill it; 1 = one after "
        "another; more: not yet measured", ge=1, le=8)] = 1
    split_chunks: Annotated[bool, doc(
        "with cuda_graphs, a dispatch's longer chunks may go into a shorter replay as several rows "
        "of their stream (pieces in order, one call), when the codec's cost model finds that "
        "cheaper than padding the short ones to the longest: a C=128 dispatch of ramp and steady "
        "chunks models 16.3 ms as one 2-frame replay of 96 rows against 26.8 ms padded into two "
        "(on an H200, a padded frame costs as much as a real one); the rings hold one frame more. "
        "Not with decode_lanes > 1; on in high-concurrency (C=128 served 1.09-1.20x the audio "
        "seconds a second, the padding 23% -> 6% of the decoded row-frames)")] = False
    fused_ring_writes: Annotated[bool, doc(
        "with ring_attention: each decoder layer rotates q and k and writes its rings in one "
        "Triton kernel, not five small torch ops (92 layers in the full v2 decoder: a small "
        "replay is mostly such launches); on in high-concurrency and low-latency, with fused_norms")] = False
    fused_norms: Annotated[bool, doc(
        "with fused_ring_writes: each decoder layer's residual adds and the LayerNorms that read "
        "them run as one Triton kernel a pair (the FFN half's add with the next layer's first "
        "LayerNorm): nine kernels a layer instead of eleven, the residual stream read and "
        "written once a pair (with fused_ring_writes, an H200's replays at 80 rows took 0.72x the "
        "time at 1, 2 and 15 frames; served, 0.79-0.83x the codec's time a frame, 1.02-1.04x the audio "
        "seconds a second over four passes each at C=128 and 64); on in high-concurrency and low-latency")] = False
    fused_attention: Annotated[bool, doc(
        "with fused_ring_writes: each decoder layer's ring attention runs in the kernel that "
        "rotates and writes the rings (one program a row and head writes its chunk, then attends; "
        "a cut chunk's pieces in order in one program): eight kernels a layer instead of nine, "
        "the same keys and results; off until measured")] = False
    gelu_epilogue: Annotated[bool, doc(
        "the decoder layers' FFN GELU as the tanh approximation inside the first matmul "
        "(cuBLASLt's GELU epilogue on CUDA: 92 kernels fewer a replay of the full v2 decoder) "
        "instead of the checkpoint's erf GELU; a fidelity change (the two differ by at most ~5e-4, "
        "under bf16's step for |x| > 0.06; on an H200 the full-size random codec's audio is 89 dB "
        "from erf's in fp32, while bf16 itself is 32.4 dB from fp32 with either GELU: "
        "`python -m bench.kernels.codec_gelu`); replays alone 0.93-0.97x the time (C=64's served mix "
        "0.94x); the encoder keeps erf; off until measured served")] = False
    encode_batch: Annotated[int, doc(
        "reference-encoding jobs batched together at most", ge=1)] = 8
    encode_batch_streaming: Annotated[PositiveInt | None, doc(
        "reference-encoding jobs batched together at most while streams are decoding: a batch holds "
        "up every open stream's next chunk for its whole duration (on an H200 at C=128, 333 new "
        "voices encoded in batches of 8 spaced the codec's dispatches ~180 ms apart and left 9-12% "
        "of the streams smooth); smaller batches keep the streams fed and make new voices wait "
        "longer (batches of 4: 100% smooth, 2.8 s to first audio against 1.7 s; of 2: 3.7 s); "
        "null = encode_batch")] = None
    encode_graphs: Annotated[bool, doc(
        "reference encoding replays CUDA graphs per (batch bucket, length bucket of 4-32 s), "
        "captured at start-up (CUDA only; ~11 s for the full v2 codec); on in high-concurrency and "
        "low-latency")] = False
    torch_threads: Annotated[PositiveInt | None, doc(
        "torch intra-op threads in the codec process; null = torch's default")] = None
    sm_percent: Annotated[Percent | None, doc(SM_PERCENT_DOC)] = None
    mps_priority: Annotated[MpsPriority, doc(MPS_PRIORITY_DOC)] = "normal"
    client_stall_s: Annotated[float, doc(
        "longest the codec waits for room in an API process's PCM ring before failing that "
        "process's requests (a stuck API process must not stall every stream)",
        gt=0)] = 5.0


class ChunkingConfig(_Section):
    """When the talker hands frames to the codec: first chunk, ramp, steady chunks."""

    initial_chunk_frames: Annotated[int, doc(
        "frames in a request's first chunk (first audio); a request may override it",
        ge=1)] = 1
    ramp: Annotated[tuple[PositiveInt, ...], doc(
        "frames of the chunks after the first, before the steady size")] = ()
    chunk_frames: Annotated[int, doc(
        "frames per steady-state chunk (15 frames = 1.2 s)", ge=1)] = 15


class CoalescingConfig(_Section):
    """How the codec worker groups ready streams into one decode batch."""

    min_batch: Annotated[int, doc(
        "wait for at least this many streams with a chunk ready (or max_wait_ms)",
        ge=1)] = 1
    max_wait_ms: Annotated[float, doc(
        "longest wait since the oldest ready chunk before dispatching anyway",
        ge=0)] = 0.0
    max_batch: Annotated[int, doc(
        "streams decoded in one codec call at most", ge=1)] = 256
    express_first_chunks: Annotated[bool, doc(
        "a request's first audio chunk skips the window and any large batch: it is decoded at "
        "once in a small call of first chunks, so first audio never waits behind a steady "
        "batch")] = True
    express_joins_dispatch: Annotated[bool, doc(
        "with express_first_chunks: when a batch is due at the same moment, the first chunks go "
        "in it, one decode call instead of two (each call's replays cost a fixed part: at 128 "
        "streams on an H200, 65 of 168 dispatches were first chunks alone, 19% of the codec's "
        "time); alone only when no batch is due; first audio then waits for the whole batch (on an "
        "H200 at C=128: ~1.05x audio-s/s, ~20 ms more first audio after a pass's first wave); on "
        "in high-concurrency")] = False
    patient_wait_ms: Annotated[float, doc(
        "a steady chunk (not a request's first or final) of a stream whose client holds audio "
        "may wait up to this long for a larger dispatch, never past the moment that client's "
        "audio would run out less buffer_margin_ms; 0 = every chunk keeps max_wait_ms", ge=0)] = 0.0
    final_wait_ms: Annotated[NonNegativeFloat | None, doc(
        "longest wait of a request's final chunk (its last audio: the request ends when it is "
        "out) before its dispatch; a shorter wait than max_wait_ms ends requests sooner (at C=128 "
        "on an H200 a final chunk came ~90 ms after the talker's last frame); 0 = a final chunk "
        "dispatches what is ready at once; null = max_wait_ms")] = None
    buffer_margin_ms: Annotated[float, doc(
        "how early before a client's buffered audio runs out a waiting chunk is dispatched",
        ge=0)] = 200.0
    policy: Annotated[Literal["fixed", "idle_wait"], doc(
        "fixed = always honour the window; idle_wait = sleep on the doorbell when nothing is "
        "runnable")] = "idle_wait"


class AdmissionConfig(_Section):
    """The coordinator's admission control and deadlines."""

    max_running: Annotated[int, doc(
        "requests admitted to the talker at once", ge=1)] = 256
    max_queued: Annotated[int, doc(
        "requests waiting for admission; beyond it a typed rejection (429/503)",
        ge=0)] = 1024
    request_timeout_s: Annotated[float, doc(
        "deadline of one request from submission", gt=0)] = 600.0
    retry_after_s: Annotated[float, doc(
        "Retry-After hint sent with a rejection when no better estimate exists",
        ge=0)] = 1.0
    min_lead_s: Annotated[float, doc(
        "queued requests wait while a playing stream has less than this many seconds of "
        "delivered audio left to play (its client playing from its first chunk at real time), "
        "so overload slows new arrivals, not the streams already heard; 0 = off (only "
        "max_running limits admission)", ge=0)] = 0.0
    lead_settle_s: Annotated[float, doc(
        "a stream counts for min_lead_s once it has delivered this many seconds of audio (its "
        "first chunks are short by design, so its buffer starts small)", ge=0)] = 1.0


class ApiConfig(_Section):
    """The HTTP front end."""

    host: Annotated[str, doc("address the server binds", min_length=1)] = "127.0.0.1"
    port: Annotated[int, doc("TCP port (0 = any free port)", ge=0, le=65535)] = 8000
    api_servers: Annotated[int, doc(
        "API processes sharing one port, one coordinator and one pair of workers",
        ge=1)] = 1
    keys: Annotated[tuple[str, ...], doc(
        "accepted bearer keys for /v1/*; empty = no authentication")] = ()
    max_input_chars: Annotated[int, doc("longest `input` text accepted", ge=1)] = 4096
    strict_fields: Annotated[bool, doc(
        "refuse (400) a request field the served model does not use, such as ref_text for "
        "MOSS-TTS-Realtime, instead of ignoring it and naming it in X-Ignored-Fields")] = False
    max_body_bytes: Annotated[int, doc(
        "largest request body accepted (413 beyond), and largest WebSocket message (the socket "
        "is closed, 1009)", ge=1024)] = 32 * 1024 * 1024
    min_ref_seconds: Annotated[float, doc(
        "shortest reference audio accepted", ge=0)] = 1.0
    max_ref_seconds: Annotated[float, doc(
        "longest reference audio accepted", gt=0)] = 30.0
    max_ref_bytes: Annotated[int, doc(
        "largest encoded reference audio accepted", ge=1024)] = 16 * 1024 * 1024
    max_ref_channels: Annotated[int, doc(
        "most channels a reference clip's file may have (checked from its header before "
        "decoding); raise it only to accept surround recordings", ge=1, le=64)] = 8
    max_ref_sample_rate: Annotated[int, doc(
        "highest sample rate, in Hz, a reference clip's file may have (checked from its header "
        "before decoding); with max_ref_seconds it bounds the samples one decode holds",
        ge=8000, le=768000)] = 192000
    max_ref_decodes: Annotated[int, doc(
        "reference clips one API process decodes at once (more wait for a turn): with the two "
        "above, the bound on the memory reference decoding holds in all; raise it on hosts with "
        "many cores and many new voices", ge=1)] = 4
    max_voices: Annotated[int, doc("registered voices kept at most", ge=0)] = 1000
    allow_remote_ref_audio: Annotated[bool, doc(
        "allow http(s) URLs as ref_audio (the server fetches them)")] = False
    allowed_local_paths: Annotated[tuple[str, ...], doc(
        "directories under which file:// or plain-path ref_audio may be read")] = ()
    data_dir: Annotated[str, doc(
        "reference-code cache, validated clips and registered voices, shared by API processes (~ expanded)",
        min_length=1)] = "~/.cache/mossvox/data"
    header_timeout_s: Annotated[float, doc(
        "a connection whose request headers are not complete this long after it opened (or after "
        "its previous response) is closed", gt=0)] = 10.0
    body_timeout_s: Annotated[float, doc(
        "a request body that stalls this long between two pieces is answered 408 and its "
        "connection closed", gt=0)] = 30.0
    max_batch_items: Annotated[int, doc(
        "most speech requests in one POST /v1/audio/speech/batch", ge=1, le=1024)] = 32
    cors_origins: Annotated[tuple[str, ...], doc(
        "origins (scheme://host[:port], or *) whose browser pages may call the API across "
        "origins; empty = no CORS headers, so browsers keep such pages out")] = ()
    pcm_layout: Annotated[Literal["openai", "native"], doc(
        "response_format pcm when a request names no sample_rate or channels: openai = 24 kHz "
        "mono s16le, what OpenAI speech clients assume; native = the model's own rate and "
        "channels")] = "openai"

    def __repr__(self) -> str:  # keys stay out of logs and tracebacks
        shown = msgspec.structs.replace(self, keys=tuple(REDACTED for _ in self.keys))
        fields = ", ".join(f"{f}={getattr(shown, f)!r}" for f in self.__struct_fields__)
        return f"ApiConfig({fields})"


class StreamConfig(_Section):
    """The WebSocket speech endpoint (`/v1/audio/speech/stream`): text in as it is written."""

    max_sessions: Annotated[int, doc(
        "open WebSocket sessions per API process; one more is refused (error frame, close "
        "1013)", ge=1)] = 64
    idle_timeout_s: Annotated[float, doc(
        "a session that sends nothing for this long while nothing is being spoken is closed",
        gt=0)] = 60.0
    send_timeout_s: Annotated[float, doc(
        "a client that does not take an event or audio frame for this long (stalled, or reading "
        "slower than it is spoken to) is dropped and its speech aborted", gt=0)] = 30.0
    max_session_chars: Annotated[int, doc(
        "text one session may send in all; input.text beyond it is refused (error frame)",
        ge=1)] = 100_000
    min_segment_chars: Annotated[int, doc(
        "a sentence or clause shorter than this joins the next one (one word is not an "
        "utterance)", ge=1)] = 10
    max_segment_chars: Annotated[int, doc(
        "text without a boundary is cut at a space before this many characters (and never "
        "past api.max_input_chars)", ge=1)] = 400
    context_frames: Annotated[int, doc(
        "models that continue audio (Local-v1.5): a sentence after the first continues the "
        "previous one's codes when it has at most this many frames (0 = never)", ge=0)] = 250


class IpcConfig(_Section):
    """Shared-memory ring sizes and peer liveness checks."""

    control_ring_bytes: Annotated[int, doc(
        "bytes of each control-record ring (submit, abort, finished, stats)",
        ge=4096)] = 1024 * 1024
    codes_ring_bytes: Annotated[int, doc(
        "bytes of the talker -> codec code-chunk ring", ge=4096)] = 4 * 1024 * 1024
    pcm_ring_bytes: Annotated[int, doc(
        "bytes of each codec -> API-process PCM ring", ge=4096)] = 64 * 1024 * 1024
    peer_check_s: Annotated[float, doc(
        "a blocked channel checks that its peer is alive this often", gt=0)] = 0.5


class EngineConfig(_Section):
    """Process lifecycle: start-up, shutdown, logging."""

    shutdown: Annotated[Literal["drain", "abort"], doc(
        "on stop: finish running requests (drain) or abort them")] = "drain"
    drain_timeout_s: Annotated[float, doc(
        "longest drain before the remaining requests are aborted", ge=0)] = 30.0
    ready_timeout_s: Annotated[float, doc(
        "longest wait for a worker's Ready record (model load and warm-up)",
        gt=0)] = 600.0
    mps: Annotated[bool, doc(
        "on cuda, start a private MPS daemon so talker and codec run concurrently"
    )] = True
    log_level: Annotated[Literal["debug", "info", "warning", "error"], doc(
        "log level of every mossvox process")] = "info"
    replicas: Annotated[int, doc(
        "talker+codec worker pairs behind the one coordinator (one per GPU, or per group of "
        "talker.tensor_parallel GPUs); a new request goes to the live replica with the most "
        "headroom; one replica failing fails only its own requests", ge=1)] = 1
    timeline_dir: Annotated[str | None, doc(
        "write a timeline of the workers' steps, codec dispatches and request events as JSON "
        "lines under this directory (one file per process; read it with `python -m "
        "bench.timeline DIR`); null = off")] = None
    devices: Annotated[tuple[Device, ...], doc(
        "device of each replica (its talker's first TP rank and its codec), e.g. [cuda:0, "
        "cuda:1]; a TP group takes the consecutive GPUs from there; empty = derive: cuda:i*tp "
        "when CUDA has enough devices, else cpu for all")] = ()
    restart_limit: Annotated[int, doc(
        "a replica whose worker dies is restarted in place (its requests fail, the others go "
        "on) at most this many times within restart_window_s; past it, it stays down and with "
        "none left the engine fails (/health 503: the orchestrator restarts the server); "
        "0 = never restart", ge=0)] = 5
    restart_window_s: Annotated[float, doc(
        "the window over which restart_limit counts a replica's restarts", gt=0)] = 600.0
    restart_backoff_s: Annotated[float, doc(
        "wait before restarting a failed replica; doubled for each earlier restart of it within "
        "restart_window_s (at most 60 s)", ge=0)] = 1.0


def _section(cls: type[_Section]) -> object:
    return msgspec.field(default_factory=cls)


class Profile(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """A resolved deploy profile. Build it with `profiles.load_profile`, not by hand."""

    model: ModelConfig = _section(ModelConfig)
    talker: TalkerConfig = _section(TalkerConfig)
    codec: CodecConfig = _section(CodecConfig)
    chunking: ChunkingConfig = _section(ChunkingConfig)
    coalescing: CoalescingConfig = _section(CoalescingConfig)
    admission: AdmissionConfig = _section(AdmissionConfig)
    api: ApiConfig = _section(ApiConfig)
    stream: StreamConfig = _section(StreamConfig)
    ipc: IpcConfig = _section(IpcConfig)
    engine: EngineConfig = _section(EngineConfig)

    def __post_init__(self) -> None:
        for message, paths in _cross_field_violations(self):
            raise CrossFieldError(message, paths)

    def to_dict(self) -> dict:
        """The tree as plain dicts, lists and scalars (JSON/YAML-ready)."""
        return msgspec.json.decode(msgspec.json.encode(self))

    def sha256(self) -> str:
        """Hex SHA-256 of the canonical JSON (sorted keys) of the resolved tree."""
        return hashlib.sha256(msgspec.json.encode(self, order="sorted")).hexdigest()

    def redacted(self) -> Profile:
        """This profile with every secret (`SECRET_FIELDS`) replaced by `REDACTED`: what logs and
        printed profiles show."""
        api = msgspec.structs.replace(self.api, keys=tuple(REDACTED for _ in self.api.keys))
        return msgspec.structs.replace(self, api=api)

    def to_yaml(self) -> str:
        """The tree as YAML in schema order; loading it back yields an equal profile."""
        return yaml.safe_dump(self.to_dict(), sort_keys=False, default_flow_style=False)


def _cross_field_violations(p: Profile) -> list[tuple[str, tuple[str, ...]]]:
    """Constraints between fields, each as (message, the key paths involved)."""
    out: list[tuple[str, tuple[str, ...]]] = []

    def at_most(a: str, av: float, b: str, bv: float, why: str) -> None:
        if av > bv:
            out.append((f"{a} ({av}) must be <= {b} ({bv}): {why}", (a, b)))

    c = p.chunking
    at_most("chunking.initial_chunk_frames", c.initial_chunk_frames, "chunking.chunk_frames",
            c.chunk_frames, "the first chunk is never larger than a steady chunk")
    for i, frames in enumerate(c.ramp):
        at_most(f"chunking.ramp[{i}]", frames, "chunking.chunk_frames", c.chunk_frames,
                "the ramp grows towards the steady chunk size")
    at_most("coalescing.min_batch", p.coalescing.min_batch, "coalescing.max_batch",
            p.coalescing.max_batch, "the window cannot wait for more streams than a batch holds")
    at_most("coalescing.max_batch", p.coalescing.max_batch, "codec.max_slots",
            p.codec.max_slots, "a codec batch holds at most one chunk per slot")
    at_most("admission.max_running", p.admission.max_running, "talker.max_running",
            p.talker.max_running, "the coordinator never admits more than the talker can run")
    at_most("talker.prefill_chunk_tokens", p.talker.prefill_chunk_tokens,
            "talker.max_prefill_tokens_per_step", p.talker.max_prefill_tokens_per_step,
            "one prefill chunk must fit in one step's prefill budget")
    at_most("api.min_ref_seconds", p.api.min_ref_seconds, "api.max_ref_seconds",
            p.api.max_ref_seconds, "the accepted reference duration range would be empty")
    at_most("stream.min_segment_chars", p.stream.min_segment_chars, "stream.max_segment_chars",
            p.stream.max_segment_chars, "a segment must be able to reach its minimum length")
    t = p.talker
    if t.batch_invariant and t.attention == "padded":
        out.append(("talker.batch_invariant needs the triton attention (padded attention sums over "
                     "a width that changes with the batch)", ("talker.batch_invariant", "talker.attention")))
    if t.batch_invariant and t.tensor_parallel > 1:
        out.append(("talker.batch_invariant needs talker.tensor_parallel 1 (an all-reduce may pick its "
                     "algorithm by message size)", ("talker.batch_invariant", "talker.tensor_parallel")))
    if t.batch_invariant and t.fp8_weights != "none":
        out.append(("talker.batch_invariant needs talker.fp8_weights none (cuBLAS picks its float8 "
                    "kernel by the batch's rows)", ("talker.batch_invariant", "talker.fp8_weights")))
    if t.batch_invariant and t.local_attention != "sdpa":
        out.append(("talker.batch_invariant needs talker.local_attention sdpa (the plain local "
                    "attention's fused sums may be tiled by batch size; the kernel is not checked for it)",
                    ("talker.batch_invariant", "talker.local_attention")))
    if t.fp8_fused_swiglu and (t.fp8_weights == "none" or t.fp8_scheme != "w8a8" or not t.fused_projections):
        out.append(("talker.fp8_fused_swiglu needs talker.fp8_weights backbone or all by talker.fp8_scheme "
                    "w8a8, with talker.fused_projections (its kernel reads gate|up's float8 product)",
                    ("talker.fp8_fused_swiglu", "talker.fp8_weights")))
    if t.fp8_fused_scales and (t.fp8_weights == "none" or t.fp8_scheme != "w8a8" or not t.deferred_residuals):
        out.append(("talker.fp8_fused_scales needs talker.fp8_weights backbone or all by talker.fp8_scheme "
                    "w8a8, with talker.deferred_residuals (the kernels that take the scales)",
                    ("talker.fp8_fused_scales", "talker.fp8_weights")))
    if t.fp8_fused_norms and not (t.fp8_fused_swiglu and t.fp8_fused_scales):
        out.append(("talker.fp8_fused_norms needs talker.fp8_fused_swiglu and talker.fp8_fused_scales (the "
                    "float8 layer whose sums and norms it takes)",
                    ("talker.fp8_fused_norms", "talker.fp8_fused_scales")))
    if t.deferred_residuals and not t.fused_qk_rope_store:
        out.append(("talker.deferred_residuals needs talker.fused_qk_rope_store (the layers' path "
                    "through the projections and one kernel)", ("talker.deferred_residuals", "talker.fused_qk_rope_store")))
    if t.overlap_steps and t.max_step_ms is not None:
        out.append(("talker.max_step_ms needs talker.overlap_steps off (its step-cost model is measured "
                    "step by step)", ("talker.max_step_ms", "talker.overlap_steps")))
    for key, on in (("codec.fused_norms", p.codec.fused_norms), ("codec.fused_attention", p.codec.fused_attention)):
        if on and not (p.codec.fused_ring_writes and p.codec.ring_attention):
            out.append((f"{key} needs codec.fused_ring_writes and codec.ring_attention (the layers' "
                        "fused path)", (key, "codec.fused_ring_writes")))
    if p.codec.split_chunks and p.codec.decode_lanes > 1:
        out.append(("codec.split_chunks needs codec.decode_lanes 1 (a cut chunk's rows share its slot; "
                    "two lanes would decode them at once)", ("codec.split_chunks", "codec.decode_lanes")))
    e = p.engine
    if e.devices and len(e.devices) != e.replicas:
        out.append((f"engine.devices lists {len(e.devices)} device(s) but engine.replicas is "
                    f"{e.replicas}: give one device per replica (or none to derive them)",
                    ("engine.devices", "engine.replicas")))
    kinds = {d.split(":")[0] for d in e.devices}
    if len(kinds) > 1 or (p.model.device != "auto" and kinds - {p.model.device}):
        out.append((f"engine.devices {list(e.devices)} must all be of model.device's kind "
                    f"({p.model.device})", ("engine.devices", "model.device")))
    groups = [_gpu_group(d, p.talker.tensor_parallel) for d in e.devices if d.startswith("cuda")]
    for i, a in enumerate(groups):
        if any(a & b for b in groups[i + 1:]):
            out.append((f"engine.devices {list(e.devices)}: replicas' GPU groups of "
                        f"talker.tensor_parallel ({p.talker.tensor_parallel}) GPUs overlap",
                        ("engine.devices", "talker.tensor_parallel")))
            break
    if p.model.device == "cpu":
        for key, on in (("talker.cuda_graphs", p.talker.cuda_graphs),
                        ("codec.cuda_graphs", p.codec.cuda_graphs), ("engine.mps", p.engine.mps)):
            if on:
                out.append((f"{key} is true but model.device is 'cpu': it needs cuda",
                            (key, "model.device")))
    return out


def _gpu_group(device: str, size: int) -> set[int]:
    """The GPU indices a replica on `device` occupies with a TP group of `size` ranks."""
    first = int(device.split(":")[1]) if ":" in device else 0
    return set(range(first, first + size))
