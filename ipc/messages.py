"""Every wire record of mossvox: tagged, frozen msgspec Structs, one union per receiving process.

Definitions only. Control fields travel msgpack-encoded; bulk data (prompts, codes, PCM, reference
waveforms) travels as the raw array payload of the same ring record, never inside the Struct.
Every record is `array_like` (encoded as a positional array behind its tag: small and fast; a
msgspec union cannot mix array-like and map-like Structs). Both ends import this one module, so
field order is the schema: append new fields at the end, with defaults.

Channels (all SPSC; `coord` = coordinator, `client` = one `EngineClient` per API process):

    client → coord   : CoordinatorInbox  (Submit, Feed, Abort, EncodeRequest)
    coord  → client  : ClientInbox       (Rejected, Failed)
    coord  → talker  : TalkerInbox       (Submit, Feed, Abort, Shutdown, PeerLost, Rewire)
    talker → coord   : CoordinatorInbox  (Ready, Slots, TalkerStep, StageError)
    coord  → codec   : CodecInbox        (Abort, EncodeRequest, Shutdown, PeerLost, Rewire)
    talker → codec   : CodecInbox        (CodeChunk)
    codec  → coord   : CoordinatorInbox  (Ready, Slots, ChunkDone, DecodeBatch, EncodeDone, StageError)
    codec  → client  : ClientInbox       (PcmChunk, Codes, EncodeResult)

With `engine.replicas: R` every replica has its own talker and codec channels (the coordinator
routes a request to one replica; each client reads one codec → client ring per replica).

A replaced process gets new rings (a ring is opened once): the surviving worker drops the dead
peer's channel (`PeerLost`) and attaches the new one (`Rewire`); the ring specs themselves, which
carry doorbell descriptors, travel over the worker's set-up pipe to the launcher, not in a ring.
Every writer of a ring to the coordinator beats in its header (`Ring.beat`): a worker whose beat
stands still is hung and is replaced like a dead one.

Request ids (`rid`) and reference-encode job ids share one space, minted by the client:
`client_index << 40 | counter`.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from speech.sampling import SamplingParams

StageName = Literal["talker", "codec"]
FinishReason = Literal["stop", "length", "abort", "error"]
FailReason = Literal["error", "deadline", "worker_lost", "engine_failed", "shutdown", "too_large"]
#   why a request failed (`Failed.reason`): an error of this request, its deadline, the worker
#   serving it died or hung, no replica is left, the engine is stopping, a prompt too large
PeerStage = Literal["talker", "codec", "client"]


# --------------------------------------------------------------------------------------- requests


class Submit(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True):
    """A speech request. Payload: the prompt `[S, 1 + n_vq]` int64 built by the variant, then its
    prime rows (`prime_frames`).

    Sent client → coordinator, then forwarded unchanged coordinator → talker.
    """

    rid: int
    client: int                    # index of the API process whose ring receives the PCM
    sampling: SamplingParams
    initial_chunk_frames: int | None = None   # None: the profile's chunking.initial_frames
    timeout_s: float | None = None             # None: the profile's admission.request_timeout_s
    prime_frames: int = 0   # the payload's last prime_frames rows are not prompt but left
    #                         context: codes [T, n_vq] in columns 1.. (column 0 unused) that the
    #                         codec decodes first, dropping their audio (continuation)
    echo_codes: bool = False  # the client also gets the codes of every chunk (`Codes`)
    open_input: bool = False  # more input follows in `Feed` records (variants that take text
    #                           while they speak); until the final one the request pauses when
    #                           its input runs out


class Feed(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True):
    """More input for request `rid`, submitted with `open_input`: rows of the kind its prompt
    ends with (Realtime: one text token per row), appended in order. Payload: rows
    `[n, 1 + n_vq]` int64 (n may be 0). Client → coordinator → talker; held by the coordinator
    while the request is queued, dropped once it has ended.

    `final`: no more input comes; `forced_frames` then replaces the request's forced length
    (random-weight benchmarks: it follows the whole text, unknown at submission)."""

    rid: int
    final: bool = False
    forced_frames: int | None = None


class Abort(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True):
    """Cancel request `rid` (client → coordinator → both workers). Unknown ids are ignored."""

    rid: int


class EncodeRequest(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True):
    """Encode a reference voice. Payload: waveform `[channels, samples]` float32 at the codec rate,
    already prepared by the processor. Client → coordinator → codec."""

    job: int
    client: int


class Shutdown(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True):
    """Stop the worker: `drain` finishes running requests first, otherwise aborts them."""

    drain: bool


# ------------------------------------------------------------------------------------- data plane


class CodeChunk(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True):
    """Talker → codec: the next `T` frames of request `rid`. Payload: codes `[T, n_vq]` int64.

    `final` marks the request's last record (T may be 0: the terminal record); `finish_reason` is
    set on it. An aborted request still gets its final record, with reason "abort". A chunk too
    large for one record of the ring goes as several with the same `seq`, only the last one
    `final`.
    """

    rid: int
    client: int
    seq: int
    final: bool
    finish_reason: FinishReason | None = None
    prime: bool = False    # left context (continuation): decode into the slot, drop the audio
    echo_codes: bool = False  # the request asked for its codes: the codec sends them on (`Codes`)


class PcmChunk(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True):
    """Codec → client: audio of chunk `seq` of `rid`. Payload: planar PCM `[channels, samples]`
    float32, as the codec produces it; the client interleaves it while copying it out of the ring
    (so the shared codec worker does no per-sample work). The record with `final=True` ends the
    stream (its PCM may be empty). PCM too large for one record goes as several with the same
    `seq`, only the last one `final`."""

    rid: int
    seq: int
    final: bool
    finish_reason: FinishReason | None = None
    batch_size: int = 0        # streams decoded together with this chunk (0: no decode needed)
    waited_s: float = 0.0      # this chunk's wait in the coalescing window


class Codes(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True):
    """Codec → client: the codes chunk `seq` of `rid` is decoded from, sent just before that
    chunk's `PcmChunk`, for a request submitted with `echo_codes` (a stream continues them in its
    next sentence). Payload: codes `[T, n_vq]` int64."""

    rid: int
    seq: int


class EncodeResult(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True):
    """Codec → client: codes of reference job `job`. Payload: codes `[T, n_vq]` int64 (none on error)."""

    job: int
    error: str | None = None


# ------------------------------------------------------------------------------------ worker events


class MemoryReport(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """A CUDA worker's share of its card by the replica's memory plan, and what it used, in bytes:
    `planned` (context included), `state` (the talker's KV cache, the codec's decode slots),
    `allocator_cap` (what torch's allocator may hold) and `allocator_peak` (the most it held by
    the time of the report); the talker's `kv_tokens`."""

    card: int
    usable: int
    planned: int
    state: int
    allocator_cap: int
    allocator_peak: int
    kv_tokens: int = 0


