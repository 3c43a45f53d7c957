"""Completions as OpenAI response bodies and stream chunks; best-of-N and voting.

Log-probabilities are the raw model's (`Completion.logprobs`: temperature 1, no
adapters), as vLLM reports them by default; they cover every generated token, the EOS or
stop token included (its text is empty), so their count equals `completion_tokens`.
`text_offset` is each token's character offset in the choice's text (which starts with
the prompt when `echo` is set). A stream sends each token's log-probs in the chunk that
carries its text (request.py's `Delta`), so its chunks' log-probs add up to the body's.
"""

from __future__ import annotations

import json
import math
import time
from collections.abc import Callable, Sequence

import torch

from decodekit.completion import Completion
from decodekit.conversation import reply_of
from decodekit.decode.tool_calls import CallDelta, ToolCall
from decodekit.models.base import LanguageModel, logprobs
from decodekit.request import Delta
from decodekit.server import protocol as p
from decodekit.server.request_plan import Plan, Selection


def now() -> int:
    return int(time.time())


def finish_reason(completion: Completion) -> str:
    return "length" if completion.finish_reason == "length" else "stop"


def reads_calls(plan: Plan) -> bool:
    """Whether the plan's answers are read for tool calls (decodekit/conversation.py `ToolUse`)."""
    return plan.tools is not None and plan.tools.reads_calls


def tool_calls_out(calls: Sequence[ToolCall]) -> list[p.ToolCallOut]:
    """Calls as a message's `tool_calls`."""
    return [p.ToolCallOut(id=c.id, function=p.CalledFunctionOut(name=c.name, arguments=c.arguments))
            for c in calls]  # fmt: skip


def tool_call_deltas(pieces: Sequence[CallDelta]) -> list[p.ToolCallDelta]:
    """Streamed pieces of calls as a delta's `tool_calls` (a call's first with its id and name)."""
    return [p.ToolCallDelta(index=c.index, id=c.id, type="function" if c.id else None,
                            function=p.CalledFunctionDelta(name=c.name, arguments=c.arguments))
            for c in pieces]  # fmt: skip


def chat_message(plan: Plan, completion: Completion) -> tuple[p.ChatMessageOut, str]:
    """A chat completion's message and finish reason (decodekit/conversation.py `reply_of`: a reasoning
    model's thinking apart; with tools, the calls and the text around them)."""
    reply = reply_of(completion, plan.tools, plan.thinking)
    message = p.ChatMessageOut(content=reply.content, tool_calls=tool_calls_out(reply.tool_calls) or None,
                               reasoning_content=reply.reasoning)  # fmt: skip
    return message, reply.finish_reason


def usage(plan: Plan, drawn: Sequence[Sequence[Completion]]) -> p.Usage:
    """Each prompt counted once (its n samples share the prefill); every drawn sample's tokens."""
    prompt = sum(len(ids) for ids in plan.prompts)
    completion = sum(c.usage.completion_tokens for completions in drawn for c in completions)
    return p.Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


# ---------------------------------------------------------------------------------- logprobs


def text_offsets(model: LanguageModel, ids: Sequence[int], start: int, first: int = 0) -> list[int]:
    """Character offset of each token from `first` on: the length of the text decoded before it."""
    return [start + len(model.decode(ids[:i])) for i in range(first, len(ids))]


def top_dict(model: LanguageModel, top: dict[int, float] | None) -> dict[str, float] | None:
    if top is None:
        return None
    return {model.token_text(t): lp for t, lp in top.items()}


@torch.inference_mode()
def prompt_logprobs(model: LanguageModel, ids: list[int], k: int) -> tuple[list, list]:
    """log p(token i | tokens < i) of a prompt (None for the first) and each position's top k."""
    logp = logprobs(model, torch.tensor([ids]))[0, :-1]  # [T-1, V]
    chosen = logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].tolist()
    tops: list = [None]
    if k:
        values, indices = logp.topk(k, dim=-1)
        tops += [dict(zip(i.tolist(), v.tolist())) for i, v in zip(indices, values)]
    else:
        tops += [None] * (len(ids) - 1)
    return [None, *chosen], tops


def completion_logprobs(
    model: LanguageModel, completion: Completion, k: int, start: int, prompt: tuple | None = None
) -> p.CompletionLogprobs:
    """The legacy logprobs object; `prompt` = (ids, logprobs, tops) prepends the echoed prompt."""
    ids, lps, tops = list(completion.token_ids), list(completion.logprobs), completion.top_logprobs
    tops = list(tops) if tops else [None] * len(ids)
    offsets = text_offsets(model, ids, start)
    if prompt is not None:
        prompt_ids, prompt_lps, prompt_tops = prompt
        offsets = text_offsets(model, prompt_ids, 0) + offsets
        ids, lps, tops = prompt_ids + ids, prompt_lps + lps, prompt_tops + tops
    return legacy_logprobs(model, ids, lps, tops, k, offsets)


