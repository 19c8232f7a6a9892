"""Benchmarks (not timed tests): ipc, models, engine, and closed-loop clients of a running server."""
