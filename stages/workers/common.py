"""What the worker processes share: their spawn spec, process set-up, inbox drain.

Channel wiring at start-up (the launcher relays over each worker's set-up pipe):

1. the launcher creates the coordinator-side channels and spawns both workers with their specs;
2. the codec creates the channels it owns (talker → codec, reader end; codec → each client,
   writer ends) and sends their specs up its pipe;
3. the launcher forwards the talker → codec spec down the talker's pipe and keeps the client specs
   (an in-process client opens one; a spawned API process gets one pickled at its spawn).

The pipes stay open for the workers' lives: when a peer is replaced (`Rewire`), the codec sends
the spec of the ring it made for the new peer up its pipe, and the talker receives the new codec's
talker → codec spec down its own.

Doorbell descriptors cross the pipes with `multiprocessing`'s resource sharer (DupFd).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import msgspec
import numpy as np

from ipc.channel import Channel, ChannelSpec
from ipc.errors import ChannelTimeout
from ipc.messages import CodecInbox, ClientInbox, MemoryReport
from profiles import Profile
from stages.runtime.chunk_policy import ChunkSchedule
from stages.runtime.memory_plan import (MemoryPlan, MemoryPlanError, allocator_peak, cap_allocator,
                                        card_memory, gib)
from stages.variant import Variant

log = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a spawned worker needs; picklable (channel specs carry their doorbells)."""

    stage: str                      # "talker" | "codec"
    variant: type[Variant]          # the checkpoint's variant (pickled by reference: its module is
    #                                 imported in the worker, so a variant registers itself there too)
    model_dir: str
    profile: Profile
    device: str
    instance: str                   # ipc instance id (segment names)
    inbox: ChannelSpec              # coordinator -> worker
    to_coord: ChannelSpec           # worker -> coordinator
    setup: Connection               # set-up pipe to the launcher (spec relay)
    parent_pid: int
    num_clients: int = 0            # codec: rings to create, one per client
    env: tuple[tuple[str, str], ...] = ()  # set before CUDA initialises (e.g. the MPS pipe)
    replica: int = 0                # which talker+codec pair this worker belongs to (ring names)
    spawned_at: float | None = None  # wall-clock time of its spawn (`time.time()`): its start-up's zero

    @property
    def ring_prefix(self) -> str:
        """Prefix of the ring names this worker creates: `r{replica}-`."""
        return f"r{self.replica}-"


def prepare_process(spec: WorkerSpec, torch_threads: int | None) -> Variant:
    """Die with the launcher, configure logging and torch threads; returns the `Variant`."""
    die_with_parent(spec.parent_pid)
    os.environ.update(dict(spec.env))
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the launcher, which stops us
    level = spec.profile.engine.log_level.upper()
    logging.basicConfig(level=level, format=f"%(asctime)s {spec.stage}{spec.replica}[%(process)d] "
                                            "%(levelname)s "
                                            "%(name)s: %(message)s")
    import torch

    if torch_threads is not None:
        torch.set_num_threads(torch_threads)
    attention_without_plans()
    if str(spec.device).startswith("cuda:"):
        # the current device is what streams, graph captures and pools default to: a replica
        # on cuda:1 capturing on cuda:0's stream fails ("operation not permitted when capturing")
        torch.cuda.set_device(torch.device(spec.device))
    return spec.variant(spec.model_dir, spec.profile)


STREAM_PRIORITY = -100  # below any device's range: torch maps it to the highest priority there is


def use_priority_stream(device: str) -> bool:
    """Make a stream of the highest priority this thread's current stream on `device` (CUDA
    only; False elsewhere): every later launch, copy and graph replay of the thread goes there.
    Threads that make streams of their own (the codec's encoder thread) keep the default priority,
    so the GPU schedules this thread's kernels ahead of theirs."""
    import torch

    if not str(device).startswith("cuda"):
        return False
    torch.cuda.set_stream(torch.cuda.Stream(device=torch.device(device), priority=STREAM_PRIORITY))
    return True


def apply_memory_plan(spec: WorkerSpec, variant: Variant) -> tuple[Variant, MemoryPlan | None]:
    """On CUDA, before this worker allocates anything: its replica's memory plan (the same in
    both workers: `stages.runtime.memory_plan`), logged; this process's allocator capped at its
    stage's share; and for the talker, the variant again with the plan's KV blocks. A card too
    small for the profile, or one another process already fills, raises `MemoryPlanError` naming
    what to change. (variant, None) on CPU."""
    if not str(spec.device).startswith("cuda"):
        return variant, None
    free, card = card_memory(spec.device)
    plan = variant.memory_plan(spec.device, card)
    mine = plan.stage(spec.stage)
    log.info("%s: memory plan of replica %d: %s", spec.stage, spec.replica, plan.describe())
    if free < mine.allocator_bytes:
        raise MemoryPlanError(
            f"{spec.device} has {gib(free)} free of {gib(card)}, and the {spec.stage} needs "
            f"{gib(mine.allocator_bytes)} of it: another process holds the card (lower "
            f"memory.gpu_utilization to share it)")
    cap_allocator(mine, card, spec.device)
    profile = spec.profile
    if spec.stage == "talker" and profile.talker.kv_blocks is None:
        talker = msgspec.structs.replace(profile.talker, kv_blocks=plan.kv_blocks)
        variant = spec.variant(spec.model_dir, msgspec.structs.replace(profile, talker=talker))
    return variant, plan


