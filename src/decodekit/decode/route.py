"""Where a request runs: the one decision between an engine and the plain loop.

`engine_route(model, items, program)` is asked by every entry point that starts decoding:
`generate`/`stream` (sample.py), `beam_search` (beam.py), `speculative_generate`
(speculative.py) and the server (server/plan.py `engine_program`; server/backend.py keeps
an engine for exactly the models this routes to their own engine); the CLI and the lab call
those library functions, so they follow it too. The rule, by declared capability, never
by class (models/base.py):

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

from collections.abc import Callable, Sequence
from typing import Any

from decodekit.models.base import LanguageModel


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
