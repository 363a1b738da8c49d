"""Reward functions: loading by `package.module:function` (or a reward model's directory), scoring with weights,
clear failures, and built-ins.

A reward function has TRL's signature `fn(prompts, completions, **columns) -> list[float | None]`, one value per
completion, and may be `async def`; None means "does not apply to this completion". One that accepts TRL's
`trainer_state`, `log_metric` or `log_extra` (by name or **kwargs) gets them. A completion's total is the
weighted sum over the functions that returned a number, else `reward_fallback`. What each argument holds, reward
models (reward_model.py) and the built-ins: docs/data.md.
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import importlib.util
import inspect
import logging
import math
import numbers
import re
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Callable

from asyncgrpo.errors import ConfigError, RewardFunctionError
from asyncgrpo.objects import remembered
from asyncgrpo.reward_model import RewardModel

log = logging.getLogger(__name__)

RewardFn = Callable[..., list]


def is_factory(fn) -> bool:
    """A reward factory (TRL's `get_soft_overlong_punishment(max_completion_len, soft_punish_cache)`) takes no
    `completions` and returns the reward function; a reward function takes `completions` (or **kwargs)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):  # a builtin without a signature: treat it as a reward function
        return False
    return not any(p.name == "completions" or p.kind == p.VAR_KEYWORD for p in params)


def reward_name(ref: str) -> str:
    """A reward's name in metrics and tables: the function's name, or a reward model directory's last part."""
    return ref.partition(":")[2] if ":" in ref else Path(ref).name


def load_reward_function(ref: str, kwargs: dict | None = None) -> RewardFn:
    """`package.module:function` -> the function, with `kwargs` bound, or, for a factory, the function it returns
    when called with `kwargs`; a directory -> a reward model scoring with it (`kwargs`: RewardModel's); errors
    name the reference and the fix."""
    if ":" not in ref:
        return _load_reward_model(ref, kwargs)
    module_name, _, attr = ref.partition(":")
    fn = remembered(ref)  # a function handed to the Python API in this process (objects.py)
    if fn is None:
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ConfigError("reward_funcs", f"cannot import module {module_name!r} ({exc})",
                              "make the module importable (installed, or on PYTHONPATH)") from exc
        fn = getattr(module, attr, None)
    if not callable(fn):
        raise ConfigError("reward_funcs", f"{module_name!r} has no function {attr!r}",
                          f"check the name after ':' in {ref!r}")
    if is_factory(fn):
        try:
            built = fn(**(kwargs or {}))
        except TypeError as exc:  # missing or unknown arguments
            raise ConfigError("reward_kwargs", f"reward factory {ref} could not be built with {kwargs or {}} ({exc})",
                              f"give its arguments under `reward_kwargs: {{{attr}: {{...}}}}`") from exc
        if not callable(built):
            raise ConfigError("reward_funcs", f"{ref} takes no `completions` argument, so it was called as a factory, "
                              f"but it returned {type(built).__name__}, not a function",
                              "name a reward function fn(prompts, completions, **columns), or a factory returning one")
        return built
    if not kwargs:
        return fn
    named = {name for name, p in inspect.signature(fn).parameters.items()
             if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)} - {"prompts", "completions"}
    unknown = sorted(set(kwargs) - named)
    if unknown:
        raise ConfigError("reward_kwargs", f"{ref} has no argument(s) {unknown}; it takes {sorted(named)}",
                          "fix the argument names under this function in reward_kwargs")
    return functools.partial(fn, **kwargs)


def reward_means(parts: list[dict[str, list]]) -> dict[str, float | None]:
    """Per-function mean over several groups' `reward_parts`, skipping None (None: it applied to none of them)."""
    values: dict[str, list[float]] = {}
    for group in parts:
        for name, rewards in group.items():
            values.setdefault(name, []).extend(r for r in rewards if r is not None)
    return {name: (sum(v) / len(v) if v else None) for name, v in values.items()}


TRL_KWARGS = ("trainer_state", "log_metric", "log_extra")  # what TRL hands every reward function besides columns


def accepted_kwargs(fn, names=TRL_KWARGS) -> frozenset[str]:
    """Which of `names` `fn` takes: by name, or all of them through **kwargs (TRL passes them to every function)."""
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin without a signature: give it none
        return frozenset()
    if any(p.kind == p.VAR_KEYWORD for p in params.values()):
        return frozenset(names)
    return frozenset(n for n in names if n in params and params[n].kind != params[n].POSITIONAL_ONLY)


