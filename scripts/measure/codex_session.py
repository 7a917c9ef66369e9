"""Codex CLI (`codex exec`) on a one-step file task against a running `specdecode serve`, through a
recording proxy: every request's status, time to first output event and time to its last event,
tokens and cached tokens; the session's wall time; whether the task's file was written. Arms set
the requests' `speculate` field (the proxy adds it): auto (absent), on, off.

    python scripts/measure/codex_session.py --server http://127.0.0.1:8000 --model qwen-coder \\
        --codex node_modules/.bin/codex --arms off,auto,auto,off --json codex.json

The runs share one CODEX_HOME (config.toml pointing Codex at the proxy) and one work folder, emptied
before each: Codex writes both paths into its prompt, so a user's sessions share its whole prefix of
instructions and tools. The sandbox is bypassed (the folder is a scratch one), as `codex exec` in a
container cannot set one up.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

TASK = "Create a file named hello.py containing a Python program that prints hello world."
FIRST_OUTPUT = ("response.output_text.delta", "response.function_call_arguments.delta",
                "response.reasoning_text.delta", "response.output_item.added")
SPECULATE = {"auto": None, "on": True, "off": False}


def proxy_app(server: str, log: list[dict], arm: list[str]) -> Starlette:
    """Forwards /v1/... to `server`, adding the arm's `speculate` to POST bodies and recording each
    request's timings from its server-sent events."""
    client = httpx.AsyncClient(base_url=server, timeout=None)

    async def forward(http: Request) -> Response:
        body = await http.body()
        entry = {"path": http.url.path, "method": http.method, "arm": arm[0], "start": time.monotonic()}
        if http.method == "POST" and body:
            data = json.loads(body)
            if SPECULATE[arm[0]] is not None:
                data["speculate"] = SPECULATE[arm[0]]
            entry.update(body_bytes=len(body), input_items=len(data.get("input") or []),
                         tools=[t.get("type") for t in data.get("tools") or []])
            body = json.dumps(data).encode()
        headers = {k: v for k, v in http.headers.items() if k.lower() in ("authorization", "content-type", "accept")}
        request = client.build_request(http.method, http.url.path, content=body, headers=headers,
                                       params=dict(http.query_params))
        upstream = await client.send(request, stream=True)
        entry["status"] = upstream.status_code
        log.append(entry)

        async def relay():
            buffer = b""
            try:
                async for chunk in upstream.aiter_raw():
                    buffer += chunk
                    *lines, buffer = buffer.split(b"\n")
                    for line in lines:
                        if not line.startswith(b"data: "):
                            continue
                        event = json.loads(line[6:])
                        kind = event.get("type", "")
                        if kind in FIRST_OUTPUT and "first_output" not in entry:
                            entry["first_output"] = time.monotonic() - entry["start"]
                        if kind in ("response.completed", "response.incomplete", "response.failed"):
                            usage = event["response"].get("usage") or {}
                            entry.update(outcome=kind.split(".")[1], input_tokens=usage.get("input_tokens"),
                                         cached_tokens=(usage.get("input_tokens_details") or {}).get("cached_tokens"),
                                         output_tokens=usage.get("output_tokens"),
                                         output=[o["type"] + (":" + o.get("name", "") if o["type"] == "function_call"
                                                              else "") for o in event["response"]["output"]],
                                         speculation=event["response"].get("speculation"))
                    yield chunk
            finally:
                entry["total"] = time.monotonic() - entry["start"]
                await upstream.aclose()

        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(relay(), status_code=upstream.status_code,
                                     media_type="text/event-stream")
        content = await upstream.aread()
        entry["total"] = time.monotonic() - entry["start"]
        await upstream.aclose()
        return Response(content, status_code=upstream.status_code,
                        media_type=upstream.headers.get("content-type"))

    return Starlette(routes=[Route("/v1/{rest:path}", forward, methods=["GET", "POST"])])


