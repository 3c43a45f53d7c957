"""The README's and the documentation pages' examples run verbatim and do what their text
says (issue 13, "Done when"; issue 35: each block runs alone or says it continues).

The `bash` blocks' commands run through the environment's `decodekit` from the checkout's
root. Each Python block runs in a fresh interpreter, together with the blocks before it on the
same page that it continues: a block whose first line is a comment starting with
"# (continues" runs after the block above it (and that block's own predecessors), any other
block runs alone. The server examples (the `openai` snippets and `eval arith --endpoint`) run
against the README's `decodekit serve` command on a free port instead of 8000. The commands
too long for a test are listed in LONG with the reason; a command that is neither run nor
listed fails the test, so no page can gain an example that nothing runs.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# The README, then every page of the documentation site that holds examples.
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
CONTINUES = "# (continues"
BIN = Path(sys.executable).parent  # the environment's bin/: `decodekit` lives beside python

# Prefix of a command of the pages -> why the test does not run it.
LONG = {
    "bash scripts/setup.sh": "builds the environment: CI runs command 2 (.ci/run) on every submission",
    "decodekit eval arith --strategies": "about 35 s (2 seeds x 3 strategies x 50 problems); "
    "tests/meta/test_evaluate.py runs the same code on a small budget",
    "decodekit eval arith --model arith-small": "about 9 minutes (3 sizes x 2 seeds x 100 problems, "
    "REBASE at every N to 64); tests/scripts/test_train_arith_smoke.py runs the same command on "
    "two tiny sizes",
    "decodekit eval perplexity": "about 20 s over the 75k held-out tokens; "
    "tests/compress/test_cli_compress.py runs the command on a short text",
    "decodekit eval alignment": "3.5 minutes (4,096 base samples, two value trainings, a dozen decoding "
    "runs); tests/align/test_frontier.py runs the same code on a tiny configuration",
    "decodekit compress": "GPTQ calibration, about 20 s; tests/compress/test_cli_compress.py "
    "compresses a tiny checkpoint through the same command",
    "decodekit bench": "a benchmark: half a minute (decode) to minutes (the others) by design",
    "decodekit serve --model shakespeare --port": "the Server section's serve command (a superset) "
    "runs in test_server_examples",
    "pip install '.[all]'": "installs decodekit into the environment: tests/test_install.py builds the "
    "wheel and installs it into a temporary venv",
    "mkdocs build": "builds the documentation site, 20-40 s: tests/test_docs.py runs it",
}
SERVER = "decodekit serve --model shakespeare --model shakespeare-draft --model arith --port 8000"
ENDPOINT = "decodekit eval arith --endpoint http://127.0.0.1:8000/v1"


def blocks(language: str, page: Path | None = None) -> list[str]:
    """The `language` blocks of `page`, or of every page in PAGES' order."""
    pages = [page] if page else PAGES
    return [block for p in pages for block in re.findall(rf"```{language}\n(.*?)```", p.read_text(),
                                                         flags=re.DOTALL)]


def commands() -> list[str]:
    """Every command line of the pages' bash blocks (comment-only and blank lines dropped), each
    once."""
    lines = [line.strip() for block in blocks("bash") for line in block.splitlines()]
    return list(dict.fromkeys(line for line in lines if line and not line.startswith("#")))


def scripts() -> list[tuple[str, str]]:
    """(name, source) of every Python script the pages hold: a block with the blocks above it
    that it continues; the openai snippets are test_server_examples'."""
    found = []
    for page in PAGES:
        chain: list[str] = []
        scripts_of_page = []
        for number, block in enumerate(blocks("python", page), start=1):
            chain = [*chain, block] if block.lstrip().startswith(CONTINUES) else [block]
            if "from openai import" not in block:
                scripts_of_page.append((f"{page.relative_to(ROOT)}:{number}", "\n".join(chain)))
        # A block continued by the next one runs inside that one's script too; run each once.
        found += [(name, source) for name, source in scripts_of_page
                  if not any(other.startswith(source + "\n") for _, other in scripts_of_page)]
    return found


def environment() -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}", "OMP_NUM_THREADS": "1"}


def shell(command: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", "-c", command], cwd=ROOT, env=environment(), capture_output=True,
                          text=True, timeout=timeout)


def json_lines(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines()]


def check_json_schema(out, err):
    text = out.removeprefix("Data: ").strip()
    assert set(json.loads(text)) == {"speaker", "age", "mood"}  # complete, valid JSON
    return "incomplete" not in err


# Prefix of a command run by test_command -> what its output must show (the README's claims).
CHECKS = {
    "decodekit models": lambda out, err: all(m in out for m in ("shakespeare", "arith")),
    "decodekit generate \"ROMEO:\" --temperature": lambda out, err: len(json_lines(out)) == 3,
    "decodekit generate \"ROMEO:\" --stream --stop": lambda out, err: "\n\n" not in out.rstrip("\n"),
    "decodekit generate \"ROMEO:\" --strategy beam": lambda out, err: out.count("--- sample") == 3,
    "decodekit generate \"Data: \" --json-schema": check_json_schema,
    "decodekit generate \"ROMEO:\" --draft-model": lambda out, err: "acceptance" in err,
    "decodekit align bon": lambda out, err: "win rate" in out,
}


def runnable() -> list[str]:
    skipped = tuple(LONG) + (SERVER, ENDPOINT)
    return [c for c in commands() if not c.startswith(skipped)]


