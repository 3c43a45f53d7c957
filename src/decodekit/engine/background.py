"""An engine's background thread: `Engine.start()` steps the engine whenever it has
work, until `Engine.stop()`. The server uses it; a library call drives `Engine.step` from
its own thread instead (engine.py `run_requests`), so this is not on a request's path.

Each `start` is undone by one `stop`: two servers on one model's shared engine (engine.py
`engine_for`) keep it running until both stop. The thread waits on the engine's inbox
condition (handle.py `Inbox`), which a submitted request and `stop` notify.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

_log = logging.getLogger(__name__)


class Background:
    """The thread that calls `step` whenever `has_work()`, waiting on `cond` in between."""

    def __init__(self, step: Callable[[], None], has_work: Callable[[], bool], cond: threading.Condition):
        self._step, self._has_work, self._cond = step, has_work, cond
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._starts = 0  # `start` calls not yet undone by `stop`

    def start(self) -> None:
        """Run the engine's step in a background thread whenever there is work."""
        with self._cond:
            self._starts += 1
            if self._thread is not None and self._thread.is_alive():
                return
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="decodekit-engine", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        """Stop the thread after its current step (queued requests stay), once every `start`
        has had its `stop`."""
        with self._cond:
            self._starts = max(self._starts - 1, 0)
            if self._starts:
                return
            self._stopping = True
            self._cond.notify_all()
            thread = self._thread
        if thread is not None:
            thread.join()
        self._thread = None

    def _loop(self) -> None:
        """The thread's: step whenever there is work, until `stop`."""
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopping or self._has_work())
                if self._stopping:
                    return
            try:
                self._step()
            except Exception as error:  # noqa: BLE001 -- the step failed its own requests
                _log.warning("an engine step failed and ended its requests: %r", error)
