"""The fault soak (bench/soak.py): mixed requests on one engine with failing steps; every
request that did not fail equals its fresh-engine output, and the pools end idle."""

from __future__ import annotations

import json

import pytest
import torch

from decodekit.bench.soak import KINDS, Soak, run_soak
from decodekit.cli import main
from decodekit.engine.block_pool import BlockManager
from decodekit.models.registry import load_model

pytest.importorskip("llguidance")  # the constrained request


@pytest.fixture(scope="module")
def soak():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    target, draft = (load_model(name, backend="native") for name in ("shakespeare", "shakespeare-draft"))
    target.batch_invariant = draft.batch_invariant = True
    prompts = ["ROMEO:\nBut soft, what light through yonder window breaks? It is the east, and",
               "JULIET:\nO Romeo, Romeo, wherefore art thou Romeo? Deny thy father and refuse"]
    yield Soak(target, draft, draft, prompts, new_tokens=8)
    torch.set_num_threads(threads)


def test_mixed_requests_under_faults_equal_their_fresh_runs(soak):
    result = run_soak(soak, requests=48, concurrency=16, fail_p=0.1, seed=3)
    assert result["failed_steps"] >= 1 and result["failed_requests"] >= 1  # faults happened
    assert result["completed_requests"] >= 8
    assert result["mismatched_requests"] == 0
    assert result["idle"] and result["members"] <= 3  # own, draft (also amateur), self-int4


def test_the_soak_catches_a_step_that_registers_what_it_never_wrote(soak, monkeypatch):
    """Without the rollback (block_pool.py) the failed programs' reserved blocks reach the prefix cache,
    and later requests with the same prompt read them: the soak must see it. At 8 requests at a
    time: at 24, since the speculation gate counts the batch (speculation_gate.py: the self-int4
    rows mostly decode plainly there), seeds 0-13 showed no mismatch, where seeds 2 and 3 did
    before; at 8, seed 1 shows 4 in repeated runs (the gate reads the clock)."""
    monkeypatch.setattr(BlockManager, "rollback", lambda self: setattr(self.pool, "journal", {}))
    result = run_soak(soak, requests=120, concurrency=8, fail_p=0.1, seed=1)
    assert result["mismatched_requests"] >= 1


def test_bench_soak_command_prints_json(capsys):
    code = main(["bench", "soak", "--requests", "6", "--clients", "3", "--new-tokens", "4", "--json"])
    assert code in (0, None)
    result = json.loads(capsys.readouterr().out)
    assert result["requests"] == 6 and result["kinds"] == list(KINDS) and result["mismatched_requests"] == 0
    assert main(["bench", "soak", "--fail-p", "1.5"]) == 2
