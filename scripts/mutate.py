"""`make mutate`: mutation testing of the core rules (pyproject.toml [tool.mutmut] lists the files) against the unit tests.

Runs mutmut ([tool.mutmut] in pyproject.toml) and prints one JSON line: mutants killed, survived or timed out, per
module, and the survivors by name (`mutmut show NAME` prints the diff). Not part of CI; docs/testing.md: the figure.

    python scripts/mutate.py                                  # every mutant
    python scripts/mutate.py "asyncgrpo.trainer.loss.*"       # only these mutants (mutmut's name patterns)
    python scripts/mutate.py --report                         # only summarise the results of the last run
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run_mutmut(patterns: list[str], children: int) -> None:
    # A fresh copy each time: mutmut keeps results of unchanged functions, but a test changed since is not seen.
    shutil.rmtree(REPO / "mutants", ignore_errors=True)
    cmd = [sys.executable, "-m", "mutmut", "run", "--max-children", str(children), *patterns]
    # Tests that launch `python -m asyncgrpo ...` in a subprocess import the mutated copy too (mutmut puts it on
    # sys.path only in its own processes), also where asyncgrpo is not installed in the running interpreter.
    # The folder exists before mutmut starts: Python remembers a path entry missing at its first import as unusable.
    (REPO / "mutants" / "src").mkdir(parents=True)
    paths = [str(REPO / "mutants" / "src"), *filter(None, [os.environ.get("PYTHONPATH")])]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(paths)}
    proc = subprocess.run(cmd, cwd=REPO, env=env, stdout=subprocess.DEVNULL)  # its progress line redraws: too long
    if proc.returncode != 0:
        sys.exit(f"mutate: `{' '.join(cmd)}` exited with {proc.returncode} (run it by hand to see why)")


def summarise(wall_s: float | None) -> dict:
    # optional extra: mutmut comes with `.[mutate]`, which `make mutate` installs just before running this
    from mutmut import __version__
    from mutmut.stats import status_by_exit_code

    counts: Counter[str] = Counter()
    modules: dict[str, dict[str, int]] = {}
    survivors: list[str] = []
    for meta in sorted((REPO / "mutants" / "src").rglob("*.py.meta")):
        module = str(meta.relative_to(REPO / "mutants" / "src"))[: -len(".meta")]
        per_module: Counter[str] = Counter()
        for name, code in json.loads(meta.read_text())["exit_code_by_key"].items():
            status = status_by_exit_code[code].replace(" ", "_")
            if status == "not_checked":
                continue  # outside the patterns of this run
            per_module[status] += 1
            if status != "killed":
                survivors.append(f"{name}: {status}")
        if per_module:
            modules[module] = dict(per_module)
            counts.update(per_module)
    tested = sum(counts.values())
    return {"tool": f"mutmut {__version__}", "killed": counts["killed"], "survived": counts["survived"],
            "timeout": counts["timeout"], "no_tests": counts["no_tests"],
            "other": tested - counts["killed"] - counts["survived"] - counts["timeout"] - counts["no_tests"],
            "total": tested, "killed_fraction": round(counts["killed"] / tested, 4) if tested else None,
            "wall_s": None if wall_s is None else round(wall_s, 1), "modules": modules, "not_killed": survivors}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("patterns", nargs="*", help="mutant name patterns (default: every mutant)")
    # 4 on 2 cores: many of a mutant's tests wait (on threads, sockets, spawned processes) rather than compute.
    parser.add_argument("--children", type=int, default=4, help="mutants tested at once (default 4)")
    parser.add_argument("--report", action="store_true", help="summarise the last run without running again")
    args = parser.parse_args()
    wall_s = None
    if not args.report:
        t0 = time.monotonic()
        run_mutmut(args.patterns, args.children)
        wall_s = time.monotonic() - t0
    print(json.dumps(summarise(wall_s)))


if __name__ == "__main__":
    main()