def legacy_logprobs(model: LanguageModel, ids: Sequence[int], lps: Sequence[float | None],
                    tops: Sequence[dict | None] | None, k: int, offsets: list[int]) -> p.CompletionLogprobs:
    tops = tops or [None] * len(ids)
    return p.CompletionLogprobs(
        tokens=[model.token_text(t) for t in ids],
        token_logprobs=list(lps),
        top_logprobs=[top_dict(model, top) for top in tops] if k else None,
        text_offset=offsets,
    )


def chat_logprobs(model: LanguageModel, ids: Sequence[int], lps: Sequence[float],
                  tops: Sequence[dict[int, float]] | None, k: int) -> p.ChatLogprobs:
    tops = tops or [{}] * len(ids)
    content = []
    for token, lp, top in zip(ids, lps, tops):
        text = model.token_text(token)
        alternatives = [p.TopLogprob(token=model.token_text(t), logprob=v,
                                     bytes=list(model.token_text(t).encode()))
                        for t, v in list(top.items())[:k]]
        content.append(p.TokenLogprob(token=text, logprob=lp, bytes=list(text.encode()),
                                      top_logprobs=alternatives))
    return p.ChatLogprobs(content=content)


# ---------------------------------------------------------------------------------- bodies


def completion_choice(
    plan: Plan, model: LanguageModel, index: int, prompt_index: int, completion: Completion, text: str,
    echo_logprobs=None,
) -> p.CompletionChoice:
    logprobs = None
    if plan.logprobs is not None:
        start = len(plan.prompt_texts[prompt_index]) if plan.echo else 0
        prompt = (plan.prompts[prompt_index], *echo_logprobs) if echo_logprobs is not None else None
        logprobs = completion_logprobs(model, completion, plan.logprobs, start, prompt)
    return p.CompletionChoice(
        index=index, text=text, logprobs=logprobs, finish_reason=finish_reason(completion),
        stop_reason=completion.stop_reason, score=completion.score,
        token_ids=list(completion.token_ids) if plan.return_token_ids else None,
    )


def completion_body(plan: Plan, model: LanguageModel, rid: str, chosen, drawn, echoes) -> dict:
    """chosen[i]: the completions returned for prompt i; drawn[i]: all its samples."""
    choices = []
    for i, completions in enumerate(chosen):
        for completion in completions:
            text = (plan.prompt_texts[i] if plan.echo else "") + completion.text
            choices.append(completion_choice(plan, model, len(choices), i, completion, text, echoes[i]))
    body = p.CompletionResponse(id=rid, created=now(), model=plan.model, choices=choices,
                                usage=usage(plan, drawn))
    return body.model_dump()


def chat_body(plan: Plan, model: LanguageModel, rid: str, chosen, drawn) -> dict:
    choices = []
    for i, c in enumerate(chosen[0]):
        message, reason = chat_message(plan, c)
        choices.append(p.ChatChoice(
            index=i, message=message, finish_reason=reason, stop_reason=c.stop_reason,
            logprobs=chat_logprobs(model, c.token_ids, c.logprobs, c.top_logprobs, plan.logprobs)
            if plan.logprobs is not None else None,
            token_ids=list(c.token_ids) if plan.return_token_ids else None, score=c.score,
        ))  # fmt: skip
    body = p.ChatResponse(id=rid, created=now(), model=plan.model, choices=choices, usage=usage(plan, drawn))
    return body.model_dump()


def delta_logprobs(plan: Plan, model: LanguageModel, prompt_index: int, delta: Delta, before: list[int]):
    """The log-probs of a streamed delta's tokens (None if not asked for); `before`: the tokens
    of its choice sent before them, which place their `text_offset`."""
    if plan.logprobs is None:
        return None
    if plan.chat:
        return chat_logprobs(model, delta.token_ids, delta.logprobs, delta.top_logprobs, plan.logprobs)
    start = len(plan.prompt_texts[prompt_index]) if plan.echo else 0
    offsets = text_offsets(model, before + delta.token_ids, start, len(before))
    return legacy_logprobs(model, delta.token_ids, delta.logprobs, delta.top_logprobs, plan.logprobs, offsets)


def completion_chunk(plan: Plan, rid: str, created: int, index: int, text: str,
                     completion: Completion | None = None, logprobs: p.CompletionLogprobs | None = None
                     ) -> str:
    choice = p.CompletionChoice(index=index, text=text, logprobs=logprobs,
                                finish_reason=finish_reason(completion) if completion else None,
                                stop_reason=completion.stop_reason if completion else None)
    return p.CompletionResponse(id=rid, created=created, model=plan.model,
                                choices=[choice]).model_dump_json()


