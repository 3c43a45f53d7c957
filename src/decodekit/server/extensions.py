"""The sampling extensions as typed request fields.

A request may set these SamplingParams fields by their own name (those declared `extension`,
params.py `option`; and `min_tokens`, vLLM's name for `min_new_tokens`). Each field's JSON type
comes from SamplingParams' annotation (a tuple is a list, a token id an integer >= 0), its
bounds from `params.RANGES`, its nullability from its type and its description from
`params.DESCRIPTIONS`, so the parser refuses a wrong type or value with a 400 naming the field
and what it allows, and /openapi.json declares them.
"""

from __future__ import annotations

import math
import types
from dataclasses import MISSING, fields
from typing import Annotated, Any, Literal, Union, get_args, get_origin, get_type_hints

from pydantic import BeforeValidator, ConfigDict, Field, create_model

from decodekit.params import (
    DEFAULT_ORDER,
    DESCRIPTIONS,
    EXTENSION_FIELDS,
    INTEGER_FIELDS,
    NULLABLE_FIELDS,
    RANGES,
    SamplingParams,
)

EXTENSIONS = EXTENSION_FIELDS  # as each field declares (params.py `option`)
RENAMED = {"min_tokens": "min_new_tokens"}  # a request's name -> SamplingParams'

def _integral(value: Any) -> Any:
    """An integral float (2.0) as the integer it is: JSON Schema's "integer" allows it, and so
    does OpenAI; the strict parser refuses anything else that is not an int (2.5, "2", true)."""
    return int(value) if isinstance(value, float) and value.is_integer() else value


Integer = Annotated[int, BeforeValidator(_integral)]  # every integer field of a request
TokenId = Annotated[Integer, Field(ge=0)]
Word = Annotated[str, Field(min_length=1)] | Annotated[list[TokenId], Field(min_length=1)]
# Items whose type the annotation does not say exactly.
ITEMS: dict[str, Any] = {"order": Literal[DEFAULT_ORDER], "bad_words": Word}
LIST_BOUNDS: dict[str, dict[str, Any]] = {
    "order": {"json_schema_extra": {"uniqueItems": True}},  # SamplingParams refuses a repeat
    "allowed_token_ids": {"min_length": 1},  # null, not [], means all
}
# What a list field allows, in words (error messages).
LISTS = {
    "dry_sequence_breakers": "a list of strings",
    "bad_words": "a list of words, each a non-empty string or a non-empty list of token ids (integers >= 0)",
    "allowed_token_ids": "null or a non-empty list of token ids (integers >= 0)",
    "stop_token_ids": "a list of token ids (integers >= 0)",
    "order": f"a list of distinct adapter names from {', '.join(DEFAULT_ORDER)}",
}
_FIELDS = {f.name: f for f in fields(SamplingParams)}
_TYPES = get_type_hints(SamplingParams)


def sampling_name(name: str) -> str:
    """The SamplingParams field a request's field `name` sets."""
    return RENAMED.get(name, name)


def wire_type(kind: Any, items: Any = None) -> Any:
    """SamplingParams' annotation `kind` as the JSON body's type: tuples are lists (of `items`
    where given), integers inside them token ids, integers `Integer`."""
    origin, args = get_origin(kind), get_args(kind)
    if origin is tuple:
        item = items if items is not None else args[0]
        return list[TokenId if item is int else wire_type(item)]
    if origin in (Union, types.UnionType):
        return Union[tuple(wire_type(arg, items) for arg in args)]  # noqa: UP007 -- built from a tuple
    return Integer if kind is int else kind


def bounds(name: str) -> dict[str, float]:
    """pydantic's (and JSON Schema's) bounds of a numeric field."""
    allowed = RANGES.get(name)
    if allowed is None:
        return {}
    low, high, low_open, high_open = allowed
    found = {"gt" if low_open else "ge": low}
    if high != math.inf:
        found["lt" if high_open else "le"] = high
    return found


def allowed(name: str) -> str:
    """What field `name` of a request allows, in words."""
    sampled = sampling_name(name)
    if sampled in LISTS:
        return LISTS[sampled]
    if _TYPES[sampled] is bool:
        return "true or false"
    integer = sampled in INTEGER_FIELDS
    words = "an integer" if integer else "a number"
    low, high, low_open, high_open = RANGES[sampled]
    if high == math.inf:
        words += f" {'>' if low_open else '>='} {low:g}"
    elif integer:
        words += f" in [{low:g}, {high:g}]"
    else:
        words += f" in {'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"
    return f"null or {words}" if sampled in NULLABLE_FIELDS else words


def _default(name: str) -> Any:
    spec = _FIELDS[name]
    value = spec.default if spec.default is not MISSING else spec.default_factory()
    return list(value) if isinstance(value, tuple) else value


def request_field(name: str) -> tuple[Any, Any]:
    """(type, pydantic Field) of the request's field `name`."""
    sampled = sampling_name(name)
    kind = wire_type(_TYPES[sampled], ITEMS.get(sampled))
    described = DESCRIPTIONS[sampled] + f". Allowed: {allowed(name)}."
    if name != sampled:
        described = f"vLLM's name for {sampled}: {described}"
    numeric = {"allow_inf_nan": False} if kind is float or float in get_args(kind) else {}
    return kind, Field(default=_default(sampled), description=described, **bounds(sampled), **numeric,
                       **LIST_BOUNDS.get(sampled, {}))


# The request's typed sampling fields; the body's other keys are checked by protocol.py.
SamplingFields = create_model(
    "SamplingFields",
    __config__=ConfigDict(strict=True, extra="allow"),
    **{name: request_field(name) for name in (*EXTENSIONS, *RENAMED)},
)
