"""What each OpenAI-compatible server calls a sampling field, and what it does when a field is
left out: the server profiles RemoteGenerator sends requests by.

A server applies its own defaults to a field a request leaves out: llama.cpp's server
samples with top_k 40, top_p 0.95, min_p 0.05 and repeat penalty 1.1 unless told otherwise,
so a request that sends only the fields it changed draws from another distribution. A
profile lists every field the server knows with its neutral value (the value that leaves
the distribution unchanged), sent whenever the caller left the field at its default, and the
server's name for each SamplingParams field; a field the server does not know at all cannot
be sent, and a request that sets one is refused (`unsupported`).

    vllm       vLLM (`owned_by: vllm`): top_k -1 is off; decodekit's extension names
    sglang     SGLang (`owned_by: sglang`): as vLLM
    llamacpp   llama.cpp's server and llama-cpp-python (`owned_by: llamacpp` or `me`, or a
               `Server: llama.cpp` header): repetition_penalty is `repeat_penalty`, top_k 0 off
    openai     OpenAI's API: top_p and the two penalties only
    decodekit  decodekit's own server: every SamplingParams field by its own name
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from decodekit.params import SamplingParams

# OpenAI's fields, sent by every profile (RemoteGenerator writes them itself).
STANDARD = ("max_new_tokens", "temperature", "top_p", "stop", "seed", "presence_penalty",
            "frequency_penalty", "logit_bias", "n", "logprobs")
# Fields whose effect RemoteGenerator can check with a probe (remote.py `probe_field`).
FILTERS = ("top_k", "top_p", "min_p", "typical_p")  # restrictive value: sampling becomes greedy
PENALTIES = ("repetition_penalty", "presence_penalty", "frequency_penalty")  # a repeated token loses


@dataclass(frozen=True)
class Profile:
    """A server's field names (SamplingParams name -> its name) and neutral values (by its name)."""

    name: str
    names: dict[str, str]
    neutral: dict[str, Any] = field(default_factory=dict)

    def wire_name(self, name: str) -> str | None:
        """The server's name of SamplingParams field `name`, None when it has none."""
        if name in STANDARD:
            return name
        return self.names.get(name)


VLLM_NAMES = {name: name for name in ("top_k", "min_p", "repetition_penalty", "min_new_tokens",
                                      "stop_token_ids", "ignore_eos", "bad_words", "allowed_token_ids")}
VLLM_NAMES["min_new_tokens"] = "min_tokens"
VLLM_NEUTRAL = {"top_k": -1, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0,
                "frequency_penalty": 0.0}
DEFAULTS = SamplingParams()
DECODEKIT_NAMES = {name: {"min_new_tokens": "min_tokens"}.get(name, name)
                   for name in SamplingParams.field_names() if name not in STANDARD}

PROFILES = {
    "vllm": Profile("vllm", VLLM_NAMES, VLLM_NEUTRAL),
    "sglang": Profile("sglang", VLLM_NAMES, VLLM_NEUTRAL),
    "llamacpp": Profile("llamacpp", {"top_k": "top_k", "min_p": "min_p", "repetition_penalty":
                                     "repeat_penalty", "min_new_tokens": "min_tokens"},
                        {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_penalty": 1.0,
                         "presence_penalty": 0.0, "frequency_penalty": 0.0}),
    "openai": Profile("openai", {}, {"top_p": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0}),
    "decodekit": Profile("decodekit", DECODEKIT_NAMES,
                         {"top_k": 0, "top_p": 1.0, "min_p": 0.0, "repetition_penalty": 1.0,
                          "presence_penalty": 0.0, "frequency_penalty": 0.0}),
}
OWNERS = {"decodekit": "decodekit", "vllm": "vllm", "sglang": "sglang", "llamacpp": "llamacpp",
          "llama.cpp": "llamacpp", "me": "llamacpp", "openai": "openai", "system": "openai"}


def profile_named(name: str) -> Profile:
    if name not in PROFILES:
        raise ValueError(f"profile must be one of {sorted(PROFILES)} or None (detect), got {name!r}")
    return PROFILES[name]


def detect_profile(models: dict, server_header: str | None) -> str | None:
    """The profile a `/v1/models` answer (its `owned_by`) or a `Server` header names, or None."""
    for card in models.get("data") or []:
        owner = str(card.get("owned_by", "")).lower()
        if owner in OWNERS:
            return OWNERS[owner]
    if server_header and "llama.cpp" in server_header.lower():
        return "llamacpp"
    return None


def requested_fields(params: SamplingParams) -> dict[str, Any]:
    """The SamplingParams fields (not OpenAI's) a caller set away from their defaults."""
    out = {}
    for name in SamplingParams.field_names():
        value = getattr(params, name)
        if name not in STANDARD and value != getattr(DEFAULTS, name):
            out[name] = list(value) if isinstance(value, tuple) else value
    return out
