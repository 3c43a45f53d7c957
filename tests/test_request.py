"""request.py's bound on tokenising a prompt: a text far past the context is refused after
encoding a prefix, never encoded whole (issue 26)."""

from __future__ import annotations

import pytest

from decodekit.request import PREFIX_CHARS_PER_TOKEN, encode_text


class CountingEncoder:
    """One token per `width` characters; records how many characters it was asked to encode."""

    def __init__(self, width: int = 4):
        self.width, self.encoded = width, []

    def __call__(self, text: str) -> list[int]:
        self.encoded.append(len(text))
        return [0] * -(-len(text) // self.width)


def test_a_text_far_past_the_context_is_refused_from_a_prefix():
    encode = CountingEncoder()
    with pytest.raises(ValueError, match="longer than the model's context of 512 tokens"):
        encode_text(encode, "word " * 1_400_000, 512)  # 7 MB
    assert encode.encoded == [PREFIX_CHARS_PER_TOKEN * 512]


def test_a_text_within_the_bound_is_encoded_whole_once():
    encode = CountingEncoder()
    text = "x" * (PREFIX_CHARS_PER_TOKEN * 512)
    assert len(encode_text(encode, text, 512)) == len(text) // 4
    assert encode.encoded == [len(text)]


def test_a_text_that_tokenises_short_is_not_refused():
    """Many characters a token (collapsed spaces): the prefix grows fourfold, then the whole text
    is encoded and its true length decides (here it fits)."""
    encode = CountingEncoder(width=1000)
    text = " " * 100_000
    assert len(encode_text(encode, text, 512)) == 100
    assert encode.encoded == [8192, 32768, 100_000]


def test_requests_whose_chains_compact_are_sampled_as_they_are_alone_at_a_large_vocabulary():
    """How wide a top-p's or min-p's kept tokens are depends on all the rows of its call
    (chain.py `compacts_apart`), so at a large CPU vocabulary sample_rows runs such requests
    apart; a top-k's are k + 16 in every row, so those merge, and a call in which some row
    cannot compact (ties past the window) is sampled request by request. A chain that cannot
    compact (temperature alone) merges, and at the package's 2,048 tokens every row-wise
    chain does. At 151,936 tokens each request gets the same tokens and logprobs beside the
    others as alone: top-k first (merged), beside a row that ties past the window; top-p first."""
    import torch

    import decodekit as dk
    from decodekit.request import _batches, make_requests, sample_rows

    model = dk.load_model("shakespeare-5gram")
    model.decode = lambda ids, *args, **kwargs: "x" * len(ids)  # ids past its 2,048 tokens
    top_k = dk.SamplingParams(top_k=40, top_p=0.9, seed=1, max_new_tokens=8, ignore_eos=True)
    top_p = dk.SamplingParams(top_p=0.9, min_p=0.01, seed=1, max_new_tokens=8, ignore_eos=True)
    plain = dk.SamplingParams(temperature=0.7, seed=1, max_new_tokens=8, ignore_eos=True)
    for params, large, runs in ((top_k, True, 1), (top_p, True, 2), (top_p, False, 1), (plain, True, 1)):
        requests = make_requests(model, [[1, 2], [3, 4]], [params.replace(seed=2), params])
        rows = [row for request in requests for row in request.rows]
        assert len(_batches(rows, False, compact_apart=large)) == runs, (params, large)

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(4, 151_936, generator=generator) * 3
    logits[:, :50] += 8.0  # peaked rows: top-p's kept tokens are few
    tied = logits.clone()
    tied[3, :200] = 30.0  # 200 tied at the top: past top-k 40's window
    for params, rows_logits in ((top_k, logits), (top_k, tied), (top_p, logits)):
        requests = make_requests(model, [[1, 2]] * 4, [params.replace(seed=seed) for seed in range(4)])
        for request in requests:
            request.state.vocab_size = 151_936
        rows = [row for request in requests for row in request.rows]
        together = sample_rows(rows_logits, rows).tolist()
        for i in range(4):
            [alone] = make_requests(model, [[1, 2]], params.replace(seed=i))
            alone.state.vocab_size = 151_936
            assert sample_rows(rows_logits[i : i + 1], alone.rows).tolist() == [together[i]]
            assert (alone.rows[0].logprobs, alone.rows[0].processed_logprobs) == \
                (rows[i].logprobs, rows[i].processed_logprobs)


@pytest.mark.parametrize("name", ["arith", "shakespeare-5gram"])  # the engine; the plain loop
def test_entropies_are_the_raw_distributions_of_a_forward(name):
    """SamplingParams.entropies: each token's raw entropy and the last step's raw log-probs
    equal those of one forward over prompt + tokens; without it the completion has neither."""
    import torch

    import decodekit as dk

    model = dk.load_model(name)
    prompt = "Compute: 7+2*3=\n" if name == "arith" else "ROMEO:"
    params = dk.SamplingParams(max_new_tokens=12, seed=1, temperature=1.5)
    [[plain]] = dk.generate(model, [prompt], params)
    [[c]] = dk.generate(model, [prompt], params.replace(entropies=True))
    assert plain.entropies is None and plain.final_logprobs is None
    assert c.token_ids == plain.token_ids and len(c.entropies) == len(c.token_ids)
    start = len(model.encode(prompt))
    ids = torch.tensor([model.encode(prompt) + c.token_ids])
    logp = torch.log_softmax(model.forward(ids, model.new_cache(1))[0, start - 1 : -1].float(), -1)  # [n, V]
    expected = -(logp.exp() * logp).nan_to_num(nan=0.0).sum(-1)
    assert torch.allclose(torch.tensor(c.entropies), expected, atol=1e-5)
    assert len(set(c.entropies)) > 1
    assert torch.allclose(c.final_logprobs, logp[-1], atol=1e-5)


def test_requests_sampled_in_one_batch_get_the_tokens_they_get_alone():
    """sample_rows batches neighbouring requests whose chains are the same row-wise function
    (seeded sampling with top-p, greedy); a request with a history adapter (repetition
    penalty) or other settings runs alone. Every row's token and logprobs equal those of its
    request sampled by itself, step after step."""
    import torch

    import decodekit as dk
    from decodekit.request import make_requests, sample_rows

    model = dk.load_model("shakespeare-5gram")
    nucleus = dk.SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=50, ignore_eos=True)
    params = [nucleus.replace(seed=1, n=2), nucleus.replace(seed=2), nucleus.replace(seed=3, n=3),
              nucleus.replace(temperature=0.0), nucleus.replace(temperature=0.0, n=2),
              nucleus.replace(seed=4, repetition_penalty=1.3), nucleus.replace(seed=5, top_p=0.5)]
    prompts = [[1 + i, 2, 3] for i in range(len(params))]

    def fresh():
        requests = make_requests(model, prompts, params)
        return requests, [row for request in requests for row in request.rows]

    together, rows = fresh()
    alone, alone_rows = fresh()
    generator = torch.Generator().manual_seed(0)
    for _ in range(6):
        logits = torch.randn(len(rows), model.vocab_size, generator=generator) * 3
        got = sample_rows(logits, rows)
        want, at = [], 0
        for request in alone:
            want += sample_rows(logits[at : at + len(request.rows)], request.rows).tolist()
            at += len(request.rows)
        assert got.tolist() == want
    for mine, theirs in zip(rows, alone_rows, strict=True):
        assert mine.token_ids == theirs.token_ids and mine.logprobs == theirs.logprobs
        assert mine.processed_logprobs == theirs.processed_logprobs


