"""Shared-memory segment naming and lifecycle.

Segment names are ``mvx-{instance}-{pid}-{name}``: ``instance`` is a random id per server
(``new_instance_id()``) and ``pid`` the owner's, so two servers on one host never collide and an
orphaned segment names the process that should have removed it (``sweep_orphans``).

Python's ``resource_tracker`` is kept away from these segments. On 3.11 an attaching
``SharedMemory(create=False)`` registers the segment too, and the tracker of the attaching
process then unlinks it (or warns about a "leak") when that process exits, while the owner still
uses it (CPython gh-82300, bpo-38119). Spawned children also share their parent's tracker, whose
registry is a set, so a child's unregister would drop the owner's entry. Every segment made or
opened here is therefore untracked (``track=False`` on 3.13+, an immediate ``unregister`` before),
and the ipc layer unlinks its own segments: the owner on close, the opener right after attaching.
"""

from __future__ import annotations

import inspect
import os
import secrets
from multiprocessing import resource_tracker
from multiprocessing.shared_memory import SharedMemory

SEGMENT_PREFIX = "mvx-"
SHM_DIR = "/dev/shm"  # where Linux shows POSIX shared memory; used only for listing

_HAS_TRACK_ARG = "track" in inspect.signature(SharedMemory.__init__).parameters


def new_instance_id() -> str:
    """A fresh random id for one server instance (8 hex digits)."""
    return secrets.token_hex(4)


def segment_name(instance: str, name: str, pid: int | None = None) -> str:
    """The segment name for ``name`` owned by ``pid`` (default: this process) in ``instance``."""
    if not name or "/" in name:
        raise ValueError(f"bad segment name {name!r}")
    return f"{SEGMENT_PREFIX}{instance}-{os.getpid() if pid is None else pid}-{name}"


def create_segment(name: str, size: int) -> SharedMemory:
    """Create a new, untracked segment of ``size`` bytes; ``FileExistsError`` if it exists."""
    if _HAS_TRACK_ARG:
        return SharedMemory(name=name, create=True, size=size, track=False)
    shm = SharedMemory(name=name, create=True, size=size)
    resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 (see module doc)
    return shm


def attach_segment(name: str) -> SharedMemory:
    """Map an existing segment without registering it with the resource tracker."""
    if _HAS_TRACK_ARG:
        return SharedMemory(name=name, create=False, track=False)
    shm = SharedMemory(name=name, create=False)
    resource_tracker.unregister(shm._name, "shared_memory")  # noqa: SLF001 (see module doc)
    return shm


def unlink_segment(name: str) -> bool:
    """Remove a segment's name (mappings stay valid). False if it was already gone."""
    import _posixshmem  # the module SharedMemory.unlink uses, minus its tracker call

    try:
        _posixshmem.shm_unlink("/" + name)
    except FileNotFoundError:
        return False
    return True


def list_segments(instance: str | None = None) -> list[str]:
    """Names of the mossvox segments on this host (of one instance if given). Linux only."""
    prefix = SEGMENT_PREFIX + (f"{instance}-" if instance else "")
    try:
        return sorted(n for n in os.listdir(SHM_DIR) if n.startswith(prefix))
    except FileNotFoundError:
        return []


def sweep_orphans(instance: str | None = None) -> list[str]:
    """Unlink segments whose owner process no longer exists; returns the names removed.

    Only needed when both ends of a channel were killed before the opener attached; a launcher
    may call it at start-up. Segments of live owners are never touched.
    """
    removed = []
    for name in list_segments(instance):
        parts = name[len(SEGMENT_PREFIX):].split("-", 2)
        if len(parts) != 3 or not parts[1].isdigit():
            continue
        if not pid_exists(int(parts[1])) and unlink_segment(name):
            removed.append(name)
    return removed


def pid_exists(pid: int) -> bool:
    """Whether process `pid` is alive (one we may not signal counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
