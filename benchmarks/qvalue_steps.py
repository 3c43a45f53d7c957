"""Token-wise controlled decoding with a Q head on hidden states (align/qvalue.py): the
engine's own states (`HiddenValue.step_values`, one forward per token) against the path
that recomputes every prefix's states (`child_values`, issue 24).

    python benchmarks/qvalue_steps.py [--model shakespeare] [--new-tokens 128] [--n 1] [--repeats 3]

A random-init `QHead` (W2 != 0, so the tilt matters: values only cost, not quality, are
measured here) tilts greedy decoding of one prompt, `ValueTilt(value, 2.0, top_k=64)`.
Rows: the two paths' CPU seconds (this process, one thread, the median of `repeats` runs
after a warm-up), their forwards per generated token and positions computed (counted by
wrapping the network's forward and `hidden_states`), and whether their tokens agree.
Prints one JSON document.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import decodekit as dk
from decodekit.align.controlled import ValueTilt
from decodekit.align.qvalue import HiddenValue, QHead

PROMPT = "ROMEO:\n"


class Recomputing:
    """The value without its states path: ValueTilt recomputes each prefix."""

    def __init__(self, value: HiddenValue):
        self.child_values = value.child_values


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="shakespeare")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--n", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    model = dk.load_model(args.model)
    torch.manual_seed(0)
    head = QHead(model.config.hidden_size, model.vocab_size)
    torch.nn.init.normal_(head.out.weight, std=0.5)
    value = HiddenValue(model, PROMPT, head)
    params = dk.SamplingParams(max_new_tokens=args.new_tokens, temperature=0, ignore_eos=True, n=args.n)
    counts = {"forwards": 0, "positions": 0}
    net_forward, hidden_states = model.net.forward, model.hidden_states

    def counted_net(tokens, *rest, **kwargs):
        counts["forwards"] += 1
        counts["positions"] += tokens.numel()
        return net_forward(tokens, *rest, **kwargs)

    def counted_states(tokens, mask=None):
        counts["forwards"] += 1
        counts["positions"] += tokens.numel()
        return hidden_states(tokens, mask)

    model.net.forward, model.hidden_states = counted_net, counted_states  # this process only
    rows, tokens = {}, {}
    for name, v in (("engine_states", value), ("recomputing", Recomputing(value))):
        tilt = ValueTilt(v, 2.0, top_k=64)
        dk.generate(model, [PROMPT], params, adapter=tilt)  # warm-up
        counts.update(forwards=0, positions=0)
        [out] = dk.generate(model, [PROMPT], params, adapter=tilt)
        generated = sum(len(c.token_ids) for c in out)
        tokens[name] = [c.token_ids for c in out]
        forwards, positions = counts["forwards"], counts["positions"]
        times = []
        for _ in range(args.repeats):
            start = time.process_time()
            dk.generate(model, [PROMPT], params, adapter=tilt)
            times.append(time.process_time() - start)
        seconds = statistics.median(times)
        rows[name] = {"cpu_s": round(seconds, 3), "tok_s": round(generated / seconds, 1),
                      "forwards_per_token": round(forwards / generated, 3),
                      "positions_per_token": round(positions / generated, 1)}
    [[plain]] = dk.generate(model, [PROMPT], params.replace(n=1))
    print(json.dumps({
        "date": time.strftime("%Y-%m-%d"), "model": args.model, "new_tokens": args.new_tokens,
        "n": args.n, "threads": torch.get_num_threads(), "rows": rows,
        "speedup": round(rows["recomputing"]["cpu_s"] / rows["engine_states"]["cpu_s"], 2),
        "same_tokens": tokens["engine_states"] == tokens["recomputing"],
        "tilt_changes_tokens": tokens["engine_states"][0] != plain.token_ids,
    }, indent=1))


if __name__ == "__main__":
    main()
