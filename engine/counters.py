"""Engine counters in one small shared-memory block: written by the coordinator, read by clients.

Every client (in-process or in a spawned API process) maps the block read-only and reads a
snapshot without messaging the coordinator. Values are float64 (counts stay exact below 2**53).
The gauges that must return to zero when nothing runs (nothing leaks) are `LEAK_GAUGES`.

Layout: `SCALARS` in order, then two histograms (index = size): coalesced codec decode batches,
then talker step batches, then `REPLICA_FIELDS` once per replica (snapshot keys
`replica{k}_{field}`; the engine-wide scalars are their sums where they overlap).
"""

from __future__ import annotations

import numpy as np

from ipc.shm import attach_segment, create_segment, segment_name, unlink_segment

SCALARS = (
    "healthy",            # 1 while the engine can serve (a replica is up or being restarted)
    "ready",              # 1 while a replica is up with both workers warmed up
    "running",            # requests dispatched to the workers, not yet closed
    "queued",             # requests waiting for admission
    "admission_held",     # 1 while queued requests wait for a playing stream to get ahead again
    "admission_holds",    # times the playout gate started holding queued requests
    "talker_slots",       # requests inside the talker runner (reported by the talker)
    "codec_slots",        # open streaming-decode slots (reported by the codec)
    "encode_jobs",        # reference-encode jobs in flight
    "ring_bytes",         # bytes in use in the coordinator's rings (in-process client's added)
    "submitted",
    "rejected",
    "failed",
    "finished_stop",
    "finished_length",
    "aborted",
    "chunks",             # PCM chunks delivered
    "audio_s",            # seconds of audio delivered
    "decode_batches",
    "decode_batch_wait_max_s",   # longest coalescing wait seen
    "talker_capacity",
    "max_prompt_rows",     # the longest prompt every replica's talker can hold (0 = unknown)
    "codec_capacity",
    "coordinator_busy_s",  # time in coordinator handlers (engine overhead)
    "codec_emit_s",        # time the codec spent writing PCM/ChunkDone records (ring overhead)
    "codec_decode_s",      # time the codec spent in decode calls (model + host copy of the PCM)
    "talker_step_s",       # time the talker spent in runner.step()
    "talker_prompt_rows",  # prompt rows the talkers took in
    "talker_cached_rows",  # of those, rows taken from their prefix caches (not computed)
    "replicas",            # talker+codec pairs launched (engine.replicas)
    "replicas_up",         # of those, still alive and serving
    "restarts",            # workers (or whole replicas) restarted in place after a failure
    "talker_restarts",     # of those, talkers replaced alone (the codec kept serving)
    "codec_restarts",      # of those, codecs replaced alone (the talker kept its state)
    "hung_workers",        # workers killed because their liveness beat stood still
    "restart_last_s",      # seconds from the last replaced worker's death to its replica serving
    "api_restarts",        # API processes replaced after one died (the supervisor's)
)
REPLICA_FIELDS = (
    "up",                  # 1 while this replica's talker and codec are alive
    "running",             # requests dispatched to this replica, not yet closed
    "dispatched",          # requests ever dispatched to it
    "failed",              # requests that failed with it (its worker died, errors, deadlines)
    "talker_slots",        # as the engine-wide gauges, for this replica alone
    "codec_slots",
    "restarts",            # times this replica was restarted in place
    "memory_card_bytes",   # its card's total memory (CUDA; 0 on CPU)
    "memory_usable_bytes",  # what its memory plan may use (memory.gpu_utilization of the card)
    "talker_memory_planned_bytes",  # the talker's planned share, its CUDA context included
    "talker_memory_peak_bytes",     # the most the talker's allocator held by its Ready
    "talker_kv_tokens",    # tokens its KV cache holds
    "codec_memory_planned_bytes",   # the codec's planned share, its CUDA context included
    "codec_memory_peak_bytes",      # the most the codec's allocator held by its Ready
)
_REPLICA_INDEX = {name: i for i, name in enumerate(REPLICA_FIELDS)}
LEAK_GAUGES = ("running", "queued", "talker_slots", "codec_slots", "encode_jobs", "ring_bytes")
_INDEX = {name: i for i, name in enumerate(SCALARS)}


