"""Request and response models of the OpenAI-compatible API, and its error bodies.

Field names follow OpenAI's `/v1/completions` and `/v1/chat/completions` (and vLLM's
names for the extensions it shares with us: `top_k`, `min_p`, `min_tokens`,
`repetition_penalty`, `stop_token_ids`, `ignore_eos`, `guided_*`, `use_beam_search`).
Bodies are parsed strictly (`model_validate_json`): a number given as a string is a type
error, not coerced; an integer field takes an integral float (`2.0`, as OpenAI and JSON
Schema's "integer" do: extensions.py `Integer`), not 2.5. Every failure becomes an
`APIError`, whose body is OpenAI's

    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}

with `param` naming the offending field. Status codes (docs/server.md): 400 for a
malformed body or an invalid value, 404 for an unknown model or route, 503 (with
Retry-After) when the queue is full, 504 when a request outlives the server's timeout;
guard.py answers 401 (API key), 403 (Host, Origin), 413 (body size) and 415 (not JSON).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from decodekit.server.extensions import EXTENSIONS, RENAMED, Integer, SamplingFields, allowed, sampling_name

# OpenAI fields this server does not implement: a clear 400 rather than silence (the tool
# fields are a chat request's own fields, so only a completions request sending them meets this).
UNSUPPORTED = ("suffix", "tools", "tool_choice", "functions", "function_call", "audio", "modalities",
               "prediction", "parallel_tool_calls", "web_search_options")


class APIError(Exception):
    """An error answered with an OpenAI-style body (never a traceback)."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.type = status, message, param, code, type
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False


class JsonSchemaFormat(_Strict):
    name: str | None = None
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class GenerationRequest(SamplingFields):
    """Fields shared by both endpoints: the sampling extensions (extensions.py), OpenAI's, then
    decodekit's strategy extensions."""

    model: str
    max_tokens: Integer | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    n: Integer = 1
    stop: str | list[str] | None = None
    seed: Integer | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    response_format: ResponseFormat | None = None
    user: str | None = None
    # a use case's temperature and top_p (params.PRESETS, seed 003); the body's own win
    preset: str | None = None
    # structured output under vLLM's names (decode/constrained.py)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # beam search (decode/beam.py)
    use_beam_search: bool = False
    num_beams: Integer | None = None
    length_penalty: float = 1.0
    early_stopping: bool = True
    # contrastive decoding (decode/contrastive.py): the amateur is another served model
    amateur_model: str | None = None
    contrastive_alpha: float | None = None
    amateur_temperature: float | None = None
    # speculative decoding (decode/speculative.py): a served model or "prompt-lookup"
    draft_model: str | None = None
    num_draft_tokens: Integer | None = None
    # best-of-N and voting (meta/parallel.py) with a named scorer
    best_of: Integer | None = None
    scorer: str | None = None
    vote: Literal["majority", "weighted"] | None = None
    answer_regex: str | None = None
    return_token_ids: bool = False

    def unknown_fields(self, strict: bool) -> list[str]:
        """The body's keys this server does not know, which it ignores (as vLLM does); with
        `strict` (OpenAI's behaviour) the first is a 400 naming it. An OpenAI field this server
        does not implement (UNSUPPORTED: tools, ...) is a 400 either way: ignoring it would
        answer another question than the one asked."""
        unknown = []
        for key in self.model_extra or {}:
            if key in UNSUPPORTED:
                raise APIError(400, f"{key} is not supported by this server build", key, "unsupported")
            if strict:
                raise APIError(400, f"Unrecognized request argument supplied: {key}", key,
                               "unknown_parameter")
            unknown.append(key)
        return unknown

    def extensions(self) -> dict[str, Any]:
        """The SamplingParams fields the body sets (by their own or vLLM's name)."""
        given = [name for name in (*EXTENSIONS, *RENAMED) if name in self.model_fields_set]
        for alias, name in RENAMED.items():
            if alias in given and name in given:
                raise APIError(400, f"give {alias} or {name}, not both", alias, "invalid_value")
        return {sampling_name(name): getattr(self, name) for name in given}


class CompletionRequest(GenerationRequest):
    prompt: str | list[str] | list[Integer] | list[list[Integer]]
    echo: bool = False
    logprobs: Integer | None = None


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class CalledFunction(_Strict):
    name: str
    arguments: str  # JSON text, as OpenAI's responses carry it


