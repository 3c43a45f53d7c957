"""`decodekit serve`'s start-up contract (issue 26): --port is validated (0 picks a free port and
prints it), each served model's id and source are logged, and a directory's full path is
accepted as its model id."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import httpx
import pytest

from decodekit.cli import main
from serving import served

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("port", ["99999", "70000", "-1", "http", "1.5"])
def test_a_bad_port_exits_nonzero_with_one_line(capsys, port):
    with pytest.raises(SystemExit) as stopped:
        main(["serve", "--port", port])
    err = capsys.readouterr().err
    assert stopped.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert f"must be a port number in 1-65535 (0: any free port), got {port!r}" in err


@pytest.mark.parametrize("gib", ["0", "-2", "nan"])
def test_a_bad_kv_bound_exits_nonzero_with_one_line(capsys, gib):
    code = main(["serve", "--kv-gib", gib])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1 and "Traceback" not in err
    assert "--kv-gib must be a number of GiB > 0, got" in err


def test_port_0_serves_on_the_printed_port_under_the_full_path_too(tiny_llama_dir):
    """The served directory answers by its name and by its full path (/v1/models and completions);
    the start-up log names both and the port uvicorn picked."""
    pytest.importorskip("uvicorn")
    full = str(Path(tiny_llama_dir).resolve())
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src"), "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "decodekit.cli", "serve", "--model", full, "--port", "0",
               "--threads", "1"]
    with served(command, env) as (port, log):
        assert port != 0
        name = Path(full).name
        assert f"decodekit serve: model {name!r} from {full} (also as {full!r})\n" in log
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/v1/models/{full}").json()["id"] == name
        for model in (name, full):
            body = {"model": model, "prompt": "ab", "max_tokens": 2}
            answer = httpx.post(f"{url}/v1/completions", json=body, timeout=60)
            assert answer.status_code == 200 and answer.json()["model"] == name, answer.text