class CounterBlock:
    """A float64 array in shared memory: the owner writes, everyone reads."""

    def __init__(self, shm, owner: bool, hist_size: int, replicas: int = 1) -> None:
        self._shm = shm
        self.owner = owner
        self.hist_size = hist_size  # entries per histogram (largest size + 1)
        self.replicas = replicas
        self._values = np.ndarray((_size(hist_size, replicas),), dtype=np.float64,
                                  buffer=shm.buf)

    @classmethod
    def create(cls, instance: str, max_size: int, replicas: int = 1) -> CounterBlock:
        """A zeroed block whose histograms count sizes up to `max_size` (larger: clipped), with
        `REPLICA_FIELDS` for each of `replicas` replicas."""
        hist = max_size + 1
        shm = create_segment(segment_name(instance, "counters"), 8 * _size(hist, replicas))
        block = cls(shm, owner=True, hist_size=hist, replicas=replicas)
        block._values[:] = 0.0
        return block

    @classmethod
    def attach(cls, name: str, hist_size: int, replicas: int = 1) -> CounterBlock:
        return cls(attach_segment(name), owner=False, hist_size=hist_size, replicas=replicas)

    @property
    def name(self) -> str:
        return self._shm.name

    def __getitem__(self, key: str) -> float:
        return float(self._values[_INDEX[key]])

    def __setitem__(self, key: str, value: float) -> None:
        self._values[_INDEX[key]] = value

    def add(self, key: str, delta: float = 1.0) -> None:
        self._values[_INDEX[key]] += delta

    def set_replica(self, replica: int, key: str, value: float) -> None:
        self._values[self._replica_index(replica, key)] = value

    def add_replica(self, replica: int, key: str, delta: float = 1.0) -> None:
        self._values[self._replica_index(replica, key)] += delta

    def replica(self, replica: int, key: str) -> float:
        return float(self._values[self._replica_index(replica, key)])

    def _replica_index(self, replica: int, key: str) -> int:
        base = len(SCALARS) + 2 * self.hist_size + replica * len(REPLICA_FIELDS)
        return base + _REPLICA_INDEX[key]

    def count_batch(self, size: int, waited_s: float) -> None:
        """One coalesced codec decode of `size` streams."""
        self._values[len(SCALARS) + min(size, self.hist_size - 1)] += 1
        self.add("decode_batches")
        i = _INDEX["decode_batch_wait_max_s"]
        self._values[i] = max(self._values[i], waited_s)

    def count_talker_step(self, batch: int, steps: int = 1) -> None:
        """`steps` talker scheduler steps over `batch` requests each."""
        self._values[len(SCALARS) + self.hist_size + min(batch, self.hist_size - 1)] += steps

    def snapshot(self) -> dict:
        """All counters as a dict; `decode_batch_sizes` / `talker_batch_sizes` map a batch size
        to how often it occurred."""
        values = self._values.copy()
        out: dict = {name: float(values[i]) for name, i in _INDEX.items()}
        n = len(SCALARS)
        h = self.hist_size
        for key, hist in (("decode_batch_sizes", values[n:n + h]),
                          ("talker_batch_sizes", values[n + h:n + 2 * h])):
            out[key] = {int(s): int(c) for s, c in enumerate(hist) if c}
        for r in range(self.replicas):
            for key in REPLICA_FIELDS:
                out[f"replica{r}_{key}"] = float(values[self._replica_index(r, key)])
        return out

    def close(self) -> None:
        """Unmap (and, for the owner, unlink) the block. Idempotent."""
        if self._shm is None:
            return
        name = self._shm.name
        self._values = None  # type: ignore[assignment]  # drop the view before unmapping
        self._shm.close()
        if self.owner:
            unlink_segment(name)
        self._shm = None


def _size(hist_size: int, replicas: int) -> int:
    """float64 entries of a block."""
    return len(SCALARS) + 2 * hist_size + replicas * len(REPLICA_FIELDS)
