"""The sampling extensions are typed request fields (server/extensions.py): every wrong type or
value of every one is a 400 naming the field as sent, saying what it allows; /openapi.json
declares each with its type, bounds and description (issue 26)."""

from __future__ import annotations

import httpx
import pytest

from decodekit.params import RANGES
from decodekit.server.extensions import EXTENSIONS, RENAMED

OK = {"model": "tiny", "prompt": "ROMEO:", "max_tokens": 2, "seed": 0}
# Wrong for every field: a string, an object, a list holding an object.
COMMON = ["x", {}, [{}]]
# Five more per field, each wrong for that field (types first, then values out of range).
WRONG = {
    "top_k": [1.5, True, None, -2, "3"],
    "min_p": [True, None, -0.1, 1.5, [0.5]],
    "typical_p": [True, None, 0, 1.01, "0.5"],
    "epsilon": [True, None, -0.1, 1, [0.1]],
    "eta": [True, None, -1, 1.0, "0.1"],
    "top_n_sigma": [True, -0.5, -1, [1], "1"],
    "min_tokens_to_keep": [1.5, True, None, 0, -1],
    "mirostat_tau": [True, 0, -1.0, [5], "5"],
    "mirostat_eta": [True, None, -0.1, -5, [0.1]],
    "xtc_threshold": [True, None, -0.1, 1.5, "0.1"],
    "xtc_probability": [True, None, -0.1, 2, [0.5]],
    "dry_multiplier": [True, None, -0.5, -1, "1"],
    "dry_base": [True, None, 0.5, 0, "2"],
    "dry_allowed_length": [1.5, True, None, 0, -3],
    "dry_sequence_breakers": [5, True, None, [5], [["a"]]],
    "repetition_penalty": [True, None, 0, -1.0, "1.2"],
    "no_repeat_ngram_size": [1.5, True, None, -1, "2"],
    "bad_words": [5, True, None, [5], [""]],
    "allowed_token_ids": [5, True, [], [-1], [10**9]],
    "stop_token_ids": [5, True, None, [-1], [1.5]],
    "ignore_eos": [5, None, 0, 1, "true"],
    "truncate_prompt_tokens": [1.5, True, 0, -2, 10**6],
    "order": [5, True, None, ["nope"], ["top_k", "top_k"]],
    "min_new_tokens": [1.5, True, None, -1, 10**6],
    "min_tokens": [1.5, True, None, -1, 10**6],
}


def test_the_sweep_covers_every_extension_with_eight_wrong_values():
    assert set(WRONG) == {*EXTENSIONS, *RENAMED}
    assert all(len(COMMON + values) == 8 for values in WRONG.values())


@pytest.fixture(scope="module")
def app_client(server):
    """A TestClient over a second app on the shared server's (started) backend."""
    from fastapi.testclient import TestClient

    from decodekit.server.app import create_app

    _, backend = server
    return TestClient(create_app(backend), base_url="http://127.0.0.1")


def test_every_wrong_value_of_every_extension_is_a_400_naming_the_field(app_client):
    silent, unnamed, vague = [], [], []
    for name, values in WRONG.items():
        for value in COMMON + values:
            response = app_client.post("/v1/completions", json={**OK, name: value})
            if response.status_code == 200:
                silent.append((name, value))
                continue
            assert response.status_code == 400, (name, value, response.text)
            error = response.json()["error"]
            if error["param"] != name:
                unnamed.append((name, value, error))
            if not error["message"].startswith(name) or "must" not in error["message"]:
                vague.append((name, value, error["message"]))
    assert silent == [], f"{len(silent)} silent 200s: {silent}"
    assert unnamed == [], f"{len(unnamed)} answers not naming the field: {unnamed}"
    assert vague == [], vague


@pytest.mark.parametrize(("name", "value", "message"), [
    ("ignore_eos", "x", "ignore_eos must be true or false, got 'x'"),
    ("top_k", -2, "top_k must be an integer >= -1, got -2"),
    ("typical_p", 0, "typical_p must be a number in (0, 1], got 0"),
    ("bad_words", [5], "bad_words must be a list of words, each a non-empty string or a non-empty list of "
                       "token ids (integers >= 0), got 5 (at bad_words[0])"),
    ("min_tokens", 10**6, "min_tokens must be <= max_tokens (2), got 1000000"),
    ("min_new_tokens", 10**6, "min_new_tokens must be <= max_tokens (2), got 1000000"),
])
def test_the_message_names_the_value_and_what_is_allowed(app_client, name, value, message):
    error = app_client.post("/v1/completions", json={**OK, name: value}).json()["error"]
    assert (error["param"], error["message"]) == (name, message)


def test_right_values_are_accepted(app_client):
    given = {"top_k": -1, "min_p": 0.1, "top_n_sigma": None, "mirostat_tau": None, "bad_words": ["zz", [7]],
             "allowed_token_ids": None, "stop_token_ids": [], "ignore_eos": True, "order": ["top_k"],
             "dry_sequence_breakers": [], "min_tokens": 1, "epsilon": 0}
    response = app_client.post("/v1/completions", json={**OK, **given})
    assert response.status_code == 200, response.text


def test_min_tokens_and_min_new_tokens_together_are_refused(app_client):
    error = app_client.post("/v1/completions", json={**OK, "min_tokens": 1, "min_new_tokens": 1}).json()
    assert error["error"]["param"] == "min_tokens"


def test_the_document_types_every_extension(server):
    thread, _ = server
    document = httpx.get(thread.url + "/openapi.json").json()
    properties = document["components"]["schemas"]["CompletionRequest"]["properties"]
    for name in (*EXTENSIONS, *RENAMED):
        schema = properties[name]
        assert "Allowed: " in schema["description"], name
        assert "type" in schema or "anyOf" in schema, name
    assert properties["top_k"] | {"description": ""} == {"default": 0, "description": "", "minimum": -1,
                                                          "title": "Top K", "type": "integer"}
    assert properties["typical_p"]["exclusiveMinimum"] == 0 and properties["typical_p"]["maximum"] == 1
    assert properties["ignore_eos"]["type"] == "boolean"
    assert {"type": "null"} in properties["mirostat_tau"]["anyOf"]
    assert properties["order"]["uniqueItems"] is True
    bounded = {name for name in RANGES if name in properties and name in EXTENSIONS}
    assert bounded == {name for name in EXTENSIONS if name in RANGES}


def schema_values(schema: dict) -> list:
    """Values the published schema allows for a field: its default, its bounds (an open bound
    nudged inside), and null where it is nullable."""
    values = [schema["default"]]
    for option in schema.get("anyOf", [schema]):
        if option.get("type") == "null":
            values.append(None)
        for key, nudge in (("minimum", 0), ("maximum", 0), ("exclusiveMinimum", 1e-3),
                           ("exclusiveMaximum", -1e-3)):
            if key in option:
                values.append(option[key] + nudge)
        if option.get("type") == "array" and "minItems" not in option:
            values.append([])
    return values


def test_values_the_document_allows_are_accepted(server, app_client):
    """Positive data acceptance for every extension: each value its schema allows is a 200."""
    thread, _ = server
    document = httpx.get(thread.url + "/openapi.json").json()
    properties = document["components"]["schemas"]["CompletionRequest"]["properties"]
    refused = []
    for name in (*EXTENSIONS, *RENAMED):
        for value in schema_values(properties[name]):
            response = app_client.post("/v1/completions", json={**OK, name: value})
            if response.status_code != 200:
                refused.append((name, value, response.json()["error"]["message"]))
    assert refused == []
