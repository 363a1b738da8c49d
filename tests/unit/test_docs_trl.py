"""What the docs and the shipped configs say about TRL and about metric names is true: no page promises that a TRL
YAML runs unchanged, TRL's defaults are quoted as TRL has them, and a metric a config comment names is one that is
logged (docs/metrics.md)."""

import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PAGES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def test_no_page_promises_that_a_trl_yaml_runs_as_it_is():
    claims = [p.name for p in PAGES if re.search(r"TRL[^.]*YAML\W+runs as it is", " ".join(p.read_text().split()))]
    assert claims == []


def test_trls_default_for_use_bias_correction_kl_is_quoted_as_false():
    from asyncgrpo.config import field_docs

    texts = {p.name: " ".join(p.read_text().split()) for p in PAGES}
    texts["config.py"] = field_docs()["use_bias_correction_kl"]
    wrong = [name for name, text in texts.items()
             if re.search(r"use_bias_correction_kl[^|]*?TRL's default is true", text)]
    assert wrong == []


def _logged_names() -> list[re.Pattern]:
    names = set(re.findall(r"`([a-z_]+/[^`\s]+)`", (REPO / "docs" / "metrics.md").read_text()))
    return [re.compile(re.sub(r"<[^>]+>", r"[^/]+", re.escape(n).replace(r"\<", "<").replace(r"\>", ">")))
            for n in names]


def test_every_metric_a_config_comment_names_is_logged():
    patterns = _logged_names()
    named = [(path.name, name) for path in sorted((REPO / "configs").glob("*.yaml"))
             for line in path.read_text().splitlines() if "#" in line
             for name in re.findall(r"\b(?:train|eval|reward|queue|rollout|policy|sync|episodes?|staleness)/[\w/]+",
                                    line.split("#", 1)[1])]
    assert named, "the recipes name the metric to watch"
    assert [n for n in named if not any(p.fullmatch(n[1]) for p in patterns)] == []
