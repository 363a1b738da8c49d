"""`log_completions`: a table of a step's completions, for every tracker and `<output_dir>/completions.jsonl`.

Rank 0 decodes the first completions of the step's batch (prompt, completion, each reward function's value, the total
reward, the advantage: TRL's columns plus the total) and appends them as JSON lines to a file that stops growing at
`MAX_FILE_BYTES`; the rollout side hands the same rows to the trackers (`log_table`).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from asyncgrpo.contracts import Group

log = logging.getLogger(__name__)

MAX_ROWS = 64  # rows per table when num_completions_to_print is unset: a batch can hold thousands of completions
MAX_FILE_BYTES = 64 * 1024 * 1024  # completions.jsonl stops growing here (a long run must not fill the disk)


def prompt_text(prompt) -> str:
    """A prompt as a table cell: text as is, chat messages as JSON."""
    return prompt if isinstance(prompt, str) else json.dumps(prompt, ensure_ascii=False)


class CompletionLog:
    """Rank 0's completions table: `table(groups, step)` gives (columns, rows), `append` writes them to the file."""

    def __init__(self, output_dir: str | Path, tokenizer, reward_names: list[str], limit: int | None):
        self.path = Path(output_dir) / "completions.jsonl"
        self.tokenizer, self.reward_names = tokenizer, reward_names
        self.limit = limit or MAX_ROWS
        self.full = False  # the file reached MAX_FILE_BYTES: nothing more is appended

    @property
    def columns(self) -> list[str]:
        return ["step", "prompt", "completion", *self.reward_names, "reward", "advantage"]

    def table(self, groups: list[Group], step: int) -> list[list]:
        """The first `limit` completions of `groups` (data order), one row each; a reward function that does not
        apply to a completion has None there. A reward the config does not name (an environment's get_reward) gets a
        column from the first batch that carries it on."""
        self.reward_names += list(dict.fromkeys(n for g in groups for n in g.reward_parts
                                                if n not in self.reward_names))
        rows = []
        for g in groups:
            for j, ids in enumerate(g.completion_ids):
                if len(rows) == self.limit:
                    return rows
                parts = [g.reward_parts.get(name, [None] * len(g.rewards))[j] for name in self.reward_names]
                text = self.tokenizer.decode(ids, skip_special_tokens=True)
                rows.append([step, prompt_text(g.prompt), text, *parts, g.rewards[j], g.advantages[j]])
        return rows

    def append(self, rows: list[list]) -> None:
        """Append the rows as JSON lines (one object per completion) unless the file is full."""
        if self.full:
            return
        lines = "".join(json.dumps(dict(zip(self.columns, row)), ensure_ascii=False) + "\n" for row in rows)
        size = self.path.stat().st_size if self.path.exists() else 0
        if size + len(lines.encode()) > MAX_FILE_BYTES:
            self.full = True
            log.warning("%s reached %d MiB; later completions go to the trackers only", self.path,
                        MAX_FILE_BYTES >> 20)
            return
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(lines)
