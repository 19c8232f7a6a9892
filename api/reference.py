"""Reference audio for voice cloning: locate, fetch, decode, validate, prepare.

A ``ref_audio`` value may be a ``data:`` URL, bare base64, ``file://`` URL or plain path (only
under ``api.allowed_local_paths``), or an http(s) URL (only when ``api.allow_remote_ref_audio``;
fetched by ``api.remote_fetch``). Any common format decodes (libsndfile first, then PyAV/FFmpeg),
always from memory and within bounds (``api.reference_decode``: the header's rate, channels and
length checked before a sample is decoded, then decoded in pieces that stop past
``api.max_ref_seconds``), at most ``api.max_ref_decodes`` at once per API process. A local path
is read only when it is a regular file (not a FIFO or a device), off the event loop, its size
checked before reading. The clip must last between ``api.min_ref_seconds`` and
``api.max_ref_seconds``; errors carry the measured duration. The decoded samples are then fixed
to the codec's channel count and rate and loudness-normalised by
``stages.models.codec.audio_prep.prepare_reference`` (the model's processor rules).
"""

from __future__ import annotations

import asyncio
import binascii
import functools
import hashlib
import os
import stat
import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import unquote, urlparse

import numpy as np

from api.clip_index import ClipIndex, KnownClip
from api.errors import ApiError, bad_request
from api.remote_fetch import (AddressCheck, RemoteFetchError, RemoteStatusError, RemoteTooLarge, fetch_remote,
                              public_address)
from api.reference_decode import (DecodeBounds, PyAvMissing, ReferenceDecodeError, ReferenceDecodeTooLong,
                                  ReferenceOutOfBounds, decode_reference)
from stages.models.codec.audio_prep import prepare_reference


class PreparedReference:
    """A validated reference clip, ready for ``EngineClient.encode_reference``.

    ``digest`` (the content address) and ``duration_s`` are known at once; the codec-ready
    waveform (channels fixed, resampled, loudness-normalised: a few ms for a few seconds of
    audio) is computed by ``prepare()`` only when asked, i.e. on a reference-cache miss. A clip
    whose bytes were seen before (``ReferenceLoader``'s memo) is decoded only then too."""

    def __init__(self, samples: np.ndarray | None, rate: int, *, digest: str, policy: "ReferencePolicy",
                 duration_s: float | None = None, data: bytes | Callable[[], bytes] | None = None) -> None:
        """``samples`` [C, S] float32 as decoded at ``rate``; or None with ``data`` (the encoded
        bytes, or a function returning them, decoded on ``prepare()``) and ``duration_s`` known."""
        self._samples = samples
        self.rate = rate
        self._data = data
        self._policy = policy
        self.digest = digest
        self.duration_s = samples.shape[1] / rate if samples is not None else duration_s
        self._prepared: np.ndarray | None = None

    def prepare(self) -> np.ndarray:
        """[codec channels, samples at the codec rate] float32 (computed once)."""
        if self._prepared is None:
            if self._samples is None:
                data = self._data() if callable(self._data) else self._data
                self._samples, self.rate = decode_audio_bytes(data, self._policy)
            self._prepared = prepare_reference(self._samples, self.rate, target_rate=self._policy.sample_rate,
                                               channels=self._policy.channels)
        return self._prepared

    @property
    def wav(self) -> np.ndarray:
        return self.prepare()


@dataclass(frozen=True)
class ReferencePolicy:
    """The profile's limits on reference audio and the codec's input format."""

    min_seconds: float
    max_seconds: float
    max_bytes: int
    allow_remote: bool
    allowed_local_paths: tuple[str, ...]
    sample_rate: int  # codec input rate
    channels: int  # codec input channels
    max_channels: int = 8  # channels a clip's file may have
    max_rate: int = 192000  # Hz a clip's file may have
    max_decodes: int = 4  # clips decoded at once by this process (threads wait for a turn)
    remote_timeout_s: float = 10.0  # one deadline for a remote clip, redirects included
    address_allowed: AddressCheck = public_address  # which addresses a remote clip may come from
    decode_turns: threading.BoundedSemaphore | None = None  # the turns themselves (made at once)

    def __post_init__(self) -> None:
        if self.decode_turns is None:
            object.__setattr__(self, "decode_turns", threading.BoundedSemaphore(self.max_decodes))

    @property
    def bounds(self) -> DecodeBounds:
        return DecodeBounds(max_seconds=self.max_seconds, max_channels=self.max_channels,
                            max_rate=self.max_rate, channels=self.channels)

    @classmethod
    def from_profile(cls, api_config, *, sample_rate: int, channels: int) -> "ReferencePolicy":
        return cls(min_seconds=api_config.min_ref_seconds, max_seconds=api_config.max_ref_seconds,
                   max_bytes=api_config.max_ref_bytes, allow_remote=api_config.allow_remote_ref_audio,
                   allowed_local_paths=tuple(api_config.allowed_local_paths),
                   sample_rate=sample_rate, channels=channels, max_channels=api_config.max_ref_channels,
                   max_rate=api_config.max_ref_sample_rate, max_decodes=api_config.max_ref_decodes,
                   remote_timeout_s=api_config.remote_ref_timeout_s)


