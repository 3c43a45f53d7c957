"""From a parsed request to what the backend runs: prompts as token ids, SamplingParams,
the library's strategy (decode/: `Sample`, `Beam`, `Speculative`; over a ContrastiveLM with
amateur_model), the constraint and the best-of-N / voting selection. Every bad value is an
`APIError` naming its field. What runs is the library's to build (`launch`: the strategy's
`prepare`, decode/sample.py `engine_route`); this module only reads the request's fields.

Chat prompts use the served model's chat template (`serve --chat-template`), else the
tokenizer's when it has one; otherwise the plain template (docs/server.md): one line per
message, "ROLE: content\\n" (role upper-cased), then "ASSISTANT:" for the model to continue.

What clients that target vLLM send is taken as vLLM takes it (backend.py ServerConfig):
unknown body keys are ignored and named (`Plan.ignored`), and a max_tokens beyond the
context left is shortened to fit. A prompt is cut on the left by the request's
`truncate_prompt_tokens` (vLLM's field) or, with `truncate_prompts`, to what fits with one token
to generate (`Plan.dropped`: the tokens cut).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, replace
from typing import Any

from decodekit.conversation import (
    ChatError,
    ToolUse,
    chat_prompt,
    template_source,
    thinking_of,
    tool_grammar,
    tool_use,
)
from decodekit.decode.beam import Beam
from decodekit.decode.reasoning import Thinking
from decodekit.decode.sample import Sample, UnsupportedField
from decodekit.decode.speculative import Speculative
from decodekit.models.base import LanguageModel
from decodekit.params import SamplingParams, preset_values
from decodekit.server.backend import Backend, Job
from decodekit.server.protocol import APIError, ChatMessage, ChatRequest, GenerationRequest

log = logging.getLogger(__name__)

LOGPROB_SCORERS = ("mean_logprob", "logprob")
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# decodekit's names in error messages -> the request's field names
# The rules across fields that `plan_request` checks (400 naming the field), in words: the
# published schema adds each to its field's description (openapi.py), so one table says them.
CROSS_FIELD_RULES = {
    "best_of": "Must be >= n. best_of > n, scorer and vote cannot be used with stream.",
    "vote": "Needs best_of (the candidates per prompt); voting returns one answer, so n must be 1.",
    "scorer": "Needs best_of (the candidates per prompt).",
    "num_beams": "Needs use_beam_search: true; n must be <= num_beams.",
    "draft_model": "Cannot be combined with use_beam_search or amateur_model.",
    "num_draft_tokens": "Needs draft_model.",
    "top_logprobs": "Needs logprobs: true.",
}
FIELD_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens", "alpha": "contrastive_alpha"}


@dataclass
class Selection:
    """best_of candidates per prompt, scored by `scorer`; voting extracts answers by regex."""

    best_of: int
    scorer: str
    vote: str | None = None
    answer_regex: re.Pattern | None = None


@dataclass
class Plan:
    model: str
    prompts: list[list[int]]
    prompt_texts: list[str]
    params: SamplingParams  # params.n = samples drawn per prompt (best_of when selecting)
    n: int  # choices returned per prompt
    strategy: Sample | Beam | Speculative = field(default_factory=Sample)
    amateur: str | None = None
    contrastive: dict[str, float] = field(default_factory=dict)  # ContrastiveLM's knobs given
    constraint: Any = None
    selection: Selection | None = None
    logprobs: int | None = None  # None: no logprobs; k: the chosen token's and k alternatives
    echo: bool = False
    stream: bool = False
    include_usage: bool = False
    return_token_ids: bool = False
    chat: bool = False
    score_only: bool = False  # echo with max_tokens 0: the prompt's log-probs, nothing generated
    ignored: tuple[str, ...] = ()  # body keys the server does not know, ignored (not strict_fields)
    dropped: tuple[int, ...] = ()  # per prompt, the tokens truncation cut from its start
    tools: ToolUse | None = None  # a chat request's tools: its answers are read for calls
    thinking: Thinking | None = None  # a reasoning model's chat: its answers' thinking kept apart


def api_error(error: Exception, default_param: str | None = None,
              names: dict[str, str] = FIELD_NAMES) -> APIError:
    """A library ValueError/TypeError as a 400 whose param is the field its message names, in the
    request's words (`names`: decodekit's name -> the field the request sent)."""
    message = re.sub(r"\b[a-z_]+\b", lambda word: names.get(word.group(0), word.group(0)), str(error))
    match = re.match(r"[a-z_]+", message)
    name = match.group(0) if match else ""
    param = name if name in GenerationRequest.model_fields or name in SamplingParams.field_names() \
        else default_param
    return APIError(400, message, param, "invalid_value")


def chat_fields(call, *args, **kwargs):
    """decodekit.conversation's `call`, its ChatError as a 400 naming the request's field."""
    try:
        return call(*args, **kwargs)
    except ChatError as error:
        raise APIError(400, str(error), error.field, error.code) from None


def tool_use_of(req: ChatRequest, template: Any) -> ToolUse | None:
    """The request's tools and tool_choice, checked (400 naming the field), or None without tools."""
    tools = None if req.tools is None else [tool.model_dump() for tool in req.tools]
    choice = req.tool_choice if req.tool_choice is None or isinstance(req.tool_choice, str) \
        else req.tool_choice.model_dump()
    return chat_fields(tool_use, tools, choice, req.parallel_tool_calls, template)


