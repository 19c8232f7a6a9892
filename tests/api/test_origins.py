"""Which origins are the server's own: the host and port its ``Host`` header names."""

from __future__ import annotations

import pytest

from api.origins import same_origin


@pytest.mark.parametrize("origin,host,same", [
    ("http://127.0.0.1:8000", "127.0.0.1:8000", True),
    ("http://localhost:8000", "LOCALHOST:8000".lower(), True),
    ("https://tts.example.com", "tts.example.com", True),  # behind a TLS proxy that keeps Host
    ("http://tts.example.com", "tts.example.com", True),
    ("http://127.0.0.1:8001", "127.0.0.1:8000", False),
    ("http://evil.example", "127.0.0.1:8000", False),
    ("http://tts.example.com:8080", "tts.example.com", False),
    ("http://tts.example.com.evil.example", "tts.example.com", False),
    ("http://[::1]:8000", "[::1]:8000", True),
    ("null", "127.0.0.1:8000", False),
    ("http://127.0.0.1:8000", "", False),
    ("http://127.0.0.1:99999", "127.0.0.1:8000", False),
])
def test_same_origin(origin, host, same):
    assert same_origin(origin, host) is same
