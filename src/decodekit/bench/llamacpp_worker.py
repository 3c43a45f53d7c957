"""Run by the llama.cpp peer's own Python (llama-cpp-python and numpy; no torch, no
decodekit), by file path (bench/llamacpp.py drives it):

- `quantize`: one JSON task on stdin, {"op": "quantize", "source": GGUF, "out": GGUF,
  "ftype": int}: `llama_model_quantize` (llama.cpp's own quantiser; ftype 1 f16, 7 q8_0,
  2 q4_0), one thread; one JSON answer on stdout.
- `session`: the first line on stdin, {"op": "session", "gguf": GGUF, "context": n,
  "threads": t, "repack": regex or null}, loads the model (batch = context, `threads` threads);
  then each line is one request and gets one JSON line back, until stdin closes:
  {"do": "decode", "prompt": [ids], "new_tokens": n}: greedy decode from position 0 (the
  prompt evaluated, then n - 1 single-token steps, argmax of the last logits: n tokens, as
  `decodekit.generate` counts them), answered with {"cpu_s": process CPU time, "wall_s"};
  {"do": "prefill", "ids": [ids]}: one `eval` of the ids in a single batch, timed the same;
  {"do": "greedy", "prompts": [[ids], ...], "new_tokens": n}: {"greedy": [[ids], ...]};
  {"do": "tokenize", "texts": [str]}: {"tokenized": [[ids], ...]};
  {"do": "logprobs", "ids": [ids]}: {"logprobs": [log p(ids[i + 1] | ids[:i + 1]) for each i]},
  one batch from position 0 with the logits of every position (a perplexity window);
  {"do": "info"}: {"system_info": str}.
  The caller times rounds of these interleaved with its own (bench/packed.py), so a change of
  load on a shared machine moves both alike.
- `samplers`: {"op": "samplers", "logits": path of raw float32 [rows, vocab], "rows": R,
  "chains": {name: [[sampler, args...], ...]}, "calls": n}: each chain of llama.cpp's
  samplers (temp, top_k, top_p, min_p, typical; then dist, seeded, or greedy alone) applied
  to every row's logits, `calls` times after one untimed call, the candidates' array filled
  from the logits each time as `llama_sampler_sample` fills it; answered with {"ms": {name:
  median wall ms of one call over all rows}, "tokens": {name: each row's token at the last
  call}}. benchmarks/sampling_vocab.py compares its own.
- `answer`: {"op": "answer", "gguf": GGUF, "prompt": str, "new_tokens": n, "context": n,
  "threads": t}: load the model, tokenise the prompt, n greedy tokens, their text; answered
  with {"text": str, "tokens": [ids]}. bench/startup.py times the whole process: a user's
  start-to-answer.
"""

from __future__ import annotations

import ctypes
import json
import sys
import time
from pathlib import Path

import llama_cpp
import numpy as np


def quantize(source: str, out: str, ftype: int) -> dict:
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.nthread = 1
    status = llama_cpp.llama_model_quantize(source.encode(), out.encode(), params)
    if status != 0:
        raise RuntimeError(f"llama_model_quantize({source!r}, ftype {ftype}) returned {status}")
    return {"out": out}


@llama_cpp.llama_log_callback
def warnings_only(level: int, text: bytes, user_data) -> None:
    """llama.cpp's log, less its debug and info lines (GGML_LOG_LEVEL_WARN is 3, CONT 5)."""
    if level in (3, 4):
        sys.stderr.write(text.decode(errors="replace"))


class Override(ctypes.Structure):
    """llama.h's llama_model_tensor_buft_override (the binding declares the field void *)."""

    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def repack_buffer_type() -> int:
    """ggml's CPU_REPACK buffer type (weights re-laid out for its vectorised kernels, e.g.
    q4_0 as q4_0_8x8 on AVX-512), found through the CPU backend's extra buffer types."""
    ggml = ctypes.CDLL(str(Path(llama_cpp.__file__).parent / "lib" / "libggml.so"))
    ggml.ggml_backend_dev_by_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_by_type.argtypes = [ctypes.c_int]
    ggml.ggml_backend_dev_backend_reg.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_backend_reg.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_reg_get_proc_address.restype = ctypes.c_void_p
    ggml.ggml_backend_reg_get_proc_address.argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    ggml.ggml_backend_buft_name.restype = ctypes.c_char_p
    ggml.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    cpu = ggml.ggml_backend_dev_by_type(0)  # GGML_BACKEND_DEVICE_TYPE_CPU
    address = ggml.ggml_backend_reg_get_proc_address(ggml.ggml_backend_dev_backend_reg(cpu),
                                                     b"ggml_backend_dev_get_extra_bufts")  # fmt: skip
    extra = ctypes.CFUNCTYPE(ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p)(address)(cpu)
    i = 0
    while extra[i]:
        if ggml.ggml_backend_buft_name(extra[i]) == b"CPU_REPACK":
            return extra[i]
        i += 1
    raise RuntimeError("this llama.cpp build has no CPU_REPACK buffer type")


