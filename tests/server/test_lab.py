"""The lab's JSON routes (server/lab.py): shapes, agreement with the library's own results,
bad input as 400 naming the value, and the API key on the data but not on the page."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

import pytest
import torch

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from decodekit.server.app import create_app  # noqa: E402
from decodekit.server.backend import Backend, ServerConfig  # noqa: E402


@pytest.fixture(scope="module")
def lab_models(server_model_dir):
    from decodekit.models.registry import load_model

    return {"tiny": load_model(server_model_dir)}  # its own objects: its own engine


@pytest.fixture(scope="module")
def lab(lab_models):
    app = create_app(Backend(lab_models, ServerConfig(max_n=16, kv_bytes=8 * 2**20)))
    with TestClient(app, base_url="http://127.0.0.1") as client:
        yield client


def post(client, view, body, status=200):
    response = client.post(f"/lab/api/{view}", json=body)
    assert response.status_code == status, response.text
    return response.json()


def test_the_page_starts_on_a_chain_with_active_stages(lab):
    from decodekit.params import SamplingParams
    from decodekit.sampling.chain import chain_stages

    info = lab.get("/lab/api/info").json()
    start = {field: value for fields in info["fields"].values() for field, value in fields.items()}
    assert [name for name, _ in chain_stages(SamplingParams(**start))] == ["temperature", "top_p"]
    out = post(lab, "sampler", {"model": "tiny", "prompt": "hello", "params": start})
    assert [s["name"] for s in out["stages"]] == ["raw", "temperature", "top_p"]
    assert out["stages"][-1]["removed_tokens"] > 0  # top_p 0.95 drops the tail


def test_sampler_stages_are_the_chain_step_by_step(lab, lab_models):
    from decodekit.params import SamplingParams
    from decodekit.sampling import SamplerState, build_chain

    model = lab_models["tiny"]
    params = {"temperature": 0.5, "top_k": 3, "seed": 0}
    out = post(lab, "sampler", {"model": "tiny", "prompt": "hello", "params": params, "top": 8})
    assert [s["name"] for s in out["stages"]] == ["raw", "temperature", "top_k"]
    assert [s["kept_tokens"] for s in out["stages"]] == [model.vocab_size, model.vocab_size, 3]
    assert out["stages"][2]["removed_tokens"] == model.vocab_size - 3
    # the last column is the whole chain's distribution (build_chain), token by token
    ids = model.encode("hello")
    with torch.inference_mode():
        logits = model.forward(torch.tensor([ids]), model.new_cache(1))[0, -1:]
    p = SamplingParams(**params)
    state = SamplerState(p, ids, 1, model.vocab_size, model.eos_token_ids, model.tokenizer)
    expected = torch.softmax(build_chain(p, model.tokenizer)(logits, state)[0].double(), -1)
    for row in out["tokens"]:
        assert row["probs"][-1] == pytest.approx(float(expected[row["id"]]), abs=1e-6)
        assert (row["removed_by"] == "top_k") == (row["probs"][-1] == 0)
    assert sum(r["probs"][-1] for r in out["tokens"]) == pytest.approx(1.0, abs=1e-5)
    assert out["stages"][2]["entropy_bits"] < out["stages"][1]["entropy_bits"]


def test_sampler_steps_by_sampling_and_by_picking(lab):
    body = {"model": "tiny", "prompt": "hello", "params": {"top_k": 2}}
    first = post(lab, "sampler", body)
    kept = [r["id"] for r in first["tokens"] if r["removed_by"] is None]
    sampled = post(lab, "sampler", {**body, "choose": "sample"})
    assert sampled["generated"] == [sampled["chosen"]["id"]] and sampled["chosen"]["id"] in kept
    picked = post(lab, "sampler", {**body, "choose": kept[-1]})
    assert picked["generated"] == [kept[-1]]
    again = post(lab, "sampler", {**body, "generated": picked["generated"], "choose": "sample"})
    assert again["generated"][:1] == [kept[-1]] and len(again["generated"]) == 2
    removed = next(r["id"] for r in first["tokens"] if r["removed_by"] is not None)
    error = post(lab, "sampler", {**body, "choose": removed}, 400)["error"]
    assert error["param"] == "choose" and str(removed) in error["message"]


def test_sampler_replays_the_generated_tokens_for_history_adapters(lab_models):
    from decodekit.params import SamplingParams
    from decodekit.server.lab_views import stage_logits

    model = lab_models["tiny"]
    prompt = model.encode("hello")
    outside = next(t for t in range(model.vocab_size) if t not in prompt)
    params = SamplingParams(repetition_penalty=3.0)
    for generated, penalised in (([], False), ([outside], True)):
        stages, _ = stage_logits(model, prompt, generated, params)
        assert [name for name, _ in stages] == ["raw", "repetition_penalty"]
        raw, after = float(stages[0][1][0, outside]), float(stages[1][1][0, outside])
        expected = (raw / 3 if raw > 0 else raw * 3) if penalised else raw  # CTRL's penalty
        assert after == pytest.approx(expected, rel=1e-6)


def test_beam_tree_holds_the_search_and_its_answer(lab, lab_models):
    from decodekit import SamplingParams, beam_search

    out = post(lab, "beam", {"model": "tiny", "prompt": "hello", "num_beams": 3,
                             "params": {"max_new_tokens": 5}})
    [best] = beam_search(lab_models["tiny"], "hello", SamplingParams(max_new_tokens=5), num_beams=3)
    assert out["hypotheses"][0]["text"] == best.text  # recording changes nothing
    nodes = {n["id"]: n for n in out["nodes"]}
    chosen = [n for n in out["nodes"] if n["chosen"] and n["parent"] is not None]
    assert [n["token"] for n in sorted(chosen, key=lambda n: n["step"])] == best.token_ids
    for step in range(1, out["steps"] + 1):
        assert sum(n["fate"] == "live" for n in out["nodes"] if n["step"] == step) <= 3
    assert all(nodes[n["parent"]]["fate"] == "live" for n in out["nodes"] if n["parent"] is not None)
    assert {n["fate"] for n in out["nodes"]} >= {"live", "pruned"}
    assert out["budget"]["model_calls"] == out["steps"]


def test_speculative_greedy_is_greedy_and_a_perfect_draft_is_all_accepted(lab):
    from decodekit import SamplingParams, generate

    body = {"model": "tiny", "draft": "tiny", "prompt": "hello", "num_draft_tokens": 3,
            "params": {"temperature": 0, "max_new_tokens": 10}}
    out = post(lab, "speculative", body)
    greedy = generate(lab.app.state.backend.models["tiny"], "hello",
                      SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=False))
    assert out["text"] == greedy[0].text
    for rule in ("token", "block"):
        totals = out["totals"][rule]
        assert totals["alpha"] == pytest.approx(1.0)
        assert totals["accepted"] == sum(len(b["draft"]) for b in out["blocks"])
        assert totals["tokens_per_call"] > 1


def test_speculative_rules_side_by_side_on_the_same_draft(lab):
    out = post(lab, "speculative", {"model": "tiny", "draft": "tiny", "prompt": "hello", "follow": "token",
                                    "params": {"temperature": 1.0, "top_k": 20, "max_new_tokens": 12}})
    assert out["follow"] == "token" and out["blocks"]
    for block in out["blocks"]:
        token, blockwise = block["token"], block["block"]
        assert token["source"] in ("residual", "target p") and blockwise["source"] in ("residual", "target p")
        if block["draft"]:  # Sun et al. 2024, Theorem 2: never fewer in expectation
            assert blockwise["expected_accepted"] >= token["expected_accepted"] - 1e-9
    assert out["totals"]["token"]["target_calls"] == len(out["blocks"])


def test_speculative_view_is_the_librarys_own_run(lab):
    """One verify-and-emit path: the view draws `speculative_generate`'s own blocks (its trace)."""
    from decodekit import SamplingParams
    from decodekit.decode.speculative import speculative_generate

    model = lab.app.state.backend.models["tiny"]
    out = post(lab, "speculative", {"model": "tiny", "draft": "tiny", "prompt": "hello", "follow": "block",
                                    "num_draft_tokens": 3,
                                    "params": {"temperature": 1.0, "seed": 5, "max_new_tokens": 12}})
    params = SamplingParams(temperature=1.0, seed=5, max_new_tokens=12, ignore_eos=False)
    result = speculative_generate(model, model, "hello", params, 3, "block")
    assert out["text"] == result.completions[0].text
    assert out["totals"]["block"]["target_calls"] == result.stats.target_calls == len(out["blocks"])
    assert out["totals"]["block"]["accepted"] == result.stats.accepted_tokens


