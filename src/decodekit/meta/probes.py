"""Checks that an endpoint does what a request asks, run once per endpoint by RemoteGenerator.

A server that does not know a field drops it without an error (llama.cpp's server ignores
`typical_p`; OpenAI's ignores `top_k`), and one whose echoed prompt log-probabilities are
shifted by a position answers a scoring request with every expected field and wrong
numbers. Each check asks for a known effect and looks for it:

- a filter (top_k, top_p, min_p, typical_p) at its most restrictive value (top_k 1, top_p
  and typical_p 1e-9, min_p 1) leaves one token, so `SAMPLES` seeded one-token draws at
  temperature `HOT` must all be the same token; the same draws without it must not be
  (otherwise the check cannot tell, and says so). `HOT` is 2, the top of the range OpenAI
  and vLLM accept ([0, 2]: vLLM answers 400 to more), so the probe is a request every
  profile's server takes;
- a penalty (repetition 1e4; presence and frequency 2, the top of OpenAI's range) must
  change the greedy continuation of `PENALTY_TOKENS` tokens, which must repeat a token
  (small models loop within 24 tokens; otherwise the check cannot tell). Servers apply
  presence and frequency penalties to the tokens they generate, not the prompt (OpenAI,
  vLLM, llama.cpp, decodekit), so only a continuation shows them: a first generated token
  never changes;
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
HOT = 2.0  # the highest temperature OpenAI and vLLM accept
PENALTY_TOKENS = 24
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
    plain = greedy(send, PROMPT, PENALTY_TOKENS, {"logprobs": 0})
    tokens = ((plain.get("choices") or [{}])[0].get("logprobs") or {}).get("tokens") or []
    repeats = any(token in tokens[:j] for j, token in enumerate(tokens))
    if tokens and not repeats:
        raise Inconclusive(f"the greedy continuation of {PROMPT!r} repeats no token in {PENALTY_TOKENS}")
    if text_of(greedy(send, PROMPT, PENALTY_TOKENS, field)) != text_of(plain):
        return True
    if not tokens:  # no tokens to show that something was there to penalise
        raise Inconclusive("the endpoint returned no token log-probabilities, and the penalty changed "
                           "nothing")
    return False


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