class ReferenceLoader:
    """Turns a ``ref_audio`` locator or uploaded bytes into a :class:`PreparedReference`.

    Clients resend the same clip with every request of a voice; decoding and hashing its samples
    again costs the API process about a millisecond each time (1.3 ms for 5.5 s of 24 kHz WAV on
    the 2-core development machine), and requests arriving together queue behind one another's.
    So the loader remembers the clips it validated (``memo_size`` of them, least recently used
    forgotten): an inline clip (a ``data:`` URL or bare base64) by the SHA-256 of the text sent,
    so a repeat is known without its base64 decoded (milliseconds for a 450 KB body, the API
    process's event loop held meanwhile); a clip read from a file or a URL by the SHA-256 of its
    bytes, which may change under the same name. Identical bytes decode to identical samples, so
    a repeat is known without decoding its audio; its waveform is decoded only if the reference
    cache misses. With an ``index`` (:class:`ClipIndex`, shared through the data directory) a
    clip any API process validated is known to every other one too, so a repeat landing on
    another process is not decoded either; an entry another server wrote is trusted only within
    this server's limits (duration and size), else the clip is decoded and judged here. Refused
    clips are not remembered: a repeat is refused again with the same error."""

    def __init__(self, policy: ReferencePolicy, memo_size: int = 4096, *, index: ClipIndex | None = None) -> None:
        self.policy = policy
        self.memo_size = memo_size
        self.index = index
        self._known: OrderedDict[bytes, KnownClip] = OrderedDict()

    @property
    def remembered(self) -> int:
        """Clips the memo holds."""
        return len(self._known)

    async def load(self, locator: str, *, param: str = "ref_audio") -> PreparedReference:
        text = locator.strip()
        sent = _sent_key(text)
        known = self._recall(sent)
        if known is not None:  # this very text was an inline clip, validated: not even decoded
            return self._known_clip(known, functools.partial(_inline_bytes, text))
        data, inline = await self._fetch(text, param)
        key = hashlib.sha256(data).digest()  # ~0.1 ms for a few seconds of WAV
        known = self._recall(key)
        if known is not None:  # the same bytes came another way (a path, other base64 text)
            prepared = self._known_clip(known, data)
        else:
            prepared = await asyncio.to_thread(self.prepare_bytes, data, param=param)
            known = KnownClip(prepared.digest, prepared.duration_s, prepared.rate, len(data))
        self._learn(sent if inline else key, known)
        return prepared

    def _recall(self, key: bytes) -> KnownClip | None:
        """The memo's entry for ``key``, else the shared index's (when within this server's
        limits: remembered from then on), else None."""
        known = self._known.get(key)
        if known is not None:
            self._known.move_to_end(key)
            return known
        known = self.index.get(key) if self.index is not None else None
        if known is None or not self._within_limits(known):
            return None
        self._remember(key, known)
        return known

    def _within_limits(self, known: KnownClip) -> bool:
        p = self.policy
        return known.size <= p.max_bytes and p.min_seconds <= known.duration_s <= p.max_seconds

    def _learn(self, key: bytes, known: KnownClip) -> None:
        if self.index is not None and key not in self._known:
            self.index.put(key, known)  # once a clip: ~0.2 ms (a get ~30 us) on the development machine
        self._remember(key, known)

    async def _fetch(self, text: str, param: str) -> tuple[bytes, bool]:
        """The encoded bytes named by stripped ``text``, and whether they were inline (a data: URL
        or bare base64: the same text always holds the same bytes)."""
        if not text:
            raise bad_request("ref_audio is empty", param=param)
        lowered = text[:8].lower()
        if lowered.startswith("data:"):
            return self._check_size(_data_url_bytes(text, param), param), True
        if lowered.startswith(("http://", "https://")):
            if not self.policy.allow_remote:
                raise bad_request("ref_audio URLs are disabled on this server (api.allow_remote_ref_audio); "
                                  "send a data: URL or base64 instead", param=param)
            return await self._fetch_remote(text, param), False
        if lowered.startswith("file://"):
            return await asyncio.to_thread(self._read_local, text, param), False
        data = _bare_base64(text)
        # Base64 may start with "/" too: a value is a path only when it is not long valid base64.
        if data is None and text.startswith(("/", "./", "../", "~")):
            return await asyncio.to_thread(self._read_local, text, param), False
        if data is None:
            raise bad_request("ref_audio must be a data: URL, base64 audio, an allowed local path "
                              "(file://...) or, where enabled, an http(s) URL", param=param)
        return self._check_size(data, param), True

    def _known_clip(self, known: KnownClip, data: bytes | Callable[[], bytes]) -> PreparedReference:
        return PreparedReference(None, known.rate, digest=known.digest, policy=self.policy,
                                 duration_s=known.duration_s, data=data)

    def _remember(self, key: bytes, known: KnownClip) -> None:
        self._known[key] = known
        self._known.move_to_end(key)
        while len(self._known) > self.memo_size:
            self._known.popitem(last=False)

    def prepare_bytes(self, data: bytes, *, param: str = "ref_audio") -> PreparedReference:
        """Decode, validate the duration and hash (CPU work); the codec waveform comes later."""
        self._check_size(data, param)
        wav, rate = decode_audio_bytes(data, self.policy, param)  # [codec channels, S]
        duration = wav.shape[1] / rate
        if duration < self.policy.min_seconds:
            raise bad_request(f"Reference audio too short ({duration:.2f} s). At least "
                              f"{self.policy.min_seconds:g} s of clear speech is required.", param=param)
        if duration > self.policy.max_seconds:
            raise bad_request(f"Reference audio too long ({duration:.2f} s). At most "
                              f"{self.policy.max_seconds:g} s is supported; use a shorter clip.", param=param,
                              limit="api.max_ref_seconds")
        if not np.isfinite(wav).all():
            raise bad_request("Reference audio contains NaN or infinite samples", param=param)
        digest = hashlib.sha256()
        digest.update(f"{rate}:{wav.shape[0]}:".encode())
        digest.update(np.ascontiguousarray(wav, dtype="<f4").tobytes())
        return PreparedReference(wav, rate, digest=digest.hexdigest(), policy=self.policy)

    def _check_size(self, data: bytes, param: str) -> bytes:
        if len(data) > self.policy.max_bytes:
            raise ApiError(413, f"Reference audio is {len(data)} bytes; the limit is "
                                f"{self.policy.max_bytes} bytes (api.max_ref_bytes)", param=param,
                           limit="api.max_ref_bytes")
        if not data:
            raise bad_request("Reference audio is empty", param=param)
        return data

    def _read_local(self, text: str, param: str) -> bytes:
        """The bytes of an allowed local file (blocking: run it in a thread)."""
        raw = unquote(urlparse(text).path) if text.lower().startswith("file://") else text
        if "\x00" in raw:
            raise bad_request("ref_audio path contains a NUL character", param=param)
        try:
            path = Path(os.path.expanduser(raw)).resolve()
        except (OSError, RuntimeError, ValueError):  # a symlink loop, a name too long, ...
            raise bad_request("ref_audio path cannot be resolved", param=param) from None
        roots = [Path(os.path.expanduser(r)).resolve() for r in self.policy.allowed_local_paths]
        if not any(path.is_relative_to(root) for root in roots):
            raise bad_request("ref_audio path is not under an allowed directory (api.allowed_local_paths)",
                              param=param)
        return self._check_size(_read_regular_file(path, self.policy.max_bytes, param), param)

    async def _fetch_remote(self, url: str, param: str) -> bytes:
        policy = self.policy
        try:
            data = await fetch_remote(url, max_bytes=policy.max_bytes, timeout_s=policy.remote_timeout_s,
                                      address_allowed=policy.address_allowed)
        except RemoteTooLarge as exc:
            raise ApiError(413, f"Reference audio is at least {exc.size} bytes; the limit is {policy.max_bytes} "
                                f"bytes (api.max_ref_bytes)", param=param, limit="api.max_ref_bytes") from None
        except RemoteStatusError as exc:
            raise bad_request(f"ref_audio URL returned HTTP {exc.status}", param=param) from None
        except RemoteFetchError:
            raise bad_request(f"ref_audio URL could not be fetched: this server fetches public http(s) URLs "
                              f"that answer within {policy.remote_timeout_s:g} s (api.remote_ref_timeout_s)",
                              param=param) from None
        return self._check_size(data, param)


