"""The reference-code cache: content-addressed codec codes on disk, shared by API processes.

Key = sha256(namespace, content digest), where the namespace names the model and its codec
configuration and the digest hashes the decoded reference samples. Each entry is one ``.npy``
file (int64 ``[T, n_vq]``) under ``<data_dir>/ref_codes/``, written to a temporary name and
renamed into place, so a reader in any API process (or after a restart) sees a whole file or
none. Concurrent misses for the same key inside one process share one encode (single flight),
which runs as a task of its own: a waiter that leaves (its client disconnected) leaves the others
their codes; only misses reach ``encode`` (the codec worker). A file that cannot be written (a
full disk) is logged and the codes are still returned. With a ``DiskBudget``
(``api.disk_budget``) every new file counts against ``api.ref_cache_max_bytes`` and every file
read is marked used, so the least used are removed first.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import uuid
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from pathlib import Path

import numpy as np

from api.disk_budget import DiskBudget, touch

log = logging.getLogger("mossvox.api")

Encode = Callable[[np.ndarray], Awaitable[np.ndarray]]


def codec_namespace(model_name: str, n_vq: int, sample_rate: int, channels: int, extra: str = "") -> str:
    """What a cached code depends on besides the audio: the model and its codec setup."""
    return f"{model_name}|n_vq={n_vq}|{sample_rate}Hz|{channels}ch|{extra}"


class ReferenceCodeCache:
    """``get_or_encode(digest, wav) -> (codes [T, n_vq] int64, hit)``."""

    def __init__(self, directory: str | Path, namespace: str, n_vq: int, encode: Encode,
                 *, memory_entries: int = 256, budget: DiskBudget | None = None) -> None:
        self.budget = budget
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.namespace = namespace
        self.n_vq = n_vq
        self._encode = encode
        self._memory: OrderedDict[str, np.ndarray] = OrderedDict()
        self._memory_entries = memory_entries
        self._in_flight: dict[str, asyncio.Task[np.ndarray]] = {}
        self.hits = 0
        self.misses = 0

    def key(self, digest: str) -> str:
        return hashlib.sha256(f"{self.namespace}\n{digest}".encode()).hexdigest()

    def path(self, key: str) -> Path:
        return self.directory / key[:2] / f"{key}.npy"

    async def get_or_encode(self, digest: str, wav: np.ndarray | Callable[[], np.ndarray]
                            ) -> tuple[np.ndarray, bool]:
        """Codes for the clip with content ``digest``; ``wav`` [C, S] (or a function computing
        it, run in a thread) is only used on a miss."""
        key = self.key(digest)
        codes = self.lookup(key)
        if codes is not None:
            self.hits += 1
            return codes, True
        pending = self._in_flight.get(key)
        hit = pending is not None  # another request of this process is encoding the same clip
        if pending is None:
            self.misses += 1
            pending = asyncio.ensure_future(self._encode_and_store(key, wav))
            self._in_flight[key] = pending
            pending.add_done_callback(lambda task: self._settled(key, task))
        else:
            self.hits += 1
        # shielded: a waiter cancelled (its client left) leaves the encode to the others
        return await asyncio.shield(pending), hit

    async def _encode_and_store(self, key: str, wav: np.ndarray | Callable[[], np.ndarray]) -> np.ndarray:
        if callable(wav):
            wav = await asyncio.to_thread(wav)
        codes = self._validate(np.asarray(await self._encode(wav)), key)
        try:
            await asyncio.to_thread(self._write, key, codes)
        except OSError as exc:  # a full or read-only disk: served from memory, encoded again later
            log.warning("reference codes %s not written (%s)", key, exc)
        self._remember(key, codes)
        return codes

    def _settled(self, key: str, task: asyncio.Task) -> None:
        if self._in_flight.get(key) is task:
            del self._in_flight[key]
        if not task.cancelled():
            task.exception()  # retrieved: its waiters re-raise it, nobody else must

    def lookup(self, key: str) -> np.ndarray | None:
        """Memory first, then the shared directory (written by any process)."""
        codes = self._memory.get(key)
        if codes is not None:
            self._memory.move_to_end(key)
            return codes
        path = self.path(key)
        try:
            codes = np.load(path, allow_pickle=False)
        except FileNotFoundError:
            return None
        except (OSError, ValueError) as exc:
            log.warning("unreadable reference-code file %s (%s); re-encoding", path, exc)
            return None
        if codes.dtype != np.int64 or codes.ndim != 2 or codes.shape[1] != self.n_vq:
            log.warning("reference-code file %s has %s %s; re-encoding", path, codes.dtype, codes.shape)
            return None
        if self.budget is not None:
            touch(path)
        self._remember(key, codes)
        return codes

    def _validate(self, codes: np.ndarray, key: str) -> np.ndarray:
        if codes.ndim != 2 or codes.shape[1] != self.n_vq or codes.shape[0] == 0:
            raise RuntimeError(f"encoder returned codes of shape {codes.shape}, expected [T, {self.n_vq}]")
        return np.ascontiguousarray(codes, dtype=np.int64)

    def _write(self, key: str, codes: np.ndarray) -> None:
        final = self.path(key)
        final.parent.mkdir(parents=True, exist_ok=True)
        tmp = final.parent / f".{key}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "wb") as handle:
            np.save(handle, codes, allow_pickle=False)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp, final)  # atomic: readers see the old state or the whole file
        if self.budget is not None:
            self.budget.added(final)

    def _remember(self, key: str, codes: np.ndarray) -> None:
        codes.setflags(write=False)
        self._memory[key] = codes
        self._memory.move_to_end(key)
        while len(self._memory) > self._memory_entries:
            self._memory.popitem(last=False)
