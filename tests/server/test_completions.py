"""The server answers the official `openai` client, and what it answers is what the library
computes for the same request (same seed) on the same tiny random model."""

from __future__ import annotations

import json
import math

import httpx
import pytest
import torch

import decodekit as dk
from decodekit.params import SamplingParams

PROMPT = "ROMEO: But soft"


def local(models, prompt=PROMPT, **params):
    return dk.generate(models["tiny"], prompt, SamplingParams(**params))


def test_models_and_health(server, client):
    thread, _ = server
    assert [m.id for m in client.models.list().data] == ["tiny", "tiny-2"]
    health = httpx.get(thread.url + "/health").json()
    assert health["status"] == "ok" and health["models"]["tiny"]["total_blocks"] > 0
    card = httpx.get(thread.url + "/v1/models/tiny").json()
    assert card["id"] == "tiny" and card["max_model_len"] == 512


def test_completion_equals_library_generation(client, server_models):
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=24, seed=7,
                                         temperature=0.9, top_p=0.95)
    [expected] = local(server_models, max_new_tokens=24, seed=7, temperature=0.9, top_p=0.95)
    [choice] = response.choices
    assert choice.text == expected.text and choice.finish_reason == expected.finish_reason
    prompt_tokens = len(server_models["tiny"].encode(PROMPT))
    assert response.usage.prompt_tokens == prompt_tokens
    assert response.usage.completion_tokens == len(expected.token_ids)
    assert response.usage.total_tokens == prompt_tokens + len(expected.token_ids)


def test_stream_concatenates_to_the_non_streamed_text(client):
    kwargs = dict(model="tiny", prompt=PROMPT, max_tokens=40, seed=3)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = list(client.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == whole.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == whole.finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0  # the usage chunk
    assert sum(1 for c in chunks if c.choices and c.choices[0].text) > 1  # really streamed


def test_chat_stream_equals_chat(client):
    kwargs = dict(model="tiny", messages=[{"role": "system", "content": "Be brief."},
                                          {"role": "user", "content": "Who is Juliet?"}],
                  max_tokens=30, seed=11)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert whole.choices[0].message.role == "assistant"


def test_chat_uses_the_plain_template(client, server_models):
    messages = [{"role": "user", "content": "Hello"}, {"role": "assistant", "content": "Hi"},
                {"role": "user", "content": [{"type": "text", "text": "More"}]}]
    response = client.chat.completions.create(model="tiny", messages=messages, max_tokens=12, seed=5)
    [expected] = local(server_models, "USER: Hello\nASSISTANT: Hi\nUSER: More\nASSISTANT:",
                       max_new_tokens=12, seed=5)
    assert response.choices[0].message.content == expected.text
    assert response.usage.prompt_tokens == len(server_models["tiny"].encode(
        "USER: Hello\nASSISTANT: Hi\nUSER: More\nASSISTANT:"))


def test_n_samples_and_several_prompts(client, server_models):
    response = client.completions.create(model="tiny", prompt=["ROMEO:", "JULIET: O"], n=3,
                                         max_tokens=10, seed=2)
    assert [c.index for c in response.choices] == list(range(6))
    expected = dk.generate(server_models["tiny"], ["ROMEO:", "JULIET: O"],
                           SamplingParams(n=3, max_new_tokens=10, seed=2))
    assert [c.text for c in response.choices] == [c.text for batch in expected for c in batch]
    assert len({c.text for c in response.choices[:3]}) > 1  # the n samples differ
    assert response.usage.completion_tokens == sum(len(c.token_ids) for b in expected for c in b)
    # Each prompt is counted once, whatever n is: its samples share one prefill.
    model = server_models["tiny"]
    assert response.usage.prompt_tokens == len(model.encode("ROMEO:")) + len(model.encode("JULIET: O"))


def test_token_id_prompts_and_stop_strings(client, server_models):
    ids = server_models["tiny"].encode(PROMPT)
    response = client.completions.create(model="tiny", prompt=ids, max_tokens=30, seed=4, stop=["o", "e"])
    [[expected]] = dk.generate(server_models["tiny"], [ids],
                               SamplingParams(max_new_tokens=30, seed=4, stop=("o", "e")))
    assert response.choices[0].text == expected.text
    assert "o" not in response.choices[0].text and "e" not in response.choices[0].text


def test_completion_logprobs(client, server_models):
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, seed=1, logprobs=3)
    [expected] = local(server_models, max_new_tokens=8, seed=1, logprobs=3)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(expected.token_ids) == response.usage.completion_tokens
    assert logprobs.token_logprobs == pytest.approx(expected.logprobs, abs=1e-5)
    model = server_models["tiny"]
    assert logprobs.tokens == [model.token_text(t) for t in expected.token_ids]
    for top, want in zip(logprobs.top_logprobs, expected.top_logprobs):
        assert sorted(top.values()) == pytest.approx(sorted({model.token_text(t): v for t, v in
                                                             want.items()}.values()), abs=1e-5)
    assert logprobs.text_offset[0] == 0
    assert logprobs.text_offset[-1] == len(model.decode(expected.token_ids[:-1]))