def chat_chunk(plan: Plan, rid: str, created: int, index: int, delta: p.ChatDelta,
               completion: Completion | None = None, logprobs: p.ChatLogprobs | None = None,
               reason: str | None = None) -> str:
    """A chat stream's chunk; the last of a choice (`completion` given) says why it finished
    (`reason`, else the completion's)."""
    choice = p.ChatChunkChoice(index=index, delta=delta, logprobs=logprobs,
                               finish_reason=reason or finish_reason(completion) if completion else None)
    return p.ChatChunk(id=rid, created=created, model=plan.model,
                       choices=[choice]).model_dump_json()


def text_chunks(plan: Plan, rid: str, created: int) -> Callable[[int, str], str]:
    """(choice index, text) -> the chunk carrying a token's text (no log-probs, not a choice's
    last), as `completion_chunk` or `chat_chunk` writes it. Each choice's chunk is rendered by
    pydantic once with an empty text and split there; a token's chunk is then that template
    around the text's JSON: about 1 us a token instead of 8 us for building and dumping two
    models (measured on the 2-core dev machine). Pydantic escapes a JSON string as
    `json.dumps(ensure_ascii=False)` does, so the chunks are the same bytes."""
    templates: dict[int, tuple[str, str]] = {}
    key = '"content":""' if plan.chat else '"text":""'  # once in the chunk: user strings are escaped

    def render(index: int, text: str) -> str:
        template = templates.get(index)
        if template is None:
            empty = chat_chunk(plan, rid, created, index, p.ChatDelta(content="")) if plan.chat else \
                completion_chunk(plan, rid, created, index, "")
            head, _, tail = empty.partition(key)
            template = templates[index] = (head + key[:-2], tail)
        return template[0] + json.dumps(text, ensure_ascii=False) + template[1]

    return render


def usage_chunk(plan: Plan, rid: str, created: int, drawn) -> str:
    cls = p.ChatChunk if plan.chat else p.CompletionResponse
    obj = "chat.completion.chunk" if plan.chat else "text_completion"
    return cls(id=rid, object=obj, created=created, model=plan.model, choices=[],
               usage=usage(plan, drawn)).model_dump_json()


# ---------------------------------------------------------------------------------- selection


def select(
    selection: Selection, n: int, prompt: str, completions: list[Completion], scorer
) -> list[Completion]:
    """best-of-N (the n highest scores, lowest index first among ties) or a vote (meta/parallel.py).

    Scorers: "mean_logprob" (OpenAI's best_of: log-probability per token), "logprob" (sum),
    or a reward model (prompt, text) -> score. A weighted vote weighs each candidate by its
    score; the log-probability scorers vote with exp(score), a probability, and a reward
    model whose scores are logits with their sigmoid (meta/scorers.py `vote_weight`).
    """
    from decodekit.meta.budget import Budget
    from decodekit.meta.parallel import candidates_of, chosen_for, vote
    from decodekit.meta.scorers import score_candidates, score_kind_of

    extract = None
    if selection.vote is not None:
        extract = answer_extractor(selection)
    candidates = candidates_of(completions, extract)
    if selection.scorer in ("mean_logprob", "logprob"):
        for c in candidates:
            total = sum(c.completion.logprobs)
            c.score = total / max(len(c.completion.logprobs), 1) if selection.scorer == "mean_logprob" \
                else total
    else:
        score_candidates(candidates, scorer, prompt, Budget(), on_error="record")
    if selection.vote is not None:
        weighted = selection.vote == "weighted"
        if weighted and selection.scorer in ("mean_logprob", "logprob"):
            for c in candidates:
                c.score = math.exp(c.score)
        kind = None if selection.scorer in ("mean_logprob", "logprob") else score_kind_of(scorer)
        answer, _ = vote(candidates, weighted, kind)
        best = chosen_for(candidates, answer, weighted) or _ranked(candidates)[0]
        best.completion.score = best.score
        return [best.completion]
    ranked = _ranked(candidates)[:n]
    for c in ranked:
        c.completion.score = c.score
    return [c.completion for c in ranked]


def _ranked(candidates):
    scored = [c for c in candidates if c.score is not None] or list(candidates)
    return sorted(scored, key=lambda c: -(c.score if c.score is not None else -math.inf))


def answer_extractor(selection: Selection):
    pattern = selection.answer_regex

    def extract(text: str):
        if pattern is None:
            return text.strip() or None
        match = pattern.search(text)
        if match is None:
            return None
        return match.group(1) if match.groups() else match.group(0)

    return extract