class ToolCallParam(_Strict):
    """A call an earlier assistant turn made (decode/tool_calls.py)."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None  # an assistant turn's calls
    tool_call_id: str | None = None  # a tool turn: the call it answers
    reasoning_content: str | None = None  # an assistant turn's thinking (templates may show it)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDef(_Strict):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments
    strict: bool | None = None  # accepted; arguments are always valid under a forced call's schema


class ToolDef(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


class ChatRequest(GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: Integer | None = None
    logprobs: bool = False
    top_logprobs: Integer | None = None
    # tool calls (decode/tool_calls.py); without tools, tool_choice is refused as OpenAI does
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    # the chat template's own variables (vLLM's field), e.g. {"enable_thinking": false} for Qwen3
    chat_template_kwargs: dict[str, Any] | None = None


class TokenizeRequest(BaseModel):
    """POST /tokenize (vLLM's route): a prompt's or a conversation's token ids, as a completions
    or chat request would feed them to the model. Unknown keys are a 400."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDef] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """POST /detokenize (vLLM's route): the text of token ids."""

    model_config = ConfigDict(strict=True, extra="forbid")
    model: str
    tokens: list[Integer]


def parse_request(cls: type[GenerationRequest], body: bytes) -> GenerationRequest:
    """The request model of `body`, or an APIError naming the first bad field."""
    if not body.strip():
        raise APIError(400, "the request body is empty; send a JSON object", None, "invalid_json")
    try:
        return cls.model_validate_json(body)
    except ValidationError as error:
        raise validation_error(error) from None


def validation_error(error: ValidationError) -> APIError:
    first = error.errors()[0]
    loc = [str(part) for part in first["loc"]]
    if first["type"] in ("json_invalid", "model_type") or not loc:
        what = "not valid JSON" if first["type"] == "json_invalid" else "not a JSON object"
        return APIError(400, f"the request body is {what}: {first['msg']}", None, "invalid_json")
    # Union members add their type names to the location (prompt.list[int].0): the first
    # segment is the parameter; a union field gets a hint of its accepted shapes.
    param = loc[0]
    if first["type"] == "extra_forbidden":  # a route that takes no unknown keys (/tokenize)
        return APIError(400, f"Unrecognized request argument supplied: {param}", param, "unknown_parameter")
    code = "missing_required_parameter" if first["type"] == "missing" else "invalid_type"
    if param in SHAPES and len(loc) > 1 and first["type"] != "missing":
        return APIError(400, SHAPES[param], param, code)
    if param in EXTENSIONS or param in RENAMED:
        where = f" (at {param}[{loc[1]}])" if len(loc) > 1 else ""
        return APIError(400, f"{param} must be {allowed(param)}, got {first['input']!r:.80}{where}", param,
                        code)
    return APIError(400, f"{'.'.join(loc)}: {first['msg']}", param, code)


SHAPES = {
    "prompt": "prompt must be a string, a list of strings, a list of token ids or a list of lists of "
              "token ids",
    "stop": "stop must be a string or a list of strings",
}


# ---------------------------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's: the stop string or token that ended it
    token_ids: list[int] | None = None
    score: float | None = None  # best-of-N / voting: the chosen candidate's score


class CompletionResponse(BaseModel):
    id: str
    object: str = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class CalledFunctionOut(BaseModel):
    name: str
    arguments: str


class ToolCallOut(BaseModel):
    id: str
    type: str = "function"
    function: CalledFunctionOut


class CalledFunctionDelta(BaseModel):
    name: str | None = None  # with a call's first piece
    arguments: str | None = None  # the next piece of the arguments' JSON text


class ToolCallDelta(BaseModel):
    """A streamed piece of a call: its id, type and name with its first piece, then its
    arguments' text piece by piece (a client adds them up by `index`)."""

    index: int
    id: str | None = None
    type: str | None = None
    function: CalledFunctionDelta


class ChatMessageOut(BaseModel):
    role: str = "assistant"
    content: str | None
    tool_calls: list[ToolCallOut] | None = None
    reasoning_content: str | None = None  # a reasoning model's thinking (decode/reasoning.py)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessageOut
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None
    score: float | None = None


class ChatResponse(BaseModel):
    id: str
    object: str = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    reasoning_content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None


class ChatChunk(BaseModel):
    id: str
    object: str = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str


class ModelCard(BaseModel):
    id: str
    object: str = "model"
    created: int
    owned_by: str = "decodekit"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: str = "list"
    data: list[ModelCard]