def memory_report(stage: str, plan: MemoryPlan | None, device: str) -> MemoryReport | None:
    """What a worker's Ready says of its memory: its planned share and its allocator's peak so
    far (after warm-up: the most its largest calls and graph pools took). None on CPU."""
    if plan is None:
        return None
    mine = plan.stage(stage)
    return MemoryReport(card=plan.card, usable=plan.usable, planned=mine.total, state=mine.state,
                        allocator_cap=mine.allocator_bytes, allocator_peak=allocator_peak(device),
                        kv_tokens=plan.kv_tokens if stage == "talker" else 0)


def attention_without_plans() -> None:
    """Leave cuDNN out of `scaled_dot_product_attention`'s kernel choices in this process.

    cuDNN builds an execution plan for every input shape it has not met, hundreds of milliseconds
    each on an H200; graph replays never meet a new shape, but an eager step does (the first
    frames of a prefill step with a new batch, a reference encode of a new length), and such a
    plan build stalls every stream for that step. The flash and memory-efficient kernels need no
    plan. No effect on CPU."""
    import torch

    torch.backends.cuda.enable_cudnn_sdp(False)


def compile_size_oblivious() -> bool:
    """Make torch.compile's dynamic sizes size-oblivious in this process
    (`talker.compile_size_oblivious`): a size of 1 is no longer specialised, so the shape-generic
    graph serves a batch (or prompt chunk) of one row too. The talker's warm-up then compiles the
    local loop once instead of twice (for one row, then shape-generic), and each other compiled
    part at most twice. False (nothing changed) where this torch has no such switch
    (`torch.fx.experimental._config.backed_size_oblivious`, which torch marks experimental)."""
    from torch.fx.experimental import _config as fx_config

    if not hasattr(fx_config, "backed_size_oblivious"):
        log.warning("talker.compile_size_oblivious: this torch has no size-oblivious switch; ignored")
        return False
    fx_config.backed_size_oblivious = True
    return True


class TritonKernelCounter:
    """Called: how many Triton kernels this process has specialised since the counter was made
    (compiled, or loaded from the disk cache, for argument types or constants not met before).
    `since(n)`: what the specialisations after the n-th were (a kernel's name and the argument
    types and constants it was made for; the last `KEEP` only), for the line of a slow step."""

    KEEP = 8

    def __init__(self) -> None:
        self.made = 0
        self._last: list[str] = []

    def __call__(self) -> int:
        return self.made

    def record(self, what: str) -> None:
        self.made += 1
        self._last = [*self._last[1 - self.KEEP:], what]

    def since(self, n: int) -> list[str]:
        return self._last[len(self._last) - min(self.made - n, len(self._last)):] if self.made > n else []


def triton_kernel_counter(device: str) -> TritonKernelCounter | None:
    """On CUDA, a `TritonKernelCounter` from now on: a kernel met first while serving holds up the
    step or dispatch that meets it, up to hundreds of milliseconds. None elsewhere, or with a
    triton that has no compile hook: triton is imported on CUDA only, since its CPU interpreter
    must be chosen before the import."""
    if not str(device).startswith("cuda"):
        return None
    try:
        from triton import knobs
    except ImportError:
        return None
    runtime = getattr(knobs, "runtime", None)
    if runtime is None or not hasattr(runtime, "jit_post_compile_hook"):
        return None
    counter = TritonKernelCounter()
    before = runtime.jit_post_compile_hook  # another's hook, still called

    def counted(*args: Any, **kwargs: Any) -> Any:
        counter.record(specialisation_name(kwargs.get("repr")))
        return before(*args, **kwargs) if before is not None else None

    runtime.jit_post_compile_hook = counted
    return counter


def specialisation_name(repr_: Any) -> str:
    """Triton's description of a specialisation, `name[launch options](arg: type, ...)`, without
    the launch options and at most 400 characters (the argument types say what was new: a constant,
    an integer's divisibility, a pointer's alignment)."""
    text = str(repr_ or "?")
    head, _, rest = text.partition("[")
    args = rest.partition("](")[2] if "](" in rest else rest
    return f"{head}({args}"[:400] if args else head[:400]


