"""CLI flags of issue 5: --strategy contrastive / --amateur, --json-schema, --regex, --grammar,
--choices, --heal (in process, on tiny local checkpoints)."""

import json
import re

import pytest
import torch

from decodekit.cli import main

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def amateur_dir(tiny_llama_dir, tmp_path_factory):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    path = tmp_path_factory.mktemp("tiny-amateur")
    config = LlamaConfig.from_pretrained(tiny_llama_dir)
    config.num_hidden_layers = 1
    torch.manual_seed(3)
    LlamaForCausalLM(config).save_pretrained(path)
    AutoTokenizer.from_pretrained(tiny_llama_dir).save_pretrained(path)
    return path


def run(capsys, *args):
    code = main(["generate", *map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines()]


def test_constraint_flags(capsys, tiny_llama_dir, tmp_path):
    model = ("--model", tiny_llama_dir, "--max-new-tokens", 40, "--seed", 1)
    code, out, _ = run(capsys, "ROMEO:", *model, "--regex", "[a-z]{2,4}-[0-9]{2}", "--n", 2, "--json")
    assert code == 0
    assert all(re.fullmatch("[a-z]{2,4}-[0-9]{2}", c["text"]) for c in json_lines(out))
    schema = {"type": "object", "properties": {"a": {"enum": [1, 2]}}, "required": ["a"],
              "additionalProperties": False}
    (tmp_path / "schema.json").write_text(json.dumps(schema))
    code, out, _ = run(capsys, "ROMEO:", *model, "--json-schema", tmp_path / "schema.json", "--json")
    assert code == 0 and json.loads(json.loads(out)["text"]) in ({"a": 1}, {"a": 2})
    (tmp_path / "g.lark").write_text('start: "to be" | "not to be"\n')
    code, out, _ = run(capsys, "Q:", *model, "--grammar", tmp_path / "g.lark", "--strategy", "beam")
    assert code == 0 and out.strip() in ("Q:to be", "Q:not to be")
    code, out, _ = run(capsys, "Q:", *model, "--choices", "yes,no", "--strategy", "greedy", "--stream")
    assert code == 0 and out.strip() in ("Q:yes", "Q:no")


def test_heal_and_contrastive_flags(capsys, tiny_llama_dir, amateur_dir):
    model = ("--model", tiny_llama_dir, "--max-new-tokens", 6)
    code, out, _ = run(capsys, "JULIET: O Ro", *model, "--heal", "--seed", 2)
    assert code == 0 and out.startswith("JULIET: O Ro")
    code, out, _ = run(capsys, "ROMEO:", *model, "--strategy", "contrastive", "--amateur-model", amateur_dir,
                       "--contrastive-alpha", 0.2, "--amateur-window", 4, "--json")
    assert code == 0 and len(json.loads(out)["token_ids"]) <= 6
    code, out, _ = run(capsys, "ROMEO:", *model, "--strategy", "sample", "--amateur-model", amateur_dir,
                       "--amateur-temperature", 0.5, "--n", 2, "--seed", 0, "--json")
    assert code == 0 and len(json_lines(out)) == 2


@pytest.mark.parametrize("flags, message", [
    (["--choices", ""], "choices must contain at least one option"),
    (["--choices", "a,b", "--regex", "x"], "at most one of"),
    (["--regex", "a(b"], "invalid regex"),
    (["--contrastive-alpha", "0.3"], "--contrastive-alpha needs --amateur-model or --strategy contrastive"),
    (["--strategy", "contrastive", "--temperature", "0.7"], "takes no --temperature"),
    (["--json-schema", "/no/such/schema.json"], "--json-schema /no/such/schema.json: no such file"),
    (["--regex", "[0-9]", "--heal"], "heal cannot be combined with a constraint"),
])
def test_bad_flags_exit_2_with_one_line(capsys, tiny_llama_dir, flags, message):
    code, _, err = run(capsys, "x", "--model", tiny_llama_dir, *flags)
    assert code == 2 and message in err and err.count("\n") == 1


def test_a_constrained_output_cut_by_the_token_limit_is_flagged(capsys, tiny_llama_dir):
    code, out, err = run(capsys, "ROMEO:", "--model", tiny_llama_dir, "--regex", "[a-z]{30}",
                         "--max-new-tokens", 3, "--json")
    assert code == 0 and json.loads(out)["finish_reason"] == "length"
    assert err == ("decodekit generate: warning: the output is incomplete: generation reached "
                   "--max-new-tokens 3 before the constraint was complete (finish reason 'length')\n")
    code, out, err = run(capsys, "ROMEO:", "--model", tiny_llama_dir, "--choices", "yes,no",
                         "--max-new-tokens", 3, "--stream")
    assert code == 0 and out.strip() in ("ROMEO:yes", "ROMEO:no") and err == ""
    code, out, err = run(capsys, "ROMEO:", "--model", tiny_llama_dir, "--regex", "[a-z]{30}",
                         "--max-new-tokens", 3, "--stream")
    assert code == 0 and "the output is incomplete" in err