def chat_text(model: LanguageModel, messages: list[ChatMessage], template: str | None = None,
              tools: ToolUse | None = None, kwargs: dict[str, Any] | None = None) -> tuple[str, bool]:
    """The prompt text of a conversation, and whether it came from a chat template
    (decodekit/conversation.py `chat_prompt`: `template`, the server's for this model, else the
    tokenizer's; the request's template variables `kwargs`; its tools)."""
    turns = [m.model_dump(exclude_none=True) for m in messages]
    return chat_fields(chat_prompt, model, turns, template, tools, kwargs)


def encode(model: LanguageModel, prompt, param: str, truncate: int | None = None) -> tuple[list[int], int]:
    """The prompt's ids and the tokens `truncate` cut from its start (request.py `truncated_prompt`)."""
    from decodekit.request import truncated_prompt

    try:
        return truncated_prompt(model, prompt, truncate)
    except (ValueError, TypeError) as error:
        if str(error).startswith("truncate_prompt_tokens"):
            raise APIError(400, str(error), "truncate_prompt_tokens", "invalid_value") from None
        code = "context_length_exceeded" if "context" in str(error) else "invalid_value"
        raise APIError(400, str(error), param, code) from None


def template_ids(model: LanguageModel, text: str, whole: bool = False) -> list[int]:
    """The ids of a chat template's text (which wrote its own special tokens), refused without
    encoding it whole when it is far past the context (request.py `encode_text`), unless it is
    to be truncated (`whole`), which keeps the last tokens of the whole text's encoding."""
    from decodekit.request import encode_text

    def plain(part: str) -> list[int]:
        return list(model.tokenizer.encode(part, add_special_tokens=False))

    if whole:
        return plain(text)
    try:
        return encode_text(plain, text, model.max_context)
    except ValueError as error:
        raise APIError(400, str(error), "messages", "context_length_exceeded") from None


def truncation_of(req: GenerationRequest, model: LanguageModel, backend: Backend) -> int | None:
    """The prompt truncation asked for: the request's truncate_prompt_tokens, else with the
    server's truncate_prompts the context less one token (room for one to generate; the
    max_tokens shortening then fits the answer to what is left), else none."""
    if req.truncate_prompt_tokens is not None:
        return req.truncate_prompt_tokens
    return model.max_context - 1 if backend.config.truncate_prompts else None