class StartupTimes(msgspec.Struct, frozen=True, kw_only=True, array_like=True):
    """Where a worker's start-up went, in seconds from its spawn to its Ready:
    `total` = `start` (the process, its imports, CUDA's context, the memory plan) + `load` (the
    model and its weights) + `compile` (torch.compile, wherever it ran) + `capture` (CUDA graphs
    recorded ahead, their compiles apart) + `warm_up` (the rest of the warm-up: its requests,
    kernel launches, timings). `compiles`: the compiles torch.compile made; `graphs`: the graphs
    recorded ahead."""

    total: float
    start: float
    load: float
    compile: float
    capture: float
    warm_up: float
    compiles: int = 0
    graphs: int = 0


class Ready(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True):
    """A worker loaded its model and warmed up; `capacity` is its slot count. A talker also says
    how many prompt rows its KV cache can hold at most (`max_prompt_rows`; 0 = no limit known).
    On CUDA, `memory` reports the worker's memory share and use after warm-up; `startup` where
    its start-up time went."""

    stage: StageName
    pid: int
    capacity: int
    max_prompt_rows: int = 0
    memory: MemoryReport | None = None  # CUDA workers: the memory plan's share and its use
    startup: StartupTimes | None = None


class Slots(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True):
    """A worker's slots in use changed (talker: requests in the runner; codec: open decode slots)."""

    stage: StageName
    in_use: int