class Session:
    """One model and context through llama.cpp's C API: `threads` threads, one sequence. Its automatic
    extra buffer types are off: on this machine llama.cpp puts every quantised weight in its
    AMX buffer, whose matmul segfaults in ggml_backend_amx_mul_mat (llama.cpp issue #20824;
    PR #26954: its worker threads lack the AMX tile permission). With `repack` the matmul
    weights go to the CPU_REPACK buffer instead, llama.cpp's next choice on an x86 CPU for the
    types it repacks (q4_0; its q8_0 repacking exists for ARM only and crashes here). `repack`
    is the regex of the tensors to move (bench/llamacpp.py `repack_pattern`)."""

    def __init__(self, gguf: str, context: int, threads: int = 1, repack: str | None = None) -> None:
        llama_cpp.llama_log_set(warnings_only, None)
        llama_cpp.llama_backend_init()
        model_params = llama_cpp.llama_model_default_params()
        model_params.use_extra_bufts = False
        if repack:
            moved = Override(repack.encode(), repack_buffer_type())
            self.overrides = (Override * 2)(moved, Override(None, None))  # NULL-terminated
            model_params.tensor_buft_overrides = ctypes.addressof(self.overrides)
        self.model = llama_cpp.llama_model_load_from_file(gguf.encode(), model_params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {gguf}")
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = params.n_batch = params.n_ubatch = context  # a prefill is one batch
        params.n_threads = params.n_threads_batch = threads
        self.context = llama_cpp.llama_init_from_model(self.model, params)
        self.vocab = llama_cpp.llama_model_get_vocab(self.model)
        self.n_vocab = llama_cpp.llama_vocab_n_tokens(self.vocab)

    def eval(self, ids: list[int]) -> None:
        """Append `ids` to the context (positions follow the KV cache's)."""
        tokens = (llama_cpp.llama_token * len(ids))(*ids)
        status = llama_cpp.llama_decode(self.context, llama_cpp.llama_batch_get_one(tokens, len(ids)))
        if status != 0:
            raise RuntimeError(f"llama_decode returned {status}")

    def reset(self) -> None:
        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.context), True)

    def greedy(self, prompt: list[int], new_tokens: int) -> list[int]:
        """`new_tokens` greedy tokens after `prompt`, from position 0."""
        self.reset()
        self.eval(prompt)
        tokens: list[int] = []
        while True:
            last = llama_cpp.llama_get_logits_ith(self.context, -1)
            tokens.append(int(np.argmax(np.ctypeslib.as_array(last, shape=(self.n_vocab,)))))  # [V] -> id
            if len(tokens) == new_tokens:
                return tokens
            self.eval(tokens[-1:])

    def prefill(self, ids: list[int]) -> None:
        self.reset()
        self.eval(ids)

    def detokenize(self, ids: list[int]) -> str:
        piece, pieces = ctypes.create_string_buffer(256), b""
        for token in ids:
            count = llama_cpp.llama_token_to_piece(self.vocab, token, piece, len(piece), 0, False)
            pieces += piece.raw[:count]
        return pieces.decode(errors="replace")

    def logprobs(self, ids: list[int]) -> list[float]:
        """log p(ids[i + 1] | ids[: i + 1]) for i < len(ids) - 1: one batch from position 0
        whose every position returns its logits."""
        self.reset()
        batch = llama_cpp.llama_batch_init(len(ids), 0, 1)
        try:
            for i, token in enumerate(ids):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, i, 1
                batch.seq_id[i][0], batch.logits[i] = 0, True
            batch.n_tokens = len(ids)
            status = llama_cpp.llama_decode(self.context, batch)
            if status != 0:
                raise RuntimeError(f"llama_decode returned {status}")
            out = []
            for i in range(len(ids) - 1):
                logits = llama_cpp.llama_get_logits_ith(self.context, i)
                row = np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).astype(np.float64)  # [V]
                top = row.max()
                out.append(float(row[ids[i + 1]] - top - np.log(np.exp(row - top).sum())))
            return out
        finally:
            llama_cpp.llama_batch_free(batch)

    def tokenize(self, text: str) -> list[int]:
        data = text.encode()
        out = (llama_cpp.llama_token * (len(data) + 8))()
        count = llama_cpp.llama_tokenize(self.vocab, data, len(data), out, len(out), False, False)
        return list(out[:count])