def test_chat_logprobs(client, server_models):
    response = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "x"}],
                                              max_tokens=6, seed=9, logprobs=True, top_logprobs=2)
    [expected] = local(server_models, "USER: x\nASSISTANT:", max_new_tokens=6, seed=9, logprobs=2)
    content = response.choices[0].logprobs.content
    assert [t.logprob for t in content] == pytest.approx(expected.logprobs, abs=1e-5)
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob >= t.logprob - 1e-6 for t in content)


def test_echo_with_zero_tokens_scores_the_prompt(client, server_models):
    model = server_models["tiny"]
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=0, echo=True, logprobs=0)
    choice = response.choices[0]
    assert choice.text == PROMPT and response.usage.completion_tokens == 0
    ids = model.encode(PROMPT)
    with torch.inference_mode():
        logp = torch.log_softmax(model.forward(torch.tensor([ids]), model.new_cache(1))[0], dim=-1)
    want = [float(logp[i, ids[i + 1]]) for i in range(len(ids) - 1)]
    assert choice.logprobs.token_logprobs[0] is None
    assert choice.logprobs.token_logprobs[1:] == pytest.approx(want, abs=1e-5)
    assert "".join(choice.logprobs.tokens) == PROMPT


def test_penalties_bias_and_extensions_reach_the_sampler(client, server_models):
    kwargs = dict(max_new_tokens=16, seed=6, presence_penalty=0.5, frequency_penalty=0.3,
                  logit_bias={5: 4.0}, top_k=20, min_p=0.01, repetition_penalty=1.2)
    [expected] = local(server_models, **kwargs)
    response = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=16, seed=6, presence_penalty=0.5, frequency_penalty=0.3,
        logit_bias={"5": 4.0}, extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.2})
    assert response.choices[0].text == expected.text
    [plain] = local(server_models, max_new_tokens=16, seed=6)
    assert plain.text != expected.text  # the fields changed the draw


def test_preset_equals_the_library_preset_and_the_body_overrides_it(client, server_models):
    model = server_models["tiny"]
    texts = []
    for extra in ({}, {"temperature": 1.5}):
        params = SamplingParams.preset("creative-writing", max_new_tokens=12, seed=3, **extra)
        [expected] = dk.generate(model, PROMPT, params)
        response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, seed=3,
                                              extra_body={"preset": "creative-writing"}, **extra)
        texts.append(response.choices[0].text)
        assert texts[-1] == expected.text
    [plain] = local(server_models, max_new_tokens=12, seed=3)
    assert len({plain.text, *texts}) == 3  # the preset, and the body's temperature, changed the draw


def test_json_schema_output_validates(client, server_models):
    jsonschema = pytest.importorskip("jsonschema")
    pytest.importorskip("llguidance")
    schema = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                               "ok": {"type": "boolean"}},
              "required": ["name", "ok"], "additionalProperties": False}
    response = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "a record"}], max_tokens=40, seed=0, n=4,
        response_format={"type": "json_schema", "json_schema": {"name": "record", "schema": schema}})
    for choice in response.choices:
        assert choice.finish_reason == "stop"
        jsonschema.validate(json.loads(choice.message.content), schema)
    # json_object: any object. A random model writes long keys; biasing '"' and '}' ends it soon.
    model = server_models["tiny"]
    bias = {str(model.encode(c)[0]): 6.0 for c in '"}'}
    anything = client.completions.create(model="tiny", prompt="{", max_tokens=60, seed=1, logit_bias=bias,
                                         extra_body={"response_format": {"type": "json_object"}})
    assert anything.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(anything.choices[0].text), dict)


def test_beam_search_extension_equals_library(client, server_models):
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=8, n=2,
                                         extra_body={"use_beam_search": True, "num_beams": 3})
    expected = dk.beam_search(server_models["tiny"], PROMPT, SamplingParams(max_new_tokens=8, n=2),
                              num_beams=3)
    assert [c.text for c in response.choices] == [c.text for c in expected]


def test_contrastive_extension_equals_library(client, server_models):
    cd = dk.ContrastiveLM(server_models["tiny"], server_models["tiny-2"], alpha=0.2)
    [expected] = dk.generate(cd, PROMPT, SamplingParams(max_new_tokens=10, temperature=0))
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, temperature=0,
                                         extra_body={"amateur_model": "tiny-2", "contrastive_alpha": 0.2})
    assert response.choices[0].text == expected.text


def test_speculative_extension_equals_library(client, server_models):
    params = SamplingParams(max_new_tokens=12, seed=8)
    [expected] = dk.speculative_generate(server_models["tiny"], server_models["tiny-2"], [PROMPT], params,
                                         num_draft_tokens=3).completions
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, seed=8,
                                         extra_body={"draft_model": "tiny-2", "num_draft_tokens": 3})
    assert response.choices[0].text == expected[0].text


