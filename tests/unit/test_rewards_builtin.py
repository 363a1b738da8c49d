"""The built-in reward functions on real-format strings: GSM8K references, boxed answers, commas, no answer.
math_accuracy's cases run twice: graded by math-verify, and by the number comparison it falls back to without it."""

import pytest

from asyncgrpo import rewards
from asyncgrpo.errors import RewardFunctionError
from asyncgrpo.rewards import (RewardScorer, extract_answer, extract_reference, format_reward, length_penalty,
                               math_accuracy)


@pytest.fixture(params=["math-verify", "numbers"], autouse=True)
def grader(request, monkeypatch):
    """Every test here runs once with math-verify grading and once with the fallback (math-verify not installed)."""
    if request.param == "math-verify":
        assert rewards.math_verify_installed(), "math-verify is a test dependency (pip install math-verify)"
    else:
        monkeypatch.setattr(rewards, "math_verify_installed", lambda: False)
    return request.param

# A GSM8K training row's reference, verbatim in format (calculator annotations, `#### answer` last).
GSM8K_REFERENCE = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                   "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")


def score(completion, reference=GSM8K_REFERENCE, **kw):
    return math_accuracy(["q"], [completion], answer=[reference], **kw)[0]


@pytest.mark.parametrize("completion,expected", [
    ("In May she sold 24, so 48 + 24 = 72 clips.", 1.0),  # the last number
    ("She sold 48 + 24 = 70 clips.", 0.0),  # wrong
    ("48 + 24 = 72, but the answer is \\boxed{72}.", 1.0),  # boxed
    ("First 72... no wait. \\boxed{70}", 0.0),  # a boxed answer wins over numbers before it
    ("The total is \\boxed{72.0}", 1.0),  # trailing .0
    ("<think>48 and 24</think><answer>72</answer>", 1.0),  # answer tags
    ("48+24 = <<48+24=72>>72\n#### 72", 1.0),  # GSM8K's own format
    ("I cannot tell.", 0.0),  # no answer
    ("", 0.0),
    ("\\boxed{72", 0.0),  # cut off inside the box: no answer, whatever numbers come before
])
def test_math_accuracy_on_gsm8k_reference(completion, expected):
    assert score(completion) == expected


def test_a_boxed_answer_with_its_unit_in_text_counts_only_for_the_number_comparison(grader):
    # math-verify reads `\text{...}` in a box as text, not as the number 72; the fallback takes the number.
    assert score("The total is \\boxed{\\text{72 clips}}") == (1.0 if grader == "numbers" else 0.0)


@pytest.mark.parametrize("reference,completion,without", [
    ("\\sqrt{8}", "<answer>2\\sqrt{2}</answer>", 0.0),  # bare LaTeX: the numbers 8 and 2 differ
    ("\\boxed{x^2+2x+1}", "\\boxed{(x+1)^2}", 0.0),  # the same polynomial, last numbers 1 and 2
    ("\\boxed{3 + x^2}", "so \\boxed{x^2 + 3}", 0.0),  # terms in another order
])
def test_math_verify_compares_expressions_the_number_comparison_cannot(grader, reference, completion, without):
    assert score(completion, reference) == (1.0 if grader == "math-verify" else without)


@pytest.mark.parametrize("reference,completion", [
    ("#### 1,234", "The answer is 1234."),
    ("#### 1234", "The answer is 1,234."),
    ("Half of it.\n#### 0.5", "\\boxed{\\frac{1}{2}}"),
    ("#### -3", "It drops by \\boxed{-3} degrees."),
    ("#### 18", "She makes $18 every day."),
    ("#### 25", "\\boxed{25\\%}"),
    (42, "so \\boxed{42}"),  # a numeric column (parquet/csv)
    ("\\boxed{7}", "The answer is 7"),  # a MATH-style solution as the reference
])
def test_numbers_compare_exactly_after_commas_currency_and_fractions(reference, completion):
    assert score(completion, reference) == 1.0


