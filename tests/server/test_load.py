"""Concurrency: 64 streaming clients at once get their own text; 20 clients that hang up
mid-stream are cancelled and their KV blocks go back to the pool."""

from __future__ import annotations

import asyncio
import time

import openai
import pytest

CLIENTS = 64
PROMPTS = ["ROMEO:", "JULIET: O", "But soft", "The quick brown fox", "Deny thy father"]


def request(i: int) -> dict:
    # Different prompts, lengths, temperatures and seeds, so a mixed-up stream would show.
    return dict(model="tiny", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=8 + i % 17, seed=1000 + i,
                temperature=0.7 + (i % 3) * 0.2)


async def streamed(client: openai.AsyncOpenAI, i: int) -> tuple[set[str], str, str]:
    ids, pieces, reason = set(), [], None
    async for chunk in await client.completions.create(stream=True, **request(i)):
        ids.add(chunk.id)
        assert chunk.choices[0].index == 0
        pieces.append(chunk.choices[0].text)
        reason = chunk.choices[0].finish_reason or reason
    return ids, "".join(pieces), reason


def test_64_concurrent_streams_each_get_their_own_text(server):
    thread, backend = server
    engine = backend.engine("tiny")
    before = engine.stats()

    async def run():
        client = openai.AsyncOpenAI(base_url=thread.url + "/v1", api_key="x", max_retries=0, timeout=60)
        streams = await asyncio.gather(*(streamed(client, i) for i in range(CLIENTS)))
        wholes = await asyncio.gather(*(client.completions.create(**request(i)) for i in range(CLIENTS)))
        await client.close()
        return streams, wholes

    streams, wholes = asyncio.run(asyncio.wait_for(run(), 60))
    assert all(len(ids) == 1 for ids, _, _ in streams)  # every chunk of a stream carries its id
    assert len({next(iter(ids)) for ids, _, _ in streams}) == CLIENTS
    for (_, text, reason), whole in zip(streams, wholes):
        assert text == whole.choices[0].text and reason == whole.choices[0].finish_reason
    assert len({text for _, text, _ in streams}) > CLIENTS // 2
    after = engine.stats()
    tokens = after["generated_tokens"] - before["generated_tokens"]
    assert tokens == sum(w.usage.completion_tokens for w in wholes) * 2
    assert tokens / (after["steps"] - before["steps"]) > 2  # requests shared forwards


def test_clients_that_disconnect_mid_stream_free_their_blocks(server):
    thread, backend = server
    engine = backend.engine("tiny")
    cancelled, generated = backend.counters["cancelled"], engine.stats()["generated_tokens"]

    async def hang_up(client, i):
        stream = await client.completions.create(
            model="tiny", prompt=PROMPTS[i % len(PROMPTS)], max_tokens=400, seed=i, stream=True,
            extra_body={"ignore_eos": True})
        received = 0
        async for chunk in stream:
            received += bool(chunk.choices[0].text)
            if received == 2:
                break
        await stream.close()
        return received

    async def run():
        client = openai.AsyncOpenAI(base_url=thread.url + "/v1", api_key="x", max_retries=0, timeout=60)
        received = await asyncio.gather(*(hang_up(client, i) for i in range(20)))
        await client.close()
        return received

    assert asyncio.run(asyncio.wait_for(run(), 60)) == [2] * 20
    deadline = time.monotonic() + 20
    while engine.stats()["running_requests"] or engine.stats()["used_blocks"]:
        assert time.monotonic() < deadline, engine.stats()
        time.sleep(0.05)
    stats = engine.stats()
    assert stats["used_blocks"] == 0 and stats["waiting_requests"] == 0
    assert stats["free_blocks"] + stats["idle_cached_blocks"] == stats["total_blocks"]
    assert backend.counters["cancelled"] - cancelled == 20
    assert stats["generated_tokens"] - generated < 20 * 400  # cut short, not run to the end


def completions_at_once(url: str, prompts: list[str], **fields) -> list:
    """One /v1/completions request per prompt, all sent at once through the openai client."""

    async def run():
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=60)
        answers = await asyncio.gather(*(client.completions.create(prompt=p, **fields) for p in prompts))
        await client.close()
        return answers

    return asyncio.run(asyncio.wait_for(run(), 60))


