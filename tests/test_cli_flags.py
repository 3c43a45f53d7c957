"""Every flag of every subcommand reaches the field or argument it names (issue 26).

The functions the commands call (`decodekit.generate`, the benchmarks, `evaluate_arith`,
`compress_to_dir`, the server's `Backend`, ...) are replaced by recorders that bind each call
to the real function's signature and return a stand-in; a row of ROWS runs one command line
through `main` and names where its flag must arrive: a sink (the replaced function) and a
path into the call's bound arguments ("params.top_k": the `params` argument's `top_k`), with
the expected value. `test_every_flag_has_help_and_a_row` lists all options of all
subcommands from the parser and fails for one without help text or without a row.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from decodekit.cli import VersionAction, build_parser, main
from decodekit.compress.evaluate import HELD_OUT

ROOT = Path(__file__).resolve().parents[1]
CALL = object()  # a sink that records the call and then runs the real function
COMPLETION = SimpleNamespace(text=" hi", token_ids=[1], logprobs=[-0.1], processed_logprobs=[-0.1],
                             top_logprobs=None, finish_reason="stop", stop_reason=None, score=None,
                             usage=SimpleNamespace(prompt_tokens=1, completion_tokens=1))
PERPLEXITY = SimpleNamespace(perplexity=2.0, nll=0.7, bits_per_char=1.0, tokens=10, window=8, stride=4,
                             to_dict=lambda: {"perplexity": 2.0})
COMPRESSED = dict(model="m", out="o", label="rtn-8b", layers=1, memory_bytes_before=2,
                  memory_bytes_after=1, disk_bytes=1)


def stream():
    yield SimpleNamespace(text=" hi", completion=COMPLETION)


REPLY = SimpleNamespace(content=" hi", reasoning=None, tool_calls=[], finish_reason="stop",
                        completion=COMPLETION)  # a dk.chat reply (decodekit/conversation.py `ChatReply`)
RUN = SimpleNamespace(completions=lambda: [[COMPLETION]], deltas=stream,
                      stats=lambda: SimpleNamespace(as_dict=dict))  # a prepared run (decode/sample.py `Run`)


@contextlib.contextmanager
def shape_dir(model_name, shape=None):
    yield f"random {shape}" if shape else model_name


# sink -> (module:attribute replaced, what the stand-in returns: a value, a callable of the
# call's arguments, or CALL). "model" stands for the tiny checkpoint (the tiny_lm fixture).
SINKS = {
    "load_model": ("decodekit:load_model", "model"),
    # `decodekit generate` prepares one strategy's run (decode/sample.py `Run`) and reads it
    "sample": ("decodekit.decode.sample:Sample.prepare", lambda *a, **k: RUN),
    "beam": ("decodekit.decode.beam:Beam.prepare", lambda *a, **k: RUN),
    "speculative": ("decodekit.decode.speculative:Speculative.prepare", lambda *a, **k: RUN),
    "ContrastiveLM": ("decodekit:ContrastiveLM", lambda expert, *a, **k: expert),
    "chat": ("decodekit:chat", lambda *a, **k: [REPLY]),
    "StaticDecodeLM": ("decodekit.models.static:StaticDecodeLM", lambda model: model),
    "JsonSchema": ("decodekit:JsonSchema", lambda text: ("json_schema", text)),
    "Regex": ("decodekit:Regex", lambda text: ("regex", text)),
    "Grammar": ("decodekit:Grammar", lambda text: ("grammar", text)),
    "Choices": ("decodekit:Choices", lambda options: ("choices", options)),
    "set_threads": ("decodekit.runtime:set_threads", 1),
    "bench_decode": ("decodekit.bench.decode:bench_decode", {}),
    "model_or_shape": ("decodekit.bench.decode:model_or_shape", shape_dir),
    "bench_engine": ("decodekit.bench.engine:bench_engine", {}),
    "bench_dtype": ("decodekit.bench.dtype:bench_dtype", {}),
    "bench_constrained": ("decodekit.bench.constrained:bench_constrained", {}),
    "bench_contrastive": ("decodekit.bench.contrastive:bench_contrastive", {}),
    "bench_compress": ("decodekit.bench.compress:bench_compress", {}),
    "bench_speculative": ("decodekit.bench.speculative:bench_speculative", {}),
    "bench_concurrent": ("decodekit.bench.speculative:bench_concurrent", {}),
    "bench_hardening": ("decodekit.bench.hardening:bench_hardening", {}),
    "bench_server": ("decodekit.bench.server:bench_server", {}),
    "bench_beam": ("decodekit.bench.beam:bench_beam", {}),
    "bench_soak": ("decodekit.bench.soak:bench_soak", {}),
    "bench_packed": ("decodekit.bench.packed:bench_packed", {}),
    "bench_gguf": ("decodekit.bench.gguf_files:bench_gguf", {}),
    "bench_latency": ("decodekit.bench.latency:bench_latency", {}),
    "latency_plot": ("decodekit.bench.latency:plot", None),
    "bench_presets": ("decodekit.bench.presets:bench_presets", {}),
    "bench_kv": ("decodekit.bench.kv_compression:bench_kv", {}),
    "evaluate_arith": ("decodekit.meta.evaluate:evaluate_arith", {}),
    "arith_plot": ("decodekit.meta.evaluate:plot", None),
    "evaluate_sizes": ("decodekit.meta.compute_optimal:evaluate_sizes", {}),
    "RemoteGenerator": ("decodekit.meta.remote:RemoteGenerator", None),
    "text_perplexity": ("decodekit.compress.evaluate:text_perplexity", PERPLEXITY),
    "alignment_frontier": ("decodekit.align.frontier:alignment_frontier", {}),
    "frontier_plot": ("decodekit.align.frontier:plot_frontier", None),
    "compress_to_dir": ("decodekit.compress.recipe:compress_to_dir", COMPRESSED),
    "load_served": ("decodekit.server.app:load_served",
                    lambda *a, **k: ({"m": MODEL[0]}, {"m": "embedded"})),
    "engine_for": ("decodekit.engine.engine:engine_for", None),
    "Backend": ("decodekit.server.backend:Backend", None),
    "serve": ("decodekit.server.app:serve", None),
    "plan_memory": ("decodekit.models.footprint:plan_memory", CALL),
    "embedded_models": ("decodekit.models.registry:embedded_models", CALL),
    "dtype_report": ("decodekit.models.dtype_probe:dtype_report", CALL),
    "bon_report": ("decodekit.align.report:bon_report", CALL),
    "plot_bon": ("decodekit.align.report:plot_bon", None),
}
# The tables the commands print without --json: stand-ins, so any dict prints.
TABLES = ["decodekit.bench.compress:table", "decodekit.bench.speculative:markdown_table",
          "decodekit.bench.server:table", "decodekit.bench.latency:table", "decodekit.bench.presets:table",
          "decodekit.bench.kv_compression:table", "decodekit.meta.evaluate:table",
          "decodekit.meta.compute_optimal:table_sizes",
          "decodekit.align.frontier:table"]
MODEL: list = []


def called(arguments) -> bool:
    return True


def json_out(text: str) -> bool:
    """One JSON document (indented or not), or one per line; a table or plain text fails."""
    try:
        return json.loads(text) is not None
    except json.JSONDecodeError:
        return all(json.loads(line) is not None for line in text.splitlines())


G = ["generate", "x"]
SPEC = ["--draft-model", "prompt-lookup"]
CD = ["--strategy", "contrastive"]
P = "params."

# (flag, command line, sink, path into the sink's bound arguments ("" = the call itself), expected).
# A path "stdout" checks the printed output instead. Sinks called twice (load_model with an
# amateur) are read at their last call.
ROWS = [
    # generate: every SamplingParams flag lands in the params of decodekit.generate
    ("generate prompt", [*G], "sample", "prompts", ["x"]),
    ("generate --prompt-file", ["generate", "--prompt-file", "prompt.txt"], "sample", "prompts",
     ["ROMEO:\n"]),
    ("generate --model", [*G, "--model", "arith"], "load_model", "name_or_path", "arith"),
    ("generate --strategy", [*G, "--strategy", "beam"], "beam", "", called),
    ("generate --n", [*G, "--n", "3"], "sample", P + "n", 3),
    ("generate --preset", [*G, "--preset", "code-comments"], "sample", P + "top_p", 0.2),
    ("generate --max-new-tokens", [*G, "--max-new-tokens", "9"], "sample", P + "max_new_tokens", 9),
    ("generate --min-new-tokens", [*G, "--min-new-tokens", "2"], "sample", P + "min_new_tokens", 2),
    ("generate --temperature", [*G, "--temperature", "0.7"], "sample", P + "temperature", 0.7),
    ("generate --top-k", [*G, "--top-k", "7"], "sample", P + "top_k", 7),
    ("generate --top-p", [*G, "--top-p", "0.9"], "sample", P + "top_p", 0.9),
    ("generate --min-p", [*G, "--min-p", "0.05"], "sample", P + "min_p", 0.05),
    ("generate --typical-p", [*G, "--typical-p", "0.8"], "sample", P + "typical_p", 0.8),
    ("generate --epsilon", [*G, "--epsilon", "0.01"], "sample", P + "epsilon", 0.01),
    ("generate --eta", [*G, "--eta", "0.02"], "sample", P + "eta", 0.02),
    ("generate --top-n-sigma", [*G, "--top-n-sigma", "1.5"], "sample", P + "top_n_sigma", 1.5),
    ("generate --min-tokens-to-keep", [*G, "--min-tokens-to-keep", "3"], "sample",
     P + "min_tokens_to_keep", 3),
    ("generate --mirostat-tau", [*G, "--mirostat-tau", "5"], "sample", P + "mirostat_tau", 5.0),
    ("generate --mirostat-eta", [*G, "--mirostat-eta", "0.2"], "sample", P + "mirostat_eta", 0.2),
    ("generate --xtc-threshold", [*G, "--xtc-threshold", "0.3"], "sample", P + "xtc_threshold", 0.3),
    ("generate --xtc-probability", [*G, "--xtc-probability", "0.5"], "sample", P + "xtc_probability", 0.5),
    ("generate --dry-multiplier", [*G, "--dry-multiplier", "0.8"], "sample", P + "dry_multiplier", 0.8),
    ("generate --dry-base", [*G, "--dry-base", "2"], "sample", P + "dry_base", 2.0),
    ("generate --dry-allowed-length", [*G, "--dry-allowed-length", "4"], "sample",
     P + "dry_allowed_length", 4),
    ("generate --repetition-penalty", [*G, "--repetition-penalty", "1.3"], "sample",
     P + "repetition_penalty", 1.3),
    ("generate --frequency-penalty", [*G, "--frequency-penalty", "0.4"], "sample",
     P + "frequency_penalty", 0.4),
    ("generate --presence-penalty", [*G, "--presence-penalty", "-0.5"], "sample",
     P + "presence_penalty", -0.5),
    ("generate --no-repeat-ngram-size", [*G, "--no-repeat-ngram-size", "3"], "sample",
     P + "no_repeat_ngram_size", 3),
    ("generate --seed", [*G, "--seed", "11"], "sample", P + "seed", 11),
    ("generate --logprobs", [*G, "--logprobs", "5"], "sample", P + "logprobs", 5),
    ("generate --stop", [*G, "--stop", r"\n", "--stop", "END"], "sample", P + "stop", ("\n", "END")),
    ("generate --order", [*G, "--order", "temperature,top_k"], "sample", P + "order", ("temperature",
     "top_k")),
    ("generate --num-beams", [*G, "--strategy", "beam", "--num-beams", "6"], "beam", "self.num_beams", 6),
    ("generate --length-penalty", [*G, "--strategy", "beam", "--length-penalty", "0.5"], "beam",
     "self.length_penalty", 0.5),
    ("generate --stream", [*G, "--stream"], "sample", "prompts", ["x"]),
    ("generate --json", [*G, "--json"], "stdout", "", json_out),
    ("generate --compile", [*G, "--compile"], "engine_for", "config.compile", True),
    ("generate --no-compile", [*G, "--no-compile"], "engine_for", "config.compile", False),
    ("generate --static-decode", [*G, "--static-decode"], "StaticDecodeLM", "", called),
    ("generate --dtype", [*G, "--dtype", "bfloat16"], "load_model", "dtype", "bfloat16"),
    ("generate --device", [*G, "--device", "cpu"], "load_model", "device", "cpu"),
    ("generate --threads", [*G, "--threads", "2"], "set_threads", "threads", 2),
    ("generate --amateur-model", [*G, "--amateur-model", "shakespeare-draft"], "load_model", "name_or_path",
     "shakespeare-draft"),
    ("generate --amateur", [*G, "--amateur", "arith"], "load_model", "name_or_path", "arith"),
    ("generate --contrastive-alpha", [*G, *CD, "--contrastive-alpha", "0.3"], "ContrastiveLM", "alpha", 0.3),
    ("generate --alpha", [*G, *CD, "--alpha", "0.2"], "ContrastiveLM", "alpha", 0.2),
    ("generate --amateur-temperature", [*G, *CD, "--amateur-temperature", "0.5"], "ContrastiveLM",
     "amateur_temperature", 0.5),
    ("generate --amateur-window", [*G, *CD, "--amateur-window", "5"], "ContrastiveLM", "amateur_window", 5),
    ("generate --amateur-weight", [*G, *CD, "--amateur-weight", "0.7"], "ContrastiveLM", "amateur_weight",
     0.7),
    ("generate --json-schema", [*G, "--json-schema", "examples/schema.json"], "sample", "constraint",
     lambda c: c[0] == "json_schema" and json.loads(c[1])),
    ("generate --regex", [*G, "--regex", "a+"], "sample", "constraint", ("regex", "a+")),
    # generate --chat: the prompt as a user message, through dk.chat
    ("generate --chat", [*G, "--chat"], "chat", "messages", [{"role": "user", "content": "x"}]),
    ("generate --system", [*G, "--chat", "--system", "be brief"], "chat", "messages",
     [{"role": "system", "content": "be brief"}, {"role": "user", "content": "x"}]),
    ("generate --tools", [*G, "--chat", "--tools", "examples/tools.json"], "chat", "tools",
     lambda tools: [t["function"]["name"] for t in tools] == ["get_time"]),
    ("generate --tool-choice", [*G, "--chat", "--tools", "examples/tools.json", "--tool-choice", "required"],
     "chat", "tool_choice", "required"),
    ("generate --grammar", [*G, "--grammar", "pyproject.toml"], "sample", "constraint",
     lambda c: c[0] == "grammar" and "[project]" in c[1]),
    ("generate --choices", [*G, "--choices", "yes,no"], "sample", "constraint", ("choices", ["yes", "no"])),
    ("generate --heal", [*G, "--heal"], "sample", "heal", True),
    ("generate --draft-model", [*G, "--draft-model", "self-int4"], "speculative", "self.draft",
     "self-int4"),
    ("generate --speculative", [*G, "--speculative", "prompt-lookup"], "speculative", "self.draft",
     "prompt-lookup"),
    ("generate --num-draft-tokens", [*G, *SPEC, "--num-draft-tokens", "6"], "speculative",
     "self.num_draft_tokens", 6),
    ("generate --gamma", [*G, *SPEC, "--gamma", "2"], "speculative", "self.num_draft_tokens", 2),
    ("generate --verify", [*G, *SPEC, "--verify", "token"], "speculative", "self.verify", "token"),
    ("generate --adaptive", [*G, *SPEC, "--adaptive"], "speculative", "self.adaptive", True),
    ("generate --adaptive-gamma", [*G, *SPEC, "--adaptive-gamma"], "speculative", "self.adaptive", True),
    ("generate --no-fallback", [*G, *SPEC, "--no-fallback"], "speculative", "self.fallback", False),
    # bench: each flag lands in the named argument of the benchmark's function
    ("bench which", ["bench", "constrained"], "bench_constrained", "", called),
    ("bench --model", ["bench", "kv", "--model", "arith"], "bench_kv", "model_name", "arith"),
    ("bench --shape", ["bench", "decode", "--shape", "llama-3.2-1b"], "bench_decode", "model_name",
     "random llama-3.2-1b"),
    ("bench --dtypes", ["bench", "dtype", "--dtypes", "float32,int8-rtn"], "bench_dtype", "dtypes",
     ("float32", "int8-rtn")),
    ("bench --batches", ["bench", "dtype", "--batches", "2,8"], "bench_dtype", "batches", (2, 8)),
    ("bench --amateur-model", ["bench", "contrastive", "--amateur-model", "arith"], "bench_contrastive",
     "amateur_name", "arith"),
    ("bench --amateur", ["bench", "contrastive", "--amateur", "arith"], "bench_contrastive", "amateur_name",
     "arith"),
    ("bench --draft-model", ["bench", "speculative", "--draft-model", "arith"], "bench_speculative",
     "draft_name", "arith"),
    ("bench --draft", ["bench", "soak", "--draft", "arith"], "bench_soak", "draft", "arith"),
    ("bench --judge-model", ["bench", "presets", "--judge-model", "arith"], "bench_presets", "judge_name",
     "arith"),
    ("bench --peer", ["bench", "packed", "--peer", "llamacpp"], "bench_packed", "peer", "llamacpp"),
    ("bench --peer-url", ["bench", "server", "--peer", "vllm", "--peer-url", "http://127.0.0.1:8000"],
     "bench_server", "peer_url", "http://127.0.0.1:8000"),
    ("bench --quick", ["bench", "speculative", "--quick"], "bench_speculative", "quick", True),
    ("bench --compile", ["bench", "packed", "--compile"], "bench_packed", "compile", True),
    # on a GPU the engine's CUDA graphs are bench engine's default (compile None); --eager: False
    ("bench --eager", ["bench", "engine", "--device", "cuda", "--eager"], "bench_engine", "compile", False),
    ("bench --gguf", ["bench", "packed", "--gguf", "m.gguf"], "bench_gguf", "files", ["m.gguf"]),
    ("bench --compile", ["bench", "packed", "--gguf", "m.gguf", "--compile"], "bench_gguf", "compile",
     True),
    ("bench --clients", ["bench", "server", "--clients", "2,4"], "bench_server", "levels", [2, 4]),
    ("bench --concurrent", ["bench", "speculative", "--concurrent", "3"], "bench_concurrent", "concurrent",
     3),
    ("bench --prompt-tokens", ["bench", "speculative", "--clients", "2", "--prompt-tokens", "64"],
     "bench_concurrent", "prompt_tokens", 64),
    ("bench --concurrency", ["bench", "beam", "--concurrency", "5"], "bench_beam", "clients", 5),
    ("bench --hardening", ["bench", "server", "--hardening"], "bench_hardening", "new_tokens", 64),
    ("bench --new-tokens", ["bench", "beam", "--new-tokens", "256"], "bench_beam", "new_tokens", 256),
    ("bench --requests", ["bench", "soak", "--requests", "7"], "bench_soak", "requests", 7),
    ("bench --fail-p", ["bench", "soak", "--fail-p", "0.2"], "bench_soak", "fail_p", 0.2),
    ("bench --seed", ["bench", "soak", "--seed", "5"], "bench_soak", "seed", 5),
    ("bench --repeats", ["bench", "kv", "--repeats", "1"], "bench_kv", "repeats", 1),
    ("bench --repeats", ["bench", "speculative", "--repeats", "2"], "bench_speculative", "repeats", 2),
    ("bench --batch-sizes", ["bench", "latency", "--batch-sizes", "1,3"], "bench_latency", "batch_sizes",
     [1, 3]),
    ("bench --tokens", ["bench", "latency", "--tokens", "2"], "bench_latency", "new_tokens", [2]),
    ("bench --context", ["bench", "latency", "--context", "64"], "bench_latency", "context", 64),
    ("bench --plot", ["bench", "latency", "--plot", "lat.png"], "latency_plot", "path", "lat.png"),
    ("bench --dtype", ["bench", "engine", "--dtype", "bfloat16"], "bench_engine", "dtype", "bfloat16"),
    ("bench --device", ["bench", "dtype", "--device", "cpu"], "bench_dtype", "device", "cpu"),
    ("bench --threads", ["bench", "packed", "--threads", "2"], "set_threads", "threads", 2),
    ("bench --json", ["bench", "compress", "--json"], "stdout", "", json_out),
    # eval
    ("eval task", ["eval", "alignment"], "alignment_frontier", "", called),
    ("eval target", ["eval", "perplexity", "arith"], "load_model", "name_or_path", "arith"),
    ("eval --text", ["eval", "perplexity", "--text", "README.md"], "text_perplexity", "text",
     lambda text: text.startswith("# decodekit")),
    ("eval --split", ["eval", "perplexity", "--split", "val"], "text_perplexity", "text",
     lambda text: text == HELD_OUT["val"].read_text()),
    ("eval --window", ["eval", "perplexity", "--window", "32"], "text_perplexity", "window", 32),
    ("eval --stride", ["eval", "perplexity", "--stride", "16"], "text_perplexity", "stride", 16),
    ("eval --strategies", ["eval", "arith", "--strategies", "majority,bon-orm"], "evaluate_arith",
     "config.strategies", ("majority", "bon-orm")),
    ("eval --budgets", ["eval", "arith", "--budgets", "1,4"], "evaluate_arith", "config.ns", (1, 4)),
    ("eval --n", ["eval", "arith", "--n", "2,8"], "evaluate_arith", "config.ns", (2, 8)),
    ("eval --seeds", ["eval", "arith", "--seeds", "2"], "evaluate_arith", "config.seeds", 2),
    ("eval --problems", ["eval", "arith", "--problems", "9"], "evaluate_arith", "config.problems", 9),
    ("eval --model", ["eval", "arith", "--model", "arith-small"], "evaluate_arith", "config.model",
     "arith-small"),
    ("eval --orm", ["eval", "arith", "--orm", "my-orm"], "evaluate_arith", "config.orm", "my-orm"),
    ("eval --prm", ["eval", "arith", "--prm", "my-prm"], "evaluate_arith", "config.prm", "my-prm"),
    ("eval --temperature", ["eval", "arith", "--temperature", "0.6"], "evaluate_arith",
     "config.temperature", 0.6),
    ("eval --width", ["eval", "arith", "--width", "3"], "evaluate_arith", "config.width", 3),
    ("eval --tau", ["eval", "arith", "--tau", "0.5"], "evaluate_arith", "config.tau", 0.5),
    ("eval --aggregate", ["eval", "arith", "--aggregate", "min"], "evaluate_arith", "config.aggregate",
     "min"),
    ("eval --tree-final", ["eval", "arith", "--tree-final", "vote"], "evaluate_arith", "config.tree_final",
     "vote"),
    ("eval --tree-max-n", ["eval", "arith", "--tree-max-n", "8"], "evaluate_arith", "config.tree_max_n", 8),
    ("eval --value", ["eval", "alignment", "--value", "hidden"], "alignment_frontier", "config.value",
     "hidden"),
    ("eval --reward", ["eval", "alignment", "--reward", "style"], "alignment_frontier", "config.reward",
     "style"),
    ("eval --base-samples", ["eval", "alignment", "--base-samples", "128"], "alignment_frontier",
     "config.base_samples", 128),
    ("eval --samples", ["eval", "alignment", "--samples", "32"], "alignment_frontier", "config.samples", 32),
    ("eval --threads", ["eval", "perplexity", "--threads", "2"], "set_threads", "threads", 2),
    ("eval --dtype", ["eval", "perplexity", "--dtype", "bfloat16"], "load_model", "dtype", "bfloat16"),
    ("eval --device", ["eval", "perplexity", "--device", "cpu"], "load_model", "device", "cpu"),
    ("eval --json", ["eval", "alignment", "--json"], "stdout", "", json_out),
    ("eval --plot", ["eval", "arith", "--plot", "acc.png"], "arith_plot", "path", "acc.png"),
    ("eval --endpoint", ["eval", "arith", "--endpoint", "http://127.0.0.1:9/v1"], "RemoteGenerator",
     "base_url", "http://127.0.0.1:9/v1"),
    # compress
    ("compress model", ["compress", "arith", "--method", "rtn"], "compress_to_dir", "model", "arith"),
    ("compress --method", ["compress", "m", "--method", "gptq"], "compress_to_dir", "config.method", "gptq"),
    ("compress --bits", ["compress", "m", "--method", "rtn", "--bits", "4"], "compress_to_dir",
     "config.bits", 4),
    ("compress --group", ["compress", "m", "--method", "rtn", "--group", "32"], "compress_to_dir",
     "config.group_size", 32),
    ("compress --act-order", ["compress", "m", "--method", "gptq", "--act-order"], "compress_to_dir",
     "config.act_order", True),
    ("compress --activation-bits", ["compress", "m", "--method", "rtn", "--activation-bits", "8"],
     "compress_to_dir", "config.activation_bits", 8),
    ("compress --head-bits", ["compress", "m", "--method", "rtn", "--head-bits", "8"],
     "compress_to_dir", "config.head_bits", 8),
    ("compress --sparsity", ["compress", "m", "--method", "magnitude", "--sparsity", "0.3"],
     "compress_to_dir",
     "config.sparsity", 0.3),
    ("compress --n-m", ["compress", "m", "--method", "magnitude", "--n-m", "2:4"], "compress_to_dir",
     "config.n_m", "2:4"),
    ("compress --calib", ["compress", "m", "--method", "gptq", "--calib", "16"], "compress_to_dir",
     "config.calib_windows", 16),
    ("compress --calib-len", ["compress", "m", "--method", "gptq", "--calib-len", "64"], "compress_to_dir",
     "config.calib_length", 64),
    ("compress --calib-file", ["compress", "m", "--method", "gptq", "--calib-file", "c.txt"],
     "compress_to_dir",
     "calib_file", "c.txt"),
    ("compress --out", ["compress", "m", "--method", "rtn"], "compress_to_dir", "out",
     lambda out: out.endswith("compressed")),
    ("compress --threads", ["compress", "m", "--method", "rtn", "--threads", "2"], "set_threads",
     "threads", 2),
    ("compress --json", ["compress", "m", "--method", "rtn", "--json"], "stdout", "", json_out),
    # serve: the models loaded, then the Backend's ServerConfig and the address served
    ("serve --model", ["serve", "--model", "a=dir"], "load_served", "specs", ["a=dir"]),
    ("serve --host", ["serve", "--host", "0.0.0.0"], "serve", "host", "0.0.0.0"),
    ("serve --port", ["serve", "--port", "8123"], "serve", "port", 8123),
    ("serve --max-tokens", ["serve", "--max-tokens", "99"], "Backend", "config.max_tokens", 99),
    ("serve --max-n", ["serve", "--max-n", "5"], "Backend", "config.max_n", 5),
    ("serve --max-queued", ["serve", "--max-queued", "3"], "Backend", "config.max_queued", 3),
    ("serve --timeout", ["serve", "--timeout", "2.5"], "Backend", "config.request_timeout", 2.5),
    ("serve --reward-model", ["serve", "--reward-model", "arith-orm"], "Backend", "config.reward_models",
     ("arith-orm",)),
    ("serve --dtype", ["serve", "--dtype", "bfloat16"], "load_served", "dtype", "bfloat16"),
    ("serve --device", ["serve", "--device", "cpu"], "load_served", "device", "cpu"),
    ("serve --api-key", ["serve", "--api-key", "k"], "Backend", "config.api_key", "k"),
    ("serve --max-body-mb", ["serve", "--max-body-mb", "1"], "Backend", "config.max_body_bytes", 2**20),
    ("serve --kv-gib", ["serve", "--kv-gib", "0.5"], "Backend", "config.kv_bytes", 2**29),
    ("serve --allowed-hosts", ["serve", "--allowed-hosts", "a,b"], "Backend", "config.allowed_hosts", ("a",
     "b")),
    ("serve --cors-origin", ["serve", "--cors-origin", "http://x"], "Backend", "config.cors_origins",
     ("http://x",)),
    ("serve --compile", ["serve", "--compile"], "engine_for", "config.compile", True),
    ("serve --no-compile", ["serve", "--no-compile"], "engine_for", "config.compile", False),
    ("serve --threads", ["serve", "--threads", "2"], "set_threads", "threads", 2),
    ("serve --strict-fields", ["serve", "--strict-fields"], "Backend", "config.strict_fields", True),
    ("serve --strict-max-tokens", ["serve", "--strict-max-tokens"], "Backend", "config.strict_max_tokens",
     True),
    ("serve --truncate-prompts", ["serve", "--truncate-prompts"], "Backend", "config.truncate_prompts",
     True),
    ("serve --chat-template", ["serve", "--chat-template", "t.jinja"], "Backend", "chat_templates",
     lambda templates: list(templates.values()) == ["{{ messages[0].content }}"]),
    # plan, models, align bon
    ("plan model", ["plan", "arith", "--context", "8"], "plan_memory", "name_or_path", "arith"),
    ("plan --context", ["plan", "arith", "--context", "8"], "plan_memory", "context", 8),
    ("plan --batch", ["plan", "arith", "--context", "8", "--batch", "3"], "plan_memory", "batch_size", 3),
    ("plan --kv-dtype", ["plan", "arith", "--context", "8", "--kv-dtype", "int8"], "plan_memory", "kv_dtype",
     "int8"),
    ("plan --dtype", ["plan", "arith", "--context", "8", "--dtype", "bfloat16"], "plan_memory", "dtype",
     "bfloat16"),
    ("plan --json", ["plan", "arith", "--context", "8", "--json"], "stdout", "", json_out),
    ("models --json", ["models", "--json"], "stdout", "", json_out),
    ("doctor --json", ["doctor", "--json"], "stdout", "", json_out),
    ("models --dtype-report", ["models", "--dtype-report"], "dtype_report", "", called),
    ("align bon --n", ["align", "bon", "--n", "3", "--p", "0.5,0.5", "--r", "0,1"], "bon_report", "n", 3),
    ("align bon --p", ["align", "bon", "--n", "3", "--p", "0.2,0.8", "--r", "0,1"], "bon_report", "p",
     [0.2, 0.8]),
    ("align bon --r", ["align", "bon", "--n", "3", "--p", "0.5,0.5", "--r", "1,0"], "bon_report", "r",
     [1.0, 0.0]),
    ("align bon --json", ["align", "bon", "--n", "3", "--p", "0.5,0.5", "--r", "0,1", "--json"], "bon_report",
     "curve", True),
    ("align bon --plot", ["align", "bon", "--n", "3", "--p", "0.5,0.5", "--r", "0,1", "--plot", "b.png"],
     "plot_bon", "path", "b.png"),
]


@pytest.fixture
def sinks(monkeypatch, tiny_lm, tmp_path):
    """Replace every sink by a recorder; returns sink -> the bound arguments of each call."""
    MODEL[:] = [tiny_lm]
    calls: dict[str, list[dict]] = {}

    def recorder(name, original, result):
        signature = inspect.signature(original)

        def record(*args, **kwargs):
            calls.setdefault(name, []).append(dict(signature.bind(*args, **kwargs).arguments))
            if result is CALL:
                return original(*args, **kwargs)
            if result == "model":
                return tiny_lm
            return result(*args, **kwargs) if callable(result) else result

        return record

    for name, (target, result) in SINKS.items():
        module_name, attribute = target.split(":")
        owner = importlib.import_module(module_name)
        *path, attribute = attribute.split(".")  # "Class.method": the class's attribute
        for part in path:
            owner = getattr(owner, part)
        monkeypatch.setattr(owner, attribute, recorder(name, getattr(owner, attribute), result))
    for target in TABLES:
        module_name, attribute = target.split(":")
        monkeypatch.setattr(importlib.import_module(module_name), attribute, lambda *a, **k: "a table")
    monkeypatch.chdir(tmp_path)  # compress --out and the plots land here; the repository's files:
    for name in ("examples", "pyproject.toml", "README.md"):
        (tmp_path / name).symlink_to(ROOT / name)
    (tmp_path / "c.txt").write_text("ROMEO: calibration text")  # the file flags' files, read
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(12))  # before the (replaced) work starts
    (tmp_path / "prompt.txt").write_text("ROMEO:\n")
    (tmp_path / "t.jinja").write_text("{{ messages[0].content }}")
    return calls


def lookup(arguments: dict, path: str):
    head, _, rest = path.partition(".")
    value = arguments[head]
    for part in rest.split(".") if rest else ():
        value = getattr(value, part)
    return value


@pytest.mark.parametrize("flag, argv, sink, path, expected", ROWS, ids=[row[0] for row in ROWS])
def test_flag_reaches_what_it_names(sinks, capsys, flag, argv, sink, path, expected):
    if argv[0] == "compress":
        argv = [*argv, "--out", "compressed"]
    code = main(argv)
    out = capsys.readouterr()
    assert code == 0, out.err
    if sink == "stdout":
        assert expected(out.out), out.out
        return
    assert sink in sinks, f"{argv} did not call {sink}; called {sorted(sinks)}"
    if not path:
        return
    value = lookup(sinks[sink][-1], path)
    if callable(expected):
        assert expected(value), value
    else:
        assert value == expected
    assert ("is deprecated" in out.err) == (flag in DEPRECATED)


def options(parser: argparse.ArgumentParser, command: str = ""):
    """(command, action) for every argument of every subcommand, --help and --version aside."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from options(sub, f"{command} {name}".strip())
        elif not isinstance(action, argparse._HelpAction | argparse._VersionAction | VersionAction):
            yield command, action


