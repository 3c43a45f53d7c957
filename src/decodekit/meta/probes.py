"""Checks that an endpoint does what a request asks, run once per endpoint by RemoteGenerator.

A server that does not know a field drops it without an error (llama.cpp's server ignores
`typical_p`; OpenAI's ignores `top_k`), and one whose echoed prompt log-probabilities are
shifted by a position answers a scoring request with every expected field and wrong
numbers. Each check asks for a known effect and looks for it:

- a filter (top_k, top_p, min_p, typical_p) at its most restrictive value (top_k 1, top_p
  and typical_p 1e-9, min_p 1) leaves one token, so `SAMPLES` seeded one-token draws at
  temperature `HOT` must all be the same token; the same draws without it must not be
  (otherwise the check cannot tell, and says so);
- a penalty (repetition, presence, frequency) at its strongest value must change the
  greedy next token where the model's own greedy continuation first repeats a token
  (the prompt then holds the token greedy picks; small models loop within 24 tokens);
- scoring: a short greedy continuation's log-probabilities, as generated, must equal those
  the echo request reports for the same text, within `SCORE_TOLERANCE`.

`send(body) -> response` posts one /v1/completions body (the endpoint's neutral fields
added) and returns its JSON.
"""

from __future__ import annotations

from collections.abc import Callable

from decodekit.meta.profiles import FILTERS, PENALTIES

PROMPT = "The"
SAMPLES = 8
HOT = 3.0
SCORE_TOLERANCE = 1e-3
STRONGEST = {"top_k": 1, "top_p": 1e-9, "min_p": 1.0, "typical_p": 1e-9, "repetition_penalty": 1e4,
             "presence_penalty": 2.0, "frequency_penalty": 2.0}

Send = Callable[[dict], dict]


class Inconclusive(ValueError):
    """The check could not tell whether the endpoint honours the field."""


def text_of(response: dict) -> str:
    return (response.get("choices") or [{}])[0].get("text") or ""


def first_tokens(send: Send, prompt: str, fields: dict) -> list[str]:
    return [text_of(send({"prompt": prompt, "max_tokens": 1, "temperature": HOT, "seed": seed, **fields}))
            for seed in range(SAMPLES)]


def greedy(send: Send, prompt: str, tokens: int, fields: dict | None = None) -> dict:
    return send({"prompt": prompt, "max_tokens": tokens, "temperature": 0.0, **(fields or {})})


def honours(send: Send, name: str, wire_name: str) -> bool:
    """Whether the endpoint applies SamplingParams field `name` (sent as `wire_name`)."""
    field = {wire_name: STRONGEST[name]}
    if name in FILTERS:
        if len(set(first_tokens(send, PROMPT, {}))) == 1:
            raise Inconclusive(f"{SAMPLES} draws at temperature {HOT} were all the same token")
        return len(set(first_tokens(send, PROMPT, field))) == 1
    assert name in PENALTIES, name
    answer = greedy(send, PROMPT, 24, {"logprobs": 0})
    tokens = ((answer.get("choices") or [{}])[0].get("logprobs") or {}).get("tokens") or []
    repeat = next((j for j, token in enumerate(tokens) if token and token in tokens[:j]), None)
    if repeat is None:
        raise Inconclusive("the greedy continuation repeats no token")
    prompt = PROMPT + "".join(tokens[:repeat])  # its greedy next token is one the prompt holds
    plain = text_of(greedy(send, prompt, 1))
    if not plain or plain not in prompt:
        raise Inconclusive("the greedy next token does not repeat the prompt")
    return text_of(greedy(send, prompt, 1, field)) != plain


def score_agrees(send: Send, prompt: str) -> tuple[float, float] | None:
    """(generated, echoed) log-probability of a greedy continuation of `prompt` (up to 4 tokens,
    fewer when the echo tokenises the text otherwise), None when the two agree."""
    answer = greedy(send, prompt, 4, {"logprobs": 0})
    logprobs = (answer.get("choices") or [{}])[0].get("logprobs") or {}
    pairs = list(zip(logprobs.get("tokens") or [], logprobs.get("token_logprobs") or []))
    for m in range(len(pairs), 0, -1):
        tokens = [token for token, _ in pairs[:m]]
        if not "".join(tokens) or any(value is None for _, value in pairs[:m]):
            continue
        echo = send({"prompt": prompt + "".join(tokens), "max_tokens": 1, "echo": True, "logprobs": 0,
                     "temperature": 0.0})
        echoed = (echo.get("choices") or [{}])[0].get("logprobs") or {}
        prompt_tokens = (echo.get("usage") or {}).get("prompt_tokens") or 0
        rows = list(zip(echoed.get("tokens") or [], echoed.get("token_logprobs") or [],
                        echoed.get("text_offset") or []))[:prompt_tokens]
        tail = [(token, value) for token, value, offset in rows if offset >= len(prompt)]
        if [token for token, _ in tail] != tokens or any(value is None for _, value in tail):
            continue  # the echo splits the text otherwise: try a shorter one
        generated, echoed_sum = sum(v for _, v in pairs[:m]), sum(v for _, v in tail)
        return None if abs(generated - echoed_sum) <= SCORE_TOLERANCE else (generated, echoed_sum)
    raise Inconclusive("no greedy continuation is echoed as the same tokens")
