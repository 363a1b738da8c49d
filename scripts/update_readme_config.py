"""Rewrite the generated parts of docs/configuration.md: the table of defaults that differ from TRL's (between its two
markers) and the config reference table at the end, from trl_compat.TRL_DEFAULTS and AsyncGRPOConfig's docstrings.

    python scripts/update_readme_config.py           # rewrite them
    python scripts/update_readme_config.py --check   # exit 1, changing nothing, when they are out of date
"""
import sys
from pathlib import Path

from asyncgrpo.config import defaults, reference_markdown
from asyncgrpo.trl_compat import trl_defaults_markdown

START, END = "<!-- generated: trl defaults -->\n", "<!-- end of generated trl defaults -->\n"
page = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
text = page.read_text()
before, rest = text.split(START)
after = rest.split(END)[1]
new = before + START + trl_defaults_markdown(defaults()) + "\n" + END + after
new = new[: new.index("| key | type | default | what it does |")] + reference_markdown() + "\n"
if "--check" in sys.argv[1:]:
    if new != text:
        sys.exit(f"{page} is out of date: run `python scripts/update_readme_config.py`")
else:
    page.write_text(new)
