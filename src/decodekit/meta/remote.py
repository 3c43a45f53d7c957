"""A `Generator` over any OpenAI-compatible endpoint: decodekit's own server, vLLM, SGLang.

    generator = RemoteGenerator("http://127.0.0.1:8000/v1", "shakespeare")
    result = best_of_n(generator, "ROMEO:", 8, scorer)            # any meta-generator, unchanged

Each prompt of a `generate` call is one `/v1/completions` request asking for its n samples
(`n`), sent by a pool of `max_concurrency` threads. SamplingParams travel as OpenAI fields
(max_tokens, temperature, top_p, stop, seed, penalties, logit_bias, logprobs) plus, for a
value that differs from its default, decodekit's own field name (top_k, min_p, ...: README
"Server"; vLLM accepts the common ones). Failures: 429 and 5xx answers and connection
errors are retried `retries` times with exponential backoff (`backoff` * 2^attempt
seconds), waiting what a Retry-After header asks instead when it is given; other 4xx
answers raise `RemoteRequestError` (a ValueError) at once.

Sequential fallback: an endpoint that refuses n > 1 (a 400 naming `n`, or fewer choices
than asked) gets n separate requests instead, sample i seeded with seed + i (unseeded
stays unseeded); the generator remembers the refusal. Samples drawn this way differ from
the server's own n-sample draw for the same seed, but are equally distributed.

Accounting: every request's `usage` goes into `budget`, as `LocalGenerator` counts a local
call: the prompt once per request (the n samples of one request share its prefill, so
samples 1..n-1 mark their prompt tokens cached), and each sample's generated tokens.

What comes back: `Completion.text`, `finish_reason`, `logprobs` (the endpoint's token
log-probabilities: requested with `logprobs=0` unless `request_logprobs=False`),
`top_logprobs` keyed by token text (not id) when params.logprobs asks, `token_ids` when
the endpoint returns them (`return_token_ids=True`; decodekit and recent vLLM do), and
`processed_logprobs` empty (no endpoint reports them).

`score(prompt, continuations)` sums the continuation's prompt log-probabilities from an
`echo` request (max_tokens 1, logprobs 0); an endpoint without echo log-probabilities
raises ValueError("endpoint does not support scoring: ...").
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import fields

from decodekit.completion import Completion, Usage
from decodekit.meta.budget import Budget
from decodekit.meta.generator import account_request, per_prompt_counts
from decodekit.params import SamplingParams
from decodekit.request import per_prompt_params

# SamplingParams fields sent as OpenAI fields (the rest go by their own name when not default).
STANDARD = {"max_new_tokens", "temperature", "top_p", "stop", "seed", "presence_penalty",
            "frequency_penalty", "logit_bias", "n", "logprobs"}
RENAMED = {"min_new_tokens": "min_tokens"}  # vLLM's name
MAX_SEED = 2**63 - 1
MAX_WAIT = 60.0  # longest single wait between retries, whatever Retry-After says


class RemoteError(RuntimeError):
    """The endpoint failed (5xx, 429 or no connection) after every retry."""

    def __init__(self, message: str, status: int | None = None, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


class RemoteRequestError(ValueError):
    """The endpoint refused the request (a 4xx other than 429): retrying would not help."""

    def __init__(self, message: str, status: int, param: str | None = None):
        super().__init__(message)
        self.status, self.param = status, param


def request_body(model: str, prompt: str, k: int, params: SamplingParams, logprobs: bool) -> dict:
    """The /v1/completions body of one prompt, k samples."""
    body: dict = {"model": model, "prompt": prompt, "n": k, "max_tokens": params.max_new_tokens,
                  "temperature": params.temperature}
    if params.top_p != 1.0:
        body["top_p"] = params.top_p
    if params.stop:
        body["stop"] = list(params.stop)
    if params.seed is not None:
        body["seed"] = params.seed
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(params, name):
            body[name] = getattr(params, name)
    if params.logit_bias:
        body["logit_bias"] = {str(token): bias for token, bias in params.logit_bias.items()}
    if params.logprobs or logprobs:
        body["logprobs"] = params.logprobs or 0
    defaults = SamplingParams()
    for f in fields(SamplingParams):
        value = getattr(params, f.name)
        if f.name not in STANDARD and value != getattr(defaults, f.name):
            body[RENAMED.get(f.name, f.name)] = list(value) if isinstance(value, tuple) else value
    return body


def completions_of(response: dict, prompt_tokens: int | None = None) -> list[Completion]:
    """The choices of a /v1/completions response as Completions (in choice order)."""
    choices = sorted(response.get("choices", []), key=lambda c: c.get("index", 0))
    usage = response.get("usage") or {}
    prompt = usage.get("prompt_tokens", prompt_tokens or 0)
    total = usage.get("completion_tokens", 0)
    out = []
    for i, choice in enumerate(choices):
        logprobs = choice.get("logprobs") or {}
        token_logprobs = [lp for lp in logprobs.get("token_logprobs") or [] if lp is not None]
        ids = list(choice.get("token_ids") or [])
        counted = len(ids) or len(token_logprobs)
        if not counted and choices:  # no per-choice count: share the total, remainder first
            counted = total // len(choices) + (1 if i < total % len(choices) else 0)
        reason = choice.get("finish_reason") or "stop"
        out.append(Completion(
            token_ids=ids,
            text=choice.get("text") or "",
            logprobs=token_logprobs,
            processed_logprobs=[],
            finish_reason="length" if reason == "length" else "stop",
            usage=Usage(prompt, counted),
            top_logprobs=logprobs.get("top_logprobs") or None,
            stop_reason=choice.get("stop_reason"),
        ))
    return out


def refuses_n(error: RemoteRequestError) -> bool:
    """Whether a 4xx answer says the endpoint does not take n > 1."""
    return error.param == "n" or re.search(r"(?<![\w.])n(?![\w.])|\bbest_of\b", str(error)) is not None


class RemoteGenerator:
    """A Generator over an OpenAI-compatible endpoint (see the module doc)."""

    def __init__(
        self,
        base_url: str,
        model: str,
        api_key: str | None = None,
        max_concurrency: int = 8,
        retries: int = 3,
        *,
        timeout: float = 600.0,
        backoff: float = 0.5,
        budget: Budget | None = None,
        request_logprobs: bool = True,
        return_token_ids: bool = False,
        transport=None,
    ):
        import httpx

        for name, value, lowest in (("max_concurrency", max_concurrency, 1), ("retries", retries, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
                raise ValueError(f"{name} must be an integer >= {lowest}, got {value!r}")
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"base_url must be an http(s) URL, got {base_url!r}")
        base = base_url.rstrip("/")
        self.base_url = base if base.endswith("/v1") else base + "/v1"
        self.model = model
        key = api_key or os.environ.get("DECODEKIT_API_KEY") or os.environ.get("OPENAI_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        # Idle connections are dropped after 2 s, before a server's usual 5 s keep-alive timeout
        # can close one just as it is reused (a failed POST; retried, but wasted).
        limits = httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency,
                              keepalive_expiry=2.0)
        self.client = httpx.Client(headers=headers, timeout=timeout, limits=limits, transport=transport)
        self.pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="decodekit-remote")
        self.retries, self.backoff = retries, backoff
        self.budget = budget if budget is not None else Budget()
        self.request_logprobs, self.return_token_ids = request_logprobs, return_token_ids
        self.n_supported = True  # set False once the endpoint refuses n > 1
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ HTTP

    def post(self, path: str, body: dict) -> dict:
        """POST with retries on 429, 5xx and connection errors; 4xx raise RemoteRequestError."""
        import httpx

        url = self.base_url + path
        error: Exception | None = None
        for attempt in range(self.retries + 1):
            response = None
            try:
                response = self.client.post(url, json=body)
            except httpx.TransportError as failure:
                error = RemoteError(f"{url}: {type(failure).__name__}: {failure}")
            else:
                if response.status_code == 200:
                    return response.json()
                message, param = error_detail(response)
                text = f"{url} answered {response.status_code}: {message}"
                if response.status_code != 429 and response.status_code < 500:
                    raise RemoteRequestError(text, response.status_code, param)
                error = RemoteError(text, response.status_code, param)
            if attempt < self.retries:
                time.sleep(retry_wait(response, attempt, self.backoff))
        assert error is not None
        raise error

    # ------------------------------------------------------------------ Generator

    def generate(
        self,
        prompts: Sequence[str],
        n: int | Sequence[int],
        params: SamplingParams | Sequence[SamplingParams],
    ) -> list[list[Completion]]:
        prompts = list(prompts)
        counts = per_prompt_counts(n, len(prompts))
        params_list = per_prompt_params(params, len(prompts))
        futures = [self.pool.submit(self._samples, prompt, k, p)
                   for prompt, k, p in zip(prompts, counts, params_list)]
        results = []
        for future in futures:
            requests = future.result()  # each request's completions, in order
            for completions in requests:
                account_request(self.budget, completions)
            results.append([c for completions in requests for c in completions])
        return results

    def _samples(self, prompt: str, k: int, params: SamplingParams) -> list[list[Completion]]:
        """k samples of one prompt: one request, or up to k (the sequential fallback)."""
        requests: list[list[Completion]] = []
        if k == 1 or self.n_supported:
            try:
                completions = self._request(prompt, k, params)
                for completion in completions[1:]:  # the server shared the prompt's prefill
                    completion.usage.cached_prompt_tokens = completion.usage.prompt_tokens
                requests.append(completions[:k])
            except RemoteRequestError as error:
                if k == 1 or not refuses_n(error):
                    raise
            if requests and len(requests[0]) == k:
                return requests
            with self._lock:
                self.n_supported = False
        # Sample i (beyond those returned) is its own request, seeded seed + i.
        for i in range(sum(len(r) for r in requests), k):
            seed = None if params.seed is None else (params.seed + i) % MAX_SEED
            requests.append(self._request(prompt, 1, params.replace(seed=seed)))
        return requests

    def _request(self, prompt: str, k: int, params: SamplingParams) -> list[Completion]:
        body = request_body(self.model, prompt, k, params, self.request_logprobs)
        if self.return_token_ids:
            body["return_token_ids"] = True
        return completions_of(self.post("/completions", body))

    def score(self, prompt: str, continuations: Sequence[str]) -> list[float]:
        """log p(continuation | prompt) of each, from the endpoint's echoed prompt log-probs."""
        return list(self.pool.map(lambda text: self._score_one(prompt, text), list(continuations)))

    def _score_one(self, prompt: str, text: str) -> float:
        if not text:
            return 0.0
        body = {"model": self.model, "prompt": prompt + text, "max_tokens": 1, "echo": True,
                "logprobs": 0, "temperature": 0.0}
        try:
            response = self.post("/completions", body)
        except RemoteRequestError as error:
            raise ValueError(f"endpoint does not support scoring: {error}") from None
        usage = response.get("usage") or {}
        with self._lock:
            self.budget.add_generation(usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0))
        return continuation_logprob(response, prompt)

    def close(self) -> None:
        self.pool.shutdown(wait=False)
        self.client.close()

    def __enter__(self) -> RemoteGenerator:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def continuation_logprob(response: dict, prompt: str) -> float:
    """Sum of the echoed log-probs of the tokens after `prompt` (ValueError if absent)."""
    choices = response.get("choices") or [{}]
    logprobs = choices[0].get("logprobs") or {}
    tokens, values = logprobs.get("tokens"), logprobs.get("token_logprobs")
    offsets = logprobs.get("text_offset")
    prompt_tokens = (response.get("usage") or {}).get("prompt_tokens")
    if not tokens or values is None or offsets is None or not prompt_tokens or len(values) < prompt_tokens:
        raise ValueError("endpoint does not support scoring: its answer to echo with logprobs has no "
                         "log-probabilities of the prompt tokens")
    total = 0.0
    for token, value, offset in list(zip(tokens, values, offsets))[:prompt_tokens]:
        if offset >= len(prompt):
            if value is None:
                raise ValueError("endpoint does not support scoring: a prompt token has no log-probability")
            total += value
        elif offset + len(token) > len(prompt):
            raise ValueError("the continuation changes the prompt's tokenisation at the boundary")
    return total


def error_detail(response) -> tuple[str, str | None]:
    """(message, param) of an OpenAI-style error body, or the raw text."""
    try:
        error = response.json().get("error") or {}
        return str(error.get("message") or response.text[:200]), error.get("param")
    except ValueError:
        return response.text[:200], None


def retry_wait(response, attempt: int, backoff: float) -> float:
    """Seconds before retry `attempt` + 1: the answer's Retry-After (in seconds) when it has
    one, else backoff * 2^attempt; at most MAX_WAIT."""
    value = response.headers.get("Retry-After") if response is not None else None
    try:
        wait = max(float(value), 0.0) if value is not None else backoff * 2**attempt
    except ValueError:  # an HTTP date, which we do not parse
        wait = backoff * 2**attempt
    return min(wait, MAX_WAIT)
