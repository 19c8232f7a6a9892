"""One GPU memory plan per replica: what the talker and the codec may each hold on their card.

A replica's two workers share one card. Each of them computes the same plan from the same inputs
(the card's total memory, `memory.gpu_utilization`, the profile's capacities and the checkpoint's
shapes) before it allocates anything, so neither's share depends on which one starts first, and a
restarted worker gets the share the first one had. The server may use `gpu_utilization` of the
card; from it the plan takes, for each stage,

- `context`: the CUDA context, kernel images and library handles, outside torch's allocator;
- `weights`: the checkpoint's tensors at the serving dtype;
- `state`: the codec's streaming-decode slots (their ring caches, `codec.max_slots`), exact;
- `workspace`: activations of the largest call the profile allows, CUDA-graph pools, compile and
  library workspaces: an estimate from the shapes (`talker_workspace`, `codec_workspace`);

and what is left is the talker's KV cache (unless `talker.kv_blocks` names it). A plan whose KV
cache cannot hold `talker.max_running` streams of `MIN_TOKENS_PER_STREAM` tokens is refused with a
`MemoryPlanError` that names the settings to change, before any weight is read.

Each worker then caps torch's caching allocator at its `StageMemory.allocator_bytes`
(`cap_allocator`), so a stage that outgrows its estimate fails in its own process, at warm-up,
instead of starving the other.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

GIB = 1 << 30
CONTEXT_BYTES = GIB  # a CUDA process's context, kernel images and library handles (outside the allocator)
TALKER_FIXED_WORKSPACE = 4 * GIB  # compile and cuBLAS workspaces, decode and local-loop graph pools
CODEC_FIXED_WORKSPACE = GIB  # cuBLAS workspaces, the pinned PCM buffer's device side, pool slack
MIN_TOKENS_PER_STREAM = 256  # KV the plan guarantees each of `talker.max_running` streams (prompt + frames);
#                              past it, new requests wait for blocks and the scheduler preempts
ACTIVATION_SAFETY = 1.5  # live activations of a call as a multiple of the largest layer's own
DECODE_GRAPH_SAFETY = 3.5  # the codec's decode graphs: their pool holds about twice a call's activations


class MemoryPlanError(ValueError):
    """The profile's capacities do not fit the card: the message names the settings to change."""


@dataclass(frozen=True)
class StageMemory:
    """One worker's share of the card, in bytes."""

    weights: int
    state: int      # talker: the KV cache; codec: the streaming-decode slots
    workspace: int  # activations, graph pools, library workspaces (an estimate)
    context: int = CONTEXT_BYTES

    @property
    def allocator_bytes(self) -> int:
        """What torch's caching allocator may hold (everything but the context)."""
        return self.weights + self.state + self.workspace

    @property
    def total(self) -> int:
        return self.allocator_bytes + self.context


@dataclass(frozen=True)
class MemoryPlan:
    """The whole replica's plan on one card."""

    card: int                # the card's total memory
    utilization: float       # memory.gpu_utilization
    talker: StageMemory
    codec: StageMemory
    kv_blocks: int           # the talker's KV cache, in blocks of `kv_block_tokens`
    kv_block_tokens: int

    @property
    def usable(self) -> int:
        return int(self.card * self.utilization)

    @property
    def kv_tokens(self) -> int:
        return self.kv_blocks * self.kv_block_tokens

    def stage(self, name: str) -> StageMemory:
        return {"talker": self.talker, "codec": self.codec}[name]

    def describe(self) -> str:
        """One line for the start-up log."""
        def parts(s: StageMemory, state: str) -> str:
            return (f"{gib(s.total)} (weights {gib(s.weights)}, {state} {gib(s.state)}, "
                    f"workspace {gib(s.workspace)}, context {gib(s.context)})")
        return (f"{gib(self.card)} card, {self.utilization:.0%} usable = {gib(self.usable)}: "
                f"talker {parts(self.talker, 'KV cache')}, KV {self.kv_tokens} tokens; "
                f"codec {parts(self.codec, 'decode slots')}")


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


@dataclass(frozen=True)
class MemoryNeeds:
    """What a replica's stages need apart from the talker's KV cache, in bytes (see the module
    docstring), with the KV cache's unit and the settings that size each part (for messages)."""

    talker_weights: int
    talker_workspace: int
    kv_block_bytes: int
    kv_block_tokens: int
    max_running: int
    codec_weights: int
    codec_state: int
    codec_workspace: int
    kv_blocks: int | None = None  # talker.kv_blocks: a fixed KV cache instead of the rest


