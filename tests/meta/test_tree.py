"""Tree search with a process reward model on the toy two-step task (meta_toys.py)."""

from __future__ import annotations

import math

import pytest
from meta_toys import TOY_PROMPT, ScriptedGenerator, toy_oracle

from decodekit.meta.generator import LocalGenerator, derive_seed
from decodekit.meta.scorers import ScorerError
from decodekit.meta.tree import Node, TreeConfig, allocate_children, tree_search, tree_search_batch
from decodekit.params import SamplingParams

pytestmark = pytest.mark.usefixtures("one_thread")
STEP = SamplingParams(max_new_tokens=4)  # one step is one character and its delimiter


class Spy(LocalGenerator):
    """Records the (prompt, n) of every request."""

    def __init__(self, model):
        super().__init__(model)
        self.requests = []

    def generate(self, prompts, n, params):
        counts = [n] * len(prompts) if isinstance(n, int) else list(n)
        self.requests.append(list(zip(prompts, counts)))
        return super().generate(prompts, n, params)


def test_greedy_misses_the_toy_solution(toy_model):
    [[completion]] = LocalGenerator(toy_model).generate([TOY_PROMPT], 1, STEP.replace(temperature=0))
    assert completion.text == "a\nx"  # the wrong path


@pytest.mark.parametrize("method", ["beam", "dvts", "rebase"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_oracle_prm_finds_the_solution_greedy_misses(toy_model, method, seed):
    params = STEP.replace(seed=seed)
    result = tree_search(LocalGenerator(toy_model), TOY_PROMPT, toy_oracle, 8, method, params,
                         TreeConfig(width=2))
    assert result.text == "b\nc" and result.chosen.steps == ["b", "c"]
    assert result.chosen.step_scores == [1.0, 1.0] and result.chosen.note == "eos"


def test_search_is_reproducible_with_a_seed(toy_model):
    def run():
        result = tree_search(LocalGenerator(toy_model), TOY_PROMPT, toy_oracle, 6, "rebase",
                             STEP.replace(seed=3), TreeConfig(width=2))
        return [c.text for c in result.candidates]

    assert run() == run()


@pytest.mark.parametrize("method", ["beam", "dvts", "rebase"])
def test_trace_records_every_child_and_changes_nothing(toy_model, method):
    def run(trace):
        return tree_search(LocalGenerator(toy_model), TOY_PROMPT, toy_oracle, 6, method, STEP.replace(seed=5),
                           TreeConfig(width=2), trace=trace)

    trace: list = []
    plain, traced = run(None), run(trace)
    assert [c.text for c in traced.candidates] == [c.text for c in plain.candidates]
    assert traced.text == plain.text and traced.budget["generated_tokens"] == plain.budget["generated_tokens"]
    children = [child for _, child in trace]
    assert len(children) == traced.budget["generated_tokens"] // 2  # each child: a character + "\n"/EOS
    for parent, child in trace:
        assert child.steps[:-1] == parent.steps  # a child extends its parent by one step
    assert any(c.completion is traced.chosen.completion for c in children)


def test_allocate_children_follows_softmax_proportions():
    # softmax(log w / 1) = w / sum(w): shares 1 : 2 : 5 of 8 are exact integers
    assert allocate_children(8, [math.log(1), math.log(2), math.log(5)], tau=1.0) == [1, 2, 5]
    # tau = 0.5 squares the weights: 1 : 4 : 25 of 30
    assert allocate_children(30, [math.log(1), math.log(2), math.log(5)], tau=0.5) == [1, 4, 25]
    # equal scores, 4 over 3: floors 1, 1, 1 and the leftover goes to the lowest index
    assert allocate_children(4, [0.3, 0.3, 0.3], tau=0.1) == [2, 1, 1]
    values = [0.1, 0.7, 0.4, 0.9, 0.2]
    counts = allocate_children(17, values, tau=0.3)
    weights = [math.exp(v / 0.3) for v in values]
    shares = [17 * w / sum(weights) for w in weights]
    assert sum(counts) == 17 and all(abs(c - s) < 1 for c, s in zip(counts, shares))
    assert allocate_children(5, [], tau=1.0) == []


def test_rebase_expands_nodes_in_softmax_proportions(toy_model):
    def prefix_prm(prefix):
        return 1.0 if prefix.endswith("b\n") else 0.0  # node value: is its last step "b"

    spy = Spy(toy_model)
    tau = 0.5
    result = tree_search(spy, TOY_PROMPT, prefix_prm, 10, "rebase", STEP.replace(seed=0),
                         TreeConfig(tau=tau), prm_kind="prefix")
    [root_request], second = spy.requests[0], spy.requests[1]
    assert root_request == (TOY_PROMPT, 10)
    firsts = [c.steps[0] for c in result.candidates]  # each leaf's first step = its parent
    assert len(firsts) == 10  # REBASE stops once N = 10 solutions are finished
    # the second depth: the 10 depth-1 nodes share 10 children by softmax(value / tau)
    n_b = sum(1 for prompt, _ in second if prompt.endswith("b\n"))
    n_a = len(second) - n_b
    expected = allocate_children(10, [1.0] * n_b + [0.0] * n_a, tau)
    got = sorted((k for _, k in second), reverse=True)
    assert got == sorted((k for k in expected if k), reverse=True)
    assert 0 < n_b < 10


def test_tree_budget_counts_by_hand(toy_model):
    greedy = STEP.replace(temperature=0)
    # beam, N = 2, width 2: the root "Q\n" (2 tokens) gets 2 children "a" + "\n" (2 tokens each);
    # keep 1, whose prefix "Q\na\n" (4 tokens) gets 2 children "x" + EOS (2 tokens each).
    result = tree_search(LocalGenerator(toy_model), TOY_PROMPT, toy_oracle, 2, "beam", greedy,
                         TreeConfig(width=2))
    budget = result.budget
    assert budget["generator_calls"] == 2
    assert budget["prompt_tokens"] == 2 + 4 and budget["reused_prefix_tokens"] == 2 + 4
    assert budget["generated_tokens"] == 4 + 4 and budget["scorer_calls"] == 4
    assert [c.text for c in result.candidates] == ["a\nx", "a\nx"]
    # DVTS, N = 4, width 2: both subtrees start at the root: one request of 4 (prompt 2,
    # reused 6, 8 tokens); each subtree's best child "a" is its own node: 2 requests of 2
    # children from "Q\na\n" (prompt 4 + 4, reused 4 + 4, 8 tokens).
    result = tree_search(LocalGenerator(toy_model), TOY_PROMPT, toy_oracle, 4, "dvts", greedy,
                         TreeConfig(width=2))
    assert {k: result.budget[k] for k in ("generator_calls", "prompt_tokens", "reused_prefix_tokens",
                                          "generated_tokens", "scorer_calls")} == {
        "generator_calls": 3, "prompt_tokens": 10, "reused_prefix_tokens": 14,
        "generated_tokens": 16, "scorer_calls": 8}


def test_node_prefix_is_the_prompt_of_its_children(toy_model):
    spy = Spy(toy_model)
    tree_search(spy, TOY_PROMPT, toy_oracle, 4, "beam", STEP.replace(seed=0), TreeConfig(width=2))
    assert spy.requests[0] == [(TOY_PROMPT, 4)]
    # the 2 kept nodes: one request each, with all their 2 children
    assert sorted(k for _, k in spy.requests[1]) == [2, 2]
    assert all(prompt.startswith(TOY_PROMPT) and prompt.endswith("\n") for prompt, _ in spy.requests[1])


def test_step_aggregation():
    node = Node(("s1", "s2", "s3"), (0.9, 0.5, 0.8))
    assert node.value("last") == 0.8
    assert node.value("min") == 0.5
    assert node.value("product") == pytest.approx(0.36)


def test_final_answer_by_vote_or_best():
    replies = {"Q\n": ["a", "b", "c", "d"]}
    answers = {"a": "1", "b": "2", "c": "2", "d": "3"}
    gen = ScriptedGenerator(lambda prompt, i: (replies[prompt][i % 4], 0))  # each step ends at EOS
    scores = {"a": 0.9, "b": 0.3, "c": 0.35, "d": 0.1}

    def prm(question, steps):
        return [scores[s] for s in steps]

    config = TreeConfig(width=4, final="best")
    best = tree_search(gen, "Q\n", prm, 4, "beam", config=config, extract=lambda t: answers[t])
    assert best.text == "a" and best.answer == "1"
    voted = tree_search(ScriptedGenerator(gen.respond), "Q\n", prm, 4, "beam",
                        config=TreeConfig(width=4, final="vote"), extract=lambda t: answers[t])
    assert voted.answer == "2" and voted.text == "b" and voted.tallies == {"1": 1.0, "2": 2.0, "3": 1.0}
    weighted = tree_search(ScriptedGenerator(gen.respond), "Q\n", prm, 4, "beam",
                           config=TreeConfig(width=4, final="weighted_vote"), extract=lambda t: answers[t])
    assert weighted.answer == "1"  # 0.9 > 0.3 + 0.35


def test_prm_failure_on_one_child(toy_model):
    def prm(question, steps):
        if steps[-1] == "a":
            raise RuntimeError("PRM out of memory")
        return toy_oracle(question, steps)

    with pytest.raises(ScorerError, match=r"candidate \d+ \('a'\): RuntimeError: PRM out of memory"):
        tree_search(LocalGenerator(toy_model), TOY_PROMPT, prm, 8, "beam", STEP.replace(seed=0),
                    TreeConfig(width=2))
    result = tree_search(LocalGenerator(toy_model), TOY_PROMPT, prm, 8, "beam", STEP.replace(seed=0),
                         TreeConfig(width=2), on_error="record")
    assert result.text == "b\nc"  # the search went on without the failed children
    failed = [c for c in result.candidates if c.failed]
    assert failed and all(c.text == "a" and "out of memory" in c.error for c in failed)


def test_prm_returning_nan_or_wrong_length_fails_clearly(toy_model):
    with pytest.raises(ScorerError, match="returned nan"):
        tree_search(LocalGenerator(toy_model), TOY_PROMPT, lambda q, s: [math.nan] * len(s), 2)
    with pytest.raises(ScorerError, match="returned 1 scores for 2 steps"):
        tree_search(LocalGenerator(toy_model), TOY_PROMPT, lambda q, s: [1.0], 2,
                    params=STEP.replace(temperature=0))


def test_bad_input(toy_model):
    gen = LocalGenerator(toy_model)
    with pytest.raises(ValueError, match="unknown tree search method 'mcts'"):
        tree_search(gen, TOY_PROMPT, toy_oracle, 4, "mcts")
    with pytest.raises(ValueError, match="n must be an integer >= 1, got 0"):
        tree_search(gen, TOY_PROMPT, toy_oracle, 0)
    with pytest.raises(ValueError, match="needs an answer extractor"):
        tree_search(gen, TOY_PROMPT, toy_oracle, 4, config=TreeConfig(final="vote"))
    with pytest.raises(ValueError, match="aggregate must be one of"):
        TreeConfig(aggregate="mean")
    with pytest.raises(ValueError, match="tau must be a number > 0"):
        TreeConfig(tau=0)


def test_batched_searches_match_single_searches_and_split_the_budget(toy_model):
    params, config = STEP.replace(seed=4), TreeConfig(width=2)
    gen = LocalGenerator(toy_model)
    batch = tree_search_batch(gen, [TOY_PROMPT, TOY_PROMPT], toy_oracle, 6, "rebase", params, config)
    for i, result in enumerate(batch):
        alone = tree_search(LocalGenerator(toy_model), TOY_PROMPT, toy_oracle, 6, "rebase",
                            params.replace(seed=derive_seed(4, "prompt", i)), config)
        assert [c.text for c in result.candidates] == [c.text for c in alone.candidates]
        for key in ("prompt_tokens", "generated_tokens", "reused_prefix_tokens", "scorer_calls"):
            assert result.budget[key] == alone.budget[key]
    # each depth is one call for both searches; the per-search counts add up to the generator's
    for key in ("prompt_tokens", "generated_tokens", "reused_prefix_tokens"):
        assert sum(r.budget[key] for r in batch) == gen.budget.counts()[key]


def test_batched_prm_scores_all_children_in_one_call(toy_model):
    calls = []

    def batched(items):
        calls.append(len(items))
        return [toy_oracle(q, steps) for q, steps in items]

    results = tree_search_batch(LocalGenerator(toy_model), [TOY_PROMPT] * 3, batched, 4, "beam",
                                STEP.replace(seed=0), TreeConfig(width=2), prm_kind="batch")
    assert all(r.text == "b\nc" for r in results)
    assert calls == [12, 12]  # 3 searches x 4 children, at each of the 2 depths

    def broken(items):
        raise RuntimeError("scorer server down")

    with pytest.raises(ScorerError, match="scorer server down"):
        tree_search_batch(LocalGenerator(toy_model), [TOY_PROMPT], broken, 2, prm_kind="batch")


def scripted_tree(method, n, width, prm, aggregate="last"):
    """A search over a ScriptedGenerator: from "Q\\n" the k-th child is the step "abcd"[k],
    not finished; from "Q\\n<p>\\n" it is "<p>1", "<p>2", ... ending at EOS."""
    counters = {}

    def respond(prompt, i):
        k = counters[prompt] = counters.get(prompt, -1) + 1
        if prompt == "Q\n":
            return "abcd"[k], "\n"
        return f"{prompt.split(chr(10))[1]}{k + 1}", 0

    gen = ScriptedGenerator(respond)
    result = tree_search(gen, "Q\n", prm, n, method, config=TreeConfig(width=width, aggregate=aggregate))
    return result, gen.requests


def last_step_prm(scores):
    return lambda question, steps: [scores.get(step, 0.5) for step in steps]


def test_dvts_follows_the_best_child_of_each_subtree():
    # N = 4, width 2: two subtrees share the root's request; subtree 1 gets children a, b and
    # follows b (0.9 > 0.2), subtree 2 gets c, d and follows c (0.7 > 0.1). Each then picks
    # its best leaf: b2 (0.8 > 0.3), and c1 over c2, the first of equal scores.
    scores = {"a": 0.2, "b": 0.9, "c": 0.7, "d": 0.1, "b1": 0.3, "b2": 0.8, "c1": 0.6, "c2": 0.6}
    result, requests = scripted_tree("dvts", 4, 2, last_step_prm(scores))
    assert requests == [("Q\n", 4), ("Q\nb\n", 2), ("Q\nc\n", 2)]
    assert [c.text for c in result.candidates] == ["b\nb2", "c\nc1"]
    assert result.text == "b\nb2" and result.chosen.score == 0.8


def test_beam_keeps_the_best_and_the_earlier_of_equal_children():
    # N = 4, width 2: keep 2 of the root's 4 children: b (0.9), then a, the first of three
    # at 0.5; each kept node gets 2 children, which finish (4 leaves = N).
    scores = {"a": 0.5, "b": 0.9, "c": 0.5, "d": 0.5, "b1": 0.3, "b2": 0.8}
    result, requests = scripted_tree("beam", 4, 2, last_step_prm(scores))
    assert requests == [("Q\n", 4), ("Q\nb\n", 2), ("Q\na\n", 2)]
    assert [c.text for c in result.candidates] == ["b\nb1", "b\nb2", "a\na1", "a\na2"]
    assert result.text == "b\nb2"


@pytest.mark.parametrize(("aggregate", "expected"), [("last", "a1"), ("min", "a2"), ("product", "a1")])
def test_search_ranks_paths_by_the_aggregate(aggregate, expected):
    # N = 2, width 2: keep a (0.9 > 0.1) and expand it. The PRM rescores the whole path:
    # a1 [0.4, 0.9] (last 0.9, min 0.4, product 0.36), a2 [0.5, 0.7] (0.7, 0.5, 0.35).
    paths = {("a",): [0.9], ("b",): [0.1], ("a", "a1"): [0.4, 0.9], ("a", "a2"): [0.5, 0.7]}
    result, requests = scripted_tree("beam", 2, 2, lambda q, steps: paths[tuple(steps)], aggregate)
    assert requests == [("Q\n", 2), ("Q\na\n", 2)]
    assert result.text == f"a\n{expected}"


class EngineSpy(LocalGenerator):
    """Records each call's prompts and the prompt tokens the model's persistent engine
    computed and reused for it (engine/engine.py `engine_for`)."""

    def __init__(self, model):
        super().__init__(model)
        self.calls = []

    def generate(self, prompts, n, params):
        from decodekit.engine.engine import engine_for

        stats = engine_for(self.model).stats
        before = stats()
        results = super().generate(prompts, n, params)
        after = stats()
        held = sum(len(self.model.encode(p)) for p in prompts)
        self.calls.append((len(prompts), held, after["prefill_tokens"] - before["prefill_tokens"],
                           after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"]))
        return results


@pytest.mark.parametrize("method", ["beam", "dvts", "rebase"])
def test_deeper_nodes_compute_no_prompt_token_the_engine_already_holds(method):
    """A child's prompt is its parent's prompt and step: the parent computed all of it but
    the step's last token (the delimiter), so each child prompt computes that one token."""
    from decodekit.engine.engine import forget_engine
    from decodekit.meta.tasks.arith import format_prompt, generate_problems
    from decodekit.models.registry import load_model

    model = load_model("arith")
    forget_engine(model)
    spy = EngineSpy(model)
    prompt = format_prompt(generate_problems(1, seed=4)[0])
    tree_search(spy, prompt, lambda p, steps: [0.5] * len(steps), 8, method,
                SamplingParams(max_new_tokens=24, seed=0), TreeConfig(width=2))
    (_, held, computed, cached), *deeper = spy.calls
    assert (computed, cached) == (held, 0)  # the root: nothing cached yet
    assert deeper, "the search never went past the first depth"
    for prompts, held, computed, cached in deeper:
        assert computed == prompts and cached == held - prompts
    assert spy.budget.prompt_tokens == sum(call[2] for call in spy.calls)

