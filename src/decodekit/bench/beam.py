"""`decodekit bench beam`: concurrent beam searches on the engine against one at a time.

C prompts (distinct), beam search with `num_beams` beams, `new_tokens` tokens each (EOS
ignored, so every search runs its full length), three ways, each `repeats` times in turn
so they see the same background load (medians reported):

- sequential: the searches one after another over a dense cache (`_beam_plain`), what the
  server's worker thread did before beam search ran on the engine (a lower bound on that
  path's time: no HTTP);
- engine: `beam_search(model, prompts)`, every search a `BeamProgram` on the model's
  persistent engine, all sharing each step's forward;
- server: C concurrent HTTP clients (`use_beam_search`) against an in-process server, whose
  requests join the engine's batch.

The three must return the same texts (checked). Figures are wall-clock tokens/s (the
searches' best hypotheses' tokens), the ratios against sequential, and CPU time.
"""

from __future__ import annotations

import asyncio
import statistics
import time

from decodekit.decode.beam import BeamSearch, _beam_plain, beam_search
from decodekit.models.registry import load_model
from decodekit.params import SamplingParams
from decodekit.runtime import progress as progress_bar

PROMPTS = ["ROMEO:", "JULIET:\nO Romeo", "KING HENRY:", "First Citizen:", "HAMLET:\nTo be",
           "MACBETH:", "LADY MACBETH:\nOut", "PORTIA:\nThe quality", "OTHELLO:", "IAGO:",
           "KING LEAR:", "PROSPERO:", "BRUTUS:", "CASSIUS:", "MERCUTIO:", "TYBALT:"]


def bench_beam(model_name: str = "shakespeare", clients: int = 16, num_beams: int = 4,
               new_tokens: int = 32, repeats: int = 3, progress: bool = False) -> dict:
    model = load_model(model_name)
    prompts = [PROMPTS[i % len(PROMPTS)] + " " * (i // len(PROMPTS)) for i in range(clients)]
    params = SamplingParams(max_new_tokens=new_tokens, ignore_eos=True)
    times: dict[str, list[float]] = {"sequential": [], "engine": [], "server": []}
    cpu: dict[str, list[float]] = {key: [] for key in times}
    texts: dict[str, list[str]] = {}

    def sequential():
        return [_beam_plain(model, BeamSearch(model, model.encode(p), params, num_beams, 1.0, True, None,
                                              model.decode))[0].text for p in prompts]  # fmt: skip

    def engine():
        return [c[0].text for c in beam_search(model, prompts, params, num_beams=num_beams)]

    from decodekit.server.app import ServerThread
    from decodekit.server.backend import Backend, ServerConfig

    backend = Backend({"bench": model}, ServerConfig(max_n=num_beams))
    with ServerThread(backend) as thread:
        def server():
            return asyncio.run(_clients(thread.url, prompts, new_tokens, num_beams))

        runs = {"sequential": sequential, "engine": engine, "server": server}
        with progress_bar(total=repeats * len(runs), desc="bench beam", enabled=progress) as bar:
            for _ in range(repeats):
                for name, run in runs.items():
                    wall, process = time.perf_counter(), time.process_time()
                    texts[name] = run()
                    times[name].append(time.perf_counter() - wall)
                    cpu[name].append(time.process_time() - process)
                    bar.update()
    if not texts["sequential"] == texts["engine"] == texts["server"]:
        raise AssertionError("beam search returned different texts on the three paths")
    tokens = clients * new_tokens
    result = {"model": model_name, "clients": clients, "num_beams": num_beams, "new_tokens": new_tokens,
              "repeats": repeats}
    for name in times:
        wall = statistics.median(times[name])
        result[name] = {"wall_s": round(wall, 3), "cpu_s": round(statistics.median(cpu[name]), 3),
                        "tokens_per_s": round(tokens / wall, 1)}
    base = result["sequential"]["tokens_per_s"]
    for name in ("engine", "server"):
        result[f"{name}_vs_sequential"] = round(result[name]["tokens_per_s"] / base, 2)
    return result


async def _clients(url: str, prompts: list[str], new_tokens: int, num_beams: int) -> list[str]:
    import httpx

    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def one(prompt):
            body = {"model": "bench", "prompt": prompt, "max_tokens": new_tokens, "ignore_eos": True,
                    "use_beam_search": True, "num_beams": num_beams}
            response = await client.post("/v1/completions", json=body)
            response.raise_for_status()
            return response.json()["choices"][0]["text"]

        return list(await asyncio.gather(*(one(p) for p in prompts)))