def _read_regular_file(path: Path, max_bytes: int, param: str) -> bytes:
    """At most ``max_bytes`` of a regular file; a FIFO, device or socket is refused without a
    read (opening never blocks: O_NONBLOCK), a larger file with 413 before reading."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        raise bad_request(f"ref_audio file not found: {path}", param=param) from None
    except OSError as exc:
        raise bad_request(f"ref_audio file cannot be read: {exc.strerror or type(exc).__name__}",
                          param=param) from None
    try:
        info = os.fstat(fd)
        if stat.S_ISDIR(info.st_mode):
            raise bad_request(f"ref_audio is a directory: {path}", param=param)
        if not stat.S_ISREG(info.st_mode):
            raise bad_request(f"ref_audio is not a regular file: {path}", param=param)
        if info.st_size > max_bytes:
            raise ApiError(413, f"Reference audio is {info.st_size} bytes; the limit is {max_bytes} "
                                f"bytes (api.max_ref_bytes)", param=param, limit="api.max_ref_bytes")
        with open(fd, "rb", closefd=False) as handle:
            return handle.read(max_bytes + 1)
    except OSError as exc:
        raise bad_request(f"ref_audio file cannot be read: {exc.strerror or type(exc).__name__}",
                          param=param) from None
    finally:
        os.close(fd)


def _sent_key(text: str) -> bytes:
    """The memo's key for a locator's text as sent (tagged apart from the keys of bytes)."""
    return b"sent:" + hashlib.sha256(text.encode("utf-8", "surrogatepass")).digest()


def _inline_bytes(text: str) -> bytes:
    """The bytes of an inline clip whose text was validated before (a data: URL or bare base64)."""
    return _data_url_bytes(text, "ref_audio") if text[:5].lower() == "data:" else _strict_base64(text)


def _strict_base64(text: str) -> bytes:
    """Base64 without whitespace or other characters, padding only at the end (binascii.Error or
    ValueError otherwise); validated in C, ~2x the pace of ``b64decode(validate=True)``'s regex."""
    return binascii.a2b_base64(text, strict_mode=True)


