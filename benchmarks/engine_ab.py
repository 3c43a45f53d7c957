"""Issue 24's speed check: the engine's per-request cost before and after a change, in one
process per side, run alternately (`PYTHONPATH=<checkout>/src python benchmarks/engine_ab.py`
for each checkout; DECODEKIT_KERNELS=0 to leave the CPU kernels out). Prints the best of 5
CPU times (s) of: one greedy request of 128 tokens; 64 seeded requests of 32 tokens at
once; 16 beam searches (4 beams); 16 speculative requests with `shakespeare-draft`."""

import json
import time

import torch

torch.set_num_threads(1)
import decodekit as dk
from decodekit.decode.beam import beam_search
from decodekit.decode.speculative import speculative_generate

m = dk.load_model("shakespeare"); d = dk.load_model("shakespeare-draft")
prompts = [f"ROMEO {i}:" for i in range(64)]
g = dk.SamplingParams(temperature=0, max_new_tokens=32, ignore_eos=True)
s = dk.SamplingParams(temperature=1, max_new_tokens=32, ignore_eos=True, seed=1)
def t(f):
    f(); best=1e9
    for _ in range(5):
        a=time.process_time(); f(); best=min(best, time.process_time()-a)
    return round(best, 4)
out = {
 "single": t(lambda: dk.generate(m, ["ROMEO:"], g.replace(max_new_tokens=128))),
 "concurrent64": t(lambda: dk.generate(m, prompts, s)),
 "beam16": t(lambda: beam_search(m, prompts[:16], g, num_beams=4)),
 "spec16": t(lambda: speculative_generate(m, d, prompts[:16], s, 4)),
}
print(json.dumps(out))
