"""The README is a front door that fits on a screen, and every page behind it is reachable: its length, its opening
commands (the ones CI runs), the files its architecture map names, and every relative link and #anchor of README.md
and docs/*.md."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
PAGES = [README, *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")  # [text](target) and ![alt](target)


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped (not `-` or `_`), spaces to `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)  # a `# comment` in a code block is no heading
    return {_slug(m.group(1)) for m in re.finditer(r"^#{1,6} (.+)$", text, re.M)}


def _relative_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return [t for t in LINK.findall(text) if not re.match(r"[a-z]+:", t)]  # http(s):, mailto: are not checked


def test_the_readme_fits_on_a_screen():
    lines = README.read_text().splitlines()
    assert len(lines) <= 250, f"README.md has {len(lines)} lines: move reference text to docs/ and link it"


def test_the_readme_opens_with_the_two_commands_ci_runs_the_test_one():
    first_block = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines()]
    assert commands == ["make demo", "make test"]
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    assert "make test" in [line.strip() for line in ci]  # CI runs the README's test command as written


def test_every_relative_link_and_anchor_of_the_readme_and_docs_resolves():
    broken = []
    for page in PAGES:
        for target in _relative_links(page):
            path, _, anchor = target.partition("#")
            dest = (page.parent / path).resolve() if path else page
            if not dest.exists():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken


def test_the_readme_links_every_docs_page():
    linked = {(ROOT / t.partition("#")[0]).resolve() for t in _relative_links(README)}
    missing = [p.name for p in PAGES[1:] if p.resolve() not in linked]
    assert not missing, f"docs pages the README does not link: {missing}"


def test_the_readme_single_node_commands_are_those_of_docs_running():
    readme = README.read_text().split("## Running it yourself", 1)[1].split("\n## ", 1)[0]
    commands = [line for block in re.findall(r"```bash\n(.*?)```", readme, re.S) for line in block.splitlines()]
    running = (ROOT / "docs" / "running.md").read_text()
    assert len(commands) == 4  # build the toy world, start its server, the accelerate launch (two lines)
    assert all(line in running for line in commands), [line for line in commands if line not in running]


def test_the_readme_map_names_only_files_that_exist():
    # A name with a slash is from the repository root; a bare name sits beside the path named before it in its cell.
    section = README.read_text().split("## Architecture map", 1)[1].split("\n## ", 1)[0]
    missing = []
    for row in (line for line in section.splitlines() if line.startswith("| `")):
        folder = ROOT
        for name in re.findall(r"`([^`]+)`", row.split("|")[1]):
            path = ROOT / name if "/" in name else folder / name
            folder = path.parent
            if not path.exists():
                missing.append(name)
    assert not missing, f"README.md's architecture map names files that do not exist: {missing}"
