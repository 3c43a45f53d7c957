"""The CLI's prompt from a file or standard input, and its file flags' errors (issue 35).

`generate --prompt-file FILE` (or '-') and `generate -` take the prompt from a file or a pipe,
for prompts past the command line's limit; every flag that reads a file says which flag and
which path when the file is missing, unreadable, not UTF-8 or malformed: one line, exit 2.
"""

from __future__ import annotations

import io
import sys
from types import SimpleNamespace

import pytest

import decodekit as dk
from decodekit.cli import main
from decodekit.decode.sample import Sample

COMPLETION = SimpleNamespace(text=" hi", token_ids=[1], logprobs=[-0.1], processed_logprobs=[-0.1],
                             top_logprobs=None, finish_reason="stop", stop_reason=None, score=None,
                             usage=SimpleNamespace(prompt_tokens=1, completion_tokens=1))


def run(capsys, *args):
    code = main([*map(str, args)])
    out = capsys.readouterr()
    return code, out.out, out.err


def stdin(monkeypatch, data: bytes) -> None:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(data), encoding="utf-8"))


@pytest.fixture
def prompts(monkeypatch, tiny_lm):
    """The prompts the CLI's sampling run is prepared with (on the tiny model, whatever --model)."""
    seen = []
    monkeypatch.setattr(dk, "load_model", lambda *a, **k: tiny_lm)
    run = SimpleNamespace(completions=lambda: [[COMPLETION]])
    monkeypatch.setattr(Sample, "prepare", lambda self, model, prompts, *a, **k: seen.extend(prompts) or run)
    return seen


def test_the_prompt_from_a_file_a_pipe_or_the_argument_is_the_same(capsys, monkeypatch, tmp_path, prompts):
    text = "ROMEO:\nBut soft — what light?\n"  # exactly as written: the newlines, the UTF-8 dash
    (tmp_path / "p.txt").write_text(text, encoding="utf-8")
    assert run(capsys, "generate", "--prompt-file", tmp_path / "p.txt")[:2] == (0, text + " hi\n")
    stdin(monkeypatch, text.encode())
    assert run(capsys, "generate", "-")[0] == 0
    stdin(monkeypatch, text.encode())
    assert run(capsys, "generate", "--prompt-file", "-")[0] == 0
    assert run(capsys, "generate", text)[0] == 0
    assert prompts == [text] * 4


def test_a_1mb_prompt_goes_through_the_file_whole(capsys, tmp_path, prompts):
    """A megabyte is past what a command line takes ("Argument list too long")."""
    text = "ROMEO: What light through yonder window breaks?\n" * 21_000
    assert len(text.encode()) > 1_000_000
    (tmp_path / "big.txt").write_text(text)
    code, out, err = run(capsys, "generate", "--prompt-file", tmp_path / "big.txt", "--max-new-tokens", 1)
    assert code == 0 and prompts == [text]


def test_a_prompt_file_past_the_models_context_is_one_line(capsys, tmp_path, tiny_llama_dir):
    (tmp_path / "big.txt").write_text("x y z " * 20_000)
    code, out, err = run(capsys, "generate", "--model", tiny_llama_dir, "--prompt-file", tmp_path / "big.txt")
    assert code == 2 and out == "" and err.count("\n") == 1
    assert err.startswith("decodekit generate: error: prompt is longer than the model's context")
    assert "(of 120000 characters)" in err  # the whole file reached the model


def test_an_at_file_prompt_is_text_with_a_warning_when_the_file_exists(capsys, monkeypatch, tmp_path,
                                                                        prompts):
    (tmp_path / "p.txt").write_text("ROMEO:")
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, "generate", "@p.txt")
    assert code == 0 and prompts == ["@p.txt"]
    assert err == ("decodekit generate: warning: the prompt '@p.txt' is taken as text; to read the file, "
                   "give --prompt-file p.txt\n")
    assert run(capsys, "generate", "@someone said")[2] == ""  # no such file: plain text, no warning


@pytest.mark.parametrize("argv, message", [
    (["generate"], "no prompt: give it as an argument ('-': standard input) or with --prompt-file FILE"),
    (["generate", "x", "--prompt-file", "p.txt"],
     "give the prompt as an argument or with --prompt-file, not both (got 'x' and --prompt-file p.txt)"),
])
def test_exactly_one_prompt(capsys, tmp_path, monkeypatch, argv, message):
    (tmp_path / "p.txt").write_text("ROMEO:")
    monkeypatch.chdir(tmp_path)
    code, out, err = run(capsys, *argv)
    assert (code, out, err) == (2, "", f"decodekit generate: error: {message}\n")


# Every flag that reads a file: (command line before the flag, the flag, a file of good type).
FILE_FLAGS = [
    (["generate"], "--prompt-file", "ROMEO:"),
    (["generate", "x"], "--json-schema", '{"type": "string"}'),
    (["generate", "x"], "--grammar", 'start: "a"'),
    (["eval", "perplexity"], "--text", "ROMEO: But soft."),
    (["compress", "shakespeare", "--method", "gptq", "--out", "out"], "--calib-file", "ROMEO: But soft."),
    (["bench", "packed"], "--gguf", "GGUF"),
]


@pytest.mark.parametrize("before, flag, good", FILE_FLAGS, ids=[row[1] for row in FILE_FLAGS])
@pytest.mark.parametrize("problem", ["missing", "directory", "not UTF-8", "unreadable"])
def test_a_file_flag_names_itself_and_the_path(capsys, tmp_path, monkeypatch, before, flag, good, problem):
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "f"
    if problem == "directory":
        path.mkdir()
    elif problem == "not UTF-8":
        if flag == "--gguf":  # read as bytes: its check is the magic number instead
            path.write_bytes(b"\xff\xfe not a model")
        else:
            path.write_bytes(good.encode()[:1] + b"\xff\xfe")
    elif problem == "unreadable":
        if _root():
            pytest.skip("root reads any file")
        path.write_text(good)
        path.chmod(0)
    code, out, err = run(capsys, *before, flag, path)
    expected = {"missing": "no such file", "directory": "is a directory, not a file",
                "not UTF-8": "not UTF-8 text (byte 1 is b'\\xff')",
                "unreadable": "cannot read it (Permission denied)"}
    if flag == "--gguf" and problem == "not UTF-8":
        expected[problem] = "not a GGUF file (it does not start with 'GGUF')"
    command = before[0]
    assert (code, out) == (2, "")
    assert err == f"decodekit {command}: error: {flag} {path}: {expected[problem]}\n"


def _root() -> bool:
    import os

    return hasattr(os, "geteuid") and os.geteuid() == 0


@pytest.mark.parametrize("flag, text, message", [
    ("--json-schema", "{", "JSON schema text is not valid JSON: Expecting property name enclosed in double "
                           "quotes: line 1 column 2 (char 1)"),
    ("--json-schema", '{"type": 5}', "invalid JSON schema: "),
    ("--json-schema", "[1]", "a JSON schema must be a dict (or true/false), got [1]"),
    ("--grammar", "start: foo(", "invalid Lark grammar: "),
    ("--grammar", "   ", "a grammar must be non-empty Lark text"),
])
def test_a_malformed_constraint_file_names_the_flag_and_the_path(capsys, tmp_path, flag, text, message):
    path = tmp_path / "constraint"
    path.write_text(text)
    code, out, err = run(capsys, "generate", "x", flag, path)
    assert (code, out) == (2, "") and err.count("\n") == 1
    assert err.startswith(f"decodekit generate: error: {flag} {path}: {message}")
