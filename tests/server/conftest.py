"""A server on a free loopback port over the tiny random Llama (tests/conftest.py), shared by
the server tests. Its copy of the checkpoint has a longer context (512), so streams can run
long enough to be cut off mid-way."""

from __future__ import annotations

import json
import shutil

import pytest


@pytest.fixture(scope="session")
def server_model_dir(tiny_llama_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama-512") / "tiny"
    shutil.copytree(tiny_llama_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["max_position_embeddings"] = 512
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="session")
def other_model_dir(server_model_dir, tmp_path_factory):
    """The same tokenizer and shape with other random weights (a draft or amateur model)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-llama-other") / "tiny-2"
    shutil.copytree(server_model_dir, path)
    torch.manual_seed(1)
    LlamaForCausalLM(LlamaConfig.from_pretrained(path)).save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def server_models(server_model_dir, other_model_dir):
    from decodekit.models.registry import load_model

    return {"tiny": load_model(server_model_dir), "tiny-2": load_model(other_model_dir)}


@pytest.fixture(scope="session")
def server(server_models):
    """(ServerThread, Backend): the shared server, with a small bound on max_tokens."""
    from decodekit.server.app import ServerThread
    from decodekit.server.backend import Backend, ServerConfig

    backend = Backend(server_models, ServerConfig(max_tokens=400, max_n=16, kv_bytes=8 * 2**20))
    with ServerThread(backend) as thread:
        yield thread, backend


@pytest.fixture(scope="session")
def client(server):
    import openai

    thread, _ = server
    return openai.OpenAI(base_url=thread.url + "/v1", api_key="unused", max_retries=0, timeout=60)
