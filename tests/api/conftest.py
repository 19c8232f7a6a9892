"""Fixtures shared by the API tests that run a real server process."""

from __future__ import annotations

import httpx
import pytest


@pytest.fixture(scope="module")
def http(server):
    """An HTTP client of the test module's own `server` fixture, kept for the module (a module
    whose server needs a key overrides it with the key's header)."""
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client