def test_tree_search_nodes_and_chosen_path(lab):
    out = post(lab, "tree", {"question": "13*7-19+4*16", "method": "rebase", "n": 4, "width": 2})
    nodes = {n["id"]: n for n in out["nodes"]}
    [root] = [n for n in out["nodes"] if n["parent"] is None]
    assert root["fate"] == "expanded" and root["chosen"]
    chosen_leaves = [n for n in out["nodes"] if n["chosen"] and n["fate"] not in ("expanded", "pruned")]
    assert len(chosen_leaves) == 1
    leaf = chosen_leaves[0]
    while leaf["parent"] is not None:  # the chosen path runs up to the root
        leaf = nodes[leaf["parent"]]
        assert leaf["chosen"]
    assert out["truth"] == 136 and out["budget"]["n"] == 4 and out["budget"]["scorer_calls"] > 0
    assert all(len(n["scores"]) == n["depth"] for n in out["nodes"])


def test_votes_picks_follow_the_samples(lab):
    out = post(lab, "votes", {"question": "18*17-9*14+6", "n": 6, "params": {"seed": 3}})
    samples = out["samples"]
    assert len(samples) == 6 and out["truth"] == 186
    answered = [s["answer"] for s in samples if s["answer"] is not None]
    counts = Counter(answered)
    assert {t["answer"]: t["total"] for t in out["picks"]["majority"]["tallies"]} == dict(counts)
    assert counts[out["picks"]["majority"]["answer"]] == max(counts.values())
    best = max(samples, key=lambda s: s["reward"])
    assert out["picks"]["best_of_n"]["index"] == samples.index(best)
    weighted = {t["answer"]: t["total"] for t in out["picks"]["weighted"]["tallies"]}
    assert weighted[out["picks"]["weighted"]["answer"]] == max(weighted.values())


