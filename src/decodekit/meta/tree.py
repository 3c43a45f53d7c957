"""Tree search over reasoning steps with a process reward model (seed 001, "tree search").

States are partial solutions split at a step delimiter ("\\n"); a state's score comes from
a process reward model v(x, s_1..s_t) (Uesato et al. 2022; Lightman et al. 2024), reduced
over the path by `aggregate` (last step, min over steps, or product). Expanding a node
generates one step (sampling stops at the delimiter) with k samples from the node's prefix
through the Generator: the prefix is the prompt of its children's request, so a
LocalGenerator prefills it once for all k children.

Methods (N = `n`, M = `config.width`):
- "beam":   step-level beam search (Snell et al. 2024; HF search-and-learn): the root gets
            N children; keep the N/M best unfinished, expand each M times; repeat.
- "dvts":   diverse verifier tree search (Beeching et al. 2024): N/M independent subtrees;
            each expands its node M times and follows its best child, so subtrees never
            compete and the leaves stay diverse.
- "rebase": reward-balanced search (Wu et al. 2024b): the unfinished nodes of a depth share
            the remaining budget B = N - finished as children n_i in proportion to
            softmax(score_i / tau) (`allocate_children`), until N solutions are finished.

A node is finished when its step ended without the delimiter (EOS, another stop string or
the token limit), when `is_final(step)` says so, or at `config.max_depth` steps. The final
answer is the best-scoring leaf ("best"), a majority vote over the leaves' extracted answers
("vote"), or a vote weighted by the leaves' scores ("weighted_vote").
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from decodekit.completion import Completion
from decodekit.meta.budget import Budget
from decodekit.meta.generator import Generator, account_request, call_generator, derive_seed
from decodekit.meta.parallel import Extractor, choose_best, chosen_for, vote
from decodekit.meta.result import Candidate, MetaResult
from decodekit.meta.scorers import (
    ScorerError,
    as_number,
    check_on_error,
    describe,
    process_scorer,
    score_kind_of,
    vote_weight,
)
from decodekit.params import SamplingParams
from decodekit.validate import check_n

METHODS = ("beam", "dvts", "rebase")
AGGREGATIONS = ("last", "min", "product")
FINALS = ("best", "vote", "weighted_vote")


@dataclass(frozen=True)
class TreeConfig:
    """width: children per expanded node (M); tau: REBASE's softmax temperature."""

    width: int = 4
    delimiter: str = "\n"
    max_depth: int = 8
    aggregate: str = "last"
    final: str = "best"
    tau: float = 0.2

    def __post_init__(self):
        check_n(self.width, "width")
        check_n(self.max_depth, "max_depth")
        if not isinstance(self.delimiter, str) or not self.delimiter:
            raise ValueError(f"delimiter must be a non-empty string, got {self.delimiter!r}")
        if self.aggregate not in AGGREGATIONS:
            raise ValueError(f"aggregate must be one of {AGGREGATIONS}, got {self.aggregate!r}")
        if self.final not in FINALS:
            raise ValueError(f"final must be one of {FINALS}, got {self.final!r}")
        if not (isinstance(self.tau, int | float) and self.tau > 0):
            raise ValueError(f"tau must be a number > 0, got {self.tau!r}")


@dataclass
class Node:
    """A partial solution: its steps, the PRM score after each, and why it ended (or "")."""

    steps: tuple[str, ...] = ()
    scores: tuple[float, ...] = ()
    reason: str = ""
    completion: Completion | None = None  # the request that produced the last step

    @property
    def finished(self) -> bool:
        return self.reason != ""

    def prefix(self, prompt: str, delimiter: str) -> str:
        return prompt + "".join(step + delimiter for step in self.steps)

    def value(self, aggregate: str, score_kind: str | None = None) -> float:
        """The path's score; "product" multiplies probabilities (a logit PRM's sigmoids)."""
        if not self.scores:
            return 0.0
        if aggregate == "last":
            return self.scores[-1]
        if aggregate == "min":
            return min(self.scores)
        return math.prod(vote_weight(s, score_kind) for s in self.scores)


