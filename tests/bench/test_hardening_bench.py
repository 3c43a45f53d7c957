"""bench server --hardening's big-body probe (bench/hardening.py): a 413 from the headers alone."""

from __future__ import annotations

import asyncio

from decodekit.bench.hardening import big_body, start
from decodekit.bench.server import free_port


def test_a_100mb_body_is_refused_from_its_headers_without_being_sent():
    port = free_port()
    server = start("shakespeare-draft", port)
    try:
        result = asyncio.run(big_body(f"http://127.0.0.1:{port}", 100))
    finally:
        server.terminate()
        server.wait(30)
    assert result["status"] == 413
    assert result["sent_bytes"] < 100 << 10  # the probe never uploads the body it announces