SAMPLERS = {
    "temp": lambda t: llama_cpp.llama_sampler_init_temp(t),
    "top_k": lambda k: llama_cpp.llama_sampler_init_top_k(k),
    "top_p": lambda p: llama_cpp.llama_sampler_init_top_p(p, 1),
    "min_p": lambda p: llama_cpp.llama_sampler_init_min_p(p, 1),
    "typical": lambda p: llama_cpp.llama_sampler_init_typical(p, 1),
    "dist": lambda seed: llama_cpp.llama_sampler_init_dist(seed),
    "greedy": lambda: llama_cpp.llama_sampler_init_greedy(),
}


def samplers(task: dict) -> dict:
    """Median wall ms of each chain over all rows (module docstring)."""
    import numpy as np

    logits = np.fromfile(task["logits"], dtype=np.float32).reshape(task["rows"], -1)
    vocab = logits.shape[1]
    data = (llama_cpp.llama_token_data * vocab)()
    fields = np.ctypeslib.as_array(data)  # a structured view: id, logit, p
    ids = np.arange(vocab, dtype=np.int32)
    out, tokens = {}, {}
    for name, links in task["chains"].items():
        chain = llama_cpp.llama_sampler_chain_init(llama_cpp.llama_sampler_chain_default_params())
        for sampler, *args in links:
            llama_cpp.llama_sampler_chain_add(chain, SAMPLERS[sampler](*args))

        def call(chain=chain, name=name) -> None:
            tokens[name] = []
            for row in logits:
                fields["id"], fields["logit"], fields["p"] = ids, row, 0.0
                candidates = llama_cpp.llama_token_data_array(data, vocab, -1, False)
                llama_cpp.llama_sampler_apply(chain, ctypes.byref(candidates))
                assert 0 <= candidates.selected < candidates.size
                tokens[name].append(int(fields["id"][candidates.selected]))

        call()
        times = []
        for _ in range(task["calls"]):
            start = time.perf_counter()
            call()
            times.append(time.perf_counter() - start)
        llama_cpp.llama_sampler_free(chain)
        out[name] = round(sorted(times)[len(times) // 2] * 1e3, 3)
    return {"ms": out, "tokens": tokens}


def timed(fn) -> dict:
    """CPU (this process) and wall seconds of `fn()`."""
    cpu, wall = time.process_time(), time.perf_counter()
    fn()
    return {"cpu_s": time.process_time() - cpu, "wall_s": time.perf_counter() - wall}


def answer(session: Session, request: dict) -> dict:
    """One request of a session (module docstring)."""
    do = request["do"]
    if do == "decode":
        return timed(lambda: session.greedy(request["prompt"], request["new_tokens"]))
    if do == "prefill":
        return timed(lambda: session.prefill(request["ids"]))
    if do == "greedy":
        return {"greedy": [session.greedy(p, request["new_tokens"]) for p in request["prompts"]]}
    if do == "tokenize":
        return {"tokenized": [session.tokenize(t) for t in request["texts"]]}
    if do == "logprobs":
        return {"logprobs": session.logprobs(request["ids"])}
    if do == "info":
        return {"system_info": llama_cpp.llama_print_system_info().decode()}
    raise ValueError(f"unknown request {do!r}")


def serve(task: dict) -> None:
    session = Session(task["gguf"], task["context"], task.get("threads", 1), task.get("repack"))
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        print(json.dumps(answer(session, json.loads(line))), flush=True)


def answer_once(task: dict) -> dict:
    session = Session(task["gguf"], task["context"], task.get("threads", 1))
    tokens = session.greedy(session.tokenize(task["prompt"]), task["new_tokens"])
    return {"text": session.detokenize(tokens), "tokens": tokens}


if __name__ == "__main__":
    request = json.loads(sys.stdin.readline())
    if request["op"] == "session":
        serve(request)
    elif request["op"] == "answer":
        print(json.dumps(answer_once(request)))
    elif request["op"] == "samplers":
        print(json.dumps(samplers(request)))
    else:
        print(json.dumps(quantize(request["source"], request["out"], request["ftype"])))
