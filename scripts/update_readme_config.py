"""Rewrite the config reference table at the end of docs/configuration.md from AsyncGRPOConfig's field docstrings.

    python scripts/update_readme_config.py           # rewrite the table
    python scripts/update_readme_config.py --check   # exit 1, changing nothing, when the table is out of date
"""
import sys
from pathlib import Path

from asyncgrpo.config import reference_markdown

page = Path(__file__).resolve().parents[1] / "docs" / "configuration.md"
text = page.read_text()
head = text[: text.index("| key | type | default | what it does |")]
new = head + reference_markdown() + "\n"
if "--check" in sys.argv[1:]:
    if new != text:
        sys.exit(f"{page} is out of date: run `python scripts/update_readme_config.py`")
else:
    page.write_text(new)
