"""Every strategy under `NamedDevices` (tests/device_guard.py; issue 33): a tensor factory in
decodekit without a device raises, so a CPU-only CI catches the tensors that would land on
the CPU beside a GPU model (a CPU block index into a CUDA pool, a CPU draft compared with a
CUDA argmax, the compiled step's inputs). tests/test_cuda.py runs the same strategies on a GPU."""

from __future__ import annotations

import pytest
import torch

import decodekit as dk
from decodekit.models.registry import ASSETS
from device_guard import HostReads, NamedDevices, UnnamedDevice

pytestmark = pytest.mark.usefixtures("one_thread")

GREEDY = dk.SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
SEEDED = dk.SamplingParams(max_new_tokens=8, seed=3, ignore_eos=True)
# Every sampling adapter of params.DEFAULT_ORDER at a value where it acts (mirostat replaces
# the truncations, allowed_token_ids the bans: each has its own run).
ADAPTERS = dict(logit_bias={5: 1.0}, bad_words=("the",), min_new_tokens=2, no_repeat_ngram_size=3,
                repetition_penalty=1.1, frequency_penalty=0.1, presence_penalty=0.1, dry_multiplier=0.5,
                temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, typical_p=0.95, epsilon=1e-4, eta=1e-4,
                top_n_sigma=3.0, xtc_probability=0.5)  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from decodekit.compress import CompressConfig, compress_to_dir

    path = tmp_path_factory.mktemp("devices")
    compress_to_dir("shakespeare", CompressConfig("rtn", bits=8), path / "int8")
    compress_to_dir("shakespeare", CompressConfig("rtn", bits=4, group_size=32), path / "int4")
    # an int8 head, and the tied embedding's lookup on its codes (models/qlinear.py QuantizedEmbedding)
    compress_to_dir("shakespeare", CompressConfig("rtn", bits=4, head_bits=8), path / "int4-head8")
    names = {"int8": path / "int8", "int4": path / "int4", "int4-head8": path / "int4-head8",
             "half": half_checkpoint(path / "half"), "moe": moe_checkpoint(path / "moe")}  # fmt: skip
    try:  # the gguf package (the dev extra) writes the file
        from decodekit.compress.gguf import write_gguf

        names["gguf"] = write_gguf(ASSETS / "shakespeare", path / "s-q8_0.gguf", "q8_0")
    except ImportError:
        pass
    loaded = {key: dk.load_model(where) for key, where in names.items()}
    from decodekit.meta.tasks.arith import load_orm, load_prm

    return {"shakespeare": dk.load_model("shakespeare"), "draft": dk.load_model("shakespeare-draft"),
            "arith": dk.load_model("arith"), "orm": load_orm("arith-hf-orm"), "prm": load_prm("arith-hf-prm"),
            **loaded}  # fmt: skip


def half_checkpoint(path):
    """A float16 checkpoint (Qwen2.5's architecture at tiny widths, tied): "auto" runs it in
    float32 on the CPU with its linear layers' weights kept in float16 (models/half_linear.py),
    on a GPU in float16."""
    from decodekit.models import shapes

    config = shapes.shape_config("qwen2.5-0.5b", "float16")
    config.update(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_hidden_layers=2, tie_word_embeddings=True)  # fmt: skip
    return shapes.save_checkpoint(config, path)


def moe_checkpoint(path):
    """A mixture of experts (Qwen2-MoE's: 6 experts, 2 a token, a shared expert; an MLP in
    layer 1) at tiny widths, with random weights and the embedded tokenizer."""
    from decodekit.models import shapes

    config = shapes.shape_config("qwen3-30b-a3b-2l")
    config.update(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"], hidden_size=64,
                  intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                  num_experts=6, num_experts_per_tok=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, num_hidden_layers=3, mlp_only_layers=[1])  # fmt: skip
    return shapes.save_checkpoint(config, path)


def _arith(models, method):
    from decodekit.meta import LocalGenerator, best_of_n, tree_search
    from decodekit.meta.tasks.arith import extract_answer, format_prompt, generate_problems

    problem = generate_problems(1, seed=3)[0]
    params = SEEDED.replace(max_new_tokens=24)
    generator = LocalGenerator(models["arith"])
    if method == "best-of-n":
        orm = models["orm"]
        return best_of_n(generator, format_prompt(problem), 4, lambda _, t: orm(problem.question, t), params)
    prm = models["prm"]
    return tree_search(generator, format_prompt(problem), prm, n=4, method="rebase", params=params,
                       extract=extract_answer)  # fmt: skip


