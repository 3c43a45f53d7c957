"""Issue 26's start-up check: `decodekit generate "ROMEO:" --max-new-tokens 8` before and after
a change, and `python -c "import torch"`, in fresh processes run in interleaved rounds (so a
change of load on the shared machine moves all alike), by bench/startup.py's `run_once` (the
child's user + system CPU and its wall time; bytecode caching on, one warm-up run each).

    PYTHONPATH=src python benchmarks/startup_ab.py BEFORE_REV [--repeats 9]

BEFORE_REV's `src/` is extracted with `git archive` into a temporary directory; "after" is the
`src/` beside this script. Prints one JSON document: the median and every run of each.
"""

from __future__ import annotations

import argparse
import io
import json
import statistics
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from decodekit.bench.startup import child_environment, run_once

ROOT = Path(__file__).resolve().parents[1]
HELLO = ["-m", "decodekit.cli", "generate", "ROMEO:", "--max-new-tokens", "8"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("before", help="the git revision to compare with")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", args.before, "src"], capture_output=True,
                             check=True).stdout  # fmt: skip
    with tempfile.TemporaryDirectory(prefix="decodekit-before-") as folder:
        with tarfile.open(fileobj=io.BytesIO(archive)) as tar:
            tar.extractall(folder, filter="data")
        sides = {"before": Path(folder) / "src", "after": ROOT / "src"}
        commands = {"import_torch": ([sys.executable, "-c", "import torch"], child_environment())}
        for side, src in sides.items():
            env = {**child_environment(), "PYTHONPATH": str(src)}
            commands[f"hello_{side}"] = ([sys.executable, *HELLO], env)
        for command, env in commands.values():
            run_once(command, env)  # warm-up: bytecode written, files in the page cache
        runs: dict[str, list[dict]] = {name: [] for name in commands}
        for _ in range(args.repeats):
            for name, (command, env) in commands.items():
                runs[name].append(run_once(command, env))
    out = {"before": args.before, "repeats": args.repeats}
    for name, done in runs.items():
        cpu, wall = [r["cpu_s"] for r in done], [r["wall_s"] for r in done]
        out[name] = {"cpu_s": round(statistics.median(cpu), 3), "wall_s": round(statistics.median(wall), 3),
                     "cpu_s_runs": [round(c, 3) for c in cpu], "wall_s_runs": [round(w, 3) for w in wall]}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