def plan_memory(needs: MemoryNeeds, card: int, utilization: float) -> MemoryPlan:
    """The plan for one replica on a card of `card` bytes (`MemoryPlanError` when it does not fit)."""
    usable = int(card * utilization)
    codec = StageMemory(needs.codec_weights, needs.codec_state, needs.codec_workspace)
    talker_fixed = StageMemory(needs.talker_weights, 0, needs.talker_workspace)
    room = usable - codec.total - talker_fixed.total
    min_blocks = needs.max_running * -(-MIN_TOKENS_PER_STREAM // needs.kv_block_tokens)
    if needs.kv_blocks is not None:
        blocks = needs.kv_blocks
        if blocks * needs.kv_block_bytes > room:
            raise MemoryPlanError(
                f"talker.kv_blocks {blocks} takes {gib(blocks * needs.kv_block_bytes)}, but "
                f"{_room(usable, card, utilization, codec, talker_fixed)}: lower talker.kv_blocks "
                f"(null sizes it to the rest) or codec.max_slots, or raise memory.gpu_utilization")
    else:
        blocks = max(0, room) // needs.kv_block_bytes
        if blocks < min_blocks:
            raise MemoryPlanError(
                f"the talker's KV cache needs at least {gib(min_blocks * needs.kv_block_bytes)} "
                f"(talker.max_running {needs.max_running} streams of {MIN_TOKENS_PER_STREAM} tokens), "
                f"but {_room(usable, card, utilization, codec, talker_fixed)}: lower "
                f"talker.max_running or codec.max_slots (with admission.max_running and "
                f"coalescing.max_batch), or raise memory.gpu_utilization, or use a larger card")
    talker = StageMemory(needs.talker_weights, blocks * needs.kv_block_bytes, needs.talker_workspace)
    return MemoryPlan(card=card, utilization=utilization, talker=talker, codec=codec,
                      kv_blocks=int(blocks), kv_block_tokens=needs.kv_block_tokens)


def _room(usable: int, card: int, utilization: float, codec: StageMemory, talker: StageMemory) -> str:
    return (f"memory.gpu_utilization {utilization:g} of this {gib(card)} card is {gib(usable)}, of "
            f"which the codec takes {gib(codec.total)} ({gib(codec.state)} of decode slots) and the "
            f"talker's weights and workspace {gib(talker.total)}")


def talker_workspace(*, hidden: int, heads: int, kv_heads: int, head_dim: int, intermediate: int,
                     step_tokens: int, element_size: int) -> int:
    """Estimated workspace of a talker whose largest step carries `step_tokens` rows through a
    Qwen3 backbone: one layer's activations (residual, norm, q/k/v, attention out, the MLP's gate
    and up) for every row, `ACTIVATION_SAFETY` times, on top of `TALKER_FIXED_WORKSPACE`."""
    per_token = (3 * hidden + (heads + 2 * kv_heads) * head_dim + 3 * intermediate) * element_size
    return int(TALKER_FIXED_WORKSPACE + ACTIVATION_SAFETY * step_tokens * per_token)


@dataclass(frozen=True)
class CodecStageShape:
    """What sizes one codec transformer stage's activations."""

    tokens_per_frame: int
    d_model: int
    dim_feedforward: int
    ring_tokens: int  # decoder stages: the ring cache's positions (context + headroom); 0 for encoder stages
    tokens_per_second: float


def codec_workspace(*, decoder: Iterable[CodecStageShape], encoder: Iterable[CodecStageShape],
                    decode_rows: int, decode_frames: int, lanes: int, attention_in_place: bool,
                    encode_batch: int, encode_seconds: float, element_size: int,
                    encode_graphs: bool = False) -> int:
    """Estimated workspace of a codec: the largest decode call (`decode_rows` streams of
    `decode_frames` frames, on each of `lanes` graph pools; `DECODE_GRAPH_SAFETY` times the largest
    stage's activations: an H100 ran out at 1.5), the largest reference-encode batch (`encode_batch`
    clips of `encode_seconds`, `ACTIVATION_SAFETY` times, or `DECODE_GRAPH_SAFETY` times with
    `encode_graphs`), on top of `CODEC_FIXED_WORKSPACE`. Attention that copies a slot's ring
    (`attention_in_place` off) also holds the gathered keys and values and the mask."""
    decode = 0
    for s in decoder:
        q = s.tokens_per_frame * decode_frames
        act = q * (4 * s.d_model + 2 * s.dim_feedforward) * element_size
        if not attention_in_place:
            act += 2 * (s.ring_tokens + q) * s.d_model * element_size + q * (s.ring_tokens + q)
        decode = max(decode, act)
    encode = 0
    for s in encoder:
        t = int(s.tokens_per_second * encode_seconds)
        encode = max(encode, t * (4 * s.d_model + 2 * s.dim_feedforward) * element_size)
    encode_safety = DECODE_GRAPH_SAFETY if encode_graphs else ACTIVATION_SAFETY
    return int(CODEC_FIXED_WORKSPACE + DECODE_GRAPH_SAFETY * decode * decode_rows * lanes
               + encode_safety * encode * encode_batch)


def card_memory(device: str) -> tuple[int, int]:
    """(free, total) bytes of `device` as CUDA reports them to this process."""
    import torch

    free, total = torch.cuda.mem_get_info(torch.device(device))
    return int(free), int(total)


def cap_allocator(stage: StageMemory, card: int, device: str) -> None:
    """Hold torch's caching allocator on `device` to the stage's share (an allocation past it
    raises torch's out-of-memory error in this process)."""
    import torch

    torch.cuda.set_per_process_memory_fraction(min(1.0, stage.allocator_bytes / card), torch.device(device))


def allocator_peak(device: str) -> int:
    """The most this process's allocator has reserved on `device` so far."""
    import torch

    return int(torch.cuda.max_memory_reserved(torch.device(device)))