S = "shakespeare"
RUNS = {
    "greedy": lambda m: dk.generate(m[S], "ROMEO:", GREEDY),
    "seeded": lambda m: dk.generate(m[S], ["ROMEO:", "JULIET: O"], SEEDED.replace(n=2, logprobs=2)),
    "adapters": lambda m: dk.generate(m[S], ["ROMEO:", "JULIET: O"], SEEDED.replace(**ADAPTERS)),
    "mirostat": lambda m: dk.generate(m[S], "ROMEO:", SEEDED.replace(mirostat_tau=3.0)),
    "allowed-tokens": lambda m: dk.generate(m[S], "ROMEO:", SEEDED.replace(allowed_token_ids=(1, 2, 3))),
    "short-prompts-together": lambda m: dk.generate(m[S], ["RO", "JU", "O R", "Th"], GREEDY),
    "healing": lambda m: dk.generate(m[S], "ROMEO: Wh", GREEDY, heal=True),
    "stream": lambda m: list(dk.stream(m[S], "ROMEO:", GREEDY)),
    "beam": lambda m: dk.beam_search(m[S], "ROMEO:", GREEDY, num_beams=3),
    "speculative-draft": lambda m: dk.speculative_generate(m[S], m["draft"], "ROMEO:", GREEDY),
    "speculative-seeded": lambda m: dk.speculative_generate(m[S], m["draft"], "ROMEO:", SEEDED),
    "speculative-self-int4": lambda m: dk.speculative_generate(m[S], "self-int4", "ROMEO:", GREEDY),
    "speculative-prompt-lookup": lambda m: dk.speculative_generate(m[S], "prompt-lookup",
                                                                   "ROMEO: ROMEO: ROMEO:", SEEDED),
    "contrastive": lambda m: dk.generate(dk.ContrastiveLM(m[S], m["draft"]), "ROMEO:", GREEDY),
    "contrastive-window": lambda m: dk.generate(dk.ContrastiveLM(m[S], m["draft"], amateur_window=4),
                                                "ROMEO:", GREEDY),
    "constrained": lambda m: dk.generate(m[S], "ROMEO:", GREEDY.replace(ignore_eos=False),
                                         constraint=dk.Regex("[a-z ]{4,8}")),
    "best-of-n-hf-orm": lambda m: _arith(m, "best-of-n"),
    "tree-search-hf-prm": lambda m: _arith(m, "tree"),
    "int8": lambda m: dk.generate(m["int8"], ["ROMEO:", "JU"], SEEDED),
    "int4": lambda m: dk.generate(m["int4"], ["ROMEO:", "JU"], SEEDED),
    "gguf": lambda m: dk.generate(m["gguf"], ["ROMEO:", "JU"], GREEDY),
    "int4-head8": lambda m: dk.generate(m["int4-head8"], ["ROMEO:", "JU"], SEEDED),
    "half-weights": lambda m: dk.generate(m["half"], ["ROMEO:", "JU"], SEEDED.replace(n=2)),
    "mixture-of-experts": lambda m: dk.generate(m["moe"], ["ROMEO:", "JU"], SEEDED.replace(n=2)),
}
# the optional package each run needs (a GPU machine may lack the extras: test_cuda.py)
NEEDS = {"gguf": "gguf", "constrained": "llguidance", "healing": "llguidance"}


def skip_without_its_package(name: str) -> None:
    import importlib.util

    if name in NEEDS and importlib.util.find_spec(NEEDS[name]) is None:
        pytest.skip(f"needs the {NEEDS[name]} package")


def tokens(result) -> list:
    """Comparable token ids of a run's result: completions (nested), a stream's deltas, a
    speculative result or a meta-generator's result."""
    if hasattr(result, "completions"):
        return tokens(result.completions)
    if hasattr(result, "candidates"):  # a meta-generator's: its candidates' texts and the answer
        return [[getattr(c, "text", None) for c in result.candidates], repr(getattr(result, "answer", None))]
    if hasattr(result, "token_ids"):
        return list(result.token_ids)
    if isinstance(result, list | tuple):
        return [tokens(item) for item in result]
    return repr(result)


