"""decodekit: language-model inference algorithms behind one API.

    import decodekit as dk
    model = dk.load_model("shakespeare")
    [[completion]] = dk.generate(model, ["ROMEO:"], dk.SamplingParams(max_new_tokens=40))
"""

from decodekit.completion import Completion, Usage
from decodekit.params import SamplingParams

__all__ = [
    "ChatReply",
    "Choices",
    "Completion",
    "Constraint",
    "ContrastiveLM",
    "Grammar",
    "JsonSchema",
    "Regex",
    "SamplingParams",
    "Tool",
    "Usage",
    "beam_search",
    "chat",
    "generate",
    "load_model",
    "speculative_generate",
    "stream",
]


def __getattr__(name):
    # Model loading and decoding import torch and transformers; keep `import decodekit`
    # (and so `decodekit --help`) cheap by importing them on first use.
    if name == "load_model":
        from decodekit.models.registry import load_model

        return load_model
    if name in ("generate", "stream"):
        from decodekit.decode import sample

        return getattr(sample, name)
    if name == "Tool":
        from decodekit.decode.tool_calls import Tool

        return Tool
    if name in ("chat", "ChatReply"):
        from decodekit import conversation

        return getattr(conversation, name)
    if name == "beam_search":
        from decodekit.decode.beam import beam_search

        return beam_search
    if name in ("Constraint", "JsonSchema", "Regex", "Grammar", "Choices"):
        from decodekit.decode import constrained

        return getattr(constrained, name)
    if name == "ContrastiveLM":
        from decodekit.decode.contrastive import ContrastiveLM

        return ContrastiveLM
    if name == "speculative_generate":
        from decodekit.decode.speculative import speculative_generate

        return speculative_generate
    raise AttributeError(f"module 'decodekit' has no attribute {name!r}")
