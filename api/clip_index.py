"""What validating a reference clip found, shared by every API process through the data directory.

A client resends a voice's clip with every request, and the kernel hands each connection to any of
the API processes: a clip one process has decoded and hashed is new to the others, and each would
decode it again (3-5 ms of CPU a clip of a few seconds, while 16 requests of a pass's first wave
wait on the same process). The index keeps each validated clip's :class:`KnownClip` under
``<data_dir>/ref_clips/``, one small file a key (the ``ReferenceLoader``'s memo key: the SHA-256 of
an inline clip's text, or of a file's bytes), written to a temporary name and renamed into place,
so a reader sees a whole entry or none. An entry that cannot be read or parsed is treated as
absent (and written again by whoever decodes the clip next). With a ``DiskBudget``
(``api.disk_budget``) each new entry is counted against ``api.ref_cache_max_bytes`` and each
entry read is marked used, so the least used are removed first.
"""

from __future__ import annotations

import contextlib
import logging
import os
import uuid
from pathlib import Path

import msgspec

from api.disk_budget import DiskBudget, touch

log = logging.getLogger("mossvox.api")


class KnownClip(msgspec.Struct, frozen=True):
    """What validating a clip's bytes found (wire record of an index entry)."""

    digest: str  # the content address of its decoded samples (hex SHA-256)
    duration_s: float
    rate: int  # the rate it decodes at
    size: int  # its encoded bytes: a server with a lower api.max_ref_bytes refuses it anyway


_decoder = msgspec.json.Decoder(KnownClip)


class ClipIndex:
    """``get(key) -> KnownClip | None`` and ``put(key, clip)`` over a shared directory."""

    def __init__(self, directory: str | Path, budget: DiskBudget | None = None) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.budget = budget

    def path(self, key: bytes) -> Path:
        name = key.hex()
        return self.directory / name[:2] / name

    def get(self, key: bytes) -> KnownClip | None:
        """The entry for ``key``, or None when there is none or it cannot be read."""
        path = self.path(key)
        try:
            clip = _decoder.decode(path.read_bytes())
            if self.budget is not None:
                touch(path)
            return clip
        except FileNotFoundError:
            return None
        except (OSError, msgspec.DecodeError) as exc:
            log.warning("unreadable reference-clip entry %s (%s); decoding the clip", self.path(key), exc)
            return None

    def put(self, key: bytes, clip: KnownClip) -> None:
        """Store ``clip`` under ``key`` (atomically); a failure to write is logged, not raised."""
        final = self.path(key)
        tmp = final.parent / f".{final.name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        try:
            final.parent.mkdir(exist_ok=True)
            tmp.write_bytes(msgspec.json.encode(clip))
            os.replace(tmp, final)
            if self.budget is not None:
                self.budget.added(final)
        except OSError as exc:
            log.warning("reference-clip entry %s not written (%s)", final, exc)
            with contextlib.suppress(OSError):
                tmp.unlink(missing_ok=True)
