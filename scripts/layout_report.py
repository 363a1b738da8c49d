"""Measure the layout rules of docs/design.md on the source tree and print them as JSON.

    python scripts/layout_report.py            # the figures and every offending place
    python scripts/layout_report.py --check    # the same, exit 1 if a rule is broken

What it measures (by reading the code with `ast`, running none of it):
- `whole_config`: the modules that take the whole `AsyncGRPOConfig` (a parameter annotated with it or named `cfg`
  without an annotation, or an attribute `self.cfg`), split into the wiring (WIRING below, where components are
  built from the config) and everything else, which should be handed sections or values instead.
- `section_reads`: parameters annotated with a section (`loss: LossSettings`) that read a key the section does not
  have; such a function could only be called with the whole config.
- `cycles`: import cycles between modules (every import, at the top or inside a function).
- `upward`: imports from a lower layer to a higher one (LAYERS below, top first).
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "src"
PACKAGE = "asyncgrpo"
CONFIG_MODULE = "asyncgrpo.config"

# Where components are built from the whole config (docs/design.md, "Who reads the config"): the entry points,
# which read or build a config (callbacks.py hands it to the user's callbacks as TRL's `args`), and the builders,
# which hand each component its sections.
WIRING = ("asyncgrpo.cli", "asyncgrpo.api", "asyncgrpo.check", "asyncgrpo.demo", "asyncgrpo.demo_agent",
          "asyncgrpo.bench", "asyncgrpo.trainer.callbacks", "asyncgrpo.trainer.recipe", "asyncgrpo.rollout.build",
          "asyncgrpo.rollout.preflight", "asyncgrpo.rollout.side",
          "asyncgrpo.transport.factory", "asyncgrpo.transport.process", "asyncgrpo.transport.remote",
          "asyncgrpo.transport.rollout_server")

# Layers, top first: a module may import its own layer and those below it. Unlisted modules are `shared`.
LAYERS = (
    ("entry", ("asyncgrpo", "asyncgrpo.__main__", "asyncgrpo.cli", "asyncgrpo.api", "asyncgrpo.check",
               "asyncgrpo.demo", "asyncgrpo.demo_agent", "asyncgrpo.bench")),
    ("trainer", ("asyncgrpo.trainer",)),
    ("transport", ("asyncgrpo.transport",)),
    ("rollout", ("asyncgrpo.rollout",)),
    ("inference", ("asyncgrpo.inference", "asyncgrpo.inference_node")),
    ("shared", ()),
)


def module_name(path: Path) -> str:
    name = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return name.removesuffix(".__init__")


def under(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def layer(module: str) -> int:
    """The index of the module's layer in LAYERS (0 is the top); the package itself is the top (its lazy API)."""
    best = len(LAYERS) - 1
    for index, (_, prefixes) in enumerate(LAYERS):
        if any(module == p for p in prefixes) or under(module, [p for p in prefixes if p != PACKAGE]):
            return index
    return best


