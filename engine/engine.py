"""The offline API: the whole engine in the caller's process tree, no HTTP.

    async with Engine("cpu") as eng:                      # profile name, path or Profile
        async for chunk in eng.generate(SpeechJob(text="Hello.")):
            play(chunk.pcm)                                # float32 [samples, channels]

It runs exactly what `mossvox serve` runs (talker and codec worker processes, the coordinator
on the caller's event loop), with one in-process client. Without `model_dir` it serves the
profile's checkpoint (`model.path`) or the embedded tiny demo model, whose weights are random (its
length forced from the text: `stages.tools.demo_model.resolve_checkpoint`).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from engine.client import AudioChunk, EngineClient
from engine.launcher import EngineHandle, launch
from profiles import Profile, load_profile
from speech.job import SpeechJob

log = logging.getLogger(__name__)


class Engine:
    """Async context manager around `launch()` with one in-process client."""

    def __init__(self, profile: Profile | str = "default", model_dir: str | Path | None = None,
                 overrides: Sequence[str] = ()) -> None:
        from stages.tools.demo_model import resolve_checkpoint

        profile = profile if isinstance(profile, Profile) else load_profile(profile, list(overrides))
        self.model_dir, self.profile = resolve_checkpoint(profile, model_dir)
        self.handle: EngineHandle | None = None
        self._client: EngineClient | None = None

    async def __aenter__(self) -> Engine:
        self.handle = await launch(self.profile, self.model_dir, clients=1)
        self._client = self.handle.client(0)
        return self

    async def __aexit__(self, *exc: Any) -> None:
        await self.stop()

    async def stop(self) -> None:
        if self.handle is not None:
            await self.handle.stop()
            self.handle = None
            self._client = None

    @property
    def client(self) -> EngineClient:
        if self._client is None:
            raise RuntimeError("the engine is not running (use `async with Engine(...)`)")
        return self._client

    @property
    def sample_rate(self) -> int:
        return self.client.sample_rate

    @property
    def channels(self) -> int:
        return self.client.channels

    def generate(self, job: SpeechJob) -> AsyncIterator[AudioChunk]:
        """Stream `job`'s audio chunk by chunk (see `EngineClient.generate`)."""
        return self.client.generate(job)

    async def synthesize(self, job: SpeechJob) -> tuple[np.ndarray, str | None]:
        """The whole audio of `job` (float32 [samples, channels]) and its finish reason."""
        pieces, reason = [], None
        async for chunk in self.client.generate(job):
            pieces.append(chunk.pcm)
            reason = chunk.finish_reason if chunk.final else reason
        pcm = (np.concatenate(pieces) if pieces
               else np.zeros((0, self.client.channels), dtype=np.float32))
        return pcm, reason

    async def encode_reference(self, wav: np.ndarray) -> np.ndarray:
        return await self.client.encode_reference(wav)

    def counters(self) -> dict:
        return self.client.counters()