def _bare_base64(text: str) -> bytes | None:
    """Decoded bytes when ``text`` is valid base64 of at least 64 bytes, else None."""
    if len(text) < 88:
        return None
    try:
        return _strict_base64(text)
    except (binascii.Error, ValueError):
        return None


def _data_url_bytes(text: str, param: str) -> bytes:
    header, sep, payload = text.partition(",")
    if not sep or ";base64" not in header.lower():
        raise bad_request("ref_audio data: URL must be base64 encoded (data:<mime>;base64,<data>)", param=param)
    try:
        return _strict_base64(payload.strip())
    except (binascii.Error, ValueError):
        raise bad_request("ref_audio data: URL holds invalid base64", param=param) from None


def decode_audio_bytes(data: bytes, policy: ReferencePolicy, param: str = "ref_audio") -> tuple[np.ndarray, int]:
    """Any common audio file -> (float32 [codec channels, samples], sample rate), within the
    policy's bounds (``api.reference_decode``), once a decode turn is free; 400 otherwise."""
    with policy.decode_turns:
        try:
            return decode_reference(data, policy.bounds)
        except ReferenceDecodeTooLong as exc:
            raise bad_request(f"Reference audio too long ({exc}). At most {policy.max_seconds:g} s is "
                              f"supported; use a shorter clip.", param=param, limit="api.max_ref_seconds") from None
        except ReferenceOutOfBounds as exc:
            raise bad_request(f"Reference audio refused: {exc}", param=param, limit=exc.limit) from None
        except PyAvMissing:
            raise bad_request("Reference audio could not be decoded; this server reads WAV, FLAC and "
                              "OGG/Vorbis clips only (PyAV is not installed)", param=param) from None
        except ReferenceDecodeError as exc:
            raise bad_request(f"Reference audio could not be decoded ({exc}); send WAV, FLAC, MP3, "
                              f"OGG/Opus, AAC/M4A or WebM audio", param=param) from None