@dataclass
class RewardState:
    """TRL's `trainer_state` as reward functions read it (the fields of transformers' TrainerState that rewards use
    for shaping): the optimizer step the newest published policy was trained to, the run's `max_steps`, and that
    policy's version. A group is scored with the state current when it is scored, as TRL does."""

    global_step: int = 0
    max_steps: int = 0
    policy_version: int = 0


class RewardLog:
    """What reward functions logged through TRL's `log_metric(name, value)` and `log_extra(column, values)` since it
    was last taken; the rollout side hands it to the trackers once per optimizer step (metrics as their mean under
    `train/<name>`, extra columns as a table). Any thread may log."""

    def __init__(self):
        self._lock = threading.Lock()
        self.metrics: dict[str, list[float]] = defaultdict(list)
        self.extra: dict[str, list] = defaultdict(list)

    def log_metric(self, name: str, value: float) -> None:
        with self._lock:
            self.metrics[str(name)].append(float(value))

    def log_extra(self, column: str, values: list) -> None:
        with self._lock:
            self.extra[str(column)].extend(values)

    def merge(self, metrics: dict[str, list[float]], extra: dict[str, list]) -> None:
        """Add what another scorer (a reward worker's) logged."""
        with self._lock:
            for name, values in metrics.items():
                self.metrics[name].extend(values)
            for column, values in extra.items():
                self.extra[column].extend(values)

    def take(self) -> tuple[dict[str, list[float]], dict[str, list]]:
        """Everything logged so far (raw values), leaving the log empty."""
        with self._lock:
            metrics, extra = dict(self.metrics), dict(self.extra)
            self.metrics, self.extra = defaultdict(list), defaultdict(list)
        return metrics, extra


@dataclass
class RewardScorer:
    """Scores completions with several weighted reward functions; counts fallbacks when configured."""

    refs: list[str]
    weights: list[float] | None = None
    fallback: float | None = None
    kwargs: dict[str, dict] | None = None  # reward_kwargs: by function name or by full reference
    fallbacks: int = 0
    functions: list[RewardFn] = field(init=False)
    on_call: Callable[[str], None] | None = field(default=None, repr=False)  # told each function's ref before it runs
    state: RewardState = field(default_factory=RewardState)  # TRL's `trainer_state`, kept current by the side
    logged: RewardLog = field(default_factory=RewardLog, repr=False)  # TRL's `log_metric` / `log_extra`

    def __post_init__(self) -> None:
        kwargs = self.kwargs or {}
        self.functions = [load_reward_function(r, kwargs.get(r, kwargs.get(reward_name(r)))) for r in self.refs]
        if self.weights is None:
            self.weights = [1.0] * len(self.refs)
        self._trl_kwargs = [accepted_kwargs(fn) for fn in self.functions]
        for fn in self.functions:  # heavy imports now (a worker: before it says ready), not inside reward_timeout
            warm_up = getattr(getattr(fn, "func", fn), "warm_up", None)  # `func`: a partial with reward_kwargs
            if callable(warm_up):
                warm_up()

    @property
    def names(self) -> list[str]:
        return [reward_name(r) for r in self.refs]

    def score(self, prompts: list, completions: list, columns: dict[str, list], *,
              completion_ids: list[list[int]] | None = None, parsed: list[dict | None] | None = None,
              truncated: list[bool] | None = None) -> tuple[list[float], dict[str, list[float | None]]]:
        """Returns (total reward per completion, {function name: its rewards, None where it does not apply})."""
        extra = dict(columns)
        if completion_ids is not None:
            extra["completion_ids"] = completion_ids
        if truncated is not None:
            extra["truncated"] = truncated
        if parsed is not None:
            extra["parsed"] = parsed
        parts: dict[str, list[float | None]] = {}
        total: list[float | None] = [None] * len(completions)
        trl = {"trainer_state": self.state, "log_metric": self.logged.log_metric, "log_extra": self.logged.log_extra}
        for i, (ref, name, fn, weight) in enumerate(zip(self.refs, self.names, self.functions, self.weights)):
            if self.on_call is not None:
                self.on_call(ref)
            # functions appended after construction (an environment's get_reward) take **kwargs
            wanted = self._trl_kwargs[i] if i < len(self._trl_kwargs) else accepted_kwargs(fn)
            values = self._call(ref, fn, prompts, completions, {**extra, **{k: trl[k] for k in wanted}})
            parts[name] = values
            total = [t if v is None else (t or 0.0) + weight * v for t, v in zip(total, values)]
        return self._fill_inapplicable(total, prompts, completions), parts

    def _fill_inapplicable(self, total: list[float | None], prompts, completions) -> list[float]:
        missing = [i for i, t in enumerate(total) if t is None]
        if not missing:
            return total
        if self.fallback is None:
            i = missing[0]
            raise RewardFunctionError(
                f"no reward function applies to {len(missing)} completion(s): all of {self.refs} returned None\n"
                f"  on prompt {prompts[i]!r}, completion {completions[i]!r}\n"
                f"  Fix: add a reward function that scores such rows, drop them from the dataset, or set "
                f"`reward_fallback: 0.0` to score them with a fallback value (counted in reward/fallbacks_total)")
        self.fallbacks += len(missing)
        return [self.fallback if t is None else t for t in total]

    def _call(self, ref, fn, prompts, completions, columns) -> list[float | None]:
        try:
            values = fn(prompts=prompts, completions=completions, **columns)
            if inspect.isawaitable(values):  # an `async def` function: run to completion in this thread
                values = asyncio.run(_awaited(values))
        except Exception as exc:  # a user's function: report it with the sample, or fall back if asked to
            if self.fallback is None:
                raise RewardFunctionError(
                    f"reward function {ref} raised {type(exc).__name__}: {exc}\n"
                    f"  on prompt {prompts[0]!r}, first completion {completions[0]!r}\n"
                    f"  Fix the function, or set `reward_fallback: 0.0` to score such samples with a "
                    f"fallback value (counted in reward/fallbacks_total)") from exc
            self.fallbacks += len(completions)
            log.warning("reward function %s raised %s on prompt %r; using reward_fallback=%s",
                        ref, type(exc).__name__, prompts[0], self.fallback)
            return [self.fallback] * len(completions)
        return self._check(ref, values, len(completions))

    @staticmethod
    def _check(ref: str, values, n: int) -> list[float | None]:
        if not isinstance(values, (list, tuple)) or len(values) != n:
            got = len(values) if isinstance(values, (list, tuple)) else type(values).__name__
            raise RewardFunctionError(f"reward function {ref} returned {got} values for {n} completions; "
                                      f"return a list with one float (or None) per completion")
        out: list[float | None] = []
        for v in values:
            if v is None:
                out.append(None)
                continue
            if not isinstance(v, numbers.Real) or not math.isfinite(float(v)):
                raise RewardFunctionError(f"reward function {ref} returned {v!r}; return a finite float for every "
                                          f"completion, or None where the function does not apply")
            out.append(float(v))
        return out


