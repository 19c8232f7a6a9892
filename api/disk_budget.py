"""The reference cache's files on disk, kept under one size for all API processes.

Every new clip adds a reference-code file (``ref_codes/``) and an index entry (``ref_clips/``)
under ``api.data_dir``; without a bound a client sending new clips fills the disk.
:class:`DiskBudget` counts what those directories hold (bytes on disk, in ``<data_dir>/.cache_usage``,
updated under an exclusive ``flock`` of ``<data_dir>/.cache_usage.lock`` by whichever API process
writes) and, once a write takes them past ``api.ref_cache_max_bytes``, removes the files used
longest ago (by modification time: a read from disk renews it, ``touch``) until they hold
``LOW_WATER`` of the limit. The eviction runs in a thread of its own, off the event loop. A reader
holding a file open keeps reading it after it is removed; a later lookup misses and encodes the
clip again. When the count is missing or unreadable it is rebuilt by scanning the directories.
Across hosts sharing the directory over a network file system the lock holds only where the file
system supports ``flock``; the bound is then per host.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path

log = logging.getLogger("mossvox.api")

LOW_WATER = 0.9  # an eviction frees the directories down to this share of the limit


def disk_bytes(path: Path | str) -> int:
    """What a file takes on disk (its blocks; at least its size)."""
    info = os.stat(path)
    return max(info.st_size, getattr(info, "st_blocks", 0) * 512)


def touch(path: Path | str) -> None:
    """Mark a file as used now (its modification time), if it is still there."""
    with contextlib.suppress(OSError):
        os.utime(path)


class DiskBudget:
    """``added(path)`` after each new file under ``directories``; see the module docstring."""

    def __init__(self, root: Path | str, directories: tuple[Path | str, ...], max_bytes: int,
                 on_evicted: Callable[[int], None] = lambda files: None) -> None:
        self.root = Path(root)
        self.directories = tuple(Path(d) for d in directories)
        self.max_bytes = max_bytes
        self._on_evicted = on_evicted
        self._usage = self.root / ".cache_usage"
        self._lock = self.root / ".cache_usage.lock"
        self._evicting = threading.Lock()  # one eviction thread at a time in this process

    def added(self, path: Path | str) -> None:
        """Count a file just written; past the limit, start an eviction (never raises: the cache
        works on without its bound rather than fail a request)."""
        try:
            size = disk_bytes(path)
            with self._locked():
                used = self._read_usage()
                used = self._scan()[0] if used is None else used + size
                self._write_usage(used)
        except OSError as exc:
            log.warning("reference cache size not counted (%s)", exc)
            return
        if used > self.max_bytes and self._evicting.acquire(blocking=False):
            threading.Thread(target=self._evict_then_release, name="ref-cache-eviction", daemon=True).start()

    def used(self) -> int:
        """Bytes the directories hold, as counted (scanned when there is no count yet)."""
        with self._locked():
            used = self._read_usage()
            if used is None:
                used = self._scan()[0]
                self._write_usage(used)
            return used

    def evict(self) -> int:
        """Remove the files used longest ago until the directories hold at most ``LOW_WATER`` of
        the limit (counted afresh by a scan); returns how many were removed."""
        with self._locked():
            total, files = self._scan()
            removed = 0
            target = int(self.max_bytes * LOW_WATER)
            if total > self.max_bytes:
                for _, size, path in sorted(files):
                    if total <= target:
                        break
                    with contextlib.suppress(FileNotFoundError):
                        os.unlink(path)
                        total -= size
                        removed += 1
            self._write_usage(total)
        if removed:
            log.info("reference cache: %d files removed to stay within api.ref_cache_max_bytes", removed)
            self._on_evicted(removed)
        return removed

    def _evict_then_release(self) -> None:
        try:
            self.evict()
        except OSError as exc:
            log.warning("reference cache eviction failed (%s)", exc)
        finally:
            self._evicting.release()

    def _scan(self) -> tuple[int, list[tuple[float, int, str]]]:
        """Every file under the directories as (modified, bytes on disk, path), and their total;
        temporary files being written are left alone but counted."""
        files, total = [], 0
        for directory in self.directories:
            for folder, _, names in os.walk(directory):
                for name in names:
                    path = os.path.join(folder, name)
                    try:
                        info = os.stat(path)
                    except FileNotFoundError:
                        continue
                    size = max(info.st_size, getattr(info, "st_blocks", 0) * 512)
                    total += size
                    if not name.startswith(".") or time.time() - info.st_mtime > 3600:
                        files.append((info.st_mtime, size, path))  # an hour-old temporary file is litter
        return total, files

    @contextlib.contextmanager
    def _locked(self):
        self.root.mkdir(parents=True, exist_ok=True)
        fd = os.open(self._lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    def _read_usage(self) -> int | None:
        try:
            return int(self._usage.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def _write_usage(self, used: int) -> None:
        tmp = self._usage.with_name(f".cache_usage.{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(str(max(0, used)))
        os.replace(tmp, self._usage)