def imports(tree: ast.Module, modules: set[str]) -> set[str]:
    """The project's modules this module imports (`from asyncgrpo import x` names module x when x is one)."""
    found = set()
    for node in ast.walk(tree):
        if (isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                and node.module.split(".")[0] == PACKAGE):
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                found.add(sub if sub in modules else node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name.split(".")[0] == PACKAGE)
    return found & modules


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm, iterative)."""
    index, low, on_stack, stack, found, counter = {}, {}, set(), [], [], [0]

    def visit(start: str) -> None:
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter[0]
        counter[0] += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        top = stack.pop()
                        on_stack.discard(top)
                        component.append(top)
                        if top == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
            elif child not in index:
                index[child] = low[child] = counter[0]
                counter[0] += 1
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def section_keys() -> dict[str, set[str]]:
    """Each section class of config.py and the names it has (fields, properties, methods)."""
    sys.path.insert(0, str(ROOT))
    from asyncgrpo import config  # noqa: PLC0415 - only this script's section check needs the classes

    keys = {}
    for section in config.SECTIONS:
        names = {f.name for f in dataclasses.fields(section)} | {n for n in dir(section) if not n.startswith("__")}
        keys[section.__name__] = names
    return keys


def annotation_names(node: ast.expr | None) -> set[str]:
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        node = ast.parse(node.value, mode="eval").body
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def protocol_keys(tree: ast.Module) -> dict[str, set[str]]:
    """The module's `typing.Protocol` classes and the names each declares: a component's own list of the few
    config keys it reads, which the whole config meets without being named."""
    found = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and any(annotation_names(b) & {"Protocol"} for b in node.bases):
            found[node.name] = {n.target.id for n in node.body if isinstance(n, ast.AnnAssign)
                                and isinstance(n.target, ast.Name)} | {
                n.name for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return found


def whole(annotation: ast.expr | None, name: str) -> bool:
    """A parameter or field holds the whole config: annotated with it, or an unannotated (or `object`) `cfg`."""
    names = annotation_names(annotation)
    return "AsyncGRPOConfig" in names or (name == "cfg" and names <= {"object", "Any"})


def typed_attribute_reads(init: ast.FunctionDef, kinds: dict[str, set[str]]) -> list[str]:
    """In a class whose `__init__` keeps a typed parameter (`self.cfg = cfg`, `cfg: EpisodeSettings`), the reads
    `self.cfg.key` anywhere in the class of keys that type lacks."""
    if init.name != "__init__" or not hasattr(init, "parent_class"):
        return []
    typed = {a.arg: annotation_names(a.annotation) & kinds.keys() for a in init.args.args + init.args.kwonlyargs}
    kept = {t.attr: typed[n.value.id] for n in ast.walk(init) if isinstance(n, ast.Assign)
            and isinstance(n.value, ast.Name) and typed.get(n.value.id)
            for t in n.targets
            if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self"}
    strays = []
    for attr, types_ in kept.items():
        allowed = set().union(*(kinds[k] for k in types_))
        strays += [f"{init.parent_class}.self.{attr}.{n.attr}" for n in ast.walk(init.parent_class_node)
                   if isinstance(n, ast.Attribute) and is_self_attr(n.value, attr) and n.attr not in allowed]
        for fn in ast.walk(init.parent_class_node):  # `cfg = self.cfg`, then `cfg.key`
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                aliases = {t.id for n in ast.walk(fn) if isinstance(n, ast.Assign) and is_self_attr(n.value, attr)
                           for t in n.targets if isinstance(t, ast.Name)}
                strays += [f"{init.parent_class}.{fn.name}.{n.value.id}.{n.attr}" for n in ast.walk(fn)
                           if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name)
                           and n.value.id in aliases and n.attr not in allowed]
    return strays


def is_self_attr(node: ast.expr, attr: str) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == attr and isinstance(node.value, ast.Name)
            and node.value.id == "self")


def config_takers(tree: ast.Module, sections: dict[str, set[str]]) -> tuple[list[str], list[str]]:
    """The places of a module that take the whole config, and the parameters typed by a section or a protocol of
    keys that read a key their type lacks (`function.param.key`)."""
    kinds = {**sections, **protocol_keys(tree)}
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef):
            for fn in cls.body:
                if isinstance(fn, ast.FunctionDef):
                    fn.parent_class, fn.parent_class_node = cls.name, cls
    takers, strays = [], []
    for cls in ast.walk(tree):
        if isinstance(cls, ast.ClassDef):
            takers += [f"{cls.name}.{n.target.id}" for n in cls.body if isinstance(n, ast.AnnAssign)
                       and isinstance(n.target, ast.Name) and whole(n.annotation, n.target.id)]
    for fn in ast.walk(tree):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        for arg in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs:
            if whole(arg.annotation, arg.arg):
                takers.append(f"{fn.name}({arg.arg})")
            typed = annotation_names(arg.annotation) & kinds.keys()
            if typed:
                allowed = set().union(*(kinds[k] for k in typed))
                strays += [f"{fn.name}.{arg.arg}.{node.attr}" for node in ast.walk(fn)
                           if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                           and node.value.id == arg.arg and node.attr not in allowed]
        strays += typed_attribute_reads(fn, kinds)
        for node in ast.walk(fn):
            if (isinstance(node, ast.Assign) and any(isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                                                     and t.value.id == "self" and t.attr in ("cfg", "config")
                                                     for t in node.targets)
                    and isinstance(node.value, ast.Name) and node.value.id in ("cfg", "config")
                    and any(whole(a.annotation, a.arg) for a in fn.args.args + fn.args.kwonlyargs
                            if a.arg == node.value.id)):
                takers.append(f"{fn.name}(self.{node.value.id})")
    return sorted(set(takers)), sorted(set(strays))


def composite_keys(trees: dict[str, ast.Module], sections: dict[str, set[str]]) -> dict[str, set[str]]:
    """The sections of config.py and the classes composed of them anywhere (`class LossSpecSettings(LossSettings,
    GenerationSettings)`: a component's own list of the sections it reads), each with the names it has."""
    kinds = dict(sections)
    classes = [node for tree in trees.values() for node in ast.walk(tree) if isinstance(node, ast.ClassDef)]
    grown = True
    while grown:
        grown = False
        for cls in classes:
            bases = {b.id for b in cls.bases if isinstance(b, ast.Name)} & kinds.keys()
            if bases and cls.name not in kinds:
                own = {n.name for n in cls.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
                kinds[cls.name] = set().union(*(kinds[b] for b in bases)) | own
                grown = True
    return kinds


def report() -> dict:
    paths = sorted(ROOT.rglob("*.py"))
    trees = {module_name(p): ast.parse(p.read_text(), str(p)) for p in paths}
    modules = set(trees)
    graph = {m: imports(t, modules) - {m} for m, t in trees.items()}
    sections = composite_keys(trees, section_keys())
    wiring, elsewhere, strays = {}, {}, {}
    for module, tree in sorted(trees.items()):
        if module == CONFIG_MODULE:
            continue
        whole, stray = config_takers(tree, sections)
        if whole:
            (wiring if under(module, WIRING) else elsewhere)[module] = whole
        if stray:
            strays[module] = stray
    upward = sorted(f"{a} -> {b}" for a, targets in graph.items() for b in targets if layer(b) < layer(a))
    found = cycles(graph)
    return {
        "modules": len(modules),
        "whole_config_files": len(wiring) + len(elsewhere),
        "whole_config_outside_wiring": len(elsewhere),
        "outside_wiring": elsewhere,
        "wiring": wiring,
        "section_reads_outside_section": strays,
        "import_cycles": found,
        "upward_imports": upward,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a rule is broken")
    parser.add_argument("--src", type=Path, default=None, help="the src folder to measure (another checkout's)")
    args = parser.parse_args(argv)
    global ROOT
    ROOT = args.src.resolve() if args.src else ROOT
    result = report()
    print(json.dumps(result, indent=2))
    broken = (result["outside_wiring"] or result["section_reads_outside_section"] or result["import_cycles"]
              or result["upward_imports"])
    return 1 if args.check and broken else 0


if __name__ == "__main__":
    sys.exit(main())
