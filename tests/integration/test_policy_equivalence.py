"""After a sync, the server's logprobs under the new adapter equal the trainer's own (fp32); before it, not."""

from asyncgrpo.bench.policy_equivalence import run


def test_served_policy_is_the_trained_policy(vllm_server, tmp_path):
    result = run(server_url=vllm_server.base_url, overrides=[], workdir=str(tmp_path))
    assert result["completion_tokens"] > 0
    assert result["max_abs_logprob_diff_sampled"] < 1e-3
    assert result["max_abs_logprob_diff_after_sync"] < 1e-3
    assert result["max_abs_logprob_diff_before_sync"] > 1e-2  # one unpublished step is visible
    assert result["policy_version"] == 3
