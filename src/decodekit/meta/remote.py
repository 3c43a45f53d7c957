"""A `Generator` over any OpenAI-compatible endpoint: decodekit's own server, vLLM, SGLang.

    generator = RemoteGenerator("http://127.0.0.1:8000/v1", "shakespeare")
    result = best_of_n(generator, "ROMEO:", 8, scorer)            # any meta-generator, unchanged

Each prompt of a `generate` call is one `/v1/completions` request asking for its n samples
(`n`), sent by a pool of `max_concurrency` threads (`chat=True`: `/v1/chat/completions`,
the prompt as one user message). SamplingParams travel as OpenAI fields (max_tokens,
temperature, top_p, stop, seed, penalties, logit_bias, logprobs) plus the server's own
names for the rest, as its profile (meta/profiles.py: vllm, sglang, llamacpp, openai,
decodekit; given as `profile=` or detected once from `/v1/models` and the `Server` header)
says; every field the server knows is sent, at its neutral value when the caller left it
at its default, so the server's own defaults never change the distribution.

Exact or refused (`verify=True`): a field the server has no name for raises ValueError
before anything is sent; a filter or penalty the caller sets is probed once per endpoint
(meta/probes.py: a known-effect request, inside the ranges every profile's server accepts)
and refused if it has no effect there; a probe that cannot decide (or that the server
refuses) raises ValueError saying why and naming `verify=False`; `score()`
first checks that the endpoint's echoed log-probabilities equal those it generates for a
short greedy continuation (within 1e-3) and otherwise refuses, naming the endpoint.
Probes are not counted in `budget`.

A pool: `RemoteGenerator([url1, url2, ...])` sends each request to the endpoint with the
fewest requests in flight, and a request that fails there (5xx, 429, timeout, no
connection) to another one. Every sample is its own request seeded
`derive_seed(seed, "sample", i)`, so seeded results do not depend on which endpoint drew
which sample: a pool of any size, one endpoint included (`[url]`), gives the same samples
and the same budget, as long as its servers run one engine: each engine (vLLM, decodekit,
...) draws its own samples for a seed, so a seeded `generate` on a pool whose endpoints
detect as different profiles raises ValueError unless `mixed_engines=True` (unseeded
sampling is the same distribution everywhere and is never refused). Failures: 429 and 5xx
answers and connection errors are retried `retries` times with exponential backoff
(`backoff` * 2^attempt seconds), waiting what a Retry-After header asks instead when it is
given; other 4xx answers raise `RemoteRequestError` (a ValueError) at once. An endpoint
that cannot be reached while its profile is detected or a field probed has failed like
one that cannot be reached with the request: the pool moves on, and detects it again when
it next tries it. A refused connection says so ("connection refused").

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
from dataclasses import dataclass, field

from decodekit.completion import Completion, Usage
from decodekit.meta import probes
from decodekit.meta.budget import Budget
from decodekit.meta.generator import account_request, derive_seed, per_prompt
from decodekit.meta.profiles import PROFILES, Profile, detect_profile, profile_named, requested_fields
from decodekit.params import SamplingParams

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


def request_body(model: str, prompt: str, k: int, params: SamplingParams, logprobs: bool,
                 profile: Profile = PROFILES["decodekit"], chat: bool = False) -> dict:
    """The /v1/completions (or chat) body of one prompt, k samples, in `profile`'s names: every
    field the server knows is sent, at its neutral value when the caller left it at its default."""
    body: dict = {"model": model, "n": k, "max_tokens": params.max_new_tokens,
                  "temperature": params.temperature, **profile.neutral}
    if chat:
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
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
        if chat:
            body.update(logprobs=True, top_logprobs=params.logprobs or 0)
        else:
            body["logprobs"] = params.logprobs or 0
    for name, value in requested_fields(params).items():
        wire = profile.wire_name(name)
        if wire is None:
            raise ValueError(f"{name} is not a field the {profile.name!r} server knows: it would be dropped "
                             f"and the samples drawn without it")
        body[wire] = value
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
        tops = logprobs.get("top_logprobs") or None
        if "content" in logprobs:  # a chat choice: one entry per token
            entries = logprobs.get("content") or []
            logprobs = {"token_logprobs": [e.get("logprob") for e in entries]}
            tops = [{t["token"]: t["logprob"] for t in e.get("top_logprobs") or []} for e in entries] or None
        token_logprobs = [lp for lp in logprobs.get("token_logprobs") or [] if lp is not None]
        ids = list(choice.get("token_ids") or [])
        counted = len(ids) or len(token_logprobs)
        if not counted and choices:  # no per-choice count: share the total, remainder first
            counted = total // len(choices) + (1 if i < total % len(choices) else 0)
        reason = choice.get("finish_reason") or "stop"
        out.append(Completion(
            token_ids=ids,
            text=choice.get("text") or (choice.get("message") or {}).get("content") or "",
            logprobs=token_logprobs,
            processed_logprobs=[],
            finish_reason="length" if reason == "length" else "stop",
            usage=Usage(prompt, counted),
            top_logprobs=tops,
            stop_reason=choice.get("stop_reason"),
        ))
    return out


def refuses_n(error: RemoteRequestError) -> bool:
    """Whether a 4xx answer says the endpoint does not take n > 1."""
    return error.param == "n" or re.search(r"(?<![\w.])n(?![\w.])|\bbest_of\b", str(error)) is not None


@dataclass
class Endpoint:
    """One server of a RemoteGenerator and what it has learnt about it."""

    url: str  # ends in /v1
    profile: Profile | None = None
    outstanding: int = 0  # requests in flight (the pool sends to the endpoint with fewest)
    honoured: dict[str, bool] = field(default_factory=dict)  # field -> probe's verdict
    scoring: tuple[float, float] | None | bool = False  # False: unchecked; None: agrees
    n_supported: bool = True


class RemoteGenerator:
    """A Generator over one OpenAI-compatible endpoint or a pool of them (see the module doc)."""

    def __init__(
        self,
        base_url: str | Sequence[str],
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
        profile: str | None = None,
        chat: bool = False,
        verify: bool = True,
        mixed_engines: bool = False,
        transport=None,
    ):
        import httpx

        for name, value, lowest in (("max_concurrency", max_concurrency, 1), ("retries", retries, 0)):
            if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
                raise ValueError(f"{name} must be an integer >= {lowest}, got {value!r}")
        urls = [base_url] if isinstance(base_url, str) else list(base_url)
        if not urls:
            raise ValueError("base_url must be a URL or a non-empty list of URLs, got []")
        for url in urls:
            if not isinstance(url, str) or not url.startswith(("http://", "https://")):
                raise ValueError(f"base_url must be an http(s) URL, got {url!r}")
        fixed = profile_named(profile) if profile is not None else None
        bases = [url.rstrip("/") for url in urls]
        self.endpoints = [Endpoint(base if base.endswith("/v1") else base + "/v1", fixed) for base in bases]
        self.base_url = self.endpoints[0].url
        self.spread = not isinstance(base_url, str)  # a pool: one request per sample, seeds derived
        self.model, self.chat, self.verify, self.mixed_engines = model, chat, verify, mixed_engines
        key = api_key or os.environ.get("DECODEKIT_API_KEY") or os.environ.get("OPENAI_API_KEY")
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        # Idle connections are dropped after 2 s, before a server's usual 5 s keep-alive timeout
        # can close one just as it is reused (a failed POST; retried, but wasted).
        connections = max_concurrency * len(urls)
        limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections,
                              keepalive_expiry=2.0)
        self.client = httpx.Client(headers=headers, timeout=timeout, limits=limits, transport=transport)
        self.pool = ThreadPoolExecutor(max_workers=max_concurrency, thread_name_prefix="decodekit-remote")
        self.retries, self.backoff = retries, backoff
        self.budget = budget if budget is not None else Budget()
        self.request_logprobs, self.return_token_ids = request_logprobs, return_token_ids
        self._lock = threading.Lock()
        self._learn = threading.Lock()  # one probe at a time

    @property
    def n_supported(self) -> bool:
        return all(endpoint.n_supported for endpoint in self.endpoints)

    # ------------------------------------------------------------------ HTTP

    def post(self, path: str, body, endpoint: Endpoint | None = None, retries: int | None = None) -> dict:
        """POST `body` (a dict, or endpoint -> dict) to `endpoint`, or to the pool's endpoint with
        the fewest requests in flight, moving to another one when it fails. 429, 5xx, timeouts
        and connection errors are retried (`retries` times in all, default the generator's);
        other 4xx raise RemoteRequestError. An endpoint that cannot be reached while `body`
        learns what it is (detection, probes) has failed like one that cannot be reached with
        the request."""
        retries = self.retries if retries is None else retries
        failed: set[int] = set()
        error: Exception | None = None
        for attempt in range(retries + 1):
            chosen = endpoint or self._acquire(failed)
            try:
                try:
                    payload = body(chosen) if callable(body) else body
                except RemoteError as unreachable:
                    response, error = None, unreachable
                else:
                    response, error = self._send(chosen, path, payload)
            finally:
                if endpoint is None:
                    with self._lock:
                        chosen.outstanding -= 1
            if error is None:
                return response
            failed.add(id(chosen))
            another = endpoint is None and len(failed) < len(self.endpoints)
            if attempt < retries and not another:
                failed.clear()  # every endpoint failed once: wait, then try them again
                time.sleep(retry_wait(response, attempt, self.backoff))
        assert error is not None
        raise error

    def _acquire(self, failed: set[int]) -> Endpoint:
        with self._lock:
            chosen = min((e for e in self.endpoints if id(e) not in failed), key=lambda e: e.outstanding)
            chosen.outstanding += 1
        return chosen

    def _send(self, endpoint: Endpoint, path: str, body: dict):
        """(JSON answer, None) or (the response or None, the RemoteError to retry)."""
        import httpx

        url = endpoint.url + path
        try:
            response = self.client.post(url, json=body)
        except httpx.TransportError as failure:  # timeouts included
            return None, unreachable(url, failure)
        if response.status_code == 200:
            return response.json(), None
        message, param = error_detail(response)
        text = f"{url} answered {response.status_code}: {message}"
        if response.status_code != 429 and response.status_code < 500:
            raise RemoteRequestError(text, response.status_code, param)
        return response, RemoteError(text, response.status_code, param)

    # ------------------------------------------------------------------ what an endpoint does

    def profile_of(self, endpoint: Endpoint) -> Profile:
        """The endpoint's profile: given, or detected from /v1/models and its Server header.
        An endpoint that cannot be reached raises RemoteError (the pool moves on, and detects
        it again next time); one that answers without naming its server, ValueError."""
        if endpoint.profile is None:
            import httpx

            url = endpoint.url + "/models"
            try:
                response = self.client.get(url)
            except httpx.TransportError as failure:
                raise unreachable(url, failure) from None
            try:
                models = response.json() if response.status_code == 200 else {}
            except ValueError:
                models = {}
            name = detect_profile(models if isinstance(models, dict) else {}, response.headers.get("server"))
            if name is None:
                raise ValueError(f"cannot tell which server {endpoint.url} is (neither /v1/models' owned_by "
                                 f"nor its Server header names one): pass profile= one of {sorted(PROFILES)}")
            endpoint.profile = PROFILES[name]
        return endpoint.profile

    def check_engines(self, detect: bool = True) -> None:
        """Refuse (ValueError) seeded samples from a pool whose servers run different engines
        (unless `mixed_engines`): each engine draws its own samples for one seed (vLLM and
        decodekit agree on none), so the results would depend on which endpoint drew which
        sample. `detect`: detect the endpoints not yet known (those that cannot be reached
        now are checked when a request first reaches them)."""
        if self.mixed_engines or not self.spread:
            return
        engines = set()
        for endpoint in self.endpoints:
            try:
                if detect or endpoint.profile is not None:
                    engines.add(self.profile_of(endpoint).name)
            except RemoteError:
                continue
        if len(engines) > 1:
            raise ValueError(f"this pool mixes {' and '.join(sorted(engines))} servers, which draw different "
                             "samples for the same seed, so seeded results would depend on which endpoint "
                             "drew each sample: use one engine per pool, or pass mixed_engines=True to "
                             "accept that (unseeded sampling is not affected)")

    def _probe_send(self, endpoint: Endpoint):
        profile = self.profile_of(endpoint)
        # In a pool, one attempt: an endpoint that fails its probe fails the request there,
        # and another endpoint takes it (post), instead of waiting out this one's retries.
        retries = 0 if len(self.endpoints) > 1 else None
        return lambda body: self.post("/completions", {"model": self.model, "n": 1, **profile.neutral,
                                                       **body}, endpoint, retries)

    def check_fields(self, endpoint: Endpoint, params: SamplingParams) -> None:
        """Refuse (ValueError) a field the endpoint's server would drop: unknown to its profile,
        or (a filter or a penalty) shown by a probe to have no effect there."""
        profile = self.profile_of(endpoint)
        wanted = requested_fields(params)
        for name in ("top_p", "presence_penalty", "frequency_penalty"):
            if getattr(params, name) != getattr(SamplingParams(), name):
                wanted[name] = getattr(params, name)
        for name in wanted:
            wire = profile.wire_name(name)
            if wire is None:
                raise ValueError(f"{endpoint.url} ({profile.name}) has no field {name}: it would be dropped "
                                 "and the samples drawn without it")
            if not self.verify or name not in probes.STRONGEST or profile.name == "openai":
                continue
            with self._learn:
                if name not in endpoint.honoured:
                    try:
                        endpoint.honoured[name] = probes.honours(self._probe_send(endpoint), name, wire)
                    except probes.Inconclusive as why:
                        raise ValueError(f"cannot check that {endpoint.url} applies {name} ({why}); pass "
                                         "verify=False to send it unchecked") from None
                    except RemoteRequestError as refused:
                        raise ValueError(f"cannot check that {endpoint.url} applies {name}: it refused "
                                         f"the probe ({refused}); pass verify=False to send it unchecked"
                                         ) from None
            if not endpoint.honoured[name]:
                raise ValueError(f"{endpoint.url} ignores {name} ({wire} at its strongest had no effect on "
                                 "a probe): refusing rather than sampling without it")

    # ------------------------------------------------------------------ Generator

    def generate(
        self,
        prompts: Sequence[str],
        n: int | Sequence[int],
        params: SamplingParams | Sequence[SamplingParams],
    ) -> list[list[Completion]]:
        prompts, counts, params_list = per_prompt(prompts, n, params)
        if self.spread and any(p.seed is not None for p in params_list):
            self.check_engines()
        if self.spread:  # each sample its own request, seeded by its index: placement-free
            jobs = [[self.pool.submit(self._request, prompt, 1, sample_params(p, j))
                     for j in range(k)] for prompt, k, p in zip(prompts, counts, params_list)]
            requests = [[job.result() for job in row] for row in jobs]
        else:
            futures = [self.pool.submit(self._samples, prompt, k, p)
                       for prompt, k, p in zip(prompts, counts, params_list)]
            requests = [future.result() for future in futures]  # each request's completions
        results = []
        for prompt_requests in requests:
            for completions in prompt_requests:
                account_request(self.budget, completions)
            results.append([c for completions in prompt_requests for c in completions])
        return results

    def _samples(self, prompt: str, k: int, params: SamplingParams) -> list[list[Completion]]:
        """k samples of one prompt: one request, or up to k (the sequential fallback)."""
        requests: list[list[Completion]] = []
        endpoint = self.endpoints[0]
        if k == 1 or endpoint.n_supported:
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
            endpoint.n_supported = False
        # Sample i (beyond those returned) is its own request, seeded seed + i.
        for i in range(sum(len(r) for r in requests), k):
            seed = None if params.seed is None else (params.seed + i) % MAX_SEED
            requests.append(self._request(prompt, 1, params.replace(seed=seed)))
        return requests

    def _request(self, prompt: str, k: int, params: SamplingParams) -> list[Completion]:
        def body(endpoint: Endpoint) -> dict:
            self.check_fields(endpoint, params)
            profile = self.profile_of(endpoint)
            if params.seed is not None:
                self.check_engines(detect=False)  # this endpoint may be reached for the first time
            body = request_body(self.model, prompt, k, params, self.request_logprobs, profile, self.chat)
            if self.return_token_ids:
                body["return_token_ids"] = True
            return body

        return completions_of(self.post("/chat/completions" if self.chat else "/completions", body))

    def score(self, prompt: str, continuations: Sequence[str]) -> list[float]:
        """log p(continuation | prompt) of each, from the endpoint's echoed prompt log-probs."""
        if self.chat:
            raise ValueError("a chat endpoint cannot score: it has no echo of the prompt's log-probabilities")
        return list(self.pool.map(lambda text: self._score_one(prompt, text), list(continuations)))

    def check_scoring(self, endpoint: Endpoint, prompt: str) -> None:
        """On first use: echoed log-probs must equal generated ones (probes.score_agrees)."""
        with self._learn:
            if endpoint.scoring is False:
                try:
                    endpoint.scoring = probes.score_agrees(self._probe_send(endpoint), prompt)
                except (probes.Inconclusive, RemoteRequestError) as why:
                    raise ValueError(f"cannot check {endpoint.url}'s scoring ({why}); pass verify=False "
                                     "to score unchecked") from None
        if endpoint.scoring is not None:
            generated, echoed = endpoint.scoring
            raise ValueError(f"endpoint does not support scoring: {endpoint.url} echoes log-probabilities "
                             f"that disagree with those it generates ({echoed:.6g} vs {generated:.6g} for "
                             "the same text); refusing to return wrong scores")

    def _score_one(self, prompt: str, text: str) -> float:
        """On the endpoint with the fewest requests in flight, or the next one where it cannot
        be reached (its scoring check and echo are tied to one endpoint)."""
        if not text:
            return 0.0
        with self._lock:
            order = sorted(self.endpoints, key=lambda e: e.outstanding)
        error: RemoteError | None = None
        for endpoint in order:
            try:
                if self.verify:
                    self.check_scoring(endpoint, prompt)
                return self._echo(endpoint, prompt, text)
            except RemoteError as failure:
                error = failure
        assert error is not None
        raise error

    def _echo(self, endpoint: Endpoint, prompt: str, text: str) -> float:
        body = {"model": self.model, "prompt": prompt + text, "max_tokens": 1, "echo": True,
                "logprobs": 0, "temperature": 0.0, **self.profile_of(endpoint).neutral}
        try:
            response = self.post("/completions", body, endpoint, 0 if len(self.endpoints) > 1 else None)
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


def sample_params(params: SamplingParams, index: int) -> SamplingParams:
    """Sample `index`'s params in a pool: its own seed, whichever endpoint draws it."""
    return params.replace(seed=derive_seed(params.seed, "sample", index))


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


def unreachable(url: str, failure: Exception) -> RemoteError:
    """The RemoteError of a request that reached no server at `url`, saying which way it failed."""
    import httpx

    if isinstance(failure, httpx.ConnectError) and "refused" in str(failure).lower():
        return RemoteError(f"cannot connect to {url}: connection refused (is a server running there?)")
    if isinstance(failure, httpx.TimeoutException):
        return RemoteError(f"{url}: no answer in time ({type(failure).__name__}: {failure})")
    return RemoteError(f"cannot reach {url}: {type(failure).__name__}: {failure}")


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