async def _awaited(awaitable):
    return await awaitable


def _load_reward_model(ref: str, kwargs: dict | None) -> RewardFn:
    """A sequence-classification checkpoint directory as a reward function (loaded on first use, in the process
    that scores)."""
    if not (Path(ref) / "config.json").is_file():
        raise ConfigError("reward_funcs", f"{ref!r} is neither `package.module:function` nor a model directory "
                          f"(no {Path(ref) / 'config.json'})", "write e.g. `asyncgrpo.toy:larger_reward`, or the "
                          "path of a sequence-classification checkpoint (a reward model)")
    try:
        return RewardModel(ref, **(kwargs or {}))
    except TypeError as exc:
        raise ConfigError("reward_kwargs", f"reward model {ref}: {exc}", "it takes `batch_size` only") from exc


# ---- built-in reward functions ----------------------------------------------------------------------------------
def completion_text(completion, parsed: dict | None = None) -> str:
    """The answer text of one completion: the parsed `content` when there is a parsed message (so that reasoning and
    tool calls are left out), else the string, else the last message's content (TRL's conversational form)."""
    if isinstance(parsed, dict):
        return str(parsed.get("content") or "")
    if isinstance(completion, str):
        return completion
    if isinstance(completion, list) and completion and isinstance(completion[-1], dict):
        return str(completion[-1].get("content") or "")
    raise TypeError(f"a completion must be a string or a list of chat messages, got {completion!r:.80}")


_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|-?\.\d+")
_FRACTION = re.compile(r"^(-?[\d.,]+)\s*/\s*(-?[\d.,]+)$")
_LATEX_FRAC = re.compile(r"\\[dt]?frac\{([^{}]*)\}\{([^{}]*)\}")
_LATEX_TEXT = re.compile(r"\\(?:text|textbf|mathrm|mbox)\{([^{}]*)\}")


