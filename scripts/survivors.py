"""Write docs/mutation-survivors.md from the last `make mutate` run: every mutant not killed, its line, its reason.

A reason carries over when the same function (in its module, or moved to another) has a mutant with the same
changed line (mutant numbers move whenever a function changes); a mutant with none is listed as `REASON NEEDED`
and the script exits 1, so that new survivors are not published unexplained. New reasons come from `--reasons` or are written into the page by hand.

    python scripts/mutate.py --report > /tmp/mutate.json
    python scripts/survivors.py /tmp/mutate.json [--reasons more.tsv]   # more.tsv: NAME<TAB>reason per line
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "mutation-survivors.md"
WIDTH = 100  # characters of a changed line shown
HEADER = ("# Mutants not killed\n\nEvery mutant the last full `make mutate` run did not kill (`mutmut show "
          "asyncgrpo.MODULE.x_FUNCTION__mutmut_N` prints its diff), with the reason it stays; "
          "[testing.md](testing.md#mutation-testing-make-mutate) has the figure and the reasons grouped.\n")
ENTRY = re.compile(r"^- (\d+) \((\w+)\): `(.*)` -> `(.*)` — (.*)$")
HEADING = re.compile(r"^## `([\w.]+)` `([\w.]+)`$")


def split_name(name: str) -> tuple[str, str, int]:
    """`asyncgrpo.mod.xǁClassǁmethod__mutmut_7` -> ("asyncgrpo.mod", "Class.method", 7)."""
    module, _, rest = name.partition(".x")
    while not rest.startswith(("ǁ", "_")):  # a dot in the module path, not the function's `x` prefix
        head, _, rest = rest.partition(".x")
        module = f"{module}.x{head}"
    function, _, number = rest.rpartition("__mutmut_")
    # `xǁClassǁmethod` is a method, `x_name` a function (`x__name` when the name has its own underscore)
    function = function.strip("ǁ").replace("ǁ", ".") if function.startswith("ǁ") else function[1:]
    return module, function, int(number)


def changed_line(mutants_src: Path, name: str) -> tuple[str, str]:
    """The first line that differs between the mutant's function and the original, both stripped."""
    module, _, _ = split_name(name)
    path = mutants_src / (module.replace(".", "/") + ".py")
    source = path.read_text()
    defs = {node.name: node for node in ast.walk(ast.parse(source)) if isinstance(node, ast.FunctionDef)}
    leaf = name[len(module) + 1:]
    original = defs[re.sub(r"__mutmut_\d+$", "__mutmut_orig", leaf)]
    mutant = defs[leaf]
    lines = source.splitlines()
    short = split_name(name)[1].rpartition(".")[2]  # the def lines name the copies: show the function's own name
    before = [lines[original.lineno - 1].replace(original.name, short), *lines[original.lineno:original.end_lineno]]
    after = [lines[mutant.lineno - 1].replace(mutant.name, short), *lines[mutant.lineno:mutant.end_lineno]]
    for old, new in zip(before, after):
        if old != new:
            return old.strip(), new.strip()
    if len(before) != len(after):  # a removed or added line
        extra = (before[len(after):] or after[len(before):])[0].strip()
        return (extra, "") if len(before) > len(after) else ("", extra)
    return "", ""


def old_reasons() -> dict[tuple[str, str, str, str], str]:
    """(module, function, old line, new line) -> reason, from the page as it stands."""
    reasons: dict[tuple[str, str, str, str], str] = {}
    module = function = ""
    for line in PAGE.read_text().splitlines() if PAGE.exists() else []:
        if m := HEADING.match(line):
            module, function = m.groups()
        elif m := ENTRY.match(line):
            reasons[(module, function, m.group(3), m.group(4))] = m.group(5)
    return reasons


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("report", help="the JSON line scripts/mutate.py printed")
    parser.add_argument("--reasons", help="a file of NAME<TAB>reason lines for mutants the page has no reason for")
    args = parser.parse_args()
    report = json.loads(Path(args.report).read_text())
    given = {}
    if args.reasons:
        for line in Path(args.reasons).read_text().splitlines():
            if line.strip():
                name, _, reason = line.partition("\t")
                given[name.strip()] = reason.strip()
    reasons = old_reasons()
    # A function moved to another module keeps its reasons: the same function and the same changed line.
    moved = {(function, old, new): reason for (_, function, old, new), reason in reasons.items()}
    mutants_src = REPO / "mutants" / "src"
    sections: dict[tuple[str, str], list[tuple[int, str]]] = {}
    missing = 0
    for entry in report["not_killed"]:
        name, _, status = entry.rpartition(": ")
        module, function, number = split_name(name)
        old, new = changed_line(mutants_src, name)
        old, new = old[:WIDTH], new[:WIDTH]
        reason = given.get(name) or reasons.get((module, function, old, new)) or moved.get((function, old, new))
        if reason is None:
            reason, missing = "REASON NEEDED", missing + 1
        sections.setdefault((module, function), []).append(
            (number, f"- {number} ({status}): `{old}` -> `{new}` — {reason}"))
    out = [HEADER]
    for (module, function), entries in sorted(sections.items(), key=lambda kv: (kv[0][0], "." in kv[0][1], kv[0][1])):
        out.append(f"## `{module}` `{function}`\n")
        out.extend(line for _, line in sorted(entries))
        out.append("")
    PAGE.write_text("\n".join(out))
    print(f"{sum(len(v) for v in sections.values())} mutants written to {PAGE.relative_to(REPO)}; {missing} without "
          f"a reason", file=sys.stderr)
    sys.exit(1 if missing else 0)


if __name__ == "__main__":
    main()