def test_every_command_is_run_or_listed_as_long():
    listed = [prefix for prefix in LONG if not any(c.startswith(prefix) for c in commands())]
    assert not listed, f"LONG names commands the pages no longer have: {listed}"
    assert any(c.startswith(SERVER) for c in commands()) and any(c.startswith(ENDPOINT) for c in commands())
    assert len(runnable()) >= 8


# The commands and scripts are each a fresh interpreter that spends seconds importing torch on
# one thread (OMP_NUM_THREADS=1): two run at once, so on the suite's two cores this file takes
# half the wall time. Each test still checks its own process's result.
WORKERS = 2


@pytest.fixture(scope="module")
def runs(request):
    """Key -> future of the subprocess run of every command and script selected in this module,
    started on first use, `WORKERS` at a time, in the tests' order."""
    jobs = {}
    for item in request.session.items:
        params = getattr(item, "callspec", None) and item.callspec.params
        if item.module is not request.module or not params:
            continue
        if "command" in params:
            jobs[params["command"]] = (shell, params["command"])
        elif "source" in params:
            jobs[params["name"]] = (run_script, params["source"])
    with concurrent.futures.ThreadPoolExecutor(max_workers=WORKERS) as pool:
        futures = {key: pool.submit(*job) for key, job in jobs.items()}
        yield futures
        pool.shutdown(cancel_futures=True)


@pytest.mark.parametrize("command", runnable())
def test_command(command, runs):
    result = runs[command].result()
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "Loading weights" not in result.stderr
    assert "is deprecated" not in result.stderr  # the README speaks the current vocabulary
    if command.startswith("decodekit generate") and "--chat" in command:  # the reply alone, not the prompt
        assert result.stdout.strip()
    elif command.startswith("decodekit generate") and "--json" not in command:
        prompt = re.match(r'decodekit generate "([^"]*)"', command).group(1)
        assert result.stdout.startswith(prompt) or result.stdout.startswith("--- sample 0")
    for prefix, check in CHECKS.items():
        if command.startswith(prefix):
            assert check(result.stdout, result.stderr), (result.stdout, result.stderr)


def test_continued_blocks_say_so():
    """A page's first Python block cannot continue anything, and every script of the README
    runs alone: it is what a newcomer copies."""
    for page in PAGES:
        first = next(iter(blocks("python", page)), "")
        assert not first.lstrip().startswith(CONTINUES), page
    assert not any(CONTINUES in block for block in blocks("python", README))
    assert len(scripts()) >= 8


def run_script(source: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", source], cwd=ROOT, env=environment(),
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("name, source", scripts(), ids=[name for name, _ in scripts()])
def test_python_block(name, source, runs):
    """Each script in a fresh interpreter; the JSON-schema examples print valid, finished JSON."""
    result = runs[name].result()
    assert result.returncode == 0, result.stderr
    if "dk.JsonSchema(" in source:  # print(c.text, c.finish_reason) of a JSON-schema example
        [(text, reason)] = re.findall(r'^(\{"speaker".*\}) (\w+)$', result.stdout, flags=re.MULTILINE)
        assert set(json.loads(text)) == {"speaker", "age", "mood"} and reason == "stop"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_server_examples():
    """The README's `decodekit serve` (on a free port), then every openai snippet and
    `eval arith --endpoint` against it."""
    [serve] = [c for c in commands() if c.startswith(SERVER)]
    [endpoint] = [c for c in commands() if c.startswith(ENDPOINT)]
    clients = list(dict.fromkeys(block for block in blocks("python") if "from openai import" in block))
    assert clients
    port = free_port()
    server = subprocess.Popen(["bash", "-c", "exec " + serve.replace("--port 8000", f"--port {port}")],
                              cwd=ROOT, env=environment(), stdout=subprocess.DEVNULL,
                              stderr=subprocess.PIPE, text=True)
    try:
        wait_for(f"http://127.0.0.1:{port}/health", server, seconds=90)
        for client in clients:
            result = subprocess.run([sys.executable, "-c", client.replace(":8000/", f":{port}/")], cwd=ROOT,
                                    env=environment(), capture_output=True, text=True, timeout=60)
            assert result.returncode == 0, result.stderr
            assert result.stdout.strip()
        result = shell(endpoint.replace(":8000/", f":{port}/"))
        assert result.returncode == 0, result.stderr
        assert "accuracy" in result.stdout
    finally:
        server.terminate()
        server.wait(timeout=30)


def wait_for(url: str, server: subprocess.Popen, seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise AssertionError(f"the server exited: {server.stderr.read()}")
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                if response.status == 200:
                    return
        except OSError:
            time.sleep(0.3)
    raise AssertionError(f"no answer from {url} in {seconds} s")


def test_setup_installs_what_the_readme_says():
    import tomllib

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["all"] == ["decodekit[constrained,server,eval,openai,gguf]"]
    assert "decodekit[all,train]" in extras["dev"]
    assert "extras=${1:-all}" in (ROOT / "scripts" / "setup.sh").read_text()  # command 1 installs [all]
    for package in ("llguidance", "fastapi", "uvicorn", "httpx", "matplotlib", "sacrebleu", "openai", "gguf"):
        assert f"`{package}`" in README.read_text()
        assert any(dep.startswith(package) for name in ("constrained", "server", "eval", "openai", "gguf")
                   for dep in extras[name])
