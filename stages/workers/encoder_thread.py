"""The codec worker's reference encoding, on a thread and CUDA stream of its own.

A new voice's reference clip must be encoded before its request can start. Run in the decode
loop, an encode batch held up every open stream's next chunk for as long as it took, so batches
were kept small while streams played, and new voices queued behind each other. Here the loop hands
a batch to `EncoderThread.submit` and goes on decoding; the thread encodes it on its own CUDA
stream (the GPU runs it beside the decode replays) and rings `bell` when it is done, which the
loop's sleep includes, so nothing polls. One batch is in flight at a time: the jobs that arrive
meanwhile form the next, larger batch.

The thread only calls the runner's `encode` (the encoder half of the codec and its graphs); the
loop only decodes. Tensors are not shared between the two.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ipc.doorbell import Doorbell


@dataclass
class EncodeBatch:
    """Jobs encoded together: what the loop submitted, then (once done) codes or an error each."""

    jobs: list[Any]                      # the loop's own records, handed back untouched
    wavs: list[np.ndarray]               # [channels, samples] float32 each
    codes: list[np.ndarray | None] = field(default_factory=list)  # [T, n_vq] int64 each
    errors: list[str | None] = field(default_factory=list)
    note: dict[str, Any] = field(default_factory=dict)  # the loop's own fields, handed back untouched
    submitted: float = 0.0               # monotonic seconds: handed to the thread
    started: float = 0.0                 # ... taken up by it
    seconds: float = 0.0                 # ... and encoding


class EncoderThread:
    """Encodes batches with `encode` (a list of waveforms -> a list of codes) on a daemon thread;
    `done()` hands back finished batches in order. On CUDA `device` the thread launches on a
    stream of its own."""

    def __init__(self, encode: Callable[[list[np.ndarray]], list[np.ndarray]], device: str,
                 on_failure: Callable[[str], None] | None = None) -> None:
        self._encode = encode
        self._device = device
        self._todo: queue.Queue[EncodeBatch | None] = queue.Queue()
        self._done: deque[EncodeBatch] = deque()
        self._on_failure = on_failure
        self.bell = Doorbell.create()
        self.in_flight = 0
        self._thread = threading.Thread(target=self._run, name="codec-encoder", daemon=True)
        self._thread.start()

    def submit(self, jobs: list[Any], wavs: list[np.ndarray], note: dict[str, Any] | None = None) -> None:
        """Encode `wavs` as one batch; `note` comes back with it (the loop's timeline fields)."""
        self.in_flight += 1
        self._todo.put(EncodeBatch(jobs, wavs, note=note or {}, submitted=time.monotonic()))

    def done(self) -> list[EncodeBatch]:
        """The batches finished since the last call (the loop's thread only)."""
        out = []
        while self._done:
            out.append(self._done.popleft())
        self.in_flight -= len(out)
        return out

    def close(self) -> None:
        """Stop the thread once the batch in flight is done."""
        self._todo.put(None)
        self._thread.join(timeout=30)
        self.bell.close()

    def _run(self) -> None:
        stream = None
        if str(self._device).startswith("cuda"):
            import torch

            torch.cuda.set_device(torch.device(self._device))
            stream = torch.cuda.Stream(device=torch.device(self._device))
        while (batch := self._todo.get()) is not None:
            batch.started = time.monotonic()
            if stream is not None:
                import torch

                with torch.cuda.stream(stream):
                    self._encode_batch(batch)
            else:
                self._encode_batch(batch)
            batch.seconds = time.monotonic() - batch.started
            self._done.append(batch)
            self.bell.ring()

    def _encode_batch(self, batch: EncodeBatch) -> None:
        try:
            batch.codes = list(self._encode(batch.wavs))
            batch.errors = [None] * len(batch.wavs)
            return
        except Exception as exc:  # one bad waveform: retry one by one to name it
            failure = f"{type(exc).__name__}: {exc}"
        batch.codes, batch.errors = [], []
        for wav in batch.wavs:
            try:
                batch.codes.append(self._encode([wav])[0])
                batch.errors.append(None)
            except Exception as single:
                batch.codes.append(None)
                batch.errors.append(f"{type(single).__name__}: {single}")
        if self._on_failure is not None:
            self._on_failure(failure)
