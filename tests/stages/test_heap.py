"""A warm worker's heap: frozen out of garbage collection, and every collection timed."""

import gc
import logging

import pytest

from stages.workers.heap import GcPauses, freeze_heap, thaw_heap


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()  # the test process's heap goes back to the collector


class Node:
    def __init__(self) -> None:
        self.me = self  # a cycle: only the collector frees it


def test_freeze_heap_takes_what_lives_out_of_collection_and_garbage_made_later_is_still_freed(unfrozen):
    kept = [Node() for _ in range(1000)]
    frozen = freeze_heap()
    # Frozen objects still die by reference count (other threads of this process drop some),
    # so the count can only have fallen since the freeze.
    assert 1000 <= gc.get_freeze_count() <= frozen
    walked = {id(o) for o in gc.get_objects()}  # what a collection walks
    assert not any(id(n) in walked for n in kept)
    Node()  # garbage made while serving
    assert gc.collect() >= 1  # still collected


def test_thaw_heap_gives_the_frozen_objects_back_to_the_collector(unfrozen):
    """At a stop: a frozen cycle is freed by the next collection (at exit, the interpreter's own)."""
    freeze_heap()
    Node()  # made and dropped after the freeze: collectable as ever
    frozen = Node()
    gc.collect()
    freeze_heap()
    ident = id(frozen)
    del frozen  # only the collector can free it, and it is frozen
    assert ident not in {id(o) for o in gc.get_objects()}
    thaw_heap()
    assert gc.get_freeze_count() == 0
    assert ident in {id(o) for o in gc.get_objects()}  # back where a collection walks
    assert gc.collect() >= 1


def test_gc_pauses_times_every_collection_and_logs_a_long_one(caplog):
    pauses = GcPauses("talker", log_over_s=0.0)  # every collection is "long" here
    try:
        Node()
        with caplog.at_level(logging.WARNING, logger="stages.workers.heap"):
            gc.collect()
        assert pauses.collections >= 1 and pauses.seconds > 0
        line = caplog.records[-1].getMessage()
        assert line.startswith("talker: a garbage collection (generation 2,") and "objects freed" in line
    finally:
        pauses.close()
    counted = pauses.collections
    gc.collect()
    assert pauses.collections == counted  # closed: no longer called