def test_a_row_without_a_numeric_reference_is_not_applicable():
    assert score("\\boxed{72}", reference="") is None
    assert score("\\boxed{72}", reference=None) is None
    assert score("\\boxed{72}", reference="#### seventy-two") is None


def test_parsed_content_is_read_instead_of_the_reasoning():
    completion = [{"role": "assistant", "content": "<think>maybe 70</think>It is 72"}]
    parsed = [{"role": "assistant", "thinking": "48 + 24 = 72, or 70", "content": "It is 72"}]
    assert math_accuracy(["q"], [completion], answer=[GSM8K_REFERENCE], parsed=parsed) == [1.0]
    parsed = [{"role": "assistant", "thinking": "it is 72", "content": "I am not sure, 70?"}]
    assert math_accuracy(["q"], [completion], answer=[GSM8K_REFERENCE], parsed=parsed) == [0.0]
    # A completion the parser rejected (None) falls back to its text; one with only tool calls has no answer.
    assert math_accuracy(["q"], [completion], answer=[GSM8K_REFERENCE], parsed=[None]) == [1.0]
    tool_only = [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "calc"}}]}]
    assert math_accuracy(["q"], [completion], answer=[GSM8K_REFERENCE], parsed=tool_only) == [0.0]


def test_the_reference_column_is_configurable_and_its_absence_names_the_fix():
    assert math_accuracy(["q"], ["\\boxed{5}"], solution=["#### 5"], answer_column="solution") == [1.0]
    with pytest.raises(RewardFunctionError, match="needs the reference column 'answer'; columns: \\['solution'\\]"):
        RewardScorer(["asyncgrpo.rewards:math_accuracy"]).score(["q"], ["1"], {"solution": ["#### 1"]})


def test_extractors():
    assert extract_reference(GSM8K_REFERENCE) == 72
    assert extract_answer("\\boxed{\\dfrac{3}{4}}") == extract_answer("0.75")
    assert extract_answer("no digits") is None


def test_format_reward_with_the_default_and_a_configured_pattern():
    good = "<think>\n48 + 24 = 72\n</think>\n<answer>72</answer>"
    assert format_reward(["q"] * 3, [good, "<answer>72</answer>", good + " trailing"]) == [1.0, 0.0, 0.0]
    boxed = r"\\boxed\{.+\}"
    assert format_reward(["q"] * 2, ["so \\boxed{72}.", "72"], pattern=boxed) == [1.0, 0.0]
    conversational = [[{"role": "assistant", "content": good}]]
    assert format_reward(["q"], conversational) == [1.0]
    scorer = RewardScorer(["asyncgrpo.rewards:format_reward"], kwargs={"format_reward": {"pattern": boxed}})
    assert scorer.score(["q"], ["\\boxed{1}"], {})[0] == [1.0]


def test_length_penalty_is_zero_until_soft_length_then_linear_to_minus_one():
    ids = [[0] * n for n in (10, 75, 80, 90, 100, 150)]
    values = length_penalty(["q"] * 6, ["x"] * 6, completion_ids=ids, max_length=100, soft_length=80)
    assert values == [0.0, 0.0, 0.0, -0.5, -1.0, -1.0]
    assert length_penalty(["q"], ["x" * 90], max_length=100, soft_length=80) == [-0.5]  # characters without ids
    with pytest.raises(ValueError, match="soft_length < max_length"):
        length_penalty(["q"], ["x"], max_length=10, soft_length=10)


def test_the_grader_can_be_named_and_a_wrong_name_says_the_choices(grader):
    assert score("<answer>2\\sqrt{2}</answer>", "\\sqrt{8}", grader="numbers") == 0.0  # whatever is installed
    if grader == "math-verify":
        assert score("<answer>2\\sqrt{2}</answer>", "\\sqrt{8}", grader="math-verify") == 1.0
    else:
        with pytest.raises(ValueError, match="math-verify is not installed: pip install math-verify"):
            score("1", "#### 1", grader="math-verify")
    with pytest.raises(ValueError, match="auto, math-verify or numbers, not 'sympy'"):
        score("1", "#### 1", grader="sympy")
