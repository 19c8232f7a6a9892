"""Process bodies for the cross-process ipc tests (module-level so ``spawn`` can import them)."""

from __future__ import annotations

import multiprocessing as mp
import time
import zlib

import numpy as np

from ipc import EndOfStream, IpcError, PeerGone, WouldBlock
from ipc.ring import record_footprint
from ipc_kinds import KINDS

SPAWN = mp.get_context("spawn")
POOL_BYTES = 1 << 20


def stress_sizes(n: int, seed: int, max_size: int) -> np.ndarray:
    """Random record sizes: mostly small, a heavy tail up to ``max_size`` and some zeros."""
    rng = np.random.default_rng(seed)
    sizes = (rng.pareto(1.2, n) * 300).astype(np.int64)
    sizes[rng.random(n) < 0.05] = 0
    return np.minimum(sizes, max_size) & ~3  # room for nothing else: 4 bytes are the checksum


def _pool(seed: int) -> bytes:
    return np.random.default_rng(seed + 1).bytes(POOL_BYTES)


def stress_writer(spec, kind_name: str, n: int, seed: int) -> None:
    """Send ``n`` records ``crc32(body) | body`` of random sizes and random content, then close."""
    kind = KINDS[kind_name]
    end = spec.open()
    sizes = stress_sizes(n, seed, min(kind.max_data(end, 2**40), POOL_BYTES) - 4)
    pool = _pool(seed)
    offsets = np.random.default_rng(seed + 2).integers(0, POOL_BYTES - sizes.max() - 1, n)
    for seq in range(n):
        body = pool[offsets[seq]:offsets[seq] + sizes[seq]]
        kind.send(end, seq, zlib.crc32(body).to_bytes(4, "little") + body, timeout=30)
    end.close()


def stress_reader_owner(kind_name: str, n: int, seed: int, capacity: int, instance: str,
                        report) -> None:
    """Own a ring as its reader, spawn the writer, check every record, report the totals."""
    kind = KINDS[kind_name]
    end = kind.create("stress", capacity, "reader", instance)
    writer = SPAWN.Process(target=stress_writer, args=(end.spec(), kind_name, n, seed))
    writer.start()
    sizes = stress_sizes(n, seed, min(kind.max_data(end, 2**40), POOL_BYTES) - 4)
    t0 = time.monotonic()
    count = footprint = 0
    error = None
    try:
        while True:
            try:
                seq, data = kind.recv(end, timeout=30)
            except EndOfStream:
                break
            if seq != count or len(data) != sizes[count] + 4:
                raise AssertionError(f"record {count}: got seq {seq}, {len(data)} bytes")
            if zlib.crc32(data[4:]) != int.from_bytes(data[:4], "little"):
                raise AssertionError(f"record {count}: checksum mismatch")
            footprint += record_footprint(len(data) + 16)
            count += 1
    except Exception as exc:  # reported, not raised: the test asserts on it
        error = repr(exc)
    seconds = time.monotonic() - t0
    writer.join(30)
    end.close()
    report.send({"count": count, "wraps": footprint // capacity, "seconds": seconds,
                 "error": error, "writer_exit": writer.exitcode})


def write_then_hang(spec, kind_name: str, k: int) -> None:
    """Send ``k`` records, then sleep until killed."""
    end = spec.open()
    for seq in range(k):
        KINDS[kind_name].send(end, seq, b"x" * seq, timeout=10)
    time.sleep(600)


def open_then_hang(spec, ready) -> None:
    """Open (as whichever end) and sleep until killed, never reading."""
    end = spec.open()
    ready.send("open")
    time.sleep(600)
    end.close()


def blocked_opener(spec, kind_name: str, role: str, k: int, report) -> None:
    """Open; as reader take ``k`` records then block on an empty ring; as writer fill the ring
    and block on it. Report how and when (CLOCK_MONOTONIC, shared by all processes) it ended."""
    kind = KINDS[kind_name]
    end = spec.open()
    try:
        if role == "reader":
            for seq in range(k):
                assert kind.recv(end, timeout=10) == (seq, b"x" * seq)
            report.send(("blocking", time.monotonic()))
            kind.recv(end, timeout=30)
        else:
            seq = 0
            try:
                while True:
                    kind.send(end, seq, b"y" * 100, block=False)
                    seq += 1
            except WouldBlock:
                pass
            report.send(("blocking", time.monotonic()))
            kind.send(end, seq, b"y" * 100, timeout=30)
        report.send(("returned", time.monotonic()))
    except PeerGone:
        report.send(("PeerGone", time.monotonic()))
    except IpcError as exc:
        report.send((type(exc).__name__, time.monotonic()))
    end.close()


def owner_then_hang(kind_name: str, role: str, k: int, instance: str, report) -> None:
    """Own a channel with ``role``, spawn ``blocked_opener`` on it, (as writer) send ``k``
    records, then sleep until killed. The opener reports straight to the test."""
    kind = KINDS[kind_name]
    end = kind.create("owner", 4096, role, instance)
    opener_role = "reader" if role == "writer" else "writer"
    opener = SPAWN.Process(target=blocked_opener,
                           args=(end.spec(), kind_name, opener_role, k, report))
    opener.start()
    if role == "writer":
        for seq in range(k):
            kind.send(end, seq, b"x" * seq, timeout=10)
    time.sleep(600)


def echo(inbox_spec, outbox_spec, n: int) -> None:
    """Receive ``n`` records and send each straight back (the other side sleeps every time)."""
    inbox, outbox = inbox_spec.open(), outbox_spec.open()
    for _ in range(n):
        view = inbox.recv(10)
        outbox.send(view)
        inbox.release()
    inbox.close()
    outbox.close()


def tiny_ring_writer(spec, n: int, seed: int) -> None:
    """Send ``n`` records of random size up to the max through a tiny ring: the writer waits
    for room on almost every record, and the reader sleeps on almost every one."""
    ring = spec.open()
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, ring.max_record_size + 1, n)
    for seq in range(n):
        if seq % 97 == 0:
            time.sleep(0.0005)  # let the reader fall asleep now and then
        ring.send(int(seq).to_bytes(8, "little") * (int(sizes[seq]) // 8), timeout=10)
    ring.close()


def ring_bell(bell, times: int) -> None:
    """Ring a doorbell received through spawn ``times`` times."""
    for _ in range(times):
        bell.ring()
    bell.close()
