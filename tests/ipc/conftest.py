"""Fixtures for the ipc tests: a private instance id whose segments must all be gone at the end."""

from __future__ import annotations

import pytest

from ipc.shm import list_segments, new_instance_id


@pytest.fixture
def instance():
    """A fresh instance id; the test fails if any of its /dev/shm segments outlive it."""
    inst = new_instance_id()
    yield inst
    assert list_segments(inst) == [], f"leaked segments of instance {inst}"