def check_max_tokens(value: int | None, default: int | None, longest: int, context: int, backend: Backend,
                     field_name: str, allow_zero: bool = False) -> int:
    """max_tokens within the server's bound and the context left after the longest prompt."""
    room = context - longest
    if value is None:
        return min(default or backend.config.max_tokens, room, backend.config.max_tokens)
    if value < (0 if allow_zero else 1):
        lowest = "0 (with echo) or more" if allow_zero else "at least 1"
        raise APIError(400, f"{field_name} must be {lowest}, got {value}", field_name, "invalid_value")
    # Above the bound is refused only where the bound, not the context, is what limits it: a
    # request the context shortens anyway (optillm's 4096 on a 512-token model) ends below it.
    if value > backend.config.max_tokens and (backend.config.strict_max_tokens
                                              or room > backend.config.max_tokens):
        raise APIError(400, f"{field_name} must be <= {backend.config.max_tokens} (this server's bound), "
                       f"got {value}", field_name, "invalid_value")
    if value > room and (backend.config.strict_max_tokens or room < 1):
        raise APIError(400, f"this model's context is {context} tokens; the prompt has {longest}, so "
                       f"{field_name} must be <= {room}, got {value}", field_name,
                       "context_length_exceeded")
    return min(value, room)  # as vLLM: what fits, then finish_reason "length"


def check_count(value: int, name: str, backend: Backend) -> None:
    if value < 1 or value > backend.config.max_n:
        raise APIError(400, f"{name} must be an integer in [1, {backend.config.max_n}], got {value}", name,
                       "invalid_value")


def constraint_of(req: GenerationRequest):
    """The constraint of response_format or a guided_* field (at most one), or None."""
    given = {}
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        if fmt.type == "json_object":
            given["response_format"] = ("json", {"type": "object"})
        elif fmt.json_schema is None or fmt.json_schema.schema_ is None:
            raise APIError(400, "response_format of type json_schema needs json_schema.schema",
                           "response_format", "invalid_value")
        else:
            given["response_format"] = ("json", fmt.json_schema.schema_)
    for name, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choices"),
                       ("guided_grammar", "grammar")):
        if getattr(req, name) is not None:
            given[name] = (kind, getattr(req, name))
    if not given:
        return None
    if len(given) > 1:
        raise APIError(400, f"give at most one of {sorted(given)}", sorted(given)[1], "invalid_value")
    [(param, (kind, value))] = given.items()
    try:
        from decodekit.decode import constrained

        constraint = {"json": constrained.JsonSchema, "regex": constrained.Regex,
                      "choices": constrained.Choices, "grammar": constrained.Grammar}[kind](value)
    except ImportError:
        raise APIError(400, f"{param} is not supported by this server build (install "
                       "decodekit[constrained])", param, "unsupported") from None
    except (ValueError, TypeError) as error:
        raise APIError(400, f"{param}: {error}", param, "invalid_value") from None
    return constraint


def constraint_param(req: GenerationRequest) -> str:
    """The field that asked for constrained output (constraint_of allows one)."""
    fmt = req.response_format
    if fmt is not None and fmt.type != "text":
        return "response_format"
    return next(name for name in ("guided_json", "guided_regex", "guided_choice", "guided_grammar")
                if getattr(req, name) is not None)


def tools_constraint(req: GenerationRequest, model: LanguageModel, tools: ToolUse, constraint, strategy,
                     thinking: Thinking | None = None):
    """The constraint of a chat request with tools (decodekit/conversation.py `tool_grammar`; 400s naming
    the field): a forced call's grammar, "auto"'s where nothing else constrains the answer (not
    with a draft model or ignore_eos), the request's own otherwise."""
    free = not isinstance(strategy, Speculative) and not req.ignore_eos  # a grammar ends on EOS
    field = constraint_param(req) if constraint is not None else "response_format"
    grammar = chat_fields(tool_grammar, model, tools, constraint, thinking=thinking, free=free, field=field)
    if tools.forced:
        check_tokenizer(model, "tool_choice")
    return grammar


