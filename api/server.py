"""``mossvox serve``: the engine, then N API processes on one port.

The supervisor (this process) resolves the model (the embedded tiny random-weight demo model when
none is given), logs the resolved profile and its hash, binds the listening socket, launches the
engine (coordinator + talker + codec workers), and spawns ``api.api_servers`` API processes. Each
API process gets the shared socket (the kernel spreads connections over the processes that
accept on it) and its own ``EngineClient`` spec (its own PCM ring). An API process that dies is
replaced in its slot (new engine channels, a new PCM ring from every codec: the other API processes
and the workers serve on; connections waiting on the shared socket are taken by the new process),
within ``engine.restart_limit`` per slot in ``engine.restart_window_s``; past that the server stops
with exit status 1. On SIGINT/SIGTERM everything is stopped: API processes first, then the engine.
At start, the metrics folders of servers that were killed before they could remove them are
removed (their owner's pid is in the name, as in shared-memory segment names).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import hashlib
import logging
import multiprocessing as mp
import os
import shutil
import signal
import socket
import sys
import tempfile
import time
from pathlib import Path

from ipc.shm import pid_exists

log = logging.getLogger("mossvox.server")

STOP_TIMEOUT_S = 10.0
METRICS_DIR_PREFIX = "mossvox-metrics-"  # + the supervisor's pid + "-" + a random part


def graceful_s(profile) -> float:
    """How long an API process lets open responses finish after SIGTERM: the drain budget
    (`engine.drain_timeout_s`) with `engine.shutdown: drain`, else 5 s."""
    return profile.engine.drain_timeout_s if profile.engine.shutdown == "drain" else 5.0


def setup_logging(level: str) -> None:
    """Every mossvox process's log: one format on stderr, query values masked (no key in a URL
    reaches a line: ``api.log_redaction``)."""
    from api.log_redaction import redact_handlers

    logging.basicConfig(level=level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(process)d %(name)s %(levelname)s: %(message)s")
    redact_handlers()


def codec_fingerprint(model_dir: Path, codec_path: str | None) -> str:
    """What else the cached reference codes depend on: both configs and the weight files' sizes."""
    digest = hashlib.sha256()
    for folder in (model_dir, Path(codec_path).expanduser() if codec_path else model_dir / "audio_tokenizer"):
        for path in sorted(folder.glob("*.json")) + sorted(folder.glob("*.safetensors")):
            digest.update(path.name.encode())
            digest.update(path.read_bytes() if path.suffix == ".json" else str(path.stat().st_size).encode())
    return digest.hexdigest()[:16]


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.set_inheritable(True)
    return sock


def serve(profile, model_dir: str | None) -> int:
    """Run the server until a signal or an API-process death; returns the exit status."""
    setup_logging(profile.engine.log_level)
    from stages.tools.demo_model import resolve_checkpoint

    resolved, profile = resolve_checkpoint(profile, model_dir)
    resolved = resolved.resolve()
    log.info("serving model %s", resolved)
    if not (model_dir or profile.model.path):
        log.warning("no model given: serving the embedded tiny demo model; its weights are RANDOM "
                    "(noise-like audio, length forced from the text)")
    log.info("resolved profile (sha256 %s):\n%s", profile.sha256(), profile.redacted().to_yaml())
    sweep_metrics_dirs(Path(tempfile.gettempdir()))
    metrics_dir = Path(tempfile.mkdtemp(prefix=f"{METRICS_DIR_PREFIX}{os.getpid()}-"))
    # prometheus-client's multiprocess mode is switched by this variable (read when the library
    # is imported, in each spawned API process); it is the library's mechanism, not a setting.
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = str(metrics_dir)
    sock = bind_socket(profile.api.host, profile.api.port)
    stop = _StopSignal()
    try:
        import uvloop

        return uvloop.run(_serve(profile, resolved, sock, stop))
    finally:
        stop.restore()
        sock.close()
        shutil.rmtree(metrics_dir, ignore_errors=True)
        log.info("stopped")