def allocate_children(total: int, values: list[float], tau: float) -> list[int]:
    """REBASE's children per node: total * softmax(values / tau), rounded by largest remainder
    (floors first, then the leftover to the largest fractional parts, lower index on ties),
    so the counts sum to exactly `total` and each is within 1 of its share."""
    if not values:
        return []
    top = max(values)
    weights = [math.exp((v - top) / tau) for v in values]
    shares = [total * w / sum(weights) for w in weights]
    counts = [math.floor(s) for s in shares]
    order = sorted(range(len(values)), key=lambda i: (-(shares[i] - counts[i]), i))
    for i in order[: total - sum(counts)]:
        counts[i] += 1
    return counts


class _Search:
    """One prompt's search: its settings, budget, expansion counter and failed children."""

    def __init__(self, prompt, params, config, extract, is_final, on_error, budget):
        self.prompt, self.config = prompt, config
        stop = params.stop if config.delimiter in params.stop else (*params.stop, config.delimiter)
        self.params = params.replace(stop=stop)
        self.extract, self.is_final, self.on_error = extract, is_final, on_error
        self.budget = budget
        self.failed: list[Candidate] = []
        self.expansions = 0
        self.stopped = False
        self.trace: list[tuple[Node, Node]] | None = None  # (parent, child) pairs, when recording
        self.score_kind: str | None = None  # the PRM's (meta/scorers.py)

    def value(self, node: Node) -> float:
        return node.value(self.config.aggregate, self.score_kind)

    def out_of_budget(self) -> bool:
        self.stopped = self.stopped or self.budget.exhausted
        return self.stopped

    def plan(self, nodes: list[Node], counts: list[int]) -> tuple[list[Node], list[int], list]:
        """The requests that expand nodes[i] counts[i] times: each distinct node object is one
        request for all its children (DVTS's subtrees all start at the root)."""
        unique: dict[int, int] = {}
        requests, totals = [], []
        for node, k in zip(nodes, counts):
            if id(node) not in unique:
                unique[id(node)] = len(requests)
                requests.append(node)
                totals.append(0)
            totals[unique[id(node)]] += k
        params = [self.params.replace(seed=derive_seed(self.params.seed, self.expansions, i))
                  for i in range(len(requests))]
        self.expansions += 1
        return requests, totals, params

    def child(self, node: Node, completion: Completion) -> Node:
        step = completion.text
        if self.is_final is not None and self.is_final(step):
            reason = "final"
        elif completion.finish_reason != "stop":
            reason = "length"
        elif completion.stop_reason != self.config.delimiter:
            reason = "eos" if isinstance(completion.stop_reason, int) else "stop"
        elif len(node.steps) + 1 >= self.config.max_depth:
            reason = "depth"
        else:
            reason = ""
        made = Node((*node.steps, step), node.scores, reason, completion)
        if self.trace is not None:
            self.trace.append((node, made))
        return made

    def scorer_item(self, node: Node) -> tuple:
        """What a process scorer reads: question, steps, prefix text, parent's step scores."""
        return self.prompt, node.steps, node.prefix(self.prompt, self.config.delimiter), node.scores

    def take_scores(self, children: list[Node], values: list) -> None:
        """Set each child's step scores from the PRM's value (or the exception it raised)."""
        failed: list[tuple[int, Candidate]] = []
        for i, (child, value) in enumerate(zip(children, values)):
            self.budget.add_scorer_calls()
            try:
                if isinstance(value, Exception):
                    raise value
                scores = tuple(as_number(v) for v in value)
                if len(scores) != len(child.steps):
                    raise ValueError(f"returned {len(scores)} scores for {len(child.steps)} steps")
                child.scores = scores
            except Exception as error:  # the failure belongs to this child
                failed.append((i, self.candidate(child, error=f"{type(error).__name__}: {error}")))
                child.reason = "failed"
        self.failed += [c for _, c in failed]
        if failed and self.on_error == "raise":
            names = "; ".join(f"{describe(i, c.text)}: {c.error}" for i, c in failed)
            raise ScorerError(
                f"process scorer failed on {len(failed)} of {len(children)} children: {names} "
                "(pass on_error='record' to keep going without them)",
                [self.candidate(c) for c in children if c.reason != "failed"] + self.failed,
            )

    def candidate(self, node: Node, error: str | None = None) -> Candidate:
        text = self.config.delimiter.join(node.steps)
        answer = self.extract(text) if self.extract is not None else None
        score = None if error else self.value(node)
        return Candidate(text, node.completion, score, answer, error, list(node.steps),
                         list(node.scores) if not error else None, node.reason or "unfinished")

    def result(self, method: str, leaves: list[Node], frontier: list[Node]) -> MetaResult:
        candidates = [self.candidate(node) for node in (leaves or frontier)]
        if self.config.final == "best":
            chosen = choose_best(candidates)
            answer = chosen.answer if chosen is not None else None
            tallies = {}
        else:
            weighted = self.config.final == "weighted_vote"
            answer, tallies = vote(candidates, weighted, self.score_kind)
            chosen = chosen_for(candidates, answer, weighted)
        return MetaResult(method, chosen, candidates + self.failed, self.budget.report(), answer,
                          tallies, self.stopped)