def _boxed(text: str) -> str | None:
    """Contents of the last `\\boxed{...}` (or `\\fbox{...}`), braces matched; None if there is none."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth = 1
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j]
    return None  # unclosed: the completion was cut off


def parse_number(text: str) -> Fraction | None:
    """`"1,234"`, `"42.0"`, `"-3.5"`, `"3/4"`, `"\\frac{3}{4}"`, `"$18"`, `"18 dollars"` -> an exact value.
    A text holding several numbers gives its last one; no number gives None."""
    text = _LATEX_TEXT.sub(r"\1", text)
    text = _LATEX_FRAC.sub(r"(\1)/(\2)", text)
    text = re.sub(r"\\[,!;: ]|\\\$|\$|\\%|%|\\left|\\right", "", text).strip()
    plain = text.replace("(", "").replace(")", "").replace(" ", "")
    frac = _FRACTION.match(plain)
    if frac:
        num, den = (_to_fraction(g) for g in frac.groups())
        if num is not None and den:
            return num / den
    numbers_found = _NUMBER.findall(text)
    return _to_fraction(numbers_found[-1]) if numbers_found else None


def _to_fraction(token: str) -> Fraction | None:
    token = token.replace(",", "").rstrip(".")
    try:
        return Fraction(token)
    except (ValueError, ZeroDivisionError):
        return None


def extract_answer(text: str) -> Fraction | None:
    """A completion's final answer: the last `\\boxed{}`, else the last `<answer>...</answer>`, else what follows
    the last GSM8K-style `####`, else the last number in the text. None when there is no number at all, or when
    the last box was never closed (the completion was cut off)."""
    if "\\boxed{" in text or "\\fbox{" in text:
        boxed = _boxed(text)
        return None if boxed is None else parse_number(boxed)  # an unclosed box: cut off before the answer
    tagged = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    if tagged:
        return parse_number(tagged[-1])
    if "####" in text:
        return parse_number(text.rsplit("####", 1)[1])
    return parse_number(text)


def extract_reference(reference) -> Fraction | None:
    """A reference answer: a number, a GSM8K solution ending in `#### 42`, a `\\boxed{}` solution, or plain text."""
    if isinstance(reference, numbers.Real) and not isinstance(reference, bool):
        return Fraction(str(reference))
    if not isinstance(reference, str) or not reference.strip():
        return None
    if "####" in reference:
        return parse_number(reference.rsplit("####", 1)[1])
    return extract_answer(reference)


def math_verify_installed() -> bool:
    """Whether `math-verify` can grade (`pip install math-verify`); without it math_accuracy compares numbers."""
    return importlib.util.find_spec("math_verify") is not None


def math_accuracy(prompts, completions, *, answer_column: str = "answer", grader: str = "auto", parsed=None,
                  **columns) -> list[float | None]:
    """1.0 when the completion's final answer equals the reference, else 0.0; None for a row whose reference holds
    no answer (not applicable).

    The reference comes from the `answer_column` column (GSM8K: `answer`, ending in `#### 42`). The completion's
    answer is read from its last `<answer>` tag, else the text after `####`, else the whole text; with a parsed
    message only its `content` is read (not the reasoning). With `math-verify` installed it extracts and compares
    the answers symbolically (`\\boxed{}`, LaTeX, fractions, expressions: `\\frac{1}{2}` == `0.5`, `2\\sqrt{2}` ==
    `\\sqrt{8}`); without it, numbers compare exactly after removing thousands commas, `$` and `%` (the last
    `\\boxed{}`, else the last number). `grader`: `auto` (math-verify when installed), `math-verify` or `numbers`
    (the number comparison costs ~0.1 ms per completion, math-verify ~10 ms).
    """
    if answer_column not in columns:
        raise ValueError(f"math_accuracy needs the reference column {answer_column!r}; columns: "
                         f"{sorted(set(columns) - set(TRL_KWARGS))} "
                         f"(set `reward_kwargs: {{math_accuracy: {{answer_column: NAME}}}}`)")
    if grader not in ("auto", "math-verify", "numbers"):
        raise ValueError(f"math_accuracy's grader is auto, math-verify or numbers, not {grader!r}")
    if grader == "math-verify" and not math_verify_installed():
        raise ValueError("math_accuracy's grader math-verify is not installed: pip install math-verify")
    use_math_verify = grader == "math-verify" or (grader == "auto" and math_verify_installed())
    grade = _grade_math_verify if use_math_verify else _grade_numbers
    parsed = parsed if parsed is not None else [None] * len(completions)
    return [grade(completion_text(completion, message), reference)
            for completion, reference, message in zip(completions, columns[answer_column], parsed)]


def _import_math_verify() -> None:
    if math_verify_installed():
        import math_verify  # noqa: F401  heavy: sympy and its LaTeX parser, seconds on first import


math_accuracy.warm_up = _import_math_verify  # RewardScorer calls it when it loads the function


def _grade_numbers(text: str, reference) -> float | None:
    """The fallback without math-verify: exact numeric comparison of the extracted numbers."""
    expected = extract_reference(reference)
    if expected is None:
        return None
    got = extract_answer(text)
    return 1.0 if got is not None and got == expected else 0.0


def _answer_region(text: str) -> str:
    """Where a completion states its answer: its last `<answer>` tag, else what follows `####`, else all of it."""
    tagged = re.findall(r"<answer>(.*?)</answer>", text, re.DOTALL)
    if tagged:
        return tagged[-1]
    return text.rsplit("####", 1)[1] if "####" in text else text


def _parse_math(parse, text: str, timeout: int | None) -> list:
    """math-verify's parse; LaTeX without delimiters (`\\frac12`, as datasets store answers and `<answer>` tags
    hold them) is read as math mode."""
    bare = "\\" in text and not any(d in text for d in ("$", "\\boxed", "\\(", "\\["))
    return parse(f"${text.strip()}$" if bare else text, parsing_timeout=timeout)


def _grade_math_verify(text: str, reference) -> float | None:
    """math-verify's extraction and symbolic comparison. Its timeouts use SIGALRM, which only the main thread may
    set: off it (request threads) they are off, and `reward_timeout` bounds the call instead."""
    from math_verify import parse, verify  # heavy: sympy, only when math_accuracy grades

    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    if isinstance(reference, numbers.Real) and not isinstance(reference, bool):
        reference = str(reference)
    if not isinstance(reference, str) or not reference.strip():
        return None
    reference = reference.rsplit("####", 1)[1] if "####" in reference else reference
    gold = _parse_math(parse, reference, timeout)
    if not gold:
        return None
    answer = _parse_math(parse, _answer_region(text), timeout)
    return 1.0 if answer and verify(gold, answer, timeout_seconds=timeout) else 0.0


@functools.lru_cache(maxsize=32)
def _compiled(pattern: str) -> re.Pattern:
    return re.compile(pattern, re.DOTALL)


THINK_ANSWER_PATTERN = r"^<think>.*?</think>\s*<answer>.*?</answer>$"


def format_reward(prompts, completions, *, pattern: str = THINK_ANSWER_PATTERN, **columns) -> list[float]:
    """1.0 when the completion (stripped) matches `pattern` (`re.search`, `.` matches newlines; anchor with `^...$`
    to require the whole completion), else 0.0. Default: reasoning in `<think>` tags, then an `<answer>` tag."""
    regex = _compiled(pattern)
    return [1.0 if regex.search(completion_text(c).strip()) else 0.0 for c in completions]


def get_soft_overlong_punishment(max_completion_len: int, soft_punish_cache: int) -> RewardFn:
    """Factory (TRL's name and arguments) for DAPO's soft overlong punishment, by completion length n in tokens:
    0 while n <= max_completion_len - soft_punish_cache, then falling linearly to -1 at max_completion_len,
    (max_completion_len - soft_punish_cache - n) / soft_punish_cache, and -1 beyond. Use it with
    `reward_kwargs: {get_soft_overlong_punishment: {max_completion_len: 256, soft_punish_cache: 64}}`."""
    if not 0 < soft_punish_cache <= max_completion_len:
        raise ValueError(f"get_soft_overlong_punishment needs 0 < soft_punish_cache <= max_completion_len, got "
                         f"{soft_punish_cache} and {max_completion_len}")
    free = max_completion_len - soft_punish_cache

    def soft_overlong_punishment(completion_ids, **columns) -> list[float]:
        return [0.0 if len(ids) <= free else -1.0 if len(ids) > max_completion_len
                else (free - len(ids)) / soft_punish_cache for ids in completion_ids]

    return soft_overlong_punishment


def length_penalty(prompts, completions, *, max_length: int = 1024, soft_length: int | None = None,
                   completion_ids=None, **columns) -> list[float]:
    """0 up to `soft_length`, then falling linearly to -1.0 at `max_length` and -1.0 beyond (DAPO's soft overlong
    penalty). Lengths are in tokens (`completion_ids`), or characters when there are no ids. Default soft_length:
    three quarters of max_length."""
    soft = int(0.75 * max_length) if soft_length is None else soft_length
    if not 0 <= soft < max_length:
        raise ValueError(f"length_penalty needs 0 <= soft_length < max_length, got {soft} and {max_length}")
    lengths = [len(i) for i in completion_ids] if completion_ids is not None else \
        [len(completion_text(c)) for c in completions]
    return [0.0 - min(1.0, max(0.0, (n - soft) / (max_length - soft))) for n in lengths]