@pytest.mark.parametrize("name", ["arith", "shakespeare-5gram"])  # the engine; the plain loop
def test_truncate_prompt_tokens_generates_from_the_prompts_last_k_tokens(name):
    """SamplingParams.truncate_prompt_tokens (vLLM's): generate and beam search run the last k
    tokens of the prompt's encoding, as if given those tokens; the context bounds k."""
    import decodekit as dk

    model = dk.load_model(name)
    prompt = "Compute: 12+34*2=\n80\n" * 20 if name == "arith" else "ROMEO: What light? " * 200
    ids = model.encode(prompt)
    assert len(ids) >= min(model.max_context, 1000)  # the 5-gram's context is unbounded
    greedy = dk.SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    [[cut]] = dk.generate(model, [prompt], greedy.replace(truncate_prompt_tokens=40))
    [[explicit]] = dk.generate(model, [ids[-40:]], greedy)
    assert cut.token_ids == explicit.token_ids  # (the second reuses the first's KV: a prefix cache hit)
    assert cut.usage.prompt_tokens == explicit.usage.prompt_tokens == 40
    if name == "arith":
        [beams] = dk.beam_search(model, [prompt], greedy.replace(truncate_prompt_tokens=40), num_beams=2)
        [plain] = dk.beam_search(model, [ids[-40:]], greedy, num_beams=2)
        assert beams[0].token_ids == plain[0].token_ids and beams[0].usage.prompt_tokens == 40
        with pytest.raises(ValueError, match=r"prompt has \d+ tokens; the model's context is 256"):
            dk.generate(model, [prompt], greedy)
        with pytest.raises(ValueError, match="must be <= the model's context of 256 tokens .or -1., got 257"):
            dk.generate(model, [prompt], greedy.replace(truncate_prompt_tokens=257))


