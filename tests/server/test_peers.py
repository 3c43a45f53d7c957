"""RemoteGenerator against a real external engine: llama.cpp's server (llama-cpp-python,
built by scripts/peers.sh into .peers/, found as bench/llamacpp.py finds it) over the
embedded shakespeare model converted to GGUF. Skipped when no peers directory has a build."""

from __future__ import annotations

import math
import socket
import subprocess
import time
from collections import Counter

import httpx
import pytest

from decodekit.bench.llamacpp import find_llamacpp
from decodekit.meta.generator import LocalGenerator
from decodekit.meta.remote import RemoteGenerator
from decodekit.params import SamplingParams

PEER = find_llamacpp("llama_cpp.server")
PYTHON = PEER and PEER.python
GGUF = PEER and PEER.directory / "shakespeare-f32.gguf"
pytestmark = [pytest.mark.peer, pytest.mark.skipif(PEER is None or not GGUF.exists(),
                                                   reason="no llama-cpp-python build: bash scripts/peers.sh")]


@pytest.fixture(scope="module")
def llama_url():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [str(PYTHON), "-m", "llama_cpp.server", "--model", str(GGUF), "--host", "127.0.0.1",
               "--port", str(port), "--n_ctx", "512", "--n_threads", "1", "--logits_all", "true"]
    server = subprocess.Popen(command,
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/v1/models").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, "llama.cpp's server did not start"
            time.sleep(0.5)
        yield url
    finally:
        server.terminate()
        server.wait(10)


@pytest.fixture(scope="module")
def local():
    from decodekit.models.registry import load_model

    return LocalGenerator(load_model("shakespeare"))


def test_greedy_equals_local_greedy(llama_url, local):
    with RemoteGenerator(llama_url, "shakespeare") as remote:
        params = SamplingParams(max_new_tokens=40, temperature=0.0)
        [[got]] = remote.generate(["ROMEO:"], 1, params)
        assert remote.endpoints[0].profile.name == "llamacpp"
        [[want]] = local.generate(["ROMEO:"], 1, params)
        assert got.text == want.text


def local_first_token(model, prompt: str):
    """The local model's next-token probabilities after `prompt` [V] (temperature 1)."""
    import torch

    from decodekit.models.base import prefill

    with torch.inference_mode():
        return torch.softmax(prefill(model, [model.encode(prompt)])[0][0].float(), -1)  # [V]


def test_first_token_logprobs_equal_local(llama_url, local):
    """The first token's context is the same there: same tokens, no BOS added, same
    log-probabilities (f32 GGUF vs torch: within 1e-3)."""
    probs = local_first_token(local.model, "ROMEO:")
    with RemoteGenerator(llama_url, "shakespeare") as remote:
        params = SamplingParams(max_new_tokens=1, temperature=0.0, logprobs=10)
        [[got]] = remote.generate(["ROMEO:"], 1, params)
    tops = got.top_logprobs[0]
    assert len(tops) == 10
    want = {local.model.token_text(t): math.log(float(probs[t])) for t in range(len(probs))}
    for text, logprob in tops.items():
        assert logprob == pytest.approx(want[text], abs=1e-3), text


def rank_bins(mass: dict[str, float], total: int, least: float = 5.0) -> list[list[str]]:
    """Token texts by falling probability, grouped so each group expects at least `least` of
    `total` draws (the remainder joins the last group): the tail is tested, not dropped."""
    bins: list[list[str]] = []
    group: list[str] = []
    expected = 0.0
    for text in sorted(mass, key=mass.__getitem__, reverse=True):
        group.append(text)
        expected += mass[text] * total
        if expected >= least:
            bins.append(group)
            group, expected = [], 0.0
    bins[-1].extend(group)
    return bins


def test_first_token_follows_the_local_distribution(llama_url, local):
    """Chi-square of 200 first tokens, each seeded differently (llama.cpp draws the same token
    for the same seed), against the local model's probabilities at temperature 1, over bins
    of tokens in order of probability that each expect >= 5 draws. The tail matters: the
    server's default top_k 40 / min_p 0.05 remove 15 % / 34 % of the mass after "ROMEO:"
    while leaving the top token first, so a test of the common tokens alone misses them."""
    model, draws = local.model, 200
    probs = local_first_token(model, "ROMEO:")
    mass: Counter[str] = Counter()
    for token, p in enumerate(probs.tolist()):
        mass[model.token_text(token)] += p  # the byte tokens share one text
    with RemoteGenerator(llama_url, "shakespeare", max_concurrency=4) as remote:
        params = [SamplingParams(max_new_tokens=1, seed=seed) for seed in range(draws)]
        drawn = Counter(cs[0].text for cs in remote.generate(["ROMEO:"] * draws, 1, params))
    assert set(drawn) <= set(mass), f"not one token's text: {set(drawn) - set(mass)}"
    bins = rank_bins(mass, draws)
    observed = [sum(drawn[text] for text in group) for group in bins]
    expected = [sum(mass[text] for text in group) * draws for group in bins]
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected))
    dof = len(bins) - 1
    assert chi2 < dof + 4 * math.sqrt(2 * dof), (chi2, dof, observed, expected)  # about p < 0.001


def test_score_matches_local_or_refuses(llama_url, local):
    with RemoteGenerator(llama_url, "shakespeare") as remote:
        try:
            got = remote.score("ROMEO:", [" But soft", "\nJULIET"])
        except ValueError as error:
            assert "echoes log-probabilities that disagree" in str(error) and llama_url in str(error)
        else:
            assert got == pytest.approx(local.score("ROMEO:", [" But soft", "\nJULIET"]), abs=1e-3)


def test_fields_it_drops_are_refused(llama_url):
    with RemoteGenerator(llama_url, "shakespeare") as remote, pytest.raises(ValueError, match="typical_p"):
        remote.generate(["ROMEO:"], 1, SamplingParams(typical_p=0.5))
