"""The OpenAPI document declares the request bodies, responses and error answers; the server's
answers conform to it (checked with jsonschema here; schemathesis' full run, when installed)."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def document(server):
    thread, _ = server
    return httpx.get(thread.url + "/openapi.json").json()


def resolve(document: dict, schema: dict) -> dict:
    ref = schema.get("$ref")
    return document["components"]["schemas"][ref.rsplit("/", 1)[1]] if ref else schema


def validator(document: dict, schema: dict):
    jsonschema = pytest.importorskip("jsonschema")
    return jsonschema.Draft202012Validator({**schema, "components": document["components"]})


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_posts_declare_their_body_responses_and_errors(document, path):
    operation = document["paths"][path]["post"]
    body = resolve(document, operation["requestBody"]["content"]["application/json"]["schema"])
    assert body["additionalProperties"] is True and "top_k" in body["properties"]  # unknown keys: ignored
    assert body["properties"]["model"]["enum"] == ["tiny", "tiny-2"]
    assert set(operation["responses"]) == {"200", "400", "401", "403", "404", "405", "413", "415", "503",
                                           "504"}
    error = operation["responses"]["400"]["content"]["application/json"]["schema"]
    assert resolve(document, error)["required"] == ["error"]


def test_answers_conform_to_the_document(server, document):
    thread, _ = server
    paths = document["paths"]
    ok = paths["/v1/completions"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    request = {"model": "tiny", "prompt": "ab", "max_tokens": 2, "logprobs": 1, "seed": 0}
    answer = httpx.post(thread.url + "/v1/completions", json=request)
    assert answer.status_code == 200
    validator(document, ok).validate(answer.json())
    chat = paths["/v1/chat/completions"]["post"]["responses"]["200"]["content"]["application/json"]["schema"]
    answer = httpx.post(thread.url + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "logprobs": True})
    validator(document, chat).validate(answer.json())
    body = paths["/v1/completions"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    request = resolve(document, body)
    typo = {"model": "tiny", "prompt": "a", "max_tokens": 2, "tmperature": 1}
    assert validator(document, request).is_valid(typo)  # ignored, as vLLM does (test_clients.py: strict)
    ignored = httpx.post(thread.url + "/v1/completions", json=typo)
    assert ignored.status_code == 200 and ignored.headers["X-Ignored-Fields"] == "tmperature"
    validator(document, ok).validate(ignored.json())
    refused = httpx.post(thread.url + "/v1/completions", json={**typo, "temperature": -1})
    error = paths["/v1/completions"]["post"]["responses"]["400"]["content"]["application/json"]["schema"]
    assert refused.status_code == 400
    validator(document, error).validate(refused.json())
    wrong = httpx.post(thread.url + "/v1/models", json={})
    assert wrong.status_code == 405 and wrong.headers["allow"] == "GET"  # not the guard's 415


@pytest.mark.skipif(os.environ.get("DECODEKIT_FUZZ") != "1" or shutil.which("curl") is None,
                    reason="schemathesis' full run takes a minute: DECODEKIT_FUZZ=1 (needs schemathesis)")
def test_schemathesis_full_run_passes():
    """Every check, positive data acceptance included (the 400s it tolerates are the checks across
    fields: scripts/fuzz_server.sh). Run here with schemathesis 4.32.5 (a separate environment,
    SCHEMATHESIS=.../bin/schemathesis): 1,537 cases at 20 examples per operation, no issue."""
    import sys

    schemathesis = Path(os.environ.get("SCHEMATHESIS") or Path(sys.executable).with_name("schemathesis"))
    if not schemathesis.exists():
        pytest.skip("schemathesis is not installed (beside this Python, or at $SCHEMATHESIS)")
    run = subprocess.run(["bash", str(ROOT / "scripts" / "fuzz_server.sh"), "10"], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "PYTHON": sys.executable,
                                                      "SCHEMATHESIS": str(schemathesis), "PORT": "8197"})
    assert run.returncode == 0, run.stdout[-3000:]
