"""The engine core's thread side: requests submitted and aborted from any thread, and the loop
that iterates the core (`run` on the serving thread, `start` in a thread of its own,
`run_until_idle` on the calling thread for `LLM.generate`), with its stop and graceful drain.
`EngineCore` (core.py) is this loop around one iteration (`iterate`)."""
from __future__ import annotations

import threading
import time

from .sequence import Failed, Request


class EngineLoop:
    """Base of EngineCore: reads its `scheduler`, `disks`, `iterate`, `_end` and `_publish_counts`."""

    def __init__(self) -> None:
        self.gate = threading.Lock()                  # held by an iteration (a test holds it to look between two)
        self.stopping = False
        self.looping = False                          # `run` is iterating (on some thread)
        self.drain_deadline: float | None = None      # set by `drain`: no new requests; ends at this time
        self.thread: threading.Thread | None = None

    # ------------------------------------------------------------------ any thread
    def submit(self, request: Request) -> None:
        self.scheduler.submit(request)

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)

    def in_flight(self) -> int:
        return self.scheduler.in_flight()

    def start(self) -> None:
        """Run the engine loop in a thread of its own (tests, notebooks, Ray replicas). `specdecode
        serve` runs it on the process's main thread instead (`run`): the native kernels' OpenMP
        workers then keep spinning between passes (a second thread's parallel regions get a second
        worker pool, whose workers sleep after every region)."""
        self.stopping = False
        self.looping = True                          # from now on: a call waits for the loop (offline.run)
        self.thread = threading.Thread(target=self.run, name="specdecode-engine", daemon=True)
        self.thread.start()

    def stop(self) -> None:
        """Stop now: what is queued or running ends with a 503 error."""
        with self.scheduler.cond:
            self.stopping = self.scheduler.closed = True
            self.scheduler.cond.notify()
        if self.thread is not None and self.thread is not threading.current_thread():
            self.thread.join(timeout=30)
        self._fail_all("the server is shutting down")

    def drain(self, timeout: float) -> None:
        """Graceful stop: new requests are refused; those queued or running go on for up to `timeout`
        seconds, then end with a 503 error; `run` then returns."""
        with self.scheduler.cond:
            deadline = time.monotonic() + max(timeout, 0.0)
            self.drain_deadline = min(deadline, self.drain_deadline or deadline)
            self.scheduler.closed = True
            self.scheduler.cond.notify()

    def _fail_all(self, message: str) -> None:
        inbox, rows = self.scheduler.take_all()
        for s in rows:
            self._end(s, "abort", Failed(503, message))
        for r in inbox:
            r.sink(Failed(503, message))

    # ------------------------------------------------------------------ the engine thread
    def run(self) -> None:
        """The engine loop, in the calling thread, until `stop`, or until a `drain` ends."""
        self.looping = True
        try:
            self._loop()
        finally:
            self.looping = False

    def _loop(self) -> None:
        sched = self.scheduler
        while True:
            with sched.cond:
                busy = sched.busy()
                if self.drain_deadline is not None and (not busy or time.monotonic() >= self.drain_deadline):
                    break
                if not self.stopping and not busy:
                    sched.cond.wait(timeout=1.0)
                if self.stopping:
                    return
            with self.gate:
                self.iterate()
            if self.metrics is not None:
                self.metrics.sample()
        with self.gate:                              # a drain's time is up
            self._fail_all("the server is shutting down and this request did not finish in time "
                           "(--shutdown-timeout)")
            self._publish_counts([])
            if self.disks:                           # what the caches hold, for the next start
                from ..cache.disk import write_all
                write_all(self.disks)

    def run_until_idle(self) -> None:
        """Iterate on the calling thread until nothing is queued or running (`LLM.generate`)."""
        while self.scheduler.busy():
            with self.gate:
                self.iterate()

