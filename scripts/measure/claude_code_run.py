"""Claude Code (npm @anthropic-ai/claude-code) on a one-step file task through a running
`specdecode serve`, every request recorded. A logging proxy sits between the two: for each request
it records the path, the body's size, status, time to the first content delta (TTFT), total time, the
answer's usage (input, cache read, output tokens), stop reason and tool calls; `--speculate off` adds
`"speculate": false` to every body (the server's own field), `on` adds true, `auto` leaves it. Runs
`claude -p TASK --model NAME --dangerously-skip-permissions` (IS_SANDBOX=1 for root) in a new
folder, then says whether the expected file was written. Prints one JSON object.

    python scripts/measure/claude_code_run.py --server http://127.0.0.1:8000 --model qwen-coder \
        [--speculate auto|on|off] [--task TEXT] [--expect FILE] [--timeout S]
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

TASK = "Create a file hello.py that prints hello world. Use your file writing tool."


def event_reader(entry: dict, started: float):
    """`read(chunk)` of an SSE body as it streams: its events recorded into `entry`."""
    pending = [""]

    def read(data: bytes) -> None:
        lines = (pending[0] + data.decode(errors="replace")).split("\n")
        pending[0] = lines.pop()                 # a line not yet whole
        for line in lines:
            if not line.startswith("data: "):
                continue
            try:
                event = json.loads(line[6:])
            except json.JSONDecodeError:
                continue
            kind = event.get("type")
            if kind == "content_block_delta" and "ttft_s" not in entry:
                entry["ttft_s"] = round(time.perf_counter() - started, 3)
            elif kind == "content_block_start" and event["content_block"].get("type") == "tool_use":
                entry["tools"].append(event["content_block"]["name"])
            elif kind == "message_delta":
                entry["stop_reason"] = event["delta"].get("stop_reason")
                entry["usage"] = event.get("usage")
                entry["speculation"] = {k: event.get("speculation", {}).get(k) for k in (
                    "mode", "drafted_tokens", "accepted_tokens", "mean_accepted_length")}
            elif kind == "error":
                entry["error"] = event.get("error")
    return read


def proxy_app(target: str, speculate: str, log: list[dict], dump: Path | None = None):
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response, StreamingResponse
    from starlette.routing import Route

    client = httpx.AsyncClient(base_url=target, timeout=None)

    async def forward(request: Request) -> Response:
        body = await request.body()
        entry = {"path": request.url.path, "bytes": len(body), "at_s": round(time.perf_counter() - T0, 3)}
        log.append(entry)
        if dump is not None and body:
            (dump / f"{len(log):03d}.json").write_bytes(body)
        if request.method == "POST" and request.url.path == "/v1/messages" and speculate != "auto":
            data = json.loads(body)
            data["speculate"] = speculate == "on"
            body = json.dumps(data).encode()
        try:
            parsed = json.loads(body) if body else {}
            entry.update(model=parsed.get("model"), stream=parsed.get("stream"), max_tokens=parsed.get("max_tokens"),
                         tools=[], keys=sorted(parsed))
        except (json.JSONDecodeError, AttributeError):
            pass
        headers = {k: v for k, v in request.headers.items() if k.lower() not in ("host", "content-length")}
        started = time.perf_counter()
        upstream = await client.send(client.build_request(request.method, request.url.path, params=request.query_params,
                                                          headers=headers, content=body), stream=True)
        entry["status"] = upstream.status_code
        entry.setdefault("tools", [])
        reader = event_reader(entry, started)

        async def relay():
            try:
                async for chunk in upstream.aiter_bytes():
                    reader(chunk)
                    yield chunk
            finally:
                entry["total_s"] = round(time.perf_counter() - started, 3)
                await upstream.aclose()
        if upstream.headers.get("content-type", "").startswith("text/event-stream"):
            return StreamingResponse(relay(), status_code=upstream.status_code, media_type="text/event-stream")
        content = await upstream.aread()
        entry["total_s"] = round(time.perf_counter() - started, 3)
        if upstream.status_code >= 400:
            entry["error"] = content.decode(errors="replace")[:300]
        else:
            try:
                data = json.loads(content)
                entry.update(usage=data.get("usage"), stop_reason=data.get("stop_reason"))
            except (json.JSONDecodeError, AttributeError):
                pass
        return Response(content, status_code=upstream.status_code,
                        media_type=upstream.headers.get("content-type"))

    methods = ["GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"]
    return Starlette(routes=[Route("/{path:path}", forward, methods=methods)])


T0 = time.perf_counter()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--server", default="http://127.0.0.1:8000")
    ap.add_argument("--model", required=True, help="the served model name")
    ap.add_argument("--speculate", choices=("auto", "on", "off"), default="auto")
    ap.add_argument("--task", default=TASK)
    ap.add_argument("--expect", default="hello.py", help="the file the task should write")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds for the whole run")
    ap.add_argument("--api-key", default="unused")
    ap.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "claude_code_task",
                    help="the task's folder, emptied first (default: TMPDIR/claude_code_task)")
    ap.add_argument("--dump", type=Path, default=None, help="write each request's body there (NNN.json)")
    args = ap.parse_args()
    import uvicorn
    log: list[dict] = []
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(proxy_app(args.server, args.speculate, log, args.dump), log_level="warning"))
    threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True).start()
    while not server.started:
        time.sleep(0.05)
    work = args.workdir                  # the same path every run: Claude Code writes it into its system prompt,
    shutil.rmtree(work, ignore_errors=True)        # so runs share their ~20k-token prefix in the prefix cache
    work.mkdir(parents=True)
    env = dict(os.environ, ANTHROPIC_BASE_URL=f"http://127.0.0.1:{port}", ANTHROPIC_API_KEY=args.api_key,
               ANTHROPIC_DEFAULT_HAIKU_MODEL=args.model, IS_SANDBOX="1", CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1",
               DISABLE_TELEMETRY="1", HOME=str(work / ".home"),
               # the first request's ~20k-token prompt can take minutes on a CPU: Claude Code gives up on a
               # stream without content for 5 min, and on a whole answer after 10 min, then retries
               CLAUDE_STREAM_IDLE_TIMEOUT_MS=str(int(args.timeout * 1000)),
               API_TIMEOUT_MS=str(int(args.timeout * 1000)))
    (work / ".home").mkdir()
    started = time.perf_counter()
    try:
        run = subprocess.run(["claude", "-p", args.task, "--model", args.model, "--dangerously-skip-permissions"],
                             cwd=work, env=env, capture_output=True, text=True, timeout=args.timeout)
        code, out, err = run.returncode, run.stdout, run.stderr
    except subprocess.TimeoutExpired as exc:
        code, out, err = "timeout", exc.stdout or "", exc.stderr or ""
    wall = time.perf_counter() - started
    server.should_exit = True
    expected = work / args.expect
    messages = [e for e in log if e["path"] == "/v1/messages"]
    ttfts = [e.get("ttft_s") for e in messages]
    print(json.dumps({"speculate": args.speculate, "wall_s": round(wall, 1), "exit": code,
                      "file_written": expected.is_file(),
                      "file": expected.read_text()[:500] if expected.is_file() else None,
                      "answered": sum(1 for e in messages if e.get("status") == 200),
                      "messages_requests": len(messages), "first_ttft_s": ttfts[0] if ttfts else None,
                      "later_ttft_s": ttfts[1:], "requests": log, "stdout": str(out)[-1500:],
                      "stderr": str(err)[-1500:], "workdir": str(work)}, indent=1, default=str))
    return 0 if expected.is_file() else 1


if __name__ == "__main__":
    sys.exit(main())
