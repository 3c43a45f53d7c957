"""The request handle: what `Engine.submit` and `Engine.add` return, and the engine's inbox.

A `RequestHandle` receives its request's deltas from the stepping thread and hands them to
one reader (iteration, `aiter`, `poll`) and its completions to anyone (`result`). The
`Inbox` is where other threads queue requests and cancellations for the engine's next step.
"""

from __future__ import annotations

import asyncio
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterator

from decodekit.completion import Completion
from decodekit.request import Delta


class EngineFull(RuntimeError):
    """`submit` beyond `EngineConfig.max_waiting` queued requests (a server answers 503)."""


Waker = tuple[asyncio.AbstractEventLoop, asyncio.Future]  # a reader waiting in `abatches`


class RequestHandle:
    """A submitted request: its deltas as they come, and its n completions at the end.

    One consumer reads the deltas (iterate, `aiter` or `poll`); `result` can be called
    by anyone. A cancelled request ends its unfinished samples with finish_reason
    "cancelled".
    """

    def __init__(self, request_id: str, num_samples: int, on_cancel: Callable[[], None]):
        self.request_id = request_id
        self._cond = threading.Condition()
        self._events: deque[Delta] = deque()
        self._completions: list[Completion | None] = [None] * num_samples
        self._done = False
        self._error: BaseException | None = None
        self._wakers: list[Waker] = []
        self._on_cancel = on_cancel

    @property
    def done(self) -> bool:
        return self._done

    def cancel(self) -> None:
        """Stop the request; its KV blocks are freed at the engine's next step."""
        self._on_cancel()

    def result(self, timeout: float | None = None) -> list[Completion]:
        """The n completions, in sample order, once every sample has finished."""
        with self._cond:
            if not self._cond.wait_for(lambda: self._done, timeout):
                raise TimeoutError(f"request {self.request_id} did not finish in {timeout} s")
        if self._error is not None:
            raise self._error
        return list(self._completions)  # type: ignore[arg-type]

    def poll(self) -> list[Delta]:
        """The deltas that arrived since the last read, without waiting."""
        with self._cond:
            events = list(self._events)
            self._events.clear()
        return events

    def __iter__(self) -> Iterator[Delta]:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._events or self._done)
                if not self._events:
                    break
                delta = self._events.popleft()
            yield delta
        if self._error is not None:
            raise self._error

    async def aiter(self) -> AsyncIterator[Delta]:
        """Async iteration for an event loop (FastAPI): the engine thread wakes it."""
        async for batch in self.abatches():
            for delta in batch:
                yield delta

    async def abatches(self) -> AsyncIterator[list[Delta]]:
        """The deltas as they arrived together (an engine step's at once): one wake-up of the
        reader and one write of a stream per step, however many samples the request has."""
        loop = asyncio.get_running_loop()
        while True:
            with self._cond:
                if self._events:
                    batch, future = list(self._events), None
                    self._events.clear()
                elif self._done:
                    break
                else:
                    batch, future = [], loop.create_future()
                    self._wakers.append((loop, future))
            if future is not None:
                await future
            else:
                yield batch
        if self._error is not None:
            raise self._error

    def _push(self, deltas: list[Delta], finished: bool = False, error=None) -> list[Waker]:
        """Queue the deltas; returns the waiting readers, for `wake` (after the step's pushes)."""
        with self._cond:
            for delta in deltas:
                self._events.append(delta)
                if delta.completion is not None:
                    self._completions[delta.sample_index] = delta.completion
            self._done = self._done or finished
            self._error = self._error or error
            self._cond.notify_all()
            wakers, self._wakers = self._wakers, []
        return wakers


def wake(wakers: list[Waker]) -> None:
    """Resolve the readers' futures with one call into each event loop: a step that feeds 64
    streams wakes their loop once, not 64 times (each cross-thread call takes the loop's lock
    and writes to its wake-up pipe)."""
    by_loop: dict[asyncio.AbstractEventLoop, list[asyncio.Future]] = {}
    for loop, future in wakers:
        by_loop.setdefault(loop, []).append(future)
    for loop, futures in by_loop.items():
        loop.call_soon_threadsafe(_resolve, futures)


def _resolve(futures: list[asyncio.Future]) -> None:
    for future in futures:
        if not future.done():
            future.set_result(None)


class Inbox:
    """Requests submitted and cancelled since the engine's last step (any thread), at most
    `max_waiting` queued counting the scheduler's `waiting`. Its condition also wakes the
    engine's background thread (engine.py `start`)."""

    def __init__(self, max_waiting: int):
        self.max_waiting = max_waiting
        self.cond = threading.Condition()
        self.incoming: deque = deque()  # entry.py Entry
        self.cancelled: list = []

    def put(self, entry, waiting: int) -> None:
        """Queue `entry` behind `waiting` entries the scheduler already holds."""
        with self.cond:
            queued = len(self.incoming) + waiting
            if queued >= self.max_waiting:
                raise EngineFull(f"{queued} requests are waiting (max_waiting={self.max_waiting})")
            self.incoming.append(entry)
            self.cond.notify_all()

    def cancel(self, entry) -> None:
        with self.cond:
            if not entry.cancelled and not entry.handle.done:
                entry.cancelled = True
                self.cancelled.append(entry)
                self.cond.notify_all()

    def take(self) -> tuple[deque, list]:
        """The submitted and the cancelled entries, emptied."""
        with self.cond:
            incoming, self.incoming = self.incoming, deque()
            cancelled, self.cancelled = self.cancelled, []
        return incoming, cancelled

    def __bool__(self) -> bool:
        return bool(self.incoming or self.cancelled)