@pytest.mark.parametrize("name", list(RUNS))
def test_every_strategy_names_its_tensors_devices(models, name):
    skip_without_its_package(name)
    with NamedDevices():
        out = RUNS[name](models)
    assert out  # each run returns its completions (or a search's result)


@pytest.mark.parametrize("name", list(RUNS))
def test_every_strategy_through_a_gpus_graphed_step_gives_the_cpus_tokens(models, name, monkeypatch):
    """On a GPU the engine's decode-only steps replay CUDA graphs (engine/cuda_graphs.py
    `GraphedLanes`), the steps that every strategy's requests and programs run on there. Here
    the same bookkeeping on the CPU (`capture=False`: the step called on the graphs' own input
    tensors and the rows' storage, their outputs copied out, the rows written inside the
    step), for every engine the run builds: the tokens equal the CPU path's."""
    skip_without_its_package(name)
    from decodekit.engine import compile_policy
    from decodekit.engine.cuda_graphs import GraphedLanes
    from decodekit.engine.engine import forget_engine

    want = tokens(RUNS[name](models))
    original, replayed = compile_policy.CompiledDecode.__init__, []

    def graphed(self, model, mode, span=1):
        original(self, model, mode, span)
        if span == 1:
            self.lanes = GraphedLanes(model, capture=False)
            run = self.lanes.run
            self.lanes.run = lambda *args, **kwargs: replayed.append(out := run(*args, **kwargs)) or out

    for model in models.values():  # persistent engines built before the patch
        forget_engine(model)
    monkeypatch.setattr(compile_policy.CompiledDecode, "__init__", graphed)
    try:
        got = tokens(RUNS[name](models))
    finally:
        for model in models.values():
            forget_engine(model)
    assert got == want
    # every run but three has one-token steps over RunningKV rows or a draft's gathered rows
    # (prompt lookup only verifies spans; a windowed amateur attends over its window eagerly;
    # a mixture of experts picks its experts on the host, so its steps run eager)
    ran = any(out is not None for out in replayed)
    eager = ("speculative-prompt-lookup", "contrastive-window", "mixture-of-experts")
    assert ran == (name not in eager), replayed


def test_the_compiled_step_names_its_inputs_devices(models):
    """The eager code around the compiled decode step (compile_policy.py `CompiledDecode`: the
    rows' tokens, positions and slots) under the guard; the graph itself runs without it
    (dynamo cannot trace a Python mode), compiled before."""
    from torch.overrides import _pop_mode_temporarily

    from decodekit.engine import compiled
    from decodekit.engine.engine import Engine, EngineConfig
    from decodekit.engine.lanes import lanes_for
    from decodekit.models.native import NativeLM

    shakespeare = models["shakespeare"]
    # a new model object: no compiled steps yet (`lanes_for` keeps them on the model object)
    model = NativeLM(shakespeare.net, shakespeare.config, tokenizer=shakespeare.tokenizer, name="s")

    def run():
        engine = Engine(model, EngineConfig(compile=True, block_size=4, num_blocks=256))
        handles = [engine.submit(model.encode("ROMEO:"), GREEDY)]  # one bucket: a short compile
        while engine.has_work():
            engine.step()
        return [[c.token_ids for c in h.result(0)] for h in handles], engine.compiled.steps

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(compiled, "BACKEND", "aot_eager")  # compiles in seconds
        want, _ = run()
    lanes = lanes_for(model)
    assert lanes.ready and not lanes.failed

    def outside_the_guard(step):
        def call(*args):
            with _pop_mode_temporarily():
                return step(*args)
        return call

    lanes.ready = {key: outside_the_guard(step) for key, step in lanes.ready.items()}
    with NamedDevices():
        got, steps = run()
    assert got == want and steps > 0


