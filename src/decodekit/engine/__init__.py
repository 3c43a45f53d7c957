"""Batched execution: paged KV blocks, prefix cache, continuous-batching scheduler (issue 4)."""

from decodekit.engine.config import EngineConfig
from decodekit.engine.engine import Engine, EngineFull, RequestHandle

__all__ = ["Engine", "EngineConfig", "EngineFull", "RequestHandle"]