def kernel_names(counter: Callable[[], int] | None, before: int) -> str:
    """'' or ': name(types), ...' of the kernels `counter` specialised after its `before`-th."""
    names = counter.since(before) if isinstance(counter, TritonKernelCounter) else []
    return ": " + "; ".join(names) if names else ""


def die_with_parent(parent_pid: int) -> None:
    """Ask the kernel to kill this process when its parent dies (Linux; elsewhere the parent's
    stop reaps it); exit at once if the parent is already gone."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (OSError, AttributeError):  # not Linux: rely on the launcher's stop
        return
    if os.getppid() != parent_pid:  # the launcher died before prctl took effect
        os._exit(1)


def beat_interval(profile: Profile) -> float | None:
    """How often a worker's loop beats at least (`Channel.beat` on its ring to the coordinator):
    a quarter of `engine.liveness_timeout_s`; None when liveness is off (sleep until work)."""
    timeout = profile.engine.liveness_timeout_s
    return timeout / 4 if timeout > 0 else None


def receive_spec(setup: Connection, timeout: float, what: str) -> ChannelSpec:
    """The next channel spec the launcher sends down the set-up pipe (a replaced peer's ring);
    RuntimeError when none comes within `timeout` seconds or the launcher has gone."""
    if not setup.poll(timeout):
        raise RuntimeError(f"no {what} spec from the launcher within {timeout:g} s")
    try:
        return setup.recv()
    except EOFError:
        raise RuntimeError(f"the launcher closed the set-up pipe before sending the {what} spec") from None


REWIRE_TIMEOUT_S = 60.0  # longest wait for a replaced peer's spec on the set-up pipe


def attach_talker(spec: WorkerSpec) -> tuple[Channel, Channel, Channel]:
    """(inbox, to_codec, to_coord) of the talker; waits for the codec's spec via the launcher."""
    inbox, to_coord = spec.inbox.open(), spec.to_coord.open()
    to_codec_spec: ChannelSpec = spec.setup.recv()
    return inbox, to_codec_spec.open(), to_coord


@dataclass(frozen=True)
class CodecRings:
    """Makes the rings a codec worker owns: the talker → codec ring (reader end) and one PCM
    ring per API process (writer ends). `generation` > 0 names the ring of a replaced peer
    (`Rewire`): a ring is opened once, so a new peer needs a new one."""

    spec: WorkerSpec

    def talker(self, generation: int = 0) -> Channel:
        name = f"{self.spec.ring_prefix}talker-codec" + (f".{generation}" if generation else "")
        return Channel.create(name, msg_type=CodecInbox, capacity=self.spec.profile.ipc.codes_ring_bytes,
                              role="reader", instance=self.spec.instance)

    def client(self, index: int, generation: int = 0) -> Channel:
        name = f"{self.spec.ring_prefix}codec-client{index}" + (f".{generation}" if generation else "")
        return Channel.create(name, msg_type=ClientInbox, capacity=self.spec.profile.ipc.pcm_ring_bytes,
                              role="writer", instance=self.spec.instance)


def attach_codec(spec: WorkerSpec) -> tuple[Channel, Channel, Channel, list[Channel]]:
    """(from_talker, from_coord, to_coord, to_clients) of the codec; creates the rings it owns."""
    rings = CodecRings(spec)
    from_talker = rings.talker()
    to_clients = [rings.client(i) for i in range(spec.num_clients)]
    spec.setup.send((from_talker.spec(), [c.spec() for c in to_clients]))
    return from_talker, spec.inbox.open(), spec.to_coord.open(), to_clients


def drain(channel: Channel, *, block: bool, timeout: float | None = None) -> Iterator[tuple[Any, Any]]:
    """Yield (msg, received) for every record waiting; with `block`, sleep for the first one (at
    most `timeout` seconds, None = until one comes; then nothing is yielded).

    `received.array(dtype)` is a view of the ring valid only until the next iteration (the
    record is released when the loop moves on): copy what must outlive it.
    """
    try:
        rec = channel.recv(timeout) if block else channel.try_recv()
    except ChannelTimeout:
        return
    while rec is not None:
        try:
            yield rec.msg, rec
        finally:
            rec.release()
        rec = channel.try_recv()


def payload_array(rec: Any, dtype: Any, width: int) -> np.ndarray:
    """An owned copy of a record's payload as `[-1, width]` (empty when there is none)."""
    if rec is None or rec.payload is None:
        return np.zeros((0, width), dtype=dtype)
    return np.array(rec.array(dtype).reshape(-1, width), copy=True)


def schedule_from(profile: Profile) -> ChunkSchedule:
    c = profile.chunking
    return ChunkSchedule(c.initial_chunk_frames, tuple(c.ramp), c.chunk_frames)
