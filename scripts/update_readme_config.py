"""Rewrite the config reference table at the end of README.md from AsyncGRPOConfig's field docstrings."""
from pathlib import Path

from asyncgrpo.config import reference_markdown

readme = Path(__file__).resolve().parents[1] / "README.md"
text = readme.read_text()
head = text[: text.index("| key | default | what it does |")]
readme.write_text(head + reference_markdown() + "\n")