@pytest.mark.parametrize("fused", [True, False], ids=["writing-sdpa", "written-out"])
def test_the_graphed_step_names_its_tensors_devices(models, fused):
    """A GPU's decode step (engine/cuda_graphs.py `GraphedLanes`, eager capture) run on the CPU
    as its graphs would (capture=False) under the guard: the step's mask, row indices and
    copies of the rows name their device; its tokens equal the eager engine's."""
    from decodekit.engine.cuda_graphs import GraphedLanes
    from decodekit.engine.engine import Engine, EngineConfig

    model = models["shakespeare"]
    prompts = [model.encode("ROMEO:"), model.encode("JULIET: O Romeo")]

    def run(graphed: bool):
        engine = Engine(model, EngineConfig(compile=None if graphed else False, block_size=4, num_blocks=256))
        if graphed:
            engine.compiled.lanes = engine.lanes = GraphedLanes(model, capture=False, fused_attention=fused)
        handles = [engine.submit(prompt, GREEDY) for prompt in prompts]
        while engine.has_work():
            engine.step()
        return [h.result(0)[0].token_ids for h in handles], engine

    want, _ = run(False)
    with NamedDevices():
        got, engine = run(True)
    assert got == want and engine.compiled.steps > 0 and engine.lanes.captures > 0


def test_the_guard_names_an_unnamed_factory_in_decodekit():
    from decodekit.models.base import left_pad

    with NamedDevices(), pytest.raises(UnnamedDevice, match=r"torch.tensor at decodekit/.*names no device"):
        left_pad([[1, 2]], device=None)  # device=None is a factory without a device
    with NamedDevices():
        assert torch.zeros(2).device.type == "cpu"  # tests and other libraries are theirs
        left_pad([[1, 2]], device="cpu")


HOST_READ_RUNS = {
    "one greedy row": lambda m, k: dk.generate(m, "JULIET:", GREEDY.replace(max_new_tokens=k)),
    "16 requests, 4 settings": lambda m, k: dk.generate(
        m, [f"JULIET {i}:" for i in range(16)],
        [SEEDED.replace(max_new_tokens=k, top_p=0.6 + 0.1 * (i % 4), logprobs=1) for i in range(16)]),
    "beam": lambda m, k: dk.beam_search(m, "JULIET:", GREEDY.replace(max_new_tokens=k), num_beams=4),
}  # fmt: skip


@pytest.mark.parametrize("name", list(HOST_READ_RUNS))
def test_a_decode_step_reads_the_host_once(models, name):
    """A decode step reads its sampled tokens (and their logprobs) on the host in one copy
    and nothing else: no per-request `.tolist()`, no per-row `.item()` (a GPU synchronises
    on each). Counted over 8 extra steps, so the prompt's step does not count."""
    model = models["shakespeare"]
    dk.generate(model, "ROMEO:", GREEDY)  # the engine and its pool, built
    with HostReads() as longer:
        HOST_READ_RUNS[name](model, 17)
    with HostReads() as shorter:
        HOST_READ_RUNS[name](model, 9)
    assert (longer.total - shorter.total) / 8 <= 1, sorted((longer.counts - shorter.counts).items())


def test_sampling_at_a_real_vocabulary_names_its_devices():
    """The CPU's real-vocabulary sampling paths (chunked argmax and topk, top-p's candidate
    stages and bins, the compacted chains of top-k, top-p and min-p, the draw among kept
    tokens, the scratch buffers) run under `NamedDevices`: none of their tensor factories
    is left to the default device."""
    import decodekit as dk
    from decodekit.request import make_requests, sample_rows

    generator = torch.Generator().manual_seed(0)
    ranks = torch.stack([torch.randperm(151_936, generator=generator) for _ in range(3)]) + 1
    peaked = -1.5 * ranks.double().log().float()
    flat = torch.randn(1, 151_936, generator=generator) * 0.1
    logits = torch.cat([peaked, flat])
    model = dk.load_model("shakespeare-5gram")
    model.decode = lambda ids, *args, **kwargs: "x" * len(ids)  # ids past its 2,048 tokens
    settings = [dict(temperature=0.0), dict(top_p=0.9), dict(typical_p=0.9), dict(min_p=0.05),
                dict(top_k=40, top_p=0.95, min_p=0.05, temperature=0.8, logprobs=3)]  # fmt: skip
    with NamedDevices():
        for fields in settings:
            for rows in (peaked, logits):
                params = dk.SamplingParams(seed=1, max_new_tokens=8, ignore_eos=True, **fields)
                requests = make_requests(model, [[1, 2]] * rows.shape[0], params)
                for request in requests:
                    request.state.vocab_size = rows.shape[-1]
                tokens = sample_rows(rows, [row for request in requests for row in request.rows])
                assert tokens.shape == (rows.shape[0],)
