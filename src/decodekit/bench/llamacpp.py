"""llama.cpp as a named peer (issue 15, item 7): `decodekit bench packed --peer llamacpp`.

The peer is what scripts/peers.sh builds into a `.peers/` directory: `venv/` (llama-cpp-python
compiled for this CPU), `convert-lib/` and `src/.../vendor/llama.cpp` (its converter). It is
found in `$DECODEKIT_PEERS`, else `./.peers`, else the source checkout's `.peers`
(`find_llamacpp`); without one the benchmark reports it absent instead of failing.

The benchmark's model is converted once with llama.cpp's converter (bench/gguf.py) to an f32
GGUF, which llama.cpp's own `llama_model_quantize` turns into f16, q8_0 and q4_0; the files
are cached in the peers directory as `NAME-FORMAT.gguf` (NAME: the embedded model's name, or
`random-SHAPE` for a random model of models/shapes.py, whose weights are fixed by seed 0).
Each format is then loaded in its own subprocess of the peer's Python (bench/llamacpp_worker.py
`session`, `PeerSession` here: batch 1, the benchmark's thread count) before the timing starts,
and bench/packed.py times its decode and prefill requests in the same rounds as decodekit's
rows, one after the other (`timers`), so a change of load on a shared machine moves both
alike; the f32 GGUF's greedy continuations of a few prompts are then compared with
decodekit's, token for token (`peer_report`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Callable
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from pathlib import Path

WORKER = Path(__file__).with_name("llamacpp_worker.py")
FORMATS = {"f32": None, "f16": 1, "q8_0": 7, "q4_0": 2}  # llama_ftype of llama_model_quantize
GREEDY_PROMPTS = ("ROMEO:", "JULIET:\nO ", "First Citizen:\nBefore we proceed", "KING HENRY:\nOnce more")
# (decodekit row, llama.cpp format) pairs whose speed ratios the issues' goals name (q8_0 is
# int8 in groups of 32, so the grouped int8 rows are its closest kin). bench/packed.py adds
# the row that dtype "auto" loads a bfloat16 checkpoint as, against f16.
PAIRS = (("float32", "f32"), ("bfloat16", "f16"), ("int8 RTN", "q8_0"), ("int8 RTN g64", "q8_0"),
         ("int8 RTN g128", "q8_0"), ("int8 GPTQ", "q8_0"), ("int4 GPTQ", "q4_0"),
         ("int8 RTN a8", "q8_0"), ("int8 RTN g32 a8", "q8_0"), ("int4 GPTQ a8", "q4_0"))  # fmt: skip
ABSENT = ("no llama-cpp-python build found in $DECODEKIT_PEERS, ./.peers or the checkout's .peers "
          "(bash scripts/peers.sh)")


@dataclass(frozen=True)
class LlamaCpp:
    """A peers directory with a working llama-cpp-python build."""

    directory: Path

    @property
    def python(self) -> Path:
        return self.directory / "venv" / "bin" / "python"

    def converter(self) -> Path | None:
        """llama.cpp's source tree with convert_hf_to_gguf.py, if the sdist is there."""
        found = sorted(self.directory.glob("src/llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
        return found[-1].parent if found else None


def peer_directories() -> list[Path]:
    """Where a peers directory is looked for, in order (module docstring)."""
    checkout = Path(__file__).resolve().parents[3] / ".peers"
    places = [Path(os.environ["DECODEKIT_PEERS"])] if os.environ.get("DECODEKIT_PEERS") else []
    return [*places, Path.cwd() / ".peers", checkout]


def find_llamacpp(module: str = "llama_cpp") -> LlamaCpp | None:
    """The first peers directory whose venv imports `module`, or None."""
    for directory in peer_directories():
        peer = LlamaCpp(directory)
        if peer.python.exists() and not subprocess.run([str(peer.python), "-c", f"import {module}"],
                                                       capture_output=True).returncode:  # fmt: skip
            return peer
    return None


def run_worker(peer: LlamaCpp, task: dict) -> dict:
    """One task of bench/llamacpp_worker.py (`quantize`, `samplers`) in the peer's Python."""
    done = subprocess.run([str(peer.python), str(WORKER)], input=json.dumps(task), capture_output=True,
                          text=True)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"llama.cpp worker failed ({task['op']}): {done.stderr.strip()[-2000:]}")
    return json.loads(done.stdout)


class PeerSession:
    """One GGUF loaded in a worker subprocess (bench/llamacpp_worker.py `session`), answering
    one request at a time; `close` (or leaving its `with`) ends it."""

    def __init__(self, peer: LlamaCpp, gguf: Path, context: int, threads: int, repack: str | None) -> None:
        # The worker's stderr, read back on a failure; closed by `close`.
        self.log = tempfile.TemporaryFile("w+")  # noqa: SIM115
        self.process = subprocess.Popen([str(peer.python), str(WORKER)], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE, stderr=self.log, text=True)  # fmt: skip
        self.name = gguf.name
        try:
            self.ask({"op": "session", "gguf": str(gguf), "context": context, "threads": threads,
                      "repack": repack})  # fmt: skip
        except BaseException:
            self.process.kill()
            self.close()
            raise

    def ask(self, request: dict) -> dict:
        """Send one request line, read its one answer line."""
        try:
            self.process.stdin.write(json.dumps(request) + "\n")
            self.process.stdin.flush()
            line = self.process.stdout.readline()
        except BrokenPipeError:
            line = ""
        if not line:
            self.log.seek(0)
            raise RuntimeError(f"llama.cpp worker for {self.name} failed: {self.log.read().strip()[-2000:]}")
        return json.loads(line)

    def close(self) -> None:
        """End the worker: stdin closed is its signal to exit; killed if it does not."""
        with suppress(BrokenPipeError):  # it died with a request unread: its stderr says why
            self.process.stdin.close()
        try:
            self.process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
        self.log.close()

    def __enter__(self) -> PeerSession:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def convert(peer: LlamaCpp, model_dir: Path, out: Path) -> None:
    """`model_dir` to an f32 GGUF by llama.cpp's converter (bench/gguf.py), in a subprocess of
    this Python (the converter needs torch and transformers, which the peer's venv lacks)."""
    llama = peer.converter()
    if llama is None:
        raise RuntimeError(f"no llama.cpp source in {peer.directory}/src to convert {model_dir}: "
                           "bash scripts/peers.sh")
    package_root = Path(__file__).resolve().parents[2]  # the directory holding decodekit/
    path = os.pathsep.join([str(peer.directory / "convert-lib"), str(llama), str(package_root)])
    done = subprocess.run([sys.executable, "-m", "decodekit.bench.gguf", str(model_dir), str(out)],
                          env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True)  # fmt: skip
    if done.returncode:
        raise RuntimeError(f"converting {model_dir} to GGUF failed: {done.stderr.strip()[-2000:]}")


def ggufs(peer: LlamaCpp, model_name: str, scratch: Path) -> dict[str, Path]:
    """The model's GGUF in each of FORMATS, converted and quantised once into the peers
    directory (module docstring); a local checkpoint directory's afresh into `scratch`."""
    from decodekit.models.registry import embedded_models, resolve
    from decodekit.models.shapes import SHAPES, save_random_checkpoint

    if model_name in SHAPES:
        name, cache = f"random-{model_name}", peer.directory
    else:
        name, model_dir, kind = resolve(model_name)
        if kind != "hf":
            raise ValueError(f"llama.cpp converts Hugging Face checkpoints, not a {kind} model: "
                             f"{model_name!r}")
        cache = peer.directory if model_name in embedded_models() else Path(scratch)
    paths = {fmt: cache / f"{name}-{fmt}.gguf" for fmt in FORMATS}
    part = cache / f"{name}.gguf.part"  # renamed when complete, so an interrupted run leaves no GGUF
    if not paths["f32"].exists():
        if model_name in SHAPES:
            with tempfile.TemporaryDirectory(prefix=f"decodekit-{model_name}-") as folder:
                convert(peer, save_random_checkpoint(model_name, folder), part)
        else:
            convert(peer, model_dir, part)
        part.replace(paths["f32"])
    for fmt, ftype in FORMATS.items():
        if ftype is not None and not paths[fmt].exists():
            run_worker(peer, {"op": "quantize", "source": str(paths["f32"]), "out": str(part),
                              "ftype": ftype})  # fmt: skip
            part.replace(paths[fmt])
    return paths


def repack_pattern(config) -> str | None:
    """The regex of the matmul weights (GGUF names) that llama.cpp's q4_0 repacking takes
    (bench/llamacpp_worker.py `Session`): those `llama_model_quantize` stored as q4_0 (an
    input width that is a multiple of q4_0's 32-weight blocks; the others fall back to f16)
    with a row count that is a multiple of 8 (its q4_0_8x8 layout). `config`: a NativeConfig."""
    attention, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    shapes = {"attn_q": (config.hidden_size, attention), "attn_k": (config.hidden_size, kv),
              "attn_v": (config.hidden_size, kv), "attn_output": (attention, config.hidden_size),
              "ffn_gate": (config.hidden_size, config.intermediate_size),
              "ffn_up": (config.hidden_size, config.intermediate_size),
              "ffn_down": (config.intermediate_size, config.hidden_size)}  # name -> (in, out)
    names = [name for name, (width, rows) in shapes.items() if width % 32 == 0 and rows % 8 == 0]
    return rf"^blk\.\d+\.({'|'.join(names)})\.weight$" if names else None


@dataclass
class PeerRun:
    """llama.cpp's formats of one model, each loaded in its PeerSession."""

    peer: LlamaCpp
    paths: dict[str, Path]
    sessions: dict[str, PeerSession]
    threads: int


def start(model, model_name: str, prefill_tokens: int, new_tokens: int, threads: int,
          stack: ExitStack) -> PeerRun | dict:  # fmt: skip
    """Convert (once) and load every format of FORMATS for `model` (decodekit's float32 model
    of `model_name`), each session entered on `stack` with a context for the prefill and for
    each greedy prompt's continuation; the peer's absence as a dict."""
    peer = find_llamacpp()
    if peer is None:
        return {"available": False, "reason": ABSENT}
    context = 8 + max(prefill_tokens, *(len(model.encode(text)) + new_tokens for text in GREEDY_PROMPTS))
    scratch = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="decodekit-gguf-")))
    paths = ggufs(peer, model_name, scratch)
    sessions = {fmt: stack.enter_context(PeerSession(peer, path, context, threads,
                                                     repack_pattern(model.config) if fmt == "q4_0" else None))
                for fmt, path in paths.items()}  # fmt: skip
    return PeerRun(peer, paths, sessions, threads)


