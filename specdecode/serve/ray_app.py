"""`specdecode serve --replicas N`: the server as a Ray Serve application.

    HTTP -> Ray Serve proxy -> Ingress (one replica: auth, routing key, retries, cluster /metrics)
         -> DeploymentHandle + AffinityRouter (ray_router.py) -> EngineReplica x N

Each `EngineReplica` is today's server: `build_state` (continuous batching, paged KV cache,
speculation) and the unchanged Starlette app of app.py, called in-process through ASGI; its
response (status, headers, then body chunks: SSE events as they come) streams back through
the handle. A replica uses `threads` cores (torch threads = its Ray CPUs) and reports its
metrics every REPORT_INTERVAL_S to the `Registry` actor, which the ingress reads for
`/metrics` (a `replica` label per replica + cluster series) and `/api/stats`.

Faults: Ray Serve replaces a replica that dies. A request whose replica dies before anything
was sent to the client is retried on another replica; a stream that already started ends with
an OpenAI-style error event (503) and `[DONE]`; a non-streaming request is always retried.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import threading
import time
from contextlib import contextmanager

import ray
from ray import serve
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.serve.config import RequestRouterConfig
from starlette.requests import Request as HttpRequest
from starlette.responses import JSONResponse, Response, StreamingResponse

from .app import api_app
from .generation import error, sse
from .protocol import stream_error
from .ray_metrics import cluster_metrics, cluster_stats
from .ray_router import AffinityRouter, RouteKey, routing_key

log = logging.getLogger("specdecode.serve")
NAMESPACE = "specdecode"
APP_NAME = "specdecode"
REPORT_INTERVAL_S = 1.0
STALE_AFTER_S = 5 * REPORT_INTERVAL_S      # a replica silent this long is left out of /metrics
APP_EXIT_S = 1.0                           # an app call may take this long to end after its response
REPLICA_GONE = (RayActorError, ActorUnavailableError)
SERVE_LOGGER = "ray.serve"
# serve.run starts Serve again without options and says so; serve.start before it applied them
RESTART_NOTICE = "New http_options/controller_options will not be applied"
HOP_HEADERS = {"host", "content-length", "authorization", "connection", "transfer-encoding"}


def registry_name(app_name: str) -> str:
    return f"specdecode-registry-{app_name}"


@ray.remote(num_cpus=0)
class Registry:
    """The replicas' latest metrics reports (in the ingress's lifetime; named, so replicas find it)."""

    def __init__(self) -> None:
        self.reports: dict[str, dict] = {}

    def report(self, replica: str, report: dict) -> None:
        self.reports[replica] = dict(report, at=time.time())

    def snapshot(self) -> dict[str, dict]:
        now = time.time()
        self.reports = {k: r for k, r in self.reports.items() if now - r["at"] <= STALE_AFTER_S}
        return self.reports


async def asgi_call(app, method: str, path: str, query: bytes, headers: list[tuple[str, str]], body: bytes):
    """Run one HTTP request through an ASGI app in this process: yields (status, headers) once,
    then the body chunks as the app sends them. Closing the generator is a client disconnect."""
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    body_sent = False
    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": method,
             "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": query, "root_path": "",
             "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in headers],
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 0)}

    async def receive():
        nonlocal body_sent
        if not body_sent:
            body_sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message):
        await messages.put(message)

    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while (message := await messages.get()) is not None:
            if message["type"] == "http.response.start":
                yield message["status"], [(k.decode("latin-1"), v.decode("latin-1"))
                                          for k, v in message.get("headers", [])]
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield message["body"]
                if not message.get("more_body", False):
                    break
        if task.done() and not task.cancelled() and task.exception() is not None:
            raise task.exception()
    finally:
        gone.set()
        if not task.done():
            try:
                await asyncio.wait_for(task, timeout=APP_EXIT_S)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 -- the app handles its own errors
                task.cancel()


class EngineReplica:
    """One engine (today's `specdecode serve`) as a Ray Serve replica."""

    def __init__(self, spec: dict) -> None:
        from ..api import LLM
        from ..engine.config import EngineConfig
        from .app import create_app
        from .server import build_state
        llm = LLM(progress=False, **spec["llm"])
        self.state = build_state(llm, EngineConfig(**spec["config"]))
        self.state.reasoning_format = spec.get("reasoning_format", "auto")
        self.app = create_app(self.state, max_body_bytes=spec["max_body_bytes"])   # the ingress checks keys
        self.state.engine.start()
        context = serve.get_replica_context()
        self.replica = context.replica_id.unique_id
        self.node = ray.get_runtime_context().get_node_id()
        self.registry_name = registry_name(context.app_name)
        self.stopped = threading.Event()
        threading.Thread(target=self._report_loop, name="specdecode-report", daemon=True).start()

    def _report_loop(self) -> None:
        registry = None
        while not self.stopped.wait(REPORT_INTERVAL_S):
            metrics = self.state.engine.metrics
            try:
                registry = registry or ray.get_actor(self.registry_name, namespace=NAMESPACE)
                report = {"metrics": metrics.render().decode(), "stats": metrics.stats(), "pid": os.getpid(),
                          "node": self.node}
                ray.get(registry.report.remote(self.replica, report), timeout=10 * REPORT_INTERVAL_S)
            except Exception as exc:  # noqa: BLE001 -- the registry may be restarting; try again
                log.debug("metrics report failed: %s", exc)
                registry = None

    async def handle(self, key: RouteKey | None, method: str, path: str, query: bytes,
                     headers: list[tuple[str, str]], body: bytes):
        """One HTTP request through the replica's app (`key` is for the router)."""
        async for item in asgi_call(self.app, method, path, query, headers, body):
            yield item

    def check_health(self) -> None:
        thread = self.state.engine.thread
        if thread is None or not thread.is_alive():
            raise RuntimeError("the engine thread is not running")

    def __del__(self) -> None:
        stopped = getattr(self, "stopped", None)
        if stopped is not None:
            stopped.set()
            self.state.engine.stop()


class Ingress:
    """The HTTP face: the same API as one server; generation requests go to an engine replica
    chosen by `AffinityRouter`, /metrics and /api/stats cover all replicas."""

    def __init__(self, engine, spec: dict) -> None:
        self.engine, self.spec = engine, spec
        self.attempts = spec["retries"] + 1
        self.draining = False            # `drain()`: shutting down, new requests get 503
        self.in_flight = 0               # generation requests not yet answered in full
        self.registry = self._registry()

    def __serve_build_asgi_app__(self):
        return api_app({"/v1/completions": self.generate, "/v1/chat/completions": self.generate,
                        "/v1/responses": self.generate, "/v1/responses/{response_id}": self.forward,
                        "/v1/responses/{response_id}/cancel": self.forward,
                        "/infill": self.generate, "/tokenize": self.forward, "/detokenize": self.forward,
                        "/tokenizer_info": self.forward, "/v1/models": self.forward,
                        "/v1/models/{model:path}": self.forward, "/health": self.health,
                        "/metrics": self.metrics, "/api/stats": self.stats,
                        "/v1/messages": self.generate, "/v1/messages/count_tokens": self.forward},
                       self.spec["api_key"], self.spec["max_body_bytes"])

    @staticmethod
    def _registry():
        return Registry.options(name=registry_name(serve.get_replica_context().app_name), namespace=NAMESPACE,
                                get_if_exists=True).remote()

    async def reports(self) -> dict[str, dict]:
        try:
            return await self.registry.snapshot.remote()
        except REPLICA_GONE:               # the registry died with its node: start another
            self.registry = self._registry()
            return {}

    async def metrics(self, http: HttpRequest) -> Response:
        from prometheus_client import CONTENT_TYPE_LATEST
        return Response(cluster_metrics(await self.reports()), media_type=CONTENT_TYPE_LATEST)

    async def stats(self, http: HttpRequest) -> Response:
        return JSONResponse(cluster_stats(await self.reports()))

    async def drain(self) -> int:
        """Shutting down (`serve --replicas` on SIGTERM / SIGINT): new requests get 503 from now
        on; returns how many are in flight (polled until 0 or the timeout)."""
        self.draining = True
        return self.in_flight

    async def health(self, http: HttpRequest) -> Response:
        if self.draining:
            return error(503, "unhealthy: the server is shutting down", code="service_unavailable")
        return await self.forward(http)

    async def generate(self, http: HttpRequest) -> Response:
        if self.draining:
            return error(503, "the server is shutting down; retry on another server", code="service_unavailable")
        self.in_flight += 1
        streamed = False
        try:
            body = await http.body()
            try:
                key = routing_key(json.loads(body))
            except (json.JSONDecodeError, UnicodeDecodeError):
                key = None                      # the replica answers the 400
            response = await self.forward(http, key, body)
            if isinstance(response, StreamingResponse):      # in flight until its last chunk
                response.body_iterator, streamed = self._counted(response.body_iterator), True
            return response
        finally:
            if not streamed:
                self.in_flight -= 1

    async def _counted(self, chunks):
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            self.in_flight -= 1

    async def forward(self, http: HttpRequest, key: RouteKey | None = None, body: bytes | None = None) -> Response:
        """Send the request to a replica; retried on another one while nothing reached the client."""
        if body is None:
            body = await http.body()
        headers = [(k, v) for k, v in http.headers.items() if k.lower() not in HOP_HEADERS]
        args = (key, http.method, http.url.path, http.url.query.encode(), headers, body)
        died = ""
        for attempt in range(self.attempts):
            stream = self.engine.options(stream=True).handle.remote(*args)
            try:
                start = await anext(stream, None)
                if start is None:
                    return error(500, "internal server error (the engine replica sent no response)")
                status, out_headers = start[0], [(k, v) for k, v in start[1] if k.lower() != "content-length"]
                if not dict((k.lower(), v) for k, v in out_headers).get("content-type", "").startswith(
                        "text/event-stream"):
                    content = b"".join([chunk async for chunk in stream])
                    return Response(content, status_code=status, headers=dict(out_headers))
                first = await anext(stream, b"")
            except REPLICA_GONE as exc:
                stream.cancel()             # (unavailable may not mean dead: the first attempt must not run on)
                died = f"{type(exc).__name__}: {exc}".splitlines()[0]
                log.warning("engine replica lost (attempt %d of %d): %s", attempt + 1, self.attempts, died)
                continue
            except asyncio.CancelledError:  # the client went away
                stream.cancel()
                raise
            return StreamingResponse(self.relay(stream, first), status_code=status, headers=dict(out_headers))
        return error(503, f"no engine replica could serve the request: {self.attempts} attempts ended with the "
                          f"replica gone (last: {died}); retry later")

    async def relay(self, stream, first: bytes):
        done = False
        try:
            yield first
            async for chunk in stream:
                yield chunk
            done = True
        except REPLICA_GONE as exc:
            log.warning("replica died mid-stream: %s", exc)
            yield sse(stream_error(503, "the engine replica serving this request died mid-stream; the cluster "
                                      "replaces it: retry the request"))
            yield "data: [DONE]\n\n"
            done = True
        finally:
            if not done:
                stream.cancel()             # the client went away: the replica aborts the request


def build_app(spec: dict):
    """The bound Serve application. `spec`: llm (LLM kwargs incl. threads), config (EngineConfig
    fields), replicas, min_replicas / max_replicas (autoscaling on queue length when either is
    set), imbalance, retries, api_key, max_body_bytes."""
    config = spec["config"]
    in_flight = config["max_batch_size"] + config["max_queue"]
    scaling = {}
    if spec.get("min_replicas") is not None or spec.get("max_replicas") is not None:
        scaling["autoscaling_config"] = {
            "min_replicas": spec.get("min_replicas") or 1,
            "max_replicas": spec.get("max_replicas") or max(spec["replicas"], spec.get("min_replicas") or 1),
            "initial_replicas": spec["replicas"],
            "target_ongoing_requests": config["max_batch_size"]}
    else:
        scaling["num_replicas"] = spec["replicas"]
    engine = serve.deployment(EngineReplica, name="Engine", max_ongoing_requests=in_flight,
                              graceful_shutdown_timeout_s=spec.get("shutdown_timeout", 30.0),
                              ray_actor_options={"num_cpus": spec["llm"]["threads"]},
                              request_router_config=RequestRouterConfig(
                                  request_router_class=AffinityRouter,
                                  request_router_kwargs={"imbalance": spec["imbalance"]}),
                              **scaling)
    ingress = serve.deployment(serve.ingress()(Ingress), name="Ingress", num_replicas=1,
                               max_ongoing_requests=in_flight * max(spec["replicas"], spec.get("max_replicas") or 0),
                               ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine.bind(spec), spec)


@contextmanager
def dropped_log(logger: str, text: str):
    """Within `with`: drop `logger`'s records whose message contains `text`."""
    def keep(record: logging.LogRecord) -> bool:
        return text not in record.getMessage()
    logging.getLogger(logger).addFilter(keep)
    try:
        yield
    finally:
        logging.getLogger(logger).removeFilter(keep)


def replica_threads(replicas: int) -> int:
    """Cores per replica when --threads is not given: the cluster's CPUs over the replicas (the
    most there can be), at most the largest node's CPUs (a replica runs on one node)."""
    per_node = [n["Resources"].get("CPU", 0) for n in ray.nodes() if n.get("Alive")]
    total = sum(per_node) or os.cpu_count() or 1
    return max(1, min(int(total // replicas), int(max(per_node, default=total))))


def start(spec: dict, host: str, port: int, ray_address: str | None, app_name: str = APP_NAME,
          after_init=None) -> dict:
    """Start (no address: a local Ray instance with this machine's cores) or join Ray, then deploy
    the application with its HTTP proxy on host:port; returns the spec (threads filled in) once
    every replica runs (raises the replicas' error when they cannot start). Ray's own ports
    listen with Ray's token authentication; the API listens on `host` only. `after_init`: called
    once Ray is initialized (which installs Ray's own fatal-signal handlers: SIGTERM would print a
    trace and abort), e.g. to install the caller's signal handlers over them."""
    if ray_address:
        ray.init(address=ray_address, namespace=NAMESPACE, log_to_driver=False)
    else:
        ray.init(num_cpus=os.cpu_count(), include_dashboard=False, namespace=NAMESPACE, log_to_driver=False)
    if after_init is not None:
        after_init()
    if spec["llm"].get("threads") is None:
        spec = dict(spec, llm=dict(spec["llm"], threads=replica_threads(max(spec["replicas"],
                                                                             spec.get("max_replicas") or 0))))
    serve.start(http_options={"host": host, "port": port})
    try:
        with dropped_log(SERVE_LOGGER, RESTART_NOTICE):
            serve.run(build_app(spec), name=app_name, route_prefix="/")
    except RuntimeError as exc:        # Ray's message names the deployment; the replica's error is in its status
        app = serve.status().applications.get(app_name)
        details = [d.message for d in app.deployments.values() if d.message] if app is not None else []
        raise RuntimeError("\n".join([str(exc), *details])) from None
    return spec
