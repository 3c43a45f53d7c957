"""Models off the engine (the worker thread), tokenizer chat templates, model specs and the
`serve` command line."""

from __future__ import annotations

import json
import shutil

import openai
import pytest

import decodekit as dk
from decodekit.cli import build_parser
from decodekit.params import SamplingParams
from decodekit.server.app import ServerThread, load_models
from decodekit.server.backend import Backend, ServerConfig

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def templated_dir(server_model_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("templated") / "templated"
    shutil.copytree(server_model_dir, path)
    config = json.loads((path / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def other_server(server_model_dir, templated_dir):
    models = {"hf": dk.load_model(server_model_dir, backend="hf"), "templated": dk.load_model(templated_dir)}
    backend = Backend(models, ServerConfig(kv_bytes=2**20))
    with ServerThread(backend) as thread:
        yield thread, backend, openai.OpenAI(base_url=thread.url + "/v1", api_key="x", max_retries=0)


def test_a_model_off_the_engine_runs_in_the_worker(other_server):
    _, backend, client = other_server
    assert "hf" not in backend.engines and "templated" in backend.engines
    kwargs = dict(model="hf", prompt="ROMEO:", max_tokens=12, seed=3)
    whole = client.completions.create(**kwargs).choices[0].text
    [expected] = dk.generate(backend.models["hf"], "ROMEO:", SamplingParams(max_new_tokens=12, seed=3))
    assert whole == expected.text
    assert "".join(c.choices[0].text for c in client.completions.create(stream=True, **kwargs)) == whole


def test_the_tokenizer_chat_template_is_used(other_server):
    _, backend, client = other_server
    response = client.chat.completions.create(model="templated", max_tokens=8, seed=1,
                                              messages=[{"role": "user", "content": "Hi"}])
    model = backend.models["templated"]
    prompt = model.tokenizer.encode("<user>Hi<assistant>", add_special_tokens=False)
    [[expected]] = dk.generate(model, [prompt], SamplingParams(max_new_tokens=8, seed=1))
    assert response.choices[0].message.content == expected.text
    assert response.usage.prompt_tokens == len(prompt)


def test_model_specs(server_model_dir):
    models = load_models([f"alias={server_model_dir}", str(server_model_dir)])
    assert list(models) == ["alias", server_model_dir.name]
    with pytest.raises(ValueError, match="given twice"):
        load_models([f"a={server_model_dir}", f"a={server_model_dir}"])
    with pytest.raises(ValueError, match="does not exist"):
        load_models(["./no/such/dir"])


def test_server_config_is_validated():
    with pytest.raises(ValueError, match="max_queued"):
        ServerConfig(max_queued=0)
    with pytest.raises(ValueError, match="request_timeout"):
        ServerConfig(request_timeout=-1)
    with pytest.raises(ValueError, match="at least one model"):
        Backend({})


def test_serve_command_line():
    args = build_parser().parse_args(["serve", "--model", "a", "--model", "b=dir", "--port", "9001",
                                      "--max-queued", "7", "--timeout", "2.5"])
    assert (args.model, args.port, args.host, args.max_queued, args.timeout) == \
        (["a", "b=dir"], 9001, "127.0.0.1", 7, 2.5)
    eval_args = build_parser().parse_args(["eval", "arith", "--endpoint", "http://127.0.0.1:9/v1"])
    assert eval_args.endpoint == ["http://127.0.0.1:9/v1"]