@pytest.mark.parametrize("value", [0, -2, 1.5, True])
def test_truncate_prompt_tokens_refuses_what_vllm_refuses(value):
    from decodekit.params import SamplingParams
    from decodekit.request import kept_tokens

    with pytest.raises((ValueError, TypeError), match="truncate_prompt_tokens must be"):
        SamplingParams(truncate_prompt_tokens=value)
    rule = r"truncate_prompt_tokens must be an integer >= 1, or -1 \(the model's context\), got "
    with pytest.raises(ValueError, match=rule + str(value)):
        kept_tokens(value, 512)
    assert kept_tokens(-1, 512) == 512 and kept_tokens(7, 512) == 7 and kept_tokens(None, 512) is None


def test_finished_rows_leave_the_state_and_the_others_keep_theirs():
    """drop_finished_rows: a request none of whose rows ended keeps its state's histories as
    they are (copying them every step made a step's cost grow with the generation's length);
    one whose row ended keeps exactly its live rows' histories, in order."""
    import torch

    import decodekit as dk
    from decodekit.request import drop_finished_rows, make_requests, sample_rows

    model = dk.load_model("shakespeare-5gram")
    params = dk.SamplingParams(seed=3, n=3, max_new_tokens=50, ignore_eos=True, repetition_penalty=1.2)
    requests = make_requests(model, [[1, 2, 3], [4, 5]], [params, params.replace(seed=4)])
    rows = [row for request in requests for row in request.rows]
    generator = torch.Generator().manual_seed(0)
    for _ in range(3):
        sample_rows(torch.randn(len(rows), model.vocab_size, generator=generator), rows)
        drop_finished_rows(rows)
    first, second = requests
    histories = list(second.state.generated)
    first.rows[1].finish_reason = "stop"
    drop_finished_rows(rows)
    assert first.state.generated == [first.rows[0].token_ids, first.rows[2].token_ids]
    assert all(kept is before for kept, before in zip(second.state.generated, histories, strict=True))
    assert [len(h) for h in second.state.generated] == [3, 3, 3]