# Each method is a generator: it yields (nodes, counts) to expand and receives, for each
# node, its scored children (failed ones left out); it returns (leaves, frontier). The
# driver (`_drive`) runs many searches in lockstep so one generator call serves them all.


def _beam(search: _Search, n: int):
    width = min(search.config.width, n)
    keep = max(1, n // width)
    frontier, counts, leaves = [Node()], [n], []
    while frontier and not search.out_of_budget():
        children = [c for group in (yield frontier, counts) for c in group]
        leaves += [c for c in children if c.finished]
        # sorted() is stable: among equal scores the earlier child stays ahead
        active = sorted((c for c in children if not c.finished), key=search.value, reverse=True)
        frontier, counts = active[:keep], [width] * min(keep, len(active))
        if len(leaves) >= n:
            break
    return leaves, frontier


def _dvts(search: _Search, n: int):
    width = min(search.config.width, n)
    current, leaves = [Node()] * max(1, n // width), []
    while current and not search.out_of_budget():
        following = []
        for children in (yield current, [width] * len(current)):
            if children:  # a subtree whose children all failed scoring ends here
                best = max(children, key=search.value)  # max() keeps the first of equals
                (leaves if best.finished else following).append(best)
        current = following
    return leaves, current


def _rebase(search: _Search, n: int):
    frontier, counts, leaves = [Node()], [n], []
    while frontier and not search.out_of_budget():
        children = [c for group in (yield frontier, counts) for c in group]
        leaves += [c for c in children if c.finished]
        active = [c for c in children if not c.finished]
        remaining = n - len(leaves)
        if remaining <= 0:
            return leaves, active
        allocation = allocate_children(remaining, [search.value(c) for c in active], search.config.tau)
        frontier = [c for c, k in zip(active, allocation) if k > 0]
        counts = [k for k in allocation if k > 0]
    return leaves, frontier


_LOOPS = {"beam": _beam, "dvts": _dvts, "rebase": _rebase}


def regroup(nodes: list[Node], counts: list[int], requests: list[Node], pools: list[list[Node]]):
    """Hand each of nodes[i] its counts[i] children from its request's pool, minus failures."""
    slots = {id(node): list(pool) for node, pool in zip(requests, pools)}
    groups = []
    for node, k in zip(nodes, counts):
        slot = slots[id(node)]
        groups.append([c for c in slot[:k] if c.reason != "failed"])
        del slot[:k]
    return groups


def _drive(generator: Generator, searches: list[_Search], method: str, n: int, prm: Callable,
           prm_kind: str | None) -> list[MetaResult]:
    """Run the searches in lockstep: each round, one generator call expands every search's
    nodes and one pass scores all their children (one call if the PRM is batched)."""
    score = process_scorer(prm, prm_kind)
    for search in searches:
        search.score_kind = score_kind_of(prm)
    loops = [_LOOPS[method](search, n) for search in searches]
    pending: dict[int, tuple] = {}
    outcomes: list = [None] * len(searches)

    def advance(i: int, sent) -> None:
        try:
            pending[i] = loops[i].send(sent)
        except StopIteration as stop:
            outcomes[i] = stop.value

    for i in range(len(searches)):
        advance(i, None)
    while pending:
        plans = {i: searches[i].plan(*pending[i]) for i in pending}
        prompts = [node.prefix(searches[i].prompt, searches[i].config.delimiter)
                   for i, (nodes, _, _) in plans.items() for node in nodes]
        totals = [k for _, totals, _ in plans.values() for k in totals]
        params = [p for _, _, params in plans.values() for p in params]
        if len(searches) == 1:
            results = iter(call_generator(generator, prompts, totals, params, searches[0].budget))
        else:  # attribute each request to its search by the completions' usage
            results = iter(generator.generate(prompts, totals, params))
        pools = {}
        for i, (nodes, _, _) in plans.items():
            pools[i] = [[searches[i].child(node, c) for c in completions]
                        for node, completions in zip(nodes, [next(results) for _ in nodes])]
            if len(searches) > 1:
                for pool in pools[i]:
                    account_request(searches[i].budget, [c.completion for c in pool])
        children = {i: [c for pool in pools[i] for c in pool] for i in pools}
        values = score([searches[i].scorer_item(c) for i in children for c in children[i]])
        start = 0
        for i in list(pending):
            searches[i].take_scores(children[i], values[start : start + len(children[i])])
            start += len(children[i])
            nodes, counts = pending.pop(i)
            advance(i, regroup(nodes, counts, plans[i][0], pools[i]))
    return [search.result(method, *outcome) for search, outcome in zip(searches, outcomes)]


def _searches(prompts, params, config, extract, is_final, on_error, budgets, method, n):
    if method not in _LOOPS:
        raise ValueError(f"unknown tree search method {method!r}; choose from {METHODS}")
    check_n(n)
    check_on_error(on_error)
    if config.final != "best" and extract is None:
        raise ValueError(f"final={config.final!r} needs an answer extractor (extract=)")
    return [_Search(prompt, params, config, extract, is_final, on_error, budget)
            for prompt, budget in zip(prompts, budgets)]


def tree_search(
    generator: Generator,
    prompt: str,
    prm: Callable,
    n: int,
    method: str = "beam",
    params: SamplingParams | None = None,
    config: TreeConfig | None = None,
    *,
    extract: Extractor | None = None,
    is_final: Callable[[str], bool] | None = None,
    prm_kind: str | None = None,
    on_error: str = "raise",
    budget: Budget | None = None,
    trace: list | None = None,
) -> MetaResult:
    """Search for a solution of `prompt` with N = n samples per depth (see the module doc).

    prm: (question, steps) -> list[float], or prefix -> float, or with prm_kind="batch"
    [(question, steps), ...] -> [list[float], ...]; params: sampling of one step
    (max_new_tokens bounds a step); extract: answer of a solution text (needed for
    final="vote"/"weighted_vote"). Candidates are the finished leaves (or, if none
    finished, the last frontier) followed by children whose scoring failed
    (on_error="record"). trace: a list that receives every (parent, child) `Node` as the
    child is made (the lab draws the tree from it; the search is the same without it)."""
    config = config or TreeConfig()
    budget = budget if budget is not None else Budget()
    searches = _searches([prompt], params or SamplingParams(), config, extract, is_final, on_error,
                         [budget], method, n)
    searches[0].trace = trace
    return _drive(generator, searches, method, n, prm, prm_kind)[0]


def tree_search_batch(
    generator: Generator,
    prompts: Sequence[str],
    prm: Callable,
    n: int,
    method: str = "beam",
    params: SamplingParams | None = None,
    config: TreeConfig | None = None,
    *,
    extract: Extractor | None = None,
    is_final: Callable[[str], bool] | None = None,
    prm_kind: str | None = None,
    on_error: str = "raise",
    budgets: Sequence[Budget] | None = None,
) -> list[MetaResult]:
    """`tree_search` of many prompts in lockstep: one generator call per depth expands every
    prompt's nodes. Prompt i's search is `tree_search` with the seed
    derive_seed(params.seed, "prompt", i), so prompts do not share random draws. Each
    result's budget counts its own requests from the completions' usage (one call per
    request; `cached_prompt_tokens` as reused) and the shared wall time."""
    config = config or TreeConfig()
    budgets = [Budget() for _ in prompts] if budgets is None else list(budgets)
    if len(budgets) != len(prompts):
        raise ValueError(f"budgets must be one per prompt ({len(prompts)}), got {len(budgets)}")
    params = params or SamplingParams()
    searches = _searches(list(prompts), params, config, extract, is_final, on_error, budgets, method, n)
    for i, search in enumerate(searches):  # independent draws per prompt, reproducible by seed
        search.params = search.params.replace(seed=derive_seed(params.seed, "prompt", i))
    return _drive(generator, searches, method, n, prm, prm_kind) if searches else []