@pytest.mark.parametrize("view, body, param", [
    ("sampler", {"model": "nope", "prompt": "x"}, "model"),
    ("sampler", {"model": "tiny", "prompt": "x", "top": 0}, "top"),
    ("sampler", {"model": "tiny", "prompt": "x", "params": {"top_p": 1.5}}, "top_p"),
    ("sampler", {"model": "tiny", "prompt": "x", "params": {"top_q": 1}}, "params"),
    ("sampler", {"model": "tiny", "prompt": "x", "params": {"order": ["top_k", "nope"]}}, "order"),
    ("sampler", {"model": "tiny", "prompt": "x", "generated": [10**9]}, "generated"),
    ("sampler", {"model": "tiny", "prompt": ""}, "prompt"),
    ("beam", {"model": "tiny", "prompt": "x", "num_beams": 0}, "num_beams"),
    ("beam", {"model": "tiny", "prompt": "x", "params": {"max_new_tokens": 10**6}}, "max_new_tokens"),
    ("tree", {"question": "hello"}, "question"),
    ("tree", {"question": "1+2*3", "method": "dfs"}, "method"),
    ("speculative", {"model": "tiny", "draft": "tiny", "prompt": "x", "follow": "both"}, "follow"),
    ("speculative", {"model": "tiny", "prompt": "x", "draft": "nope"}, "draft"),
    ("speculative", {"model": "tiny", "prompt": "x"}, "draft"),  # no tiny-draft: "auto" names it
    ("votes", {"question": "1+2*3", "n": 0}, "n"),
])
def test_bad_values_are_400_naming_the_field(lab, view, body, param):
    error = post(lab, view, body, 400)["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert param in error["message"] or param == "params"


def test_a_body_that_is_not_an_object_is_400(lab):
    response = lab.post("/lab/api/sampler", content=b"[1, 2]", headers={"Content-Type": "application/json"})
    assert response.status_code == 400 and "JSON object" in response.json()["error"]["message"]
    response = lab.post("/lab/api/sampler", content=b"{", headers={"Content-Type": "application/json"})
    assert response.status_code == 400
    response = lab.post("/lab/api/sampler", content=b"{}", headers={"Content-Type": "text/plain"})
    assert response.status_code == 415  # the guard's body checks cover the lab's routes


def test_the_page_is_public_and_its_data_needs_the_key(lab_models):
    backend = Backend(lab_models, ServerConfig(api_key="sesame", kv_bytes=8 * 2**20))
    with TestClient(create_app(backend), base_url="http://127.0.0.1") as client:
        page = client.get("/lab")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert client.get("/lab/static/lab.js").status_code == 200
        assert client.get("/lab/static/app.py").status_code == 404  # only the page's own files
        assert client.get("/lab/static/..%2Fapp.py").status_code == 404
        assert client.get("/lab/api/info").status_code == 401
        assert client.post("/lab/api/sampler", json={"model": "tiny", "prompt": "x"}).status_code == 401
        info = client.get("/lab/api/info", headers={"Authorization": "Bearer sesame"}).json()
        assert info["served"] == ["tiny"] and "arith" in info["models"]
        assert info["adapters"][0] == "logit_bias" and "top_k" in info["fields"]
        from decodekit.params import PRESETS

        assert {k: (v["temperature"], v["top_p"]) for k, v in info["presets"].items()} == PRESETS


def test_the_page_needs_no_network():
    from decodekit.server.lab import FILES, STATIC

    for name in ["index.html", *FILES]:
        text = (STATIC / name).read_text()
        urls = set(re.findall(r"https?://[^\s\"')]+", text)) - {"http://www.w3.org/2000/svg"}
        assert not urls, (name, urls)
    pyproject = (Path(__file__).parents[2] / "pyproject.toml").read_text()
    assert '"server/lab/*"' in pyproject  # shipped in the wheel


def test_the_top_k_bound_is_the_servers(lab):
    """-1 is off in the lab as on the server (SamplingParams' one range); -2 is refused by both
    with one message."""
    off = post(lab, "sampler", {"model": "tiny", "prompt": "hello", "params": {"top_k": -1}})
    assert "top_k" not in [s["name"] for s in off["stages"]]
    lab_error = post(lab, "sampler", {"model": "tiny", "prompt": "hello", "params": {"top_k": -2}}, 400)
    server_error = lab.post("/v1/completions", json={"model": "tiny", "prompt": "hello", "top_k": -2}).json()
    assert lab_error["error"]["message"] == server_error["error"]["message"] == \
        "top_k must be an integer >= -1, got -2"


def test_an_error_names_the_field_as_the_lab_body_does(lab):
    """The lab's params are SamplingParams' own fields: min_new_tokens, not the server's min_tokens."""
    body = {"model": "tiny", "prompt": "hello", "params": {"min_new_tokens": 50}}
    error = post(lab, "beam", body, 400)["error"]
    assert (error["param"], error["message"]) == ("min_new_tokens",
                                                  "min_new_tokens must be <= max_new_tokens (12), got 50")
