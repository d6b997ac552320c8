"""The engine's own thread for a server: requests come in from any thread, every new token goes out to its
request's sink as soon as the runner reads it, and a request can be cancelled at any time (its pages freed at once).

The runner is not thread-safe, so only this thread touches it: ``submit`` and ``cancel`` post commands that the
loop applies between steps. While nothing runs, the loop sleeps on the command queue.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable

from kvjax.runtime.engine import Engine
from kvjax.runtime.runner import Runner
from kvjax.runtime.scheduler import Request, State

log = logging.getLogger("kvjax.serving")

# sink(request, new_tokens, finished): called on the engine thread; it must not block
Sink = Callable[[Request, list[int], bool], None]


@dataclasses.dataclass
class _Live:
    request: Request
    sink: Sink
    sent: int = 0  # tokens handed to the sink


class Worker:
    """Runs ``engine`` continuously batched on a thread of its own (``start``), feeding each request's sink."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.runner = Runner(engine)
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._live: dict[int, _Live] = {}  # by id(request)
        self._thread = threading.Thread(target=self._loop, name="kvjax-engine", daemon=True)
        self._stop = threading.Event()
        self._submitted, self._submitting, self._closed = 0, threading.Lock(), False
        self.error: BaseException | None = None
        # requests finished, those of them cancelled (a client gone, a stop), and the preemptions they went through
        self.finished = self.aborted = self.preemptions = 0

    def start(self) -> Worker:
        self._thread.start()
        return self

    def submit(self, request: Request, sink: Sink) -> Request:
        """Queue ``request``; ``sink`` gets its tokens as they arrive and a last call with ``finished`` True."""
        with self._submitting:
            if not self._closed:
                self._submitted += 1
                self._commands.put(("add", request, sink))
                return request
        # the engine thread has ended: nothing would ever answer the request, so it finishes now
        request.state, request.finish_reason, request.error = State.FINISHED, "abort", "server stopping"
        sink(request, [], True)
        return request

    def cancel(self, request: Request) -> None:
        """Finish ``request`` with reason "abort" if it has not finished; its pages go back before the next step."""
        self._commands.put(("cancel", request, None))

    def stats(self) -> dict:
        """Counts for /health (read without locking: a snapshot, possibly a step old)."""
        sched = self.runner.scheduler
        return dict(
            running=len(sched.running) + len(sched.draining),
            waiting=len(sched.waiting),
            # pool 0's free and total pages, and the sliding-window layers' pools by window (kvjax.runtime.pages):
            # "window_pages": {"512": [free, total]}
            **sched.pages.stats(),
            steps=self.runner.steps,
            finished=self.finished,
            aborted=self.aborted,
            preemptions=self.preemptions,
        )

    @property
    def in_flight(self) -> int:
        """Requests submitted whose sink has not had its last call yet (queued ones included)."""
        return self._submitted - self.finished if self._thread.is_alive() else 0

    def stop(self, grace_s: float = 0.0, timeout_s: float = 60.0) -> None:
        """Let running requests finish for up to ``grace_s`` seconds, abort the rest (each sink gets its last call,
        finish_reason "abort"), wait for the device to finish the steps it was given, and end the thread (waiting
        ``timeout_s`` at most for the step it is in). A request submitted after this finishes at once, aborted."""
        deadline = time.monotonic() + grace_s
        while self.in_flight and time.monotonic() < deadline:
            time.sleep(0.01)
        self._stop.set()
        self._commands.put(("wake", None, None))  # the loop then aborts every request left
        if self._thread.is_alive():  # (never started: nothing to join)
            self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            log.error("the engine thread did not stop within %.0f s", timeout_s)

    # the engine thread

    def _loop(self) -> None:
        try:
            while not self._stop.is_set():
                self._apply(block=not self.runner.busy)
                if self.runner.busy:  # again: the commands may have added requests
                    self.runner.step()
                self._deliver()
        except BaseException as e:  # a failed step fails every request, never silently
            self.error = e
            log.exception("the engine failed; every request in flight is finished with an error")
            for live in list(self._live.values()):
                live.request.finish_reason, live.request.error = "error", f"the engine failed: {e}"
                live.request.state = State.FINISHED
            self._deliver()
        finally:
            with self._submitting:  # the last requests submitted; later ones finish at once (``submit``)
                self._closed = True
                self._apply(block=False)
            for live in list(self._live.values()):
                self.runner.cancel(live.request)
            self._deliver()
            try:  # the thread ends with nothing left computing (``Runner.settle``): joined, the device is idle
                self.runner.settle()
            except Exception:  # a failed step's arrays raise again here; already reported
                log.debug("waiting for the device after the engine stopped", exc_info=True)

    def _apply(self, block: bool) -> None:
        """Apply the queued commands (waiting for one while the engine is idle)."""
        try:
            command = self._commands.get(timeout=0.5) if block else self._commands.get_nowait()
        except queue.Empty:
            return
        while True:
            kind, request, sink = command
            if kind == "add":
                self._live[id(request)] = _Live(request, sink)
                if self.error is not None or self._stop.is_set():
                    request.state, request.finish_reason, request.error = State.FINISHED, "abort", "server stopping"
                else:
                    self.runner.add(request)
            elif kind == "cancel":
                self.runner.cancel(request)
            try:
                command = self._commands.get_nowait()
            except queue.Empty:
                return

    def _deliver(self) -> None:
        """Hand every live request its new tokens; drop those that finished."""
        for key, live in list(self._live.items()):
            r = live.request
            new = r.tokens[live.sent :]
            done = r.state is State.FINISHED
            if new or done:
                live.sent += len(new)
                try:
                    live.sink(r, new, done)
                except Exception:  # a sink's failure must not stop the engine
                    log.exception("a request's sink failed")
            if done:
                del self._live[key]
                self.finished, self.preemptions = self.finished + 1, self.preemptions + r.preemptions
                self.aborted += r.finish_reason == "abort"