def check_tokenizer(model: LanguageModel, param: str) -> None:
    """The model's tokenizer must be one llguidance reads: if not, the server cannot constrain
    this model whatever the request says, so it is the server's error (500), not the client's."""
    from decodekit.decode.constrained import UnreadableTokenizer, ll_tokenizer

    try:
        ll_tokenizer(model)
    except UnreadableTokenizer as error:
        raise APIError(500, f"{param} cannot be served for this model: {error}", param,
                       "unsupported_tokenizer", "server_error") from None
    except (TypeError, ValueError) as error:  # no tokenizer, no EOS: this model cannot be constrained
        raise APIError(400, f"{param}: {error}", param, "invalid_value") from None


def sampling_params(req: GenerationRequest, samples: int, max_tokens: int, logprobs: int | None,
                    vocab_size: int, max_field: str = "max_tokens") -> SamplingParams:
    bias = {}
    for key, value in (req.logit_bias or {}).items():
        if not re.fullmatch(r"\d+", key) or int(key) >= vocab_size:
            raise APIError(400, f"logit_bias keys must be token ids in [0, {vocab_size}), got {key!r}",
                           "logit_bias")
        if not -100 <= value <= 100:
            raise APIError(400, f"logit_bias values must be in [-100, 100], got {value}", "logit_bias")
        bias[int(key)] = value
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    temperature, top_p = preset_of(req)
    values = dict(max_new_tokens=max(max_tokens, 1), temperature=temperature, top_p=top_p,
                  n=samples, stop=tuple(stop), seed=req.seed, presence_penalty=req.presence_penalty,
                  frequency_penalty=req.frequency_penalty, logit_bias=bias,
                  logprobs=logprobs or None)
    values.update(req.extensions())
    min_field = "min_new_tokens" if "min_new_tokens" in req.model_fields_set else "min_tokens"
    try:
        params = SamplingParams(**values)
        params.check_vocab(vocab_size)
    except (ValueError, TypeError) as error:
        raise api_error(error, names={**FIELD_NAMES, "max_new_tokens": max_field,
                                      "min_new_tokens": min_field}) from None
    return params


def preset_of(req: GenerationRequest) -> tuple[float, float]:
    """temperature and top_p: the body's where it gives them, else its preset's (or the defaults)."""
    temperature, top_p = req.temperature, req.top_p
    if req.preset is not None:
        try:
            temperature, top_p = preset_values(req.preset)
        except ValueError as error:
            raise APIError(400, str(error), "preset", "invalid_value") from None
    given = req.model_fields_set
    return (req.temperature if "temperature" in given else temperature,
            req.top_p if "top_p" in given else top_p)


def selection_of(req: GenerationRequest, n: int, backend: Backend) -> Selection | None:
    if req.best_of is None:
        if req.vote is not None or req.scorer is not None:
            raise APIError(400, "vote and scorer need best_of (the candidates per prompt)", "best_of")
        return None
    check_count(req.best_of, "best_of", backend)
    if req.best_of < n:
        raise APIError(400, f"best_of must be >= n ({n}), got {req.best_of}", "best_of", "invalid_value")
    if req.best_of == n and req.vote is None and req.scorer is None:
        return None
    scorer = req.scorer or "mean_logprob"
    if scorer not in LOGPROB_SCORERS + backend.config.reward_models:
        allowed = ", ".join(LOGPROB_SCORERS + backend.config.reward_models)
        raise APIError(400, f"scorer must be one of {allowed}, got {scorer!r}", "scorer", "invalid_value")
    if req.vote is not None and n != 1:
        raise APIError(400, f"voting returns one answer, so n must be 1, got {n}", "n", "invalid_value")
    pattern = None
    if req.answer_regex is not None:
        try:
            pattern = re.compile(req.answer_regex)
        except re.error as error:
            raise APIError(400, f"answer_regex is not a valid regex: {error}", "answer_regex") from None
    if req.stream:
        raise APIError(400, "best_of > n, scorer and vote cannot be used with stream", "stream")
    return Selection(req.best_of, scorer, req.vote, pattern)