def sweep_metrics_dirs(folder: Path) -> list[Path]:
    """Remove the metrics folders in ``folder`` whose server process is gone; returns them."""
    removed = []
    for path in folder.glob(f"{METRICS_DIR_PREFIX}*"):
        pid = path.name[len(METRICS_DIR_PREFIX):].split("-", 1)[0]
        if path.is_dir() and pid.isdigit() and not pid_exists(int(pid)):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(path)
    if removed:
        log.info("removed %d metrics folder(s) of servers that are gone", len(removed))
    return removed
    return True


async def _serve(profile, model_dir: Path, sock: socket.socket, stop: "_StopSignal") -> int:
    """The coordinator runs on this loop; the API processes are spawned beside it."""
    from engine.launcher import launch
    from stages.workers.heap import GcPauses, freeze_heap, thaw_heap

    api = profile.api
    host, port = sock.getsockname()[:2]
    engine = await launch(profile, model_dir, clients=api.api_servers)
    freeze_heap()  # the coordinator's warm heap: out of the collector's walks (stages.workers.heap)
    pauses = GcPauses("coordinator")
    apis = _ApiProcesses(profile, engine, sock, codec_fingerprint(model_dir, profile.model.codec_path))
    try:
        for index in range(api.api_servers):
            apis.start(index, engine.client_spec(index))
        print(f"mossvox: serving on http://{host}:{port} with {api.api_servers} API process(es)",
              flush=True)
        return await apis.supervise(stop)
    finally:
        pauses.close()
        thaw_heap()
        await apis.close()
        await asyncio.to_thread(_stop_processes, list(apis.procs.values()),
                                graceful_s(profile) + STOP_TIMEOUT_S)
        await engine.stop()


class _ApiProcesses:
    """The API processes, one per client slot: started, watched (their sentinels, on the loop:
    no polling) and replaced when one dies."""

    def __init__(self, profile, engine, sock: socket.socket, codec_id: str) -> None:
        from engine.restarts import RestartPolicy

        self.profile, self.engine, self.sock, self.codec_id = profile, engine, sock, codec_id
        self.procs: dict[int, mp.process.BaseProcess] = {}
        self.policy = RestartPolicy.from_profile(profile.engine)
        self._ctx = mp.get_context("spawn")
        self._done: asyncio.Future[int] | None = None
        self._replacing: dict[int, asyncio.Task] = {}

    def start(self, index: int, spec) -> None:
        proc = self._ctx.Process(target=api_process_main, name=f"mossvox-api-{index}",
                                 args=(self.profile, spec, self.sock, self.codec_id, os.getpid()))
        proc.start()
        self.procs[index] = proc
        if self._done is not None:
            asyncio.get_running_loop().add_reader(proc.sentinel, self._on_exit, index, proc)

    async def supervise(self, stop: "_StopSignal") -> int:
        """Until a stop signal (0), or an API process that may not be replaced any more (1)."""
        loop = asyncio.get_running_loop()
        self._done = loop.create_future()

        def on_signal() -> None:
            log.info("signal %s: shutting down", stop.received())
            self._finish(0)

        loop.add_reader(stop.fd, on_signal)
        for index, proc in self.procs.items():
            loop.add_reader(proc.sentinel, self._on_exit, index, proc)
        try:
            return await self._done
        finally:
            loop.remove_reader(stop.fd)
            for proc in self.procs.values():
                loop.remove_reader(proc.sentinel)

    def _finish(self, status: int) -> None:
        if self._done is not None and not self._done.done():
            self._done.set_result(status)

    def _on_exit(self, index: int, proc) -> None:
        asyncio.get_running_loop().remove_reader(proc.sentinel)
        if self._done is None or self._done.done():
            return
        proc.join(0)
        _mark_metrics_dead(proc.pid)
        delay = self.policy.next_delay(index)
        if delay is None:
            log.error("API process %s exited with %s and was replaced %d times within %.0f s "
                      "(engine.restart_limit): shutting down", proc.name, proc.exitcode,
                      self.policy.limit, self.policy.window_s)
            self._finish(1)
            return
        log.error("API process %s (pid %d) exited with %s: replacing it", proc.name, proc.pid, proc.exitcode)
        self._replacing[index] = asyncio.get_running_loop().create_task(self._replace(index, time.monotonic()))

    async def _replace(self, index: int, t0: float) -> None:
        try:
            spec = await self.engine.replace_client(index)
            if self._done is None or self._done.done():
                return
            self.start(index, spec)
            log.info("API process slot %d replaced by pid %d %.2f s after the old one died",
                     index, self.procs[index].pid, time.monotonic() - t0)
        except Exception:
            log.exception("API process slot %d could not be replaced: shutting down", index)
            self._finish(1)
        finally:
            self._replacing.pop(index, None)

    async def close(self) -> None:
        for task in list(self._replacing.values()):
            task.cancel()
        await asyncio.gather(*self._replacing.values(), return_exceptions=True)