class ChunkDone(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True):
    """Codec → coordinator: chunk `seq` of `rid` went to its client (`samples` per channel).

    `final=True` means the request's codec slot is closed and its stream has ended."""

    rid: int
    seq: int
    samples: int
    final: bool
    finish_reason: FinishReason | None = None


class DecodeBatch(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True):
    """Codec → coordinator: one coalesced decode dispatch (for batch statistics)."""

    size: int          # streams decoded together
    waited_s: float    # oldest chunk's wait in the coalescing window
    decode_s: float    # model time of the batch
    emit_s: float = 0.0  # time spent writing its PCM and ChunkDone records to the rings


class TalkerStep(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True):
    """Talker → coordinator: `steps` scheduler steps over `batch` requests each (batch
    statistics). Sent when the batch size changes, every 64 steps, and when the talker idles."""

    batch: int         # requests in the runner during the step (decode and prefill)
    steps: int         # consecutive steps of this batch size
    step_s: float      # their summed wall time of runner.step()
    prompt_rows: int = 0  # prompt rows of the requests the runner took in since the last record
    cached_rows: int = 0  # prompt rows it took from its prefix cache since then (not computed)


class EncodeDone(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True):
    """Codec → coordinator: reference job `job` answered (result or error went to the client)."""

    job: int


class StageError(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True):
    """A worker failed: for one request (`rid` set; the request fails) or fatally (`rid` None)."""

    stage: StageName
    message: str
    rid: int | None = None


# ------------------------------------------------------------------------------------ client control


class Rejected(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True):
    """Coordinator → client: admission refused `rid`; retry after about `retry_after_s`."""

    rid: int
    reason: str
    retry_after_s: float


class Failed(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True):
    """Coordinator → client: request or encode job `rid` failed (worker died, deadline, error);
    `reason` says which, so the API answers as a client expects (503 when the engine could not
    serve it, a cut stream counted by reason)."""

    rid: int
    message: str
    reason: FailReason = "error"


# ------------------------------------------------------------------------------- replaced peers


class PeerLost(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True):
    """Coordinator → the surviving worker of a replica: its peer `stage` died or hung and is
    being replaced. The worker drops every request that peer was part of (their clients are
    told by the coordinator; nothing is sent for them) and the channel to it; it keeps its model,
    caches and graphs. `client`: the API process, when `stage` is "client"."""

    stage: PeerStage
    client: int = -1


class Rewire(msgspec.Struct, frozen=True, kw_only=True, tag=True, array_like=True):
    """Coordinator → a worker: attach the channel of a replaced peer `stage`.

    Talker, `stage="codec"`: the new codec's talker → codec spec is on its set-up pipe: open it,
    then send `Ready` again. Codec, `stage="talker"`: create a new talker → codec ring and send
    its spec up the set-up pipe; `stage="client"`: likewise a new PCM ring for API process
    `client` (its old ring is dropped). `generation` makes the new ring's name unique."""

    stage: PeerStage
    generation: int
    client: int = -1


# ------------------------------------------------------------------------------ unions per receiver

CoordinatorInbox = (
    Submit | Feed | Abort | EncodeRequest | Ready | Slots | ChunkDone | DecodeBatch | TalkerStep
    | EncodeDone | StageError
)
TalkerInbox = Submit | Feed | Abort | Shutdown | PeerLost | Rewire
CodecInbox = CodeChunk | Abort | EncodeRequest | Shutdown | PeerLost | Rewire
ClientInbox = PcmChunk | EncodeResult | Rejected | Failed | Codes
