"""`decodekit serve` in a subprocess for a test: started on port 0, its port read from uvicorn's
start-up line, stopped after (tests/test_cli_serve.py, test_install.py, server/test_its_hub.py)."""

from __future__ import annotations

import contextlib
import re
import signal
import subprocess
import time

import pytest


@contextlib.contextmanager
def served(command: list[str], env: dict[str, str], cwd=None, wait_s: float = 20):
    """Run `command` (a `decodekit serve ... --port 0`); yield (port, the stderr lines read so far)
    once uvicorn names its address; then SIGINT, and a kill after `wait_s` (a client's idle
    keep-alive connection can hold a graceful shutdown)."""
    server = subprocess.Popen(command, stderr=subprocess.PIPE, text=True, env=env, cwd=cwd)
    log: list[str] = []
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = server.stderr.readline()
            assert line or server.poll() is None, "".join(log)
            log.append(line)
            if match := re.search(r"Uvicorn running on http://127\.0\.0\.1:(\d+)", line):
                break
        else:
            pytest.fail("the server did not start: " + "".join(log))
        yield int(match.group(1)), log
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(wait_s)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
