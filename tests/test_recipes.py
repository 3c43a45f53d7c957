"""docs/ARCHITECTURE.md's recipes ("Where a new piece plugs in"), followed literally: a toy
adapter, a toy strategy and a model-family alias, each added only where its recipe says, then
used through the surfaces the recipe promises."""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch

import decodekit as dk
from decodekit.completion import Completion
from decodekit.engine.engine import run_requests
from decodekit.engine.program import Feed, Forward, Program
from decodekit.models.families import FAMILIES
from decodekit.request import Delta

PACKAGE = Path(dk.__file__).parent
RECIPES = PACKAGE.parents[1] / "docs" / "ARCHITECTURE.md"

# -- a sampling adapter: its class, its field and place in the order, nothing else ------------

TOY_CLASS = '''
class BanLast(Adapter):
    # lowers each row's last token: reads the history
    name, fields, reads_history = "ban_last", ("ban_last_penalty",), True
    active = staticmethod(lambda p: p.ban_last_penalty > 0)

    def __call__(self, logits, state):
        last = [[context[-1]] for context in state.contexts()]
        index = torch.tensor(last, dtype=torch.long, device=logits.device)  # [R, 1]
        return logits.scatter_add(-1, index, torch.full_like(index, -self.params.ban_last_penalty,
                                                             dtype=logits.dtype))


'''
TOY_FIELD = '''    ban_last_penalty: float = option(
        0.0, "subtracted from the logit of the last token", Range(0.0),
        flag="lower the last token's logit by this (default 0)", extension=True)
'''
TOY_CHECKS = r'''
import contextlib, io, math, torch
import decodekit as dk
from decodekit.decode.speculative import history_free
from decodekit.params import SamplingParams
from decodekit.sampling import SamplerState, build_chain
from decodekit.server.lab import ADAPTER_FIELDS
from decodekit.server.protocol import APIError, CompletionRequest, parse_request

# the chain: a hand-computed four-token case
params = SamplingParams(ban_last_penalty=2.0)
state = SamplerState(params, [1, 2], 1, 4)
out = build_chain(params)(torch.zeros(1, 4), state)
assert out.tolist() == [[0.0, 0.0, -2.0, 0.0]], out
assert not history_free(params)  # speculative decoding goes position by position
try:
    SamplingParams(ban_last_penalty=-1.0)
    raise SystemExit("no range check")
except ValueError as error:
    assert "ban_last_penalty must be in [0, inf], got -1.0" in str(error), error
# the CLI flag
help_text = io.StringIO()
with contextlib.redirect_stdout(help_text), contextlib.suppress(SystemExit):
    from decodekit.cli import main
    main(["generate", "--help"])
assert "--ban-last-penalty" in help_text.getvalue() and "lower the last token" in help_text.getvalue()
# the server's typed field, and its 400
request = parse_request(CompletionRequest, b'{"model": "m", "prompt": "a", "ban_last_penalty": 1.5}')
assert request.extensions() == {"ban_last_penalty": 1.5}
try:
    parse_request(CompletionRequest, b'{"model": "m", "prompt": "a", "ban_last_penalty": -1}')
    raise SystemExit("no 400")
except APIError as error:
    assert "ban_last_penalty must be a number >= 0, got -1" in str(error.message), error.message
# the lab's editor
assert ADAPTER_FIELDS["ban_last"] == ("ban_last_penalty",)
# every strategy: greedy decoding on the shipped model never repeats its last token
model = dk.load_model("shakespeare")
[[c]] = dk.generate(model, ["ROMEO:"], SamplingParams(max_new_tokens=24, temperature=0.0,
                                                       ban_last_penalty=1e4, ignore_eos=True))
ids = c.token_ids
assert all(a != b for a, b in zip(ids, ids[1:])), ids
print("recipe ok")
'''


def copy_package(where: Path) -> Path:
    """A copy of the package's sources (its models and built kernels linked, not copied; the
    byte code copied with its sources' times, so only the edited modules compile again)."""
    big = {"assets", "_native"}
    target = where / "decodekit"
    shutil.copytree(PACKAGE, target, ignore=lambda folder, names: [n for n in names if n in big])
    for name in big:
        if (PACKAGE / "models" / name).exists():
            (target / "models" / name).symlink_to(PACKAGE / "models" / name)
    return target


def edit(path: Path, before: str, insert: str) -> None:
    """Insert `insert` before the one occurrence of `before` in `path`."""
    text = path.read_text()
    assert text.count(before) == 1, (path, before)
    path.write_text(text.replace(before, insert + before))


