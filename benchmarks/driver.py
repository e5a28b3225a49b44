"""Runs configurations: a fresh server process and a fresh client process
per run, implementations in rotating order round by round.

Round r runs the implementations rotated by r (ABC, BCA, CAB, ...), so each
one runs next to each other one and in every position: a drift of the
machine over time (thermal, a noisy neighbour) spreads over all of them
instead of landing on one.

A Python server gets a listening socket the driver has already bound to
127.0.0.1:0 (inherited fd), so the client can start at the same time; an
external server (``openssl s_server``) binds itself and the driver reads the
port from its output.  Each run is bounded by ``timeout`` seconds (``--set
dur=``); a run that exceeds it is killed and reported failed.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import select
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import IO, Any

from .core import HEAP_ENV, HEAP_STATES, Files, Impl, Params, Scenario

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXIT_UNAVAILABLE = 3  # worker.EXIT_UNAVAILABLE (not imported: keeps it light)


@dataclasses.dataclass
class RunResult:
    scenario: str
    params: Params
    impl: str
    run: int
    status: str  # "ok", "failed" or "unavailable"
    metrics: dict[str, float]
    error: str = ""
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return self.status == "ok"


@dataclasses.dataclass
class _Server:
    proc: subprocess.Popen[bytes]
    port: int
    log: IO[bytes]

    def stop(self, grace: float = 3.0) -> str:
        """Wait for the server to exit on its own, else end it; returns its
        error output if it failed."""
        try:
            self.proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=2)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            return ""
        if self.proc.returncode not in (0, None):
            return _tail(self.log)
        return ""


def _tail(f: IO[bytes], limit: int = 1500) -> str:
    f.seek(0)
    text = f.read().decode(errors="replace").strip()
    return text[-limit:]


def _last_line(text: str) -> str:
    lines = [line for line in text.splitlines() if line.strip()]
    return lines[-1].strip() if lines else text


class Driver:
    def __init__(
        self, files: Files, timeout: float, on_run: Callable[[RunResult], None],
        heap: str = "settled",
    ) -> None:
        self.files = files
        self.timeout = timeout
        self.on_run = on_run
        self.env = dict(os.environ)
        self.env["PYTHONPATH"] = ROOT + os.pathsep + self.env.get("PYTHONPATH", "")
        # Workers must not be slowed by debugging aids the parent may have on,
        # nor run with malloc tuning other than the --heap state asked for.
        for key in ("PYTHONTRACEMALLOC", "PYTHONDEVMODE", "PYTHONASYNCIODEBUG",
                    "PYTHONMALLOC", *[k for k in self.env if k.startswith("MALLOC_")]):
            self.env.pop(key, None)
        if heap not in HEAP_STATES:
            raise ValueError(f"heap must be one of {HEAP_STATES}, got {heap!r}")
        self.env[HEAP_ENV] = heap
        if heap == "pinned":
            # Setting the threshold turns glibc's dynamic adjustment off.
            self.env["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)

    # ------------------------------------------------------------ plan ----

    @staticmethod
    def order(impls: list[Impl], rnd: int) -> list[Impl]:
        k = rnd % len(impls) if impls else 0
        return impls[k:] + impls[:k]

    def run_config(self, scenario: Scenario, params: Params, impls: list[Impl], runs: int) -> list[RunResult]:
        results: list[RunResult] = []
        for rnd in range(runs):
            for impl in self.order(impls, rnd):
                result = self.run_once(scenario, params, impl, rnd)
                results.append(result)
                self.on_run(result)
        return results

    # ------------------------------------------------------------- run ----

    def _spec(self, role: str, scenario: Scenario, params: Params, **extra: Any) -> str:
        return json.dumps({"role": role, "scenario": scenario.name, "params": params,
                           "files": self.files.to_json(), **extra})

    def _worker_argv(self, spec: str) -> list[str]:
        return [sys.executable, "-m", "benchmarks.worker", spec]

    def _start_server(self, scenario: Scenario, params: Params) -> _Server:
        log = tempfile.TemporaryFile()
        external = scenario.external_server(params, self.files) if scenario.external_server else None
        if external is not None:
            # Unbuffered: select() must see every line that is not read yet.
            proc = subprocess.Popen(external.argv, cwd=external.cwd, stdout=subprocess.PIPE,
                                    stderr=log, stdin=subprocess.DEVNULL, bufsize=0)
            port = self._read_port(proc, external.port_pattern)
            return _Server(proc, port, log)
        listener = socket.create_server(("127.0.0.1", 0), backlog=4096)
        try:
            fd = listener.fileno()
            spec = self._spec("server", scenario, params, fd=fd)
            proc = subprocess.Popen(self._worker_argv(spec), cwd=ROOT, env=self.env, pass_fds=[fd],
                                    stdout=subprocess.DEVNULL, stderr=log, stdin=subprocess.DEVNULL)
            return _Server(proc, listener.getsockname()[1], log)
        finally:
            listener.close()

    @staticmethod
    def _read_port(proc: subprocess.Popen[bytes], pattern: str, timeout: float = 10.0) -> int:
        assert proc.stdout is not None
        deadline = time.monotonic() + timeout
        seen = b""
        while time.monotonic() < deadline:
            ready, _, _ = select.select([proc.stdout], [], [], 0.1)
            if ready:
                line = proc.stdout.readline()
                if not line and proc.poll() is not None:
                    break
                seen += line
                m = re.search(pattern, line.decode(errors="replace"))
                if m:
                    return int(m.group(1))
        proc.kill()
        raise RuntimeError(f"external server printed no port: {seen.decode(errors='replace')[-300:]!r}")

    def run_once(self, scenario: Scenario, params: Params, impl: Impl, rnd: int) -> RunResult:
        t0 = time.monotonic()

        def done(status: str, metrics: dict[str, float] | None = None, error: str = "") -> RunResult:
            return RunResult(scenario.name, params, impl.name, rnd, status, metrics or {},
                             error, time.monotonic() - t0)

        server: _Server | None = None
        try:
            port = 0
            if impl.needs_server:
                server = self._start_server(scenario, params)
                port = server.port
            spec = self._spec("client", scenario, params, impl=impl.name, port=port)
            try:
                proc = subprocess.run(self._worker_argv(spec), cwd=ROOT, env=self.env,
                                      capture_output=True, timeout=self.timeout,
                                      stdin=subprocess.DEVNULL)
            except subprocess.TimeoutExpired:
                return done("failed", error=f"timeout: run exceeded dur={self.timeout:g}s")
            stderr = proc.stderr.decode(errors="replace")
            if proc.returncode == EXIT_UNAVAILABLE:
                return done("unavailable", error=_last_line(stderr))
            server_error = server.stop() if server else ""
            server = None
            if proc.returncode != 0:
                error = _last_line(stderr)
                if server_error:
                    error += f" | server: {_last_line(server_error)}"
                return done("failed", error=error)
            try:
                metrics = json.loads(proc.stdout.decode().strip().splitlines()[-1])
            except (ValueError, IndexError):
                return done("failed", error=f"client printed no result: {stderr[-300:]!r}")
            return done("ok", {k: float(v) for k, v in metrics.items()})
        except Exception as exc:  # the driver must carry on with the next run
            return done("failed", error=f"driver: {type(exc).__name__}: {exc}")
        finally:
            if server is not None:
                server.stop(grace=0.5)
