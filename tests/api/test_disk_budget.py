"""The reference cache's directories kept under one size, shared by every writer."""

from __future__ import annotations

import os
import time

from api.disk_budget import LOW_WATER, DiskBudget, disk_bytes, touch

KB = 1024


def write(directory, name: str, size: int, age_s: float = 0.0):
    path = directory / name[:2] / name
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(b"x" * size)
    if age_s:
        then = time.time() - age_s
        os.utime(path, (then, then))
    return path


def total(*directories) -> int:
    return sum(disk_bytes(os.path.join(folder, name)) for d in directories for folder, _, names in os.walk(d)
               for name in names)


def settle(budget: DiskBudget) -> None:
    """Wait for an eviction this process started."""
    budget._evicting.acquire()
    budget._evicting.release()


def test_past_the_limit_the_files_used_longest_ago_go_first(tmp_path):
    codes, clips = tmp_path / "ref_codes", tmp_path / "ref_clips"
    evicted = []
    budget = DiskBudget(tmp_path, (codes, clips), 400 * KB, on_evicted=evicted.append)
    paths = []
    for i in range(10):  # 10 x (32 + 4) KB, within the limit, each a second younger than the one before
        paths.append(write(codes, f"c{i:02d}", 32 * KB, age_s=100 - i))
        budget.added(paths[-1])
        paths.append(write(clips, f"k{i:02d}", 4 * KB, age_s=100 - i))
        budget.added(paths[-1])
    touch(paths[0])  # the oldest, read again just now: kept
    paths.append(write(codes, "c99", 64 * KB))
    budget.added(paths[-1])
    settle(budget)
    assert total(codes, clips) <= 400 * KB * LOW_WATER and sum(evicted) > 0
    assert paths[0].exists() and paths[-1].exists()
    assert not paths[1].exists() and not paths[2].exists()  # the next oldest
    assert budget.used() == total(codes, clips)


def test_writers_share_one_count(tmp_path):
    """Two API processes' budgets on one directory: each counts what the other wrote."""
    codes = tmp_path / "ref_codes"
    first, second = (DiskBudget(tmp_path, (codes,), 256 * KB) for _ in range(2))
    for i in range(10):
        budget = first if i % 2 else second
        budget.added(write(codes, f"s{i:02d}", 32 * KB, age_s=50 - i))
    settle(first)
    settle(second)
    assert total(codes) <= 256 * KB
    # one count for both; never below what is there (a file counted by a scan and by its writer
    # is counted twice until the next eviction counts afresh)
    assert first.used() == second.used() >= total(codes)


def test_a_lost_count_is_rebuilt_from_the_directories(tmp_path):
    codes = tmp_path / "ref_codes"
    for i in range(4):
        write(codes, f"r{i}", 8 * KB)
    (tmp_path / ".cache_usage").write_text("not a number")
    budget = DiskBudget(tmp_path, (codes,), 1 << 20)
    assert budget.used() == total(codes) > 0