def start_proxy(app: Starlette) -> tuple[str, uvicorn.Server]:
    import socket
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    return f"http://127.0.0.1:{sock.getsockname()[1]}", server


CONFIG = """model = "{model}"
model_provider = "local"

[model_providers.local]
name = "specdecode"
base_url = "{url}/v1"
wire_api = "responses"
request_max_retries = 0
stream_max_retries = 0
stream_idle_timeout_ms = {idle_ms}
"""


def run_codex(args, url: str, work: str, home: str) -> dict:
    """One `codex exec` in `work` (emptied first) with CODEX_HOME `home`."""
    for path in Path(work).iterdir():
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    Path(home, "config.toml").write_text(CONFIG.format(model=args.model, url=url, idle_ms=args.timeout * 1000))
    start = time.monotonic()
    try:
        command = [args.codex, "exec", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox", args.task]
        done = subprocess.run(command, cwd=work, env=dict(os.environ, CODEX_HOME=home), stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=args.timeout)
        code, out = done.returncode, done.stdout + done.stderr
    except subprocess.TimeoutExpired as exc:
        code, out = "timeout", exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else ""
    wall = time.monotonic() - start
    written = {p.name: p.read_text(errors="replace")[:400] for p in Path(work).iterdir() if p.is_file()}
    return {"exit": code, "wall_s": round(wall, 2), "files": written, "log_tail": out[-1500:]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", default="http://127.0.0.1:8000", help="a running specdecode serve")
    ap.add_argument("--model", required=True, help="the served model name")
    ap.add_argument("--codex", default="codex", help="the codex executable (npm @openai/codex)")
    ap.add_argument("--task", default=TASK)
    ap.add_argument("--arms", default="auto,off", help="comma-separated runs: auto, on or off (speculate)")
    ap.add_argument("--timeout", type=int, default=1800, help="seconds one codex run may take")
    ap.add_argument("--json", help="write every run's record here")
    ap.add_argument("--codex-home", help="CODEX_HOME of every run (default: a temporary one; its config.toml is "
                                         "rewritten): the same one across invocations keeps the prompts' prefix")
    ap.add_argument("--workdir", help="the folder every run works in, emptied before each (default: a temporary "
                                      "one); one folder for all runs, as a user's project, keeps the prompts' "
                                      "prefix (which names the folder) the same from run to run")
    args = ap.parse_args()
    arms = args.arms.split(",")
    if any(a not in SPECULATE for a in arms):
        ap.error(f"--arms takes {', '.join(SPECULATE)}")
    log: list[dict] = []
    arm = [arms[0]]
    url, proxy = start_proxy(proxy_app(args.server, log, arm))
    runs = []
    work = args.workdir or tempfile.mkdtemp(prefix="codex-session-")
    Path(work).mkdir(parents=True, exist_ok=True)
    home = args.codex_home or tempfile.mkdtemp(prefix="codex-home-")     # one for all runs, as a user's ~/.codex
    Path(home).mkdir(parents=True, exist_ok=True)
    for name in arms:
        arm[0] = name
        before = len(log)
        result = run_codex(args, url, work, home)
        requests = [{k: (round(v, 3) if isinstance(v, float) else v) for k, v in e.items() if k != "start"}
                    for e in log[before:]]
        posts = [r for r in requests if r["method"] == "POST"]
        ttft = [r.get("first_output") for r in posts]
        runs.append(dict(result, arm=name, requests=requests, posts=len(posts),
                         answered=sum(r.get("outcome") in ("completed", "incomplete") for r in posts),
                         first_ttft_s=ttft[0] if ttft else None, later_ttft_s=ttft[1:]))
        print(json.dumps({k: v for k, v in runs[-1].items() if k not in ("requests", "log_tail")}), flush=True)
    proxy.should_exit = True
    if args.json:
        Path(args.json).write_text(json.dumps(runs, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
