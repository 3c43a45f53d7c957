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


def test_first_token_follows_the_local_distribution(llama_url, local):
    """Chi-square of 200 seeded first tokens against the local model's probabilities."""
    import torch

    from decodekit.models.base import prefill

    model = local.model
    with torch.inference_mode():
        logits, _ = prefill(model, [model.encode("ROMEO:")])  # [1, V]
    probs = torch.softmax(logits[0].float(), -1)
    with RemoteGenerator(llama_url, "shakespeare", max_concurrency=4) as remote:
        params = [SamplingParams(max_new_tokens=1, seed=s) for s in range(200)]
        drawn = remote.generate(["ROMEO:"] * 200, 1, params)
    counts = Counter(model.encode("ROMEO:" + cs[0].text)[len(model.encode("ROMEO:"))] for cs in drawn
                     if cs[0].text)
    total = sum(counts.values())
    common = [t for t in range(len(probs)) if probs[t] * total >= 5]
    observed = [counts.get(t, 0) for t in common] + [total - sum(counts.get(t, 0) for t in common)]
    expected = [float(probs[t]) * total for t in common]
    expected.append(total - sum(expected))
    chi2 = sum((o - e) ** 2 / e for o, e in zip(observed, expected) if e > 0)
    dof = len(expected) - 1
    assert chi2 < dof + 4 * math.sqrt(2 * dof), (chi2, dof)  # about p < 0.001


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
