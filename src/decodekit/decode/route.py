"""Where a request runs, and what a built request is: the one decision between an engine
and the plain loop, and the `Run` every strategy builds.

A strategy (`sample.Sample`, `beam.Beam`, `speculative.Speculative`) builds a request from
its parameters in one method, `prepare(model, prompts, params, constraint=, heal=,
adapter=) -> Run`, which checks every argument and routes it here. `generate`/`stream`,
`beam_search` and `speculative_generate` are that call and `Run.completions()`; the CLI
builds the strategy from its flags, the server from the request's fields (and submits the
run to its engine, server/backend.py `Backend.submit`), the lab calls the same; none builds
a program itself.

`engine_route(model, items, program)` decides by declared capability, never by class
(models/base.py); server/backend.py keeps an engine for exactly the models this routes to
their own engine (`runs_on_own_engine`):

1. a model with paged KV (`supports_paged_kv`) runs the items on its own persistent
   engine: sampling requests as they are, other strategies' items as the programs
   `program(index, item)` builds (engine/program.py);
2. a model built on others runs them on the engine its `engine_programs(items)` hook names
   (a ContrastiveLM of two paged-KV models: its expert's, for sampling requests and beam
   searches), unless the strategy cannot be delegated (`delegate=False`: speculative
   decoding verifies against the target's own logits);
3. anything else runs on the plain loop (None).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from decodekit.completion import Completion
from decodekit.models.base import LanguageModel
from decodekit.request import Delta


class UnsupportedField(ValueError):
    """A strategy cannot honour a SamplingParams field's value; `field` names it (the server
    answers 400 with it as the param)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field


@dataclass
class Run:
    """A request built by its strategy, every argument checked: `items` (its sampling
    requests, beam searches, ...; one per prompt), `counts` (the completions each prompt
    gets), `route` (`engine_route`'s answer: the model whose engine runs it and what to
    submit there) or None, and `plain()`, its deltas on the plain loop."""

    items: list
    counts: list[int]
    route: tuple[LanguageModel, list] | None
    plain: Callable[[], Iterator[Delta]]

    def deltas(self) -> Iterator[Delta]:
        """The deltas wherever the run is routed: the model's persistent engine, or the plain loop."""
        if self.route is None:
            return self.plain()
        from decodekit.engine.persistent import run_requests

        return run_requests(*self.route)

    def completions(self) -> list[list[Completion]]:
        """Run it to the end: the completions of each prompt."""
        results: list[list] = [[None] * count for count in self.counts]
        for delta in self.deltas():
            if delta.completion is not None:
                results[delta.prompt_index][delta.sample_index] = delta.completion
        return results


def completion_deltas(prompt_index: int, completions: Sequence[Completion]) -> Iterator[Delta]:
    """One delta per completion of a search that produces its text at the end (beam,
    speculative decoding on the plain loop)."""
    for i, c in enumerate(completions):
        yield Delta(prompt_index, i, c.text, c, list(c.token_ids), list(c.logprobs), c.top_logprobs)


def engine_route(
    model: LanguageModel,
    items: Sequence[Any],
    program: Callable[[int, Any], Any] | None = None,
    delegate: bool = True,
) -> tuple[LanguageModel, list] | None:
    """(the model whose engine runs the items, what to submit there: requests or programs),
    or None for the plain loop (module docstring)."""
    if model.supports_paged_kv:
        if program is None:
            return model, list(items)
        return model, [program(index, item) for index, item in enumerate(items)]
    if not delegate:
        return None
    return model.engine_programs(list(items))


def runs_on_own_engine(model: LanguageModel) -> bool:
    """Whether `engine_route` runs this model's requests on the model's own engine (the
    server keeps one for exactly such a model)."""
    route = engine_route(model, [])
    return route is not None and route[0] is model