def test_concurrent_beam_searches_join_the_engine_batch(server, server_models):
    """Beam-search requests run on the model's engine (no worker thread): 8 at once share its
    forwards, and each equals the library's beam search."""
    import decodekit as dk

    thread, backend = server
    engine = backend.engine("tiny")
    before = engine.stats()["steps"]
    prompts = PROMPTS + ["O Romeo", "Good night", "Parting is"]

    extra = {"use_beam_search": True, "num_beams": 4, "ignore_eos": True}
    answers = completions_at_once(thread.url, prompts, model="tiny", max_tokens=12, n=2, extra_body=extra)
    steps = engine.stats()["steps"] - before
    assert steps <= 3 * 12  # 13 measured; alone, the 8 searches would take 8 x 12 forwards
    params = dk.SamplingParams(max_new_tokens=12, n=2, ignore_eos=True)
    for prompt, answer in zip(prompts, answers):
        expected = dk.beam_search(server_models["tiny"], prompt, params, num_beams=4)
        assert [c.text for c in answer.choices] == [c.text for c in expected]


def test_concurrent_contrastive_requests_run_on_the_experts_engine(server, server_models):
    """Contrastive requests join the expert's engine batch (the amateur in its member pool),
    not the worker thread, and each equals the library's contrastive decoding."""
    import decodekit as dk

    thread, backend = server
    engine = backend.engine("tiny")
    before = engine.stats()["steps"]
    prompts = PROMPTS[:4]

    extra = {"amateur_model": "tiny-2", "contrastive_alpha": 0.2, "ignore_eos": True}
    answers = completions_at_once(thread.url, prompts, model="tiny", max_tokens=10, temperature=0,
                                  extra_body=extra)
    assert engine.stats()["steps"] - before <= 3 * 10  # together, not 4 x 10 steps
    assert server_models["tiny-2"] in engine.members
    cd = dk.ContrastiveLM(server_models["tiny"], server_models["tiny-2"], alpha=0.2)
    params = dk.SamplingParams(max_new_tokens=10, temperature=0, ignore_eos=True)
    for prompt, answer in zip(prompts, answers):
        [expected] = dk.generate(cd, prompt, params)
        assert answer.choices[0].text == expected.text


def test_beam_search_over_a_contrastive_pair_runs_on_the_experts_engine(server, server_models, monkeypatch):
    """Beam search with an amateur_model is a BeamProgram on the expert's engine (the library
    routes it there, decode/sample.py `engine_route`), never a worker-thread job, and equals the library's."""
    import decodekit as dk

    thread, backend = server
    monkeypatch.setattr(backend, "submit_thread", lambda run: pytest.fail("it ran in the worker thread"))
    engine = backend.engine("tiny")
    before = engine.stats()["steps"]
    extra = {"use_beam_search": True, "num_beams": 3, "amateur_model": "tiny-2", "contrastive_alpha": 0.2,
             "ignore_eos": True}
    [answer] = completions_at_once(thread.url, PROMPTS[:1], model="tiny", max_tokens=8, n=2, extra_body=extra)
    assert engine.stats()["steps"] - before >= 8  # one step per token, on this engine
    cd = dk.ContrastiveLM(server_models["tiny"], server_models["tiny-2"], alpha=0.2)
    params = dk.SamplingParams(max_new_tokens=8, n=2, ignore_eos=True)
    expected = dk.beam_search(cd, PROMPTS[0], params, num_beams=3)
    assert [c.text for c in answer.choices] == [c.text for c in expected]


def test_concurrent_speculative_requests_verify_in_one_forward(server, server_models):
    """Speculative requests run on the target's engine as programs: 4 at once draft together
    on the draft's member pool and verify in the same forwards; each equals the library."""
    import decodekit as dk

    thread, backend = server
    engine = backend.engine("tiny")
    before = engine.stats()["steps"]
    prompts = PROMPTS[:4]

    extra = {"draft_model": "tiny-2", "num_draft_tokens": 3, "ignore_eos": True}
    answers = completions_at_once(thread.url, prompts, model="tiny", max_tokens=12, temperature=0,
                                  extra_body=extra)
    assert engine.stats()["steps"] - before <= 3 * 13  # together: alone, 4 x (1 + up to 12) steps
    params = dk.SamplingParams(max_new_tokens=12, temperature=0, ignore_eos=True)
    for prompt, answer in zip(prompts, answers):
        [expected] = dk.generate(server_models["tiny"], prompt, params)
        assert answer.choices[0].text == expected.text