def strategy_of(req: GenerationRequest, backend: Backend, n: int) -> Sample | Beam | Speculative:
    """The library strategy the request's fields ask for (its draft model resolved later,
    `draft_of`, after every other check)."""
    if req.use_beam_search:
        if req.draft_model is not None:
            raise APIError(400, "beam search cannot be combined with draft_model", "draft_model")
        beams = req.num_beams if req.num_beams is not None else max(n, 4)
        check_count(beams, "num_beams", backend)
        if n > beams:
            raise APIError(400, f"n must be <= num_beams ({beams}), got {n}", "n", "invalid_value")
        return Beam(beams, req.length_penalty, req.early_stopping)
    if req.num_beams is not None:
        raise APIError(400, "num_beams needs use_beam_search: true", "num_beams")
    if req.draft_model is not None:
        if req.amateur_model is not None:
            raise APIError(400, "draft_model cannot be combined with amateur_model", "draft_model")
        draft = req.draft_model
        if draft != "prompt-lookup":
            draft = served_name(draft, backend, "draft_model")
        k = req.num_draft_tokens if req.num_draft_tokens is not None else 4
        if not 1 <= k <= 64:
            raise APIError(400, f"num_draft_tokens must be in [1, 64], got {k}", "num_draft_tokens")
        return Speculative(draft, k)
    if req.num_draft_tokens is not None:
        raise APIError(400, "num_draft_tokens needs draft_model", "num_draft_tokens")
    return Sample()


def served_name(name: str, backend: Backend, param: str = "model") -> str:
    """The served model's name that `name` means (its own, or an alias: a directory's full path)."""
    served = backend.served_name(name)
    if served is None:
        raise APIError(404, f"The model '{name}' does not exist; served: {', '.join(backend.models)}",
                       param, "model_not_found")
    return served


