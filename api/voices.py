"""The voice registry: named reference voices on disk, shared by every API process.

A voice is one file ``<data_dir>/voices/<name>.voice.npz`` holding its codec codes (encoded at
upload, so the first synthesis is already hot) and a JSON metadata record. Files are written under
a temporary name and renamed into place; every read goes to the directory (with a small
stat-keyed memo), so a voice uploaded or deleted through one API process is seen by all of them
and survives restarts.
"""

from __future__ import annotations

import json
import os
import re
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from api.schemas import VoiceInfo

NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
SUFFIX = ".voice.npz"


@dataclass(frozen=True)
class Voice:
    """A registered voice: what the API lists plus the codes it conditions on."""

    info: VoiceInfo
    codes: np.ndarray  # [T, n_vq] int64
    namespace: str  # model + codec setup the codes were encoded with


class VoiceExists(Exception):
    """``put`` without ``overwrite`` found the name taken (maybe by another API process)."""


def valid_voice_name(name: str) -> bool:
    return bool(NAME_RE.match(name)) and not name.endswith(".")


class VoiceRegistry:
    """CRUD over the voice directory. Methods do blocking file I/O: call them off the loop."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self._memo: dict[str, tuple[tuple[int, int], Voice]] = {}

    def path(self, name: str) -> Path:
        if not valid_voice_name(name):
            raise ValueError(f"invalid voice name {name!r}")
        return self.directory / f"{name}{SUFFIX}"

    def names(self) -> list[str]:
        return sorted(p.name[: -len(SUFFIX)] for p in self.directory.glob(f"*{SUFFIX}"))

    def get(self, name: str) -> Voice | None:
        if not valid_voice_name(name):
            return None
        path = self.path(name)
        try:
            stat = path.stat()
        except FileNotFoundError:
            self._memo.pop(name, None)
            return None
        stamp = (stat.st_mtime_ns, stat.st_size)
        memo = self._memo.get(name)
        if memo is not None and memo[0] == stamp:
            return memo[1]
        try:
            with np.load(path, allow_pickle=False) as data:
                meta = json.loads(str(data["meta"]))
                codes = np.ascontiguousarray(data["codes"], dtype=np.int64)
        except FileNotFoundError:  # deleted between stat and open
            return None
        namespace = meta.pop("namespace")
        voice = Voice(info=VoiceInfo(**meta), codes=codes, namespace=namespace)
        self._memo[name] = (stamp, voice)
        return voice

    def list(self) -> list[VoiceInfo]:
        return [voice.info for name in self.names() if (voice := self.get(name)) is not None]

    def put(self, *, name: str, codes: np.ndarray, namespace: str, consent: str,
            duration_s: float, ref_text: str | None, overwrite: bool = False) -> Voice:
        """Register ``name`` (replace it with ``overwrite``, else ``VoiceExists`` if it is taken,
        decided atomically across processes); atomic for readers in any process."""
        info = VoiceInfo(name=name, consent=consent, created_at=time.time(), duration_s=round(duration_s, 3),
                         frames=int(codes.shape[0]), ref_text=ref_text)
        meta = {"name": name, "consent": consent, "created_at": info.created_at,
                "duration_s": info.duration_s, "frames": info.frames, "ref_text": ref_text,
                "namespace": namespace}
        final = self.path(name)
        tmp = self.directory / f".{name}.{os.getpid()}.{uuid.uuid4().hex}.tmp"
        with open(tmp, "wb") as handle:
            np.savez(handle, codes=np.asarray(codes, dtype=np.int64), meta=np.array(json.dumps(meta)))
            handle.flush()
            os.fsync(handle.fileno())
        if overwrite:
            os.replace(tmp, final)
        else:
            try:
                os.link(tmp, final)  # fails if the name exists, whoever wrote it
            except FileExistsError:
                raise VoiceExists(name) from None
            finally:
                tmp.unlink()
        return Voice(info=info, codes=codes, namespace=namespace)

    def delete(self, name: str) -> bool:
        if not valid_voice_name(name):
            return False
        self._memo.pop(name, None)
        try:
            self.path(name).unlink()
            return True
        except FileNotFoundError:
            return False
