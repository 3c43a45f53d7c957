"""Meta-generators over the `Generator` protocol (seed 001).

    from decodekit.meta import LocalGenerator, best_of_n, tree_search
    gen = LocalGenerator(model)
    result = best_of_n(gen, prompt, 16, reward)      # result.text, .candidates, .budget

Modules: generator (protocol, LocalGenerator), budget, parallel (best-of-N, rejection
sampling, voting), bayes_risk (`mbr`), tree (beam / DVTS / REBASE with a PRM), refinement
(`refine`), pipeline (`run_pipeline`, tool calls), evaluate. Names resolve on first use, so
importing a task module does not import torch. No exported name is also a submodule's: once
a submodule is imported it is an attribute of this package, which `__getattr__` (asked only
for missing attributes) would no longer shadow.
"""

_EXPORTS = {
    "Budget": "budget",
    "Generator": "generator",
    "LocalGenerator": "generator",
    "Candidate": "result",
    "MetaResult": "result",
    "ScorerError": "scorers",
    "best_of_n": "parallel",
    "rejection_sampling": "parallel",
    "majority_vote": "parallel",
    "weighted_vote": "parallel",
    "mbr": "bayes_risk",
    "TreeConfig": "tree",
    "tree_search": "tree",
    "tree_search_batch": "tree",
    "Feedback": "refinement",
    "refine": "refinement",
    "run_pipeline": "pipeline",
    "generate_with_tool": "pipeline",
    "calculator": "pipeline",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        from importlib import import_module

        return getattr(import_module(f"decodekit.meta.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'decodekit.meta' has no attribute {name!r}")