def timers(run: PeerRun, prompt: list[int], new_tokens: int, prefill: list[int]) -> dict[str, Callable]:
    """Name -> a function that runs one decode or prefill in a session and returns the
    worker's (CPU, wall) seconds of it: what bench/packed.py interleaves with its own rows."""

    def timer(session: PeerSession, request: dict) -> Callable[[], tuple[float, float]]:
        def run() -> tuple[float, float]:
            answer = session.ask(request)
            return answer["cpu_s"], answer["wall_s"]

        return run

    out = {}
    for fmt, session in run.sessions.items():
        decode = {"do": "decode", "prompt": prompt, "new_tokens": new_tokens}
        out[f"decode llama.cpp {fmt}"] = timer(session, decode)
        out[f"prefill llama.cpp {fmt}"] = timer(session, {"do": "prefill", "ids": prefill})
    return out


def peer_report(run: PeerRun, model, new_tokens: int, speeds: dict[str, dict], rows: list[dict],
                auto_row: str) -> dict:  # fmt: skip
    """llama.cpp's rows (`speeds`: "llama.cpp FORMAT" -> its tok/s, as bench/packed.py
    measured them beside decodekit's `rows`), the f32 GGUF's greedy equality with `model`
    (decodekit's float32), and the pairs' ratios; `auto_row` is the row dtype "auto" loads a
    bfloat16 checkpoint as."""
    import decodekit as dk

    prompts = [model.encode(text) for text in GREEDY_PROMPTS]
    params = dk.SamplingParams(max_new_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    ours = [list(completions[0].token_ids) for completions in dk.generate(model, prompts, params)]
    f32 = run.sessions["f32"]
    theirs = f32.ask({"do": "greedy", "prompts": prompts, "new_tokens": new_tokens})["greedy"]
    tokenized = f32.ask({"do": "tokenize", "texts": list(GREEDY_PROMPTS)})["tokenized"]
    peer_rows = [{"format": fmt, "layout": "CPU_REPACK q4_0_8x8" if fmt == "q4_0" else "ggml",
                  "bits_per_weight": round(8 * path.stat().st_size / model.num_parameters(), 2),
                  **speeds[f"llama.cpp {fmt}"]} for fmt, path in run.paths.items()]  # fmt: skip
    by_config = {row["config"]: row for row in rows if "decode_tok_s" in row}
    by_format = {row["format"]: row for row in peer_rows}
    pairs = [*PAIRS, (auto_row, "f16", f"auto for a bfloat16 checkpoint ({auto_row}) / f16")]
    ratios = {}
    for ours_name, fmt, *label in pairs:
        if ours_name in by_config:
            ratios[label[0] if label else f"{ours_name} / {fmt}"] = {
                key: round(by_config[ours_name][key] / by_format[fmt][key], 2)
                for key in ("decode_tok_s", "prefill_tok_s")
            }
    return {"available": True, "python": str(run.peer.python),
            "system_info": f32.ask({"do": "info"})["system_info"], "threads": run.threads,
            "rows": peer_rows, "ratios": ratios,
            "greedy_f32": {"prompts": list(GREEDY_PROMPTS), "new_tokens": new_tokens,
                           "tokens_equal": [a == b for a, b in zip(ours, theirs, strict=True)],
                           "tokenizer_equal": tokenized == prompts}}  # fmt: skip