def test_plain_greedy_skips_the_one_hot_and_gives_its_tokens_and_logprobs():
    """A greedy request with no other adapter (chain.py `argmax_only`) takes the raw logits'
    argmax and a processed logprob of 0 without building the temperature-0 adapter's one-hot
    (an argmax, a scatter and a log-softmax over the vocabulary fewer): the same tokens and
    logprobs as through the adapter, alone, in a batch of greedy requests, and beside a
    seeded one (where the one-hot is built for the batch's processed logits)."""
    import torch

    import decodekit as dk
    from decodekit.bench.aten_calls import CountCalls
    from decodekit.request import make_requests, sample_rows

    model = dk.load_model("shakespeare-5gram")
    greedy = dk.SamplingParams(temperature=0.0, max_new_tokens=50, ignore_eos=True)
    seeded = dk.SamplingParams(temperature=0.8, top_k=20, seed=1, max_new_tokens=50, ignore_eos=True)
    layouts = {"alone": [greedy], "greedy batch": [greedy, greedy.replace(n=2)], "mixed": [greedy, seeded]}
    generator = torch.Generator().manual_seed(0)
    for layout, params in layouts.items():
        prompts = [[1 + i, 2, 3] for i in range(len(params))]
        runs = {}
        for fast in (True, False):
            requests = make_requests(model, prompts, params)
            assert requests[0].chain.argmax_only
            for request in requests:
                request.chain.argmax_only &= fast  # through the adapter: the one-hot built
            runs[fast] = [row for request in requests for row in request.rows]
        for _ in range(5):
            logits = torch.randn(len(runs[True]), model.vocab_size, generator=generator) * 3
            with torch.inference_mode(), CountCalls() as counter:
                fast_tokens = sample_rows(logits, runs[True])
            slow_tokens = sample_rows(logits, runs[False])
            assert fast_tokens.tolist() == slow_tokens.tolist(), layout
            if layout != "mixed":
                assert counter.calls["log_softmax"] == 1 and "scatter" not in counter.calls, counter.calls
        for mine, theirs in zip(*runs.values(), strict=True):
            assert mine.token_ids == theirs.token_ids and mine.logprobs == theirs.logprobs, layout
            assert mine.processed_logprobs == theirs.processed_logprobs, layout
        assert all(lp == 0.0 for lp in runs[True][0].processed_logprobs)


def test_rows_recorded_in_scratch_buffers_equal_the_plain_path(monkeypatch):
    """sampling/select.py's scratch buffers (large CPU rows: draws, the chosen logprobs, the
    whole log-softmax that top logprobs and entropies read) and the truncation adapters'
    probabilities in them (processors.py `probs64`) give every recorded number of the
    plain ops bit for bit: seeded sampling with top-k, top logprobs and entropies, greedy,
    and top-p, min-p and epsilon in one chain, recorded once with every row in the buffers
    (size bound 0) and once with none."""
    import torch

    import decodekit as dk
    from decodekit import scratch
    from decodekit.request import make_requests, sample_rows

    model = dk.load_model("shakespeare-5gram")
    params = [dk.SamplingParams(temperature=0.8, top_k=40, seed=3, n=2, logprobs=3, entropies=True,
                                max_new_tokens=50, ignore_eos=True),
              dk.SamplingParams(temperature=0.0, logprobs=2, max_new_tokens=50, ignore_eos=True),
              dk.SamplingParams(top_p=0.9, min_p=0.02, epsilon=1e-4, seed=5, n=2, logprobs=1,
                                max_new_tokens=50, ignore_eos=True)]  # fmt: skip
    generator = torch.Generator().manual_seed(0)
    steps = [torch.randn(5, model.vocab_size, generator=generator) * 3 for _ in range(4)]
    runs = []
    for bound in (0, 1 << 62):
        monkeypatch.setattr(scratch, "MIN_BYTES", bound)
        requests = make_requests(model, [[1, 2, 3], [4, 5], [6, 7]], params)
        rows = [row for request in requests for row in request.rows]
        for logits in steps:
            sample_rows(logits, rows)
        runs.append(rows)
    for in_buffers, plain in zip(*runs, strict=True):
        assert in_buffers.token_ids == plain.token_ids and in_buffers.logprobs == plain.logprobs
        assert in_buffers.processed_logprobs == plain.processed_logprobs
        assert in_buffers.top_logprobs == plain.top_logprobs and in_buffers.entropies == plain.entropies
    assert runs[0][0].top_logprobs and runs[0][0].entropies  # asked, and recorded
