"""Toy generators for meta-generation tests: a character k-gram task with a known greedy
path, and a scripted Generator whose outputs are fixed in advance."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from decodekit.completion import Completion, Usage
from decodekit.meta.budget import Budget
from decodekit.meta.generator import per_prompt_counts, per_prompt_params
from decodekit.models.ngram import NGramConfig, train_ngram

# A two-step toy task. Prompt "Q\n"; steps are lines. The corpus has "a" then "x" three
# times and "b" then "c" twice, so greedy decoding writes "a\nx"; the correct solution
# (for the oracle below) is "b\nc". Character 4-gram, add-constant 1e-6: the counts.
TOY_VOCAB = ["Q", "\n", "a", "b", "c", "x", "$"]
TOY_DOCS = ["Q\na\nx"] * 3 + ["Q\nb\nc"] * 2
TOY_PROMPT = "Q\n"
TOY_SOLUTION = ["b", "c"]


def toy_oracle(question: str, steps: Sequence[str]) -> list[float]:
    """Exact process reward: 1 while every step so far follows the correct solution."""
    return [float(list(steps[: t + 1]) == TOY_SOLUTION[: t + 1]) for t in range(len(steps))]


def make_toy_model():
    config = NGramConfig(4, "add-constant", 1e-6)
    return train_ngram(TOY_DOCS, config, level="char", vocabulary=TOY_VOCAB, eos="$", name="toy")


class ScriptedGenerator:
    """A Generator whose i-th sample (over all calls) is respond(prompt, i): a text, or
    (text, stop_reason) where stop_reason None means the sample hit the length limit.
    Tokens are characters; the prompt of each request counts once (shared prefill)."""

    def __init__(self, respond: Callable[[str, int], str | tuple] | Sequence[str]):
        if not callable(respond):
            texts = list(respond)
            respond = lambda prompt, i: texts[i % len(texts)]  # noqa: E731
        self.respond = respond
        self.budget = Budget()
        self.requests: list[tuple[str, int]] = []
        self.count = 0

    def generate(self, prompts, n, params):
        counts = per_prompt_counts(n, len(prompts))
        per_prompt_params(params, len(prompts))
        results = []
        for prompt, k in zip(prompts, counts):
            self.requests.append((prompt, k))
            batch = []
            for _ in range(k):
                reply = self.respond(prompt, self.count)
                self.count += 1
                text, stop = reply if isinstance(reply, tuple) else (reply, 0)
                finish = "length" if stop is None else "stop"
                usage = Usage(len(prompt), len(text) + 1)
                batch.append(Completion(list(range(len(text) + 1)), text, [], [], finish, usage,
                                        stop_reason=stop))
            self.budget.add_generation(len(prompt), sum(c.usage.completion_tokens for c in batch),
                                       reused=len(prompt) * (k - 1))
            results.append(batch)
        return results

    def score(self, prompt, continuations):
        raise NotImplementedError
