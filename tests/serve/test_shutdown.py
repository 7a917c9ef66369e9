"""Graceful stop of `specdecode serve` (serve/server.py `serve_forever`): SIGTERM or SIGINT, as
service managers send them. Requests in flight are answered, new ones get 503 meanwhile, the
process exits 0 without a traceback; with --shutdown-timeout 0 a request still running ends
with an error event, not a cut connection."""
from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import pytest

LAUNCH = "import sys; from specdecode.cli import main; sys.exit(main())"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start(*extra):
    """The embedded model (a few hundred tokens per second: a long answer is still running when
    the signal comes)."""
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, "serve", "--method", "none", "--port", str(port),
                             "--max-model-len", "4096", "--max-batch-size", "2", "--threads", "1", *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.communicate()[1][-2000:]
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.2)
    proc.kill()
    raise AssertionError("the server did not start")


def stream(url, max_tokens, events, started):
    """A streamed completion; every data line is appended to `events`."""
    body = {"prompt": "the quick brown fox", "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as response:
        events.append(("status", response.status_code))
        for line in response.iter_lines():
            if line.startswith("data: "):
                started.set()
                events.append(("data", line[6:]))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_lets_running_requests_finish_refuses_new_ones_and_exits_cleanly(sig):
    proc, url = start("--shutdown-timeout", "300")
    events, started = [], threading.Event()
    client = threading.Thread(target=stream, args=(url, 300, events, started))
    client.start()
    assert started.wait(60)
    proc.send_signal(sig)
    time.sleep(0.2)
    refused = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    client.join(300)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    assert "Traceback" not in err and "stopped" in err
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "service_unavailable"
    data = [json.loads(d) for kind, d in events if kind == "data" and d != "[DONE]"]
    assert events[-1] == ("data", "[DONE]")
    assert data[-1]["choices"][0]["finish_reason"] == "length"        # answered in full
    assert sum(len(c["choices"][0]["text"]) > 0 for c in data) > 1


def test_past_the_shutdown_timeout_a_running_request_ends_with_an_error_event():
    proc, url = start("--shutdown-timeout", "0")
    events, started = [], threading.Event()
    client = threading.Thread(target=stream, args=(url, 1500, events, started))
    client.start()
    assert started.wait(60)
    proc.send_signal(signal.SIGTERM)
    client.join(120)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0 and "Traceback" not in err, err[-2000:]
    data = [json.loads(d) for kind, d in events if kind == "data" and d != "[DONE]"]
    assert data[-1].get("error", {}).get("code") == "service_unavailable", data[-1]
    assert events[-1] == ("data", "[DONE]")


def test_a_port_in_use_is_said_before_the_model_loads(tmp_path):
    """A busy port is one line naming the port and the cause, before anything loads: the model named
    does not exist, and the port's error comes first (it used to load the model, then fail with "could
    not start the HTTP server" and the cause only in uvicorn's log)."""
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = subprocess.run([sys.executable, "-c", LAUNCH, "serve", "--model", str(tmp_path / "missing.gguf"),
                               "--method", "none", "--port", str(port)],
                              capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("specdecode: error:"), proc.stderr
    assert f"--port {port}" in lines[0] and "127.0.0.1" in lines[0] and "already in use" in lines[0], lines[0]


def test_sigterm_drains_the_ray_replicas_and_leaves_no_process_behind():
    """serve --replicas: a stream in flight at SIGTERM is answered in full (Ray Serve's own
    shutdown closes its proxy first, which cut it), a new request gets 503, nothing is left."""
    pytest.importorskip("ray.serve")
    psutil = pytest.importorskip("psutil")
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-c", LAUNCH, "serve", "--method", "none", "--replicas", "2",
                             "--threads", "1", "--port", str(port), "--max-model-len", "4096",
                             "--shutdown-timeout", "300"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 240
        while True:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            assert time.monotonic() < deadline, "the replicas did not start"
            try:
                if httpx.post(url + "/v1/completions", json={"prompt": "the quick", "max_tokens": 4},
                              timeout=10).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        family = psutil.Process(proc.pid).children(recursive=True)
        assert any("raylet" in " ".join(p.cmdline()) for p in family)         # Ray runs under it
        events, started = [], threading.Event()
        client = threading.Thread(target=stream, args=(url, 400, events, started))
        client.start()
        assert started.wait(60)
        proc.send_signal(signal.SIGTERM)
        refused, deadline = None, time.monotonic() + 60
        while time.monotonic() < deadline:   # served until the ingress hears of the drain, then 503
            try:
                refused = httpx.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
            except httpx.HTTPError:          # (or already gone, had the stream finished by then)
                refused = None
                break
            if refused.status_code != 200:
                break
            time.sleep(0.2)
        client.join(300)
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0 and "Traceback" not in err, err[-3000:]
    assert "stopped" in err, err[-3000:]
    import re
    started = re.search(r"specdecode serve: (\d+ replicas?) \(fixed\) of .*?, (\d+ threads?) each", err)
    assert started is None or started.groups() == ("2 replicas", "1 thread"), started.group(0)  # (or still starting)
    # Ray's notices of what specdecode did itself: Serve started twice, the controller killed at the stop
    assert "will not be applied" not in err and "graceful_shutdown failed" not in err, err[-3000:]
    data = [json.loads(d) for kind, d in events if kind == "data" and d != "[DONE]"]
    assert events[-1] == ("data", "[DONE]") and data[-1]["choices"][0]["finish_reason"] == "length"   # in full
    assert refused is None or (refused.status_code == 503 and refused.json()["error"]["code"] == "service_unavailable")
    time.sleep(2)
    left = [p for p in family if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    assert not left, [" ".join(p.cmdline())[:120] for p in left]
