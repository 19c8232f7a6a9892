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
    "on cuda under MPS (engine.mps): the share of the GPU's streaming multiprocessors this stage's "
    "kernels may occupy, in percent (CUDA_MPS_ACTIVE_THREAD_PERCENTAGE); ignored without MPS; null "
    "= all")
MpsPriority = Literal["normal", "below_normal"]
MPS_PRIORITY_DOC = (
    "on cuda under MPS (engine.mps): this stage's MPS client priority (CUDA_MPS_CLIENT_PRIORITY); "
    "below_normal lets the other stage's ready kernels go first; ignored without MPS")
PositiveFloat = Annotated[float, msgspec.Meta(gt=0)]
NonNegativeFloat = Annotated[float, msgspec.Meta(ge=0)]
Bytes = Annotated[int, msgspec.Meta(ge=4096)]
Device = Annotated[str, msgspec.Meta(pattern=r"^(cpu|cuda(:[0-9]+)?)$")]
NonEmptyStr = Annotated[str, msgspec.Meta(min_length=1)]


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
        "force each request's frame count from its text (frames_per_char) instead of the model's "
        "stop decision: random weights stop at random, often at once; a benchmark and demo "
        "feature, logged when on")] = False
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
        "KV-cache blocks to allocate; null = what the GPU memory plan leaves (memory.gpu_utilization), "
        "or 2048 tokens a stream on CPU")] = None
    prefill_chunk_tokens: Annotated[int, doc(
        "a long prompt is prefilled in chunks of at most this many tokens so running streams "
        "keep their cadence", ge=1)] = 512
    max_prefill_tokens_per_step: Annotated[int, doc(
        "prompt tokens prefilled per scheduler step across all new requests",
        ge=1)] = 2048
    cuda_graphs: Annotated[bool, doc(
        "capture the decode step in CUDA graphs per batch bucket")] = True
    backbone_graphs: Annotated[bool, doc(
        "Delay and Realtime talkers: replay the decoding rows' backbone step (and Realtime's depth "
        "loop) from CUDA graphs (with cuda_graphs; CUDA only); off only to debug")] = True
    prefill_graphs: Annotated[bool, doc(
        "with cuda_graphs (and backbone_graphs for Delay and Realtime): a step's prompt chunks "
        "replay a CUDA graph per token bucket, captured at warm-up, instead of one eager call: "
        "earlier first audio, longer start-up")] = False
    prefill_graph_seqs: Annotated[int, doc(
        "with prefill_graphs: the most prompt chunks one prefill replay (and so one step) takes; "
        "more wait for the next step. Raise it when many requests arrive at once; each unused "
        "chunk costs idle attention programs",
        ge=1)] = 32
    mixed_step_tokens: Annotated[int, doc(
        "Local-v1.5 with cuda_graphs and the Triton attention: a step that decodes at least 16 "
        "requests and takes at most 8 prompt chunks of this many tokens in all replays one graph "
        "for both, instead of two; more graphs at warm-up; 0 = off", ge=0)] = 0
    capture_ahead: Annotated[bool, doc(
        "with cuda_graphs: record at warm-up every graph bucket serving can meet (every sampler "
        "mode, block tables up to 2048 tokens), so no request after /ready waits for a capture; "
        "minutes more start-up")] = False
    prefix_caching: Annotated[bool, doc(
        "keep the full KV blocks of prompts by content, so a request whose prompt begins like an "
        "earlier one (same voice: template prefix and reference frames) prefills only the rest; "
        "idle cached blocks are reused for new tokens when no free block is left, so it costs no "
        "capacity")] = True
    compile: Annotated[bool, doc(
        "on CUDA: the backbone layers, row embedding and the local loop + sampling through "
        "torch.compile (fused kernels, compiled at warm-up: tens of seconds)")] = True
    compile_size_oblivious: Annotated[bool, doc(
        "with compile: the shape-generic graphs serve a batch or prompt chunk of one row too, "
        "instead of graphs specialised for it (torch's size-oblivious shapes, an experimental "
        "switch): fewer compiles at warm-up; one row runs the generic kernels")] = False
    prefill_interval: Annotated[int, doc(
        "while streams are decoding, new prompts are prefilled at most every this many steps "
        "(1 = every step; larger = more decode steps replayed from graphs between prefills, "
        "more throughput, later first audio for new requests)", ge=1)] = 1
    overlap_steps: Annotated[bool, doc(
        "Local-v1.5 talker: plan and launch each step before the one before is read back, so the "
        "host's work overlaps the GPU's (a frame whose stop head fires is computed once more and "
        "dropped); not with max_step_ms")] = False
    fused_sampling: Annotated[bool, doc(
        "Local-v1.5 talker: each of a frame's heads samples in one Triton kernel instead of the "
        "torch sampler's chain of small kernels; the same tokens except where float rounding "
        "decides (CUDA, or Triton's CPU interpreter)")] = False
    local_attention: Annotated[Literal["sdpa", "plain", "kernel"], doc(
        "Local-v1.5 talker: how a frame's local steps attend (one query, at most 12 keys): sdpa "
        "(torch's kernel), plain (float32 products and sums that torch.compile fuses) or kernel "
        "(one Triton kernel a position); sdpa with batch_invariant")] = "sdpa"
    fused_projections: Annotated[bool, doc(
        "Local-v1.5 talker: each backbone layer's q/k/v projections as one matmul and gate/up as "
        "another (weights stacked after loading): fewer, wider kernels, the same products summed "
        "in the wider kernel's order")] = False
    fused_kv_writes: Annotated[bool, doc(
        "Local-v1.5 talker: each backbone layer's new keys and values stored in the paged cache by "
        "the compiled kernels that compute them, not by two copies after the layer; "
        "fused_qk_rope_store takes precedence")] = False
    fused_qk_rope_store: Annotated[bool, doc(
        "Local-v1.5 talker on CUDA: each backbone layer's q/k RMSNorms, RoPE and KV stores in one "
        "Triton kernel after the compiled projections (the same values up to the rotation's "
        "rounding); takes precedence over fused_kv_writes")] = False
    deferred_residuals: Annotated[bool, doc(
        "Local-v1.5 talker, with fused_qk_rope_store: each backbone layer leaves its two residual "
        "sums to the next norm's kernel (the last layer's to the final norm), a copy fewer per "
        "sum; each sum rounded once instead of twice")] = False
    kv_cache_dtype: Annotated[Literal["auto", "fp8"], doc(
        "the talker's paged KV cache: auto (model.dtype) or fp8 (float8 e4m3, no scale, "
        "saturating): half the bytes attention reads and twice the tokens in the same memory; a "
        "precision change: only where `mossvox check-precision` says PASS (docs/model_facts.md)")] = "auto"
    fp8_weights: Annotated[Literal["none", "backbone", "all"], doc(
        "Local-v1.5 talker: matmuls from float8 e4m3 weights (a scale per output channel): "
        "backbone (the Qwen3 layers) or all (the local block too); CUDA sm89+ or the CPU, else as "
        "loaded; a precision change: only where `mossvox check-precision` says PASS for the "
        "checkpoint served (docs/model_facts.md)")] = "none"
    fp8_scheme: Annotated[Literal["w8a16", "w8a8"], doc(
        "with fp8_weights: w8a8 quantizes each input row too and multiplies float8 by float8 "
        "(cuBLAS), the scales applied after; w8a16 multiplies the inputs as they are by the upcast "
        "weights (a Triton kernel), rounding only the weights")] = "w8a16"
    fp8_fused_swiglu: Annotated[bool, doc(
        "with fp8_weights by w8a8 and fused_projections: each backbone MLP's SiLU product and its "
        "row quantization for down in one Triton kernel a row (CUDA; torch ops elsewhere), the "
        "scaled product kept in fp32")] = False
    fp8_fused_scales: Annotated[bool, doc(
        "with fp8_weights by w8a8, fused_qk_rope_store and deferred_residuals: q|k|v's row and "
        "channel scales applied in the q/k norm kernel and down's in the next input norm, not by a "
        "kernel each after the matmul")] = False
    fp8_fused_norms: Annotated[bool, doc(
        "with fp8_fused_swiglu and fp8_fused_scales: each layer's residual sums, the norm after "
        "each and the rows' quantization for the next float8 matmul in one Triton kernel a row; "
        "each half layer's sum rounded once")] = False
    priority_stream: Annotated[bool, doc(
        "on CUDA: the talker's work goes to a CUDA stream of the highest priority, so under MPS "
        "the GPU schedules its short step kernels ahead of the codec's long ones")] = False
    max_step_ms: Annotated[PositiveFloat | None, doc(
        "while streams are decoding, a step prefills no more prompt tokens than fit in this many "
        "ms by the talker's measured step costs (at least 64 tokens); spreads a burst of long "
        "prompts over steps; not with overlap_steps; null = off")] = None
    attention: Annotated[Literal["auto", "padded", "triton"], doc(
        "attention kernel over the paged KV cache: padded (gather blocks, torch SDPA-like), "
        "triton (paged decode kernel, CUDA only), auto = triton on CUDA when available, else "
        "padded")] = "auto"
    torch_threads: Annotated[PositiveInt | None, doc(
        "torch intra-op threads in the talker process; null = torch's default")] = None
    sm_percent: Annotated[Percent | None, doc(SM_PERCENT_DOC)] = None
    mps_priority: Annotated[MpsPriority, doc(MPS_PRIORITY_DOC)] = "normal"
    batch_invariant: Annotated[bool, doc(
        "a seed gives the same speech at any load: fixed-tiling Triton kernels, no torch.compile, "
        "and the codec decodes each chunk in a call of its own; needs CUDA, the triton attention, "
        "one GPU, bf16 weights, codec.split_chunks off, codec.decode_lanes 1; much slower")] = False
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
        "first, audio dropped, so the new audio has them as left context (upstream's "
        "decode-then-trim); false: first audio sooner")] = True
    compile: Annotated[bool, doc(
        "on CUDA: the codec's transformer layers (norms, projections, RoPE, FFN) through "
        "torch.compile, attention and ring writes eager; longer start-up")] = False
    compile_encoder: Annotated[bool, doc(
        "on CUDA: the encoder's transformer layers alone through torch.compile (with compile, "
        "both stacks): cheaper reference encoding for new voices, a longer start-up")] = False
    ring_attention: Annotated[bool, doc(
        "on CUDA: streaming decode attends over the slots' ring caches in place (a Triton kernel "
        "applying the window) instead of copying each row's rings out and masking (chunks up to "
        "ring_attention_max_frames); its decode activations are far smaller")] = True
    ring_attention_max_frames: Annotated[PositiveInt | None, doc(
        "with ring_attention: only chunks of at most this many frames attend in place, longer ones "
        "copy the rings out; null = every length")] = None
    decode_lanes: Annotated[int, doc(
        "with cuda_graphs: a dispatch's replays (one per group of chunk lengths) run on up to this "
        "many CUDA streams at once, each lane with graphs and a memory pool of its own; 1 = one "
        "after another", ge=1, le=8)] = 1
    split_chunks: Annotated[bool, doc(
        "with cuda_graphs: a dispatch's longer chunks may go into a shorter replay as several rows "
        "of their stream when the codec's cost model finds it cheaper than padding; the rings hold "
        "a frame more; not with decode_lanes > 1")] = False
    fused_ring_writes: Annotated[bool, doc(
        "with ring_attention: each decoder layer rotates q and k and writes its rings in one "
        "Triton kernel instead of five small torch ops")] = False
    fused_norms: Annotated[bool, doc(
        "with fused_ring_writes: each decoder layer's residual adds and the LayerNorms that read "
        "them as one Triton kernel a pair, the residual stream read and written once a pair")] = False
    fused_attention: Annotated[bool, doc(
        "with fused_ring_writes: each decoder layer's ring attention in the kernel that rotates "
        "and writes the rings (the same keys and results, a kernel fewer a layer); experimental")] = False
    gelu_epilogue: Annotated[bool, doc(
        "the decoder's FFN GELU as the tanh approximation inside the first matmul (cuBLASLt's "
        "epilogue on CUDA) instead of the checkpoint's erf GELU; a precision change, opt-in "
        "(docs/model_facts.md; python -m bench.kernels.codec_gelu measures it); the encoder keeps "
        "erf")] = False
    fused_encoder: Annotated[bool, doc(
        "on CUDA: reference encodes run the encoder through the streaming Triton kernels (window "
        "in the attention kernel, RoPE with the key writes, residual adds with the norms, one "
        "kernel a quantizer stage) instead of masked attention and small separate ops; same "
        "arithmetic, less GPU time a new voice")] = True
    priority_stream: Annotated[bool, doc(
        "on CUDA: the codec's decode loop runs on a CUDA stream of the highest priority, its "
        "reference encodes on one of the default priority, so the GPU schedules the playing "
        "streams' decode kernels ahead of a new voice's encode")] = False
    encode_batch: Annotated[int, doc(
        "reference-encoding jobs batched together at most", ge=1)] = 8
    encode_batch_seconds: Annotated[PositiveFloat | None, doc(
        "a reference-encode batch, its clips padded to its longest, holds at most this many "
        "seconds in all; the memory plan sizes encodes (and encode graphs) for it, not for "
        "encode_batch clips of api.max_ref_seconds, so short clips share a batch; null = no bound")] = None
    encode_batch_streaming: Annotated[PositiveInt | None, doc(
        "reference-encoding jobs batched together at most while streams are decoding: a batch "
        "shares the GPU with their decoding, so smaller keeps playing streams fed and makes new "
        "voices wait longer; null = encode_batch")] = None
    encode_graphs: Annotated[bool, doc(
        "reference encoding replays CUDA graphs per (batch bucket, length bucket of 4-32 s), "
        "captured at start-up (CUDA only; seconds more start-up); a batch is cut where one more "
        "clip would leave every graph")] = False
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
        "with express_first_chunks: first chunks ride in a batch due at the same moment (one "
        "decode call instead of two), alone only when none is due; more audio a second, first "
        "audio waits for that batch")] = False
    patient_wait_ms: Annotated[float, doc(
        "a steady chunk (not a request's first or final) of a stream whose client holds audio "
        "may wait up to this long for a larger dispatch, never past the moment that client's "
        "audio would run out less buffer_margin_ms; 0 = every chunk keeps max_wait_ms", ge=0)] = 0.0
    final_wait_ms: Annotated[NonNegativeFloat | None, doc(
        "longest wait of a request's final chunk (the request ends when it is out) before its "
        "dispatch, in ms; 0 = dispatch what is ready at once; null = max_wait_ms")] = None
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
        "allow http(s) URLs as ref_audio (the server fetches them, from public addresses only, "
        "after every redirect too)")] = False
    remote_ref_timeout_s: Annotated[float, doc(
        "one deadline, in seconds, for fetching a remote ref_audio URL: every redirect and the "
        "whole body", gt=0)] = 10.0
    allowed_local_paths: Annotated[tuple[str, ...], doc(
        "directories under which file:// or plain-path ref_audio may be read")] = ()
    data_dir: Annotated[str, doc(
        "reference-code cache, validated clips and registered voices, shared by API processes (~ expanded)",
        min_length=1)] = "~/.cache/mossvox/data"
    ref_cache_max_bytes: Annotated[int, doc(
        "bytes on disk the reference cache under data_dir (codes and validated clips, ~100 KB a "
        "clip) may take in all; past it the least recently used files are removed (voices are "
        "not: api.max_voices bounds them)", ge=65536)] = 1024 * 1024 * 1024
    header_timeout_s: Annotated[float, doc(
        "a connection whose request headers are not complete this long after it opened (or after "
        "its previous response) is closed", gt=0)] = 10.0
    body_timeout_s: Annotated[float, doc(
        "a request body that stalls this long between two pieces is answered 408 and its "
        "connection closed", gt=0)] = 30.0
    body_deadline_s: Annotated[float, doc(
        "a request body not complete this long after its headers is answered 408 and its "
        "connection closed, however steadily it trickles in; raise it for clients uploading "
        "large references over slow links", gt=0)] = 120.0
    max_connections: Annotated[int, doc(
        "open client connections (HTTP and WebSocket) one API process holds; one more is "
        "answered 503 and closed at once (never more than the process's descriptor limit "
        "allows, less a reserve)", ge=16)] = 4096
    max_connections_per_address: Annotated[int, doc(
        "open connections one client address may hold in one API process (503 past it), so one "
        "host cannot take them all; behind a proxy or load balancer every client shares its "
        "addresses: allow its connections there, or 0 = no per-address cap", ge=0)] = 1024
    max_batch_items: Annotated[int, doc(
        "most speech requests in one POST /v1/audio/speech/batch", ge=1, le=1024)] = 32
    max_batch_output_bytes: Annotated[int, doc(
        "most bytes of audio the files of one batch hold together; an item that would pass it "
        "fails alone with a 413 (the JSON answer carries them as base64, about 4/3 of this)",
        ge=65536)] = 64 * 1024 * 1024
    send_timeout_s: Annotated[float, doc(
        "an HTTP response whose client takes none of it for this long is cut: the connection "
        "dropped, its request aborted (WebSocket sessions: stream.send_timeout_s)", gt=0)] = 30.0
    max_stream_buffer_bytes: Annotated[int, doc(
        "bytes of audio made for one response and not yet taken by its client: a stream past it "
        "is cut (a client reading slower than the audio is made), a whole file (stream: false) "
        "past it is a 413; raise it for clients that read long files at playback speed",
        ge=65536)] = 64 * 1024 * 1024
    max_held_audio_bytes: Annotated[int, doc(
        "bytes of audio one API process holds for all its clients and has not sent yet; past it a "
        "stream whose client lags is cut and a whole file is a 503 (streams whose clients keep up "
        "go on); size it to the memory an API process may use", ge=1048576)] = 2 * 1024 * 1024 * 1024
    cors_origins: Annotated[tuple[str, ...], doc(
        "origins (scheme://host[:port], or *) whose browser pages may call the API across "
        "origins: CORS headers for them, and their WebSocket handshakes and POST/DELETE requests "
        "let in; empty = only the server's own pages (others get a 403 on anything that acts)")] = ()
    pcm_layout: Annotated[Literal["openai", "native"], doc(
        "response_format pcm when a request names no sample_rate or channels: openai = 24 kHz "
        "mono s16le, what OpenAI speech clients assume; native = the model's own rate and "
        "channels")] = "openai"

    def __repr__(self) -> str:  # keys stay out of logs and tracebacks
        shown = msgspec.structs.replace(self, keys=tuple(REDACTED for _ in self.keys))
        fields = ", ".join(f"{f}={getattr(shown, f)!r}" for f in self.__struct_fields__)
        return f"ApiConfig({fields})"


