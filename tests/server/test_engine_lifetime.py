"""The server follows its model's persistent engine (server/backend.py `Backend.engine`):
an engine replaced by `engine_for` with another config, or rebuilt because the weights
changed, is never served from again; the replaced one stops once drained."""

from __future__ import annotations

import httpx
import torch

from decodekit.engine.config import EngineConfig
from decodekit.engine.engine import engine_for, forget_engine
from decodekit.models.registry import load_model

BODY = {"model": "tiny", "prompt": "ROMEO:", "max_tokens": 6, "temperature": 0}


def test_a_replaced_engine_is_never_served_from_again(server_model_dir):
    from decodekit.server.app import ServerThread
    from decodekit.server.backend import Backend, ServerConfig

    model = load_model(server_model_dir)
    backend = Backend({"tiny": model}, ServerConfig(kv_bytes=4 * 2**20))
    with ServerThread(backend) as thread:
        first = httpx.post(thread.url + "/v1/completions", json=BODY, timeout=30).json()
        old = backend.engines["tiny"]
        new = engine_for(model, EngineConfig(num_blocks=64))  # another caller, another bound
        assert new is not old
        again = httpx.post(thread.url + "/v1/completions", json=BODY, timeout=30).json()
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        current = backend.engines["tiny"]
        assert current is not old and current.stats()["generated_tokens"] == 6  # served there
        assert old.background._thread is None  # drained and stopped
        with torch.no_grad():
            model.net.norm.weight.mul_(0.5)  # weights changed in place: cached KV is stale
        changed = httpx.post(thread.url + "/v1/completions", json=BODY, timeout=30).json()
        assert backend.engines["tiny"] is not current
        forget_engine(model)
        want = httpx.post(thread.url + "/v1/completions", json=BODY, timeout=30).json()
        assert changed["choices"][0]["text"] == want["choices"][0]["text"]
        health = httpx.get(thread.url + "/health", timeout=30).json()
        assert health["models"]["tiny"]["generated_tokens"] == 6  # the engine it now serves from