def _mark_metrics_dead(pid: int) -> None:
    """A dead API process's live gauges leave the multiprocess metrics (its counters stay)."""
    with contextlib.suppress(Exception):
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)


def _stop_processes(procs: list, timeout_s: float = STOP_TIMEOUT_S) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()  # uvicorn shuts down gracefully on SIGTERM
    for proc in procs:
        proc.join(timeout_s)
        if proc.is_alive():
            log.warning("API process %s did not stop in %.0f s; killing it", proc.name, timeout_s)
            proc.kill()
            proc.join()


class _StopSignal:
    """SIGINT/SIGTERM written to a pipe the supervisor waits on (handlers only record)."""

    def __init__(self) -> None:
        self._read, self._write = os.pipe()
        os.set_blocking(self._write, False)
        self.fd = self._read
        self._previous = {sig: signal.signal(sig, self._handle) for sig in (signal.SIGINT, signal.SIGTERM)}

    def _handle(self, signum, frame) -> None:
        with contextlib.suppress(BlockingIOError):
            os.write(self._write, bytes([signum]))

    def received(self) -> str:
        data = os.read(self._read, 16)
        return ",".join(signal.Signals(b).name for b in data)

    def restore(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        os.close(self._read)
        os.close(self._write)


def _die_with_parent() -> None:
    """Linux: SIGTERM this process when the supervisor dies (no orphaned API processes)."""
    with contextlib.suppress(OSError, AttributeError):
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def api_process_main(profile, spec, sock: socket.socket, codec_id: str, parent_pid: int) -> None:
    """One API process: uvicorn (uvloop) serving the app on the shared socket."""
    _die_with_parent()
    if os.getppid() != parent_pid:  # the supervisor died before we armed the signal
        return
    setup_logging(profile.engine.log_level)
    import uvicorn

    from api.app import create_app
    from api.connection_limits import ConnectionGate, gated_protocols
    from api.log_redaction import redact_handlers
    from engine.client import EngineClient
    from stages.workers.heap import GcPauses, freeze_heap, thaw_heap

    @contextlib.asynccontextmanager
    async def connect():
        client = EngineClient.connect(spec)
        freeze_heap()  # this process's heap once it is up: out of the collector's walks
        pauses = GcPauses(f"api[{os.getpid()}]")
        try:
            yield client
        finally:
            pauses.close()
            thaw_heap()
            await client.close()

    gate = ConnectionGate.for_process(profile.api)  # open connections, counted from the first byte
    app = create_app(profile, connect, codec_id=codec_id, connections=gate)
    config = uvicorn.Config(app, loop="uvloop", lifespan="on", access_log=False,
                            **gated_protocols(profile.api, gate),  # and the request-header timeout
                            # a WebSocket message is bounded like a request body (close 1009)
                            ws_max_size=profile.api.max_body_bytes,
                            log_level=profile.engine.log_level,
                            timeout_graceful_shutdown=graceful_s(profile))
    for name in ("uvicorn", "uvicorn.access"):  # its own handlers (set up by Config): no query values
        redact_handlers(logging.getLogger(name))
    uvicorn.Server(config).run(sockets=[sock])
