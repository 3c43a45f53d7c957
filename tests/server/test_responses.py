"""The chunks a stream writes for a token's text are the ones pydantic writes, byte for byte."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from decodekit.server import protocol, responses

TEXTS = [" the", "", 'é\n"\\\t\x01\x7f😀', "\u2028</script>"]


@pytest.mark.parametrize("chat", [False, True])
def test_text_chunks_equal_the_models_dumped(chat):
    plan, created = SimpleNamespace(model='odd "name"\n', chat=chat), 1700000000
    render = responses.text_chunks(plan, "cmpl-1", created)
    for index in (0, 3):
        for text in TEXTS:
            if chat:
                want = responses.chat_chunk(plan, "cmpl-1", created, index, protocol.ChatDelta(content=text))
            else:
                want = responses.completion_chunk(plan, "cmpl-1", created, index, text)
            assert render(index, text) == want


def test_the_bench_client_reads_streams_over_one_connection(server):
    from decodekit.bench.server import Connection, http_request, request_body

    thread, _ = server

    async def two():
        connection = Connection(thread.url)
        try:
            first = await http_request(connection, request_body("tiny", 0, 6))
            second = await http_request(connection, request_body("tiny", 1, 5))  # the same connection
            with pytest.raises(RuntimeError, match="404"):
                await http_request(connection, request_body("no-such-model", 2, 5))
            return first, second
        finally:
            await connection.close()

    first, second = asyncio.run(two())
    assert (first.tokens, second.tokens) == (6, 5)
    assert 0 < len(first.chunk_times) <= 6 and first.chunk_times[0] > first.start