def plan_request(req: GenerationRequest, backend: Backend) -> Plan:
    """The plan of a completions or chat request (validation included)."""
    name = served_name(req.model, backend)
    model = backend.models[name]
    chat = isinstance(req, ChatRequest)
    ignored = tuple(req.unknown_fields(backend.config.strict_fields))
    if ignored:
        log.warning("ignored fields the server does not know: %s (--strict-fields refuses them)",
                    ", ".join(ignored))
    n = req.n
    check_count(n, "n", backend)
    truncate = truncation_of(req, model, backend)
    tools = thinking = None
    if chat:
        template = backend.chat_templates.get(name)
        source = template_source(model, template)
        tools = tool_use_of(req, source)
        text, templated = chat_text(model, req.messages, template, tools, req.chat_template_kwargs)
        thinking = thinking_of(source, text)
        ids = template_ids(model, text, whole=truncate is not None) if templated else None
        encoded = [encode(model, ids if ids is not None else text, "messages", truncate)]
        texts = [text]
        max_field = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        wanted = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs needs logprobs: true", "top_logprobs")
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        default, echo = None, False
    else:
        raw = req.prompt
        single = isinstance(raw, str) or (isinstance(raw, list) and raw and isinstance(raw[0], int))
        items = [raw] if single else list(raw)
        if not items:
            raise APIError(400, "prompt must not be empty", "prompt", "invalid_value")
        if len(items) > backend.config.max_queued:  # no retry could succeed: not a 503
            raise APIError(400, f"the request has {len(items)} prompts; this server queues at most "
                           f"{backend.config.max_queued} per model (--max-queued), so it can never run: "
                           "send fewer prompts per request", "prompt", "too_many_prompts")
        encoded = [encode(model, item, "prompt", truncate) for item in items]
        texts = [item if isinstance(item, str) else model.decode(ids)
                 for item, (ids, _) in zip(items, encoded)]
        max_field, wanted, logprobs = "max_tokens", req.max_tokens, req.logprobs
        default, echo = COMPLETIONS_DEFAULT_MAX_TOKENS, req.echo
    prompts = [ids for ids, _ in encoded]
    dropped = tuple(cut for _, cut in encoded)
    # A truncated prompt reads as what the model saw (echo, voting's answer text).
    texts = [model.decode(ids) if cut else text for text, (ids, cut) in zip(texts, encoded)]
    if logprobs is not None and not 0 <= logprobs <= 20:
        name = "top_logprobs" if chat else "logprobs"
        raise APIError(400, f"{name} must be in [0, 20], got {logprobs}", name, "invalid_value")
    longest = max(len(p) for p in prompts)
    max_tokens = check_max_tokens(wanted, default, longest, model.max_context, backend, max_field,
                                  allow_zero=echo)
    selection = selection_of(req, n, backend)
    strategy = strategy_of(req, backend, n)
    amateur, contrastive = None, {}
    if req.amateur_model is not None:
        amateur = served_name(req.amateur_model, backend, "amateur_model")
        knobs = {"alpha": req.contrastive_alpha, "amateur_temperature": req.amateur_temperature}
        contrastive = {k: v for k, v in knobs.items() if v is not None}
    elif req.contrastive_alpha is not None or req.amateur_temperature is not None:
        raise APIError(400, "contrastive_alpha and amateur_temperature need amateur_model", "amateur_model")
    constraint = constraint_of(req)
    if constraint is not None:
        check_tokenizer(model, constraint_param(req))
    if tools is not None:
        constraint = tools_constraint(req, model, tools, constraint, strategy, thinking)
    if constraint is not None and isinstance(strategy, Speculative):
        raise APIError(400, "constrained output cannot be combined with draft_model", "draft_model")
    samples = selection.best_of if selection is not None else n
    params = sampling_params(req, samples, max_tokens, logprobs, model.vocab_size, max_field)
    if selection is not None and isinstance(strategy, Beam):
        raise APIError(400, "best_of selection cannot be combined with beam search", "best_of")
    if echo and max_tokens == 0 and req.stream:
        raise APIError(400, "max_tokens 0 (scoring the prompt) cannot be streamed", "stream")
    include_usage = req.stream_options.include_usage if req.stream_options else False
    return Plan(name, prompts, texts, params, n, strategy, amateur, contrastive, constraint,
                selection, logprobs, echo, req.stream, include_usage, req.return_token_ids, chat,
                score_only=echo and max_tokens == 0, ignored=ignored,
                dropped=dropped if any(dropped) else (), tools=tools, thinking=thinking)


def launch(plan: Plan, index: int, backend: Backend) -> Job:
    """Start prompt `index` of the plan (raises QueueFull, or APIError for a bad request): the
    library builds and routes it (the strategy's `prepare`), the backend runs it on the
    served model's engine or in its worker thread."""
    model = backend.models[plan.model]
    try:
        if plan.amateur is not None:
            from decodekit.decode.contrastive import ContrastiveLM

            model = ContrastiveLM(model, backend.models[plan.amateur], **plan.contrastive)
        strategy = plan.strategy
        if isinstance(strategy, Speculative):
            strategy = replace(strategy, draft=draft_of(strategy.draft, model, backend))
        run = strategy.prepare(model, [plan.prompts[index]], plan.params, constraint=plan.constraint)
    except UnsupportedField as error:
        raise APIError(400, str(error), error.field) from None
    except (ValueError, TypeError) as error:
        raise api_error(error, "amateur_model" if plan.amateur is not None else None) from None
    return backend.submit(plan.model, run)


def draft_of(draft: str, model: LanguageModel, backend: Backend):
    """The request's drafter: "prompt-lookup" or a served model over the model's vocabulary."""
    drafter = draft if draft == "prompt-lookup" else backend.models[draft]
    if drafter is not model and not isinstance(drafter, str) and drafter.vocab_size > model.vocab_size:
        raise APIError(400, f"draft_model {draft!r} does not share the model's vocabulary", "draft_model")
    return drafter