def test_the_recipes_name_the_places_these_tests_edit():
    text = RECIPES.read_text()
    recipes = text[text.index("**Where a new piece plugs in.**") : text.index("Layout as built")]
    for place in ("subclass of `Adapter` in `sampling/adapters.py`", "`option(", "`DEFAULT_ORDER`",
                  "tests/sampling/test_adapters.py `ON`", "`Program` (engine/program.py)",
                  "`engine.engine.run_requests(model, programs)`", "`models/families.py` `FAMILIES`"):
        assert place in recipes, place


def test_a_toy_adapter_added_where_the_recipe_says_reaches_every_surface(tmp_path):
    package = copy_package(tmp_path)
    edit(package / "sampling" / "adapters.py", "# Every adapter class by name, in DEFAULT_ORDER", TOY_CLASS)
    edit(package / "params.py", "    order: tuple[str, ...] = option(", TOY_FIELD)
    edit(package / "params.py", '    "dry",\n)', '    "ban_last",\n')
    env = {**os.environ, "PYTHONPATH": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", TOY_CHECKS], capture_output=True, text=True, env=env,
                         cwd=tmp_path, timeout=300)  # fmt: skip
    assert out.returncode == 0 and "recipe ok" in out.stdout, out.stderr[-3000:]


# -- a decoding strategy: a Program, run with run_requests ------------------------------------


class GreedyProgram(Program):
    """A toy strategy: the argmax of the raw logits, `max_new_tokens` of them."""

    def __init__(self, model, prompt_ids: list[int], max_new_tokens: int, prompt_index: int = 0):
        self.model, self.prompt_ids, self.max_new_tokens = model, list(prompt_ids), max_new_tokens
        self.prompt_index = prompt_index
        self.seq = None

    def needs(self, block_size):
        return [(self.model, math.ceil((len(self.prompt_ids) + self.max_new_tokens) / block_size))]

    def step(self, kv):
        if self.seq is None:
            self.seq = kv.open(kv.model, self.prompt_ids)
        [[logits]] = yield [Forward(kv.model, [Feed(self.seq)])]  # [1, V]
        self.seq.tokens.append(int(logits[-1].argmax()))
        new = self.seq.tokens[len(self.prompt_ids) :]
        if len(new) < self.max_new_tokens:
            return []
        self.finished = True
        kv.close_all()
        text = self.model.tokenizer.decode(new)
        done = Completion(new, text, [], [], "length")
        return [Delta(self.prompt_index, 0, text, completion=done, token_ids=new)]


def test_a_toy_strategy_written_as_the_recipe_says_matches_the_plain_greedy_loop():
    model = dk.load_model("shakespeare")
    prompts = ["ROMEO:", "JULIET: O"]
    params = dk.SamplingParams(max_new_tokens=8, temperature=0.0, ignore_eos=True)
    plain = [c.token_ids for [c] in dk.generate(model, prompts, params)]
    programs = [GreedyProgram(model, model.tokenizer.encode(p), 8, i) for i, p in enumerate(prompts)]
    done = {d.prompt_index: d.completion.token_ids for d in run_requests(model, programs) if d.completion}
    assert [done[0], done[1]] == plain  # two programs at once, against one plain run each


# -- a model family: one entry in FAMILIES ----------------------------------------------------


def test_a_family_alias_is_one_entry_in_the_table(tmp_path, monkeypatch):
    """A Llama alias under its own model_type and class: NativeLM loads it, and a GGUF file
    written of it loads back as llama, with the same logits."""
    from decodekit.models.base import prefill
    from decodekit.models.shapes import save_checkpoint, shape_config

    config = {**shape_config("smollm2-135m"), "num_hidden_layers": 1}  # a small Llama checkpoint
    source = save_checkpoint(config, tmp_path / "llama")
    alias = shutil.copytree(source, tmp_path / "toyllama")
    renamed = {**config, "model_type": "toyllama", "architectures": ["ToyLlamaForCausalLM"]}
    (alias / "config.json").write_text(json.dumps(renamed))
    with pytest.raises(ValueError, match="not supported by the native backend"):
        dk.load_model(alias, backend="native")
    monkeypatch.setitem(FAMILIES, "toyllama", replace(FAMILIES["llama"], architecture="ToyLlamaForCausalLM"))
    prompt = [[1, 5, 9, 2]]
    expected = prefill(dk.load_model(source), prompt)[0]
    assert torch.equal(prefill(dk.load_model(alias, backend="native"), prompt)[0], expected)
    pytest.importorskip("gguf")
    from decodekit.compress.gguf import write_gguf

    gguf = dk.load_model(write_gguf(alias, tmp_path / "toy.gguf", "f32"))
    assert gguf.config.model_type == "llama"  # llama.cpp's architecture for the family
    torch.testing.assert_close(prefill(gguf, prompt)[0], expected, rtol=1e-4, atol=1e-4)