# The old names kept as aliases (issue 26): each prints one deprecation line.
DEPRECATED = {"generate --gamma", "generate --speculative", "generate --adaptive-gamma", "generate --amateur",
              "generate --alpha", "bench --amateur", "bench --draft", "bench --concurrent",
              "bench --concurrency",
              "eval --n"}


def test_every_flag_has_help_and_a_row():
    rows = {row[0] for row in ROWS}
    missing_help, missing_row, seen = [], [], set()
    for command, action in options(build_parser()):
        names = action.option_strings or [action.dest]
        if not (action.help or "").strip():
            missing_help.append(f"{command} {names[0]}")
        for name in names:
            seen.add(f"{command} {name}")
            if f"{command} {name}" not in rows:
                missing_row.append(f"{command} {name}")
    assert not missing_help, f"options without help text: {missing_help}"
    assert not missing_row, f"options without a row in ROWS: {missing_row}"
    assert rows <= seen, f"rows for options that no longer exist: {sorted(rows - seen)}"
    assert len(seen) >= 150


def test_a_deprecated_name_prints_one_line_and_works_as_the_new_one(capsys):
    for old, new in [("--gamma", "--num-draft-tokens"), ("--speculative", "--draft-model")]:
        args = build_parser().parse_args(["generate", "x", old, "3"])
        assert capsys.readouterr().err == f"decodekit generate: warning: {old} is deprecated; use {new}\n"
        assert getattr(args, new[2:].replace("-", "_")) == "3" if old == "--speculative" else 3
    args = build_parser().parse_args(["generate", "x", "--speculative"])  # alone: the '-draft' model
    assert args.draft_model == "auto"
    assert build_parser().parse_args(["eval", "arith", "--n", "1,2"]).budgets == "1,2"
    assert "--n is deprecated; use --budgets" in capsys.readouterr().err


@pytest.mark.parametrize("argv, sink, expected", [
    (["bench", "beam"], "bench_beam", {"new_tokens": 32, "clients": 16, "repeats": 3}),
    (["bench", "server"], "bench_server", {"new_tokens": 256, "levels": [1, 8, 32, 64]}),
    (["bench", "server", "--hardening"], "bench_hardening", {"new_tokens": 64}),
    (["bench", "soak"], "bench_soak", {"requests": 500, "concurrency": 64, "fail_p": 0.05, "seed": 0}),
    (["bench", "speculative"], "bench_speculative", {"new_tokens": 256, "draft_name": "shakespeare-draft"}),
])
def test_a_benchmark_without_a_flag_gets_its_own_default(sinks, capsys, argv, sink, expected):
    """Not given is None and becomes the benchmark's default; a value equal to another
    benchmark's default is still the user's (bench beam --new-tokens 256 runs 256, above)."""
    assert main([*argv, "--json"]) == 0
    arguments = sinks[sink][-1]
    assert {name: arguments[name] for name in expected} == expected