def test_best_of_returns_the_highest_mean_logprob(client, server_models):
    samples = local(server_models, n=5, max_new_tokens=10, seed=12)
    means = [sum(c.logprobs) / len(c.logprobs) for c in samples]
    order = sorted(range(5), key=lambda i: -means[i])[:2]
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, seed=12, n=2,
                                         best_of=5)
    assert [c.text for c in response.choices] == [samples[i].text for i in order]
    assert [c.model_extra["score"] for c in response.choices] == pytest.approx([means[i] for i in order])
    assert response.usage.completion_tokens == sum(len(c.token_ids) for c in samples)  # all 5 drawn


def test_majority_vote_with_an_answer_regex(client, server_models):
    samples = local(server_models, n=9, max_new_tokens=4, seed=13, temperature=1.5)
    firsts = [c.text[:1] or None for c in samples]
    counts = {a: firsts.count(a) for a in dict.fromkeys(firsts) if a is not None}
    winner = max(counts, key=counts.get)  # first occurrence wins ties (dicts keep order)
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=4, seed=13,
                                         temperature=1.5, best_of=9,
                                         extra_body={"vote": "majority", "answer_regex": "^(.)"})
    [choice] = response.choices
    assert choice.text == samples[firsts.index(winner)].text
    assert math.isfinite(choice.model_extra["score"])


def test_guided_choice_and_prompt_lookup_drafting(client, server_models):
    pytest.importorskip("llguidance")
    response = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=10, seed=2, n=3,
                                         extra_body={"guided_choice": ["Romeo", "Juliet"]})
    assert {c.text for c in response.choices} <= {"Romeo", "Juliet"}
    params = SamplingParams(max_new_tokens=12, seed=5)
    [expected] = dk.speculative_generate(server_models["tiny"], "prompt-lookup", [PROMPT], params,
                                         num_draft_tokens=2).completions
    looked_up = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=12, seed=5,
                                          extra_body={"draft_model": "prompt-lookup", "num_draft_tokens": 2})
    assert looked_up.choices[0].text == expected[0].text


# Seed 1 draws "... b the..." (chat: "... s the...") and "...ROMEOre...": each stop string
# is held back (its first tokens could start it) before it completes, and partial UTF-8
# characters abound.
STREAM_STOP = dict(prompt=PROMPT, max_tokens=30, seed=1, n=2, stop=["b the", "s the", "ROMEOre"])


def test_streamed_logprobs_come_with_their_tokens(client, server_models):
    kwargs = dict(model="tiny", logprobs=2, **STREAM_STOP)
    whole = client.completions.create(extra_body={"return_token_ids": True}, **kwargs).choices
    streamed = {0: [], 1: []}
    for chunk in client.completions.create(stream=True, **kwargs):
        [choice] = chunk.choices
        streamed[choice.index].append(choice)
    model = server_models["tiny"]
    for want, chunks in zip(whole, streamed.values()):
        assert want.finish_reason == "stop"
        got = {key: [x for c in chunks for x in getattr(c.logprobs, key)]
               for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        assert got == want.logprobs.model_dump()
        assert sum(bool(c.logprobs.tokens) for c in chunks) > 1  # not all in the last chunk
        text, sent = "", 0
        for c in chunks[:-1]:  # a chunk's tokens have all their text out by its end
            text, sent = text + c.text, sent + len(c.logprobs.tokens)
            assert text.startswith(model.decode(want.token_ids[:sent]))


def test_streamed_echo_logprobs_come_with_the_prompt(client):
    kwargs = dict(model="tiny", logprobs=1, echo=True, **STREAM_STOP)
    whole = client.completions.create(**kwargs).choices
    streamed = {0: [], 1: []}
    for chunk in client.completions.create(stream=True, **kwargs):
        [choice] = chunk.choices
        streamed[choice.index].append(choice)
    for want, chunks in zip(whole, streamed.values()):
        assert chunks[0].text == PROMPT and "".join(chunks[0].logprobs.tokens) == PROMPT
        got = {key: [x for c in chunks for x in getattr(c.logprobs, key)]
               for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")}
        assert got == want.logprobs.model_dump()


def test_streamed_chat_logprobs_come_with_their_tokens(client):
    kwargs = dict(model="tiny", messages=[{"role": "user", "content": "x"}], logprobs=True, top_logprobs=2,
                  **{k: v for k, v in STREAM_STOP.items() if k != "prompt"})
    whole = client.chat.completions.create(**kwargs).choices
    streamed = {0: [], 1: []}
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        [choice] = chunk.choices
        streamed[choice.index].append(choice)
    for want, chunks in zip(whole, streamed.values()):
        assert want.finish_reason == "stop"
        got = [t.model_dump() for c in chunks if c.logprobs is not None for t in c.logprobs.content]
        assert got == [t.model_dump() for t in want.logprobs.content]
        assert sum(bool(c.logprobs and c.logprobs.content) for c in chunks) > 1
