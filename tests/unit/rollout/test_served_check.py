"""The served check's comparison and its diagnosis (rollout/served_check.py): the bound by dtype, the cause named by
what the served logprobs match. The real-server cases (a base or old adapter served under the new name) are in
tests/integration/test_served_check.py; here the server's answer is a list, to pin each branch of the message."""

import pytest

from asyncgrpo.contracts import ServedProbe
from asyncgrpo.errors import ServedPolicyError
from asyncgrpo.rollout.served_check import ServedCheck
from fakes import cfg

IDS = [7, 8, 9, 10]
BASE, V1, V2 = [-1.0, -2.0, -3.0], [-0.9, -1.8, -2.9], [-0.7, -1.5, -2.6]


class Scores:
    """A client whose server reports `logprobs` for the probe's scored tokens."""

    base_url = "http://node:8000"

    def __init__(self, logprobs):
        self.logprobs, self.asked = logprobs, []

    def score(self, name, token_ids):
        self.asked.append((name, list(token_ids)))
        return [None] + [0.0] * (len(token_ids) - 1 - len(self.logprobs)) + list(self.logprobs)


def checked_twice() -> ServedCheck:
    check = ServedCheck(tolerance=1e-3, dtype="float32")
    assert check.expect(1, ServedProbe(IDS, 1, V1, base_logprobs=BASE)) is None  # a probe's first version
    assert check.expect(2, ServedProbe(IDS, 1, V2)) == pytest.approx(0.3)  # how far the step moved it
    return check


def test_the_bound_follows_torch_dtype_unless_set_and_zero_turns_the_check_off():
    assert ServedCheck.from_config(cfg(served_check_every=1)).tolerance == 1e-3
    assert ServedCheck.from_config(cfg(served_check_every=1, torch_dtype="bfloat16")).tolerance == 0.1
    assert ServedCheck.from_config(cfg(served_check_every=2, served_check_tolerance=0.3)).tolerance == 0.3
    assert ServedCheck.from_config(cfg(served_check_every=0)) is None


def test_a_server_within_the_bound_passes_and_reports_its_difference():
    client = Scores([x + 4e-4 for x in V2])
    assert checked_twice().verify(client, "run-v2", 2, ServedProbe(IDS, 1, V2)) == pytest.approx(4e-4)
    assert client.asked == [("run-v2", IDS)]


@pytest.mark.parametrize("served, cause", [
    (BASE, "They match the base model"),
    (V1, "They match version 1, an older adapter"),
    ([-5.0, -5.0, -5.0], "They match neither the base model nor an older version"),
])
def test_a_server_beyond_the_bound_is_refused_naming_the_server_the_version_and_what_it_matches(served, cause):
    with pytest.raises(ServedPolicyError) as refused:
        checked_twice().verify(Scores(served), "run-v2", 2, ServedProbe(IDS, 1, V2))
    message = str(refused.value)
    assert message.startswith("server http://node:8000 does not serve policy version 2 under 'run-v2'")
    assert "(bound 0.001 for torch_dtype float32)" in message and cause in message


def test_a_new_probe_forgets_what_was_kept_for_the_old_one():
    check = checked_twice()
    assert check.expect(3, ServedProbe([1, 2, 3, 4], 1, V1)) is None
    assert check.base is None and list(check.history) == [3]


def test_a_base_built_in_bf16_under_torch_dtype_float32_is_judged_by_the_bf16_bound_unless_one_is_given():
    # A DeepSpeed json with bf16 on builds a bf16 base while torch_dtype says float32 (trainer/policy.py): the probe
    # carries the dtype really run, and a bf16-sized difference (0.05) is not a wrong server.
    served = [x + 0.05 for x in V1]
    probe = ServedProbe(IDS, 1, V1, dtype="bfloat16")
    by_dtype = ServedCheck.from_config(cfg(served_check_every=1))
    by_dtype.expect(1, probe)
    assert by_dtype.verify(Scores(served), "v1", 1, probe) == pytest.approx(0.05)
    with pytest.raises(ServedPolicyError, match="bound 0.001 for torch_dtype float32"):  # an fp32 base: caught
        by_dtype.verify(Scores(served), "v1", 1, ServedProbe(IDS, 1, V1))
    given = ServedCheck.from_config(cfg(served_check_every=1, served_check_tolerance=0.01))
    given.expect(1, probe)
    with pytest.raises(ServedPolicyError, match="bound 0.01 for"):  # a bound the user set is kept as set
        given.verify(Scores(served), "v1", 1, probe)