class StreamConfig(_Section):
    """The speech WebSockets (`/v1/audio/speech/stream` and the ElevenLabs-compatible ones): text in
    as it is written."""

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
    max_contexts: Annotated[int, doc(
        "contexts open at once on one multi-context socket (ElevenLabs' multi-stream-input); "
        "one more is refused with an error message", ge=1)] = 5


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
    compile_cache_dir: Annotated[NonEmptyStr | None, doc(
        "the workers' torch.compile and Triton caches (inductor/, triton/ inside; ~ expanded; keyed "
        "by graph, settings and versions: profiles share it); on a persistent volume a restart "
        "reuses what was compiled; TORCHINDUCTOR_CACHE_DIR or TRITON_CACHE_DIR set for the server "
        "wins; null = torch's places"
    )] = "~/.cache/mossvox/compile"
    devices: Annotated[tuple[Device, ...], doc(
        "device of each replica (its talker's first TP rank and its codec), e.g. [cuda:0, "
        "cuda:1]; a TP group takes the consecutive GPUs from there; empty = derive: cuda:i*tp "
        "when CUDA has enough devices, else cpu for all")] = ()
    restart_limit: Annotated[int, doc(
        "a dead or hung worker (or API process) is replaced in place while the rest serve on, "
        "at most this many times per replica (or API process slot) within restart_window_s; "
        "past it the replica stays down, and with none left /health answers 503; 0 = never",
        ge=0)] = 5
    restart_window_s: Annotated[float, doc(
        "the window over which restart_limit counts a replica's restarts", gt=0)] = 600.0
    restart_backoff_s: Annotated[float, doc(
        "wait before restarting a failed replica; doubled for each earlier restart of it within "
        "restart_window_s (at most 60 s)", ge=0)] = 1.0
    liveness_timeout_s: Annotated[float, doc(
        "a serving worker whose loop has not beaten for this long (stopped, or stuck in one "
        "call) is killed and replaced like a dead one; its loop beats at least every quarter "
        "of it, also when idle; raise it if a legitimate step or dispatch can take longer "
        "(a first compile under load); seconds, 0 = off", ge=0)] = 30.0


class MemoryConfig(_Section):
    """The GPU memory plan: how much of each card a replica (its talker and codec) may use."""

    gpu_utilization: Annotated[float, doc(
        "share of the card's total memory a replica plans for: weights, the codec's decode slots "
        "and workspaces are taken out of it and the rest is the talker's KV cache (unless "
        "talker.kv_blocks fixes it); lower it when another process shares the card", gt=0, le=1)] = 0.9


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
    memory: MemoryConfig = _section(MemoryConfig)

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
    if t.batch_invariant and (p.codec.split_chunks or p.codec.decode_lanes > 1):
        out.append(("talker.batch_invariant needs codec.split_chunks off and codec.decode_lanes 1 (the "
                    "codec then decodes each chunk in a call of its own, never cut or packed with other "
                    "streams' chunks)", ("talker.batch_invariant", "codec.split_chunks", "codec.decode_lanes")))
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
