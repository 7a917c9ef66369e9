"""The server side of `specdecode bench serve`: a local `specdecode serve` started for the run
(on 127.0.0.1, a free port, its log in --out/server.log), and memory sampled while load runs:
the server's resident set size when it is local (from /proc) and the KV cache in use that
GET /api/stats reports (local or not)."""
from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx

LAUNCH = "import sys; from specdecode.cli import main; sys.exit(main())"


def child_env() -> dict[str, str]:
    """The environment of a child `specdecode` process: this one's, with the folder holding the
    specdecode package in use first on PYTHONPATH, so a server started from a git worktree (or any
    checkout other than the installed one) runs that checkout's code, whatever the working directory."""
    import specdecode
    root = str(Path(specdecode.__file__).resolve().parent.parent)
    env = dict(os.environ)
    rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p != root]
    env["PYTHONPATH"] = os.pathsep.join([root, *rest])
    return env


class ServerError(RuntimeError):
    """The local server could not be started."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def rss_bytes(pid: int) -> int | None:
    """Resident set size of a process (Linux /proc; None elsewhere or once it has gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


class LocalServer:
    """`specdecode serve ARGS --host 127.0.0.1 --port P` in a child process, ready once
    GET /health answers 200; stopped (SIGTERM, then SIGKILL) on exit."""

    def __init__(self, serve_args: list[str], log_path: Path, startup_timeout_s: float = 300.0) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.serve_args = [*serve_args, "--host", "127.0.0.1", "--port", str(self.port)]
        self.args = [sys.executable, "-c", LAUNCH, "serve", *self.serve_args]
        self.log_path = log_path
        self.timeout_s = startup_timeout_s
        self.process: subprocess.Popen | None = None

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> LocalServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log = open(self.log_path, "wb")
        try:
            self.process = subprocess.Popen(self.args, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                            env=child_env())
        finally:
            log.close()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise ServerError(f"the local server exited with code {self.process.returncode} before it was ready: "
                                   f"{self.log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=5.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise ServerError(f"the local server did not answer /health within --server-timeout "
                           f"{self.timeout_s:g} s (log: {self.log_path})")

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self.log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return "(no log)"
        return " | ".join(text[-lines:]) or "(empty log)"

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None and self.process.poll() is None else None

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=15)


class MemorySampler:
    """Samples every `interval_s` while running: {"t", "rss_bytes", "kv_bytes_used", "running", "waiting"}.
    rss_bytes is None for a remote server; the /api/stats fields are None when it does not answer."""

    def __init__(self, client: httpx.AsyncClient, pid: int | None, interval_s: float, t0: float) -> None:
        self.client, self.pid, self.interval_s, self.t0 = client, pid, interval_s, t0
        self.samples: list[dict] = []
        self._task: asyncio.Task | None = None

    async def sample(self) -> None:
        row: dict = {"t": round(time.perf_counter() - self.t0, 3),
                     "rss_bytes": rss_bytes(self.pid) if self.pid else None,
                     "kv_bytes_used": None, "running": None, "waiting": None}
        try:
            response = await self.client.get("/api/stats", timeout=max(self.interval_s, 2.0))
            if response.status_code == 200:
                stats = response.json()
                row["kv_bytes_used"] = (stats.get("memory") or {}).get("kv_bytes_used")
                row["running"] = (stats.get("requests") or {}).get("running")
                row["waiting"] = (stats.get("requests") or {}).get("waiting")
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        self.samples.append(row)

    async def _loop(self) -> None:
        while True:
            await self.sample()
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._task = asyncio.create_task(self._loop())

    async def stop(self) -> list[dict]:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass
        await self.sample()    # the level's end
        return self.samples


def summarize_memory(samples: list[dict], warmup_fraction: float = 0.25) -> dict:
    """RSS and KV use at the start, after warm-up (the first sample past `warmup_fraction`
    of the level's time), at the end and at peak; growth = end - after warm-up."""
    out: dict = {"samples": len(samples)}
    for key, pick in (("rss_bytes", lambda s: s.get("rss_bytes")),
                      ("kv_bytes_used", lambda s: sum((s.get("kv_bytes_used") or {}).values())
                       if s.get("kv_bytes_used") else None)):
        series = [(s["t"], pick(s)) for s in samples if pick(s) is not None]
        if not series:
            out[key] = None
            continue
        t_start, t_end = series[0][0], series[-1][0]
        after = next(v for t, v in series if t >= t_start + warmup_fraction * (t_end - t_start))
        out[key] = {"start": series[0][1], "after_warmup": after, "end": series[-1][1],
                    "peak": max(v for _, v in series), "growth": series[-1][1] - after}
    return out

