"""The agent endpoint against the real vLLM server, driven by agents written with the real `openai` package: the
ids a 3-turn tool-calling agent's calls sampled are exactly the ids the trainer trains on, each sampled token's
trainer logprob (fp32) equals the server's within 1e-3, tool and template ids carry no loss; and a whole run with
`agent_function` (an async agent, staleness 0) trains on exactly what the server sampled.

The chat format is tests/agent_format.py's (every non-empty turn is a `lookup` call), so a 3-turn agent does not
depend on what the toy model writes; tests/agent_fns.py holds the agents."""

from __future__ import annotations

import json

import pytest
from agent_format import agent_tokenizer
from fakes import cfg as make_cfg
from logprob_check import max_sampled_gap

from asyncgrpo.data import PromptRow
from asyncgrpo.rollout.agent_endpoint import AgentEndpoint
from asyncgrpo.rollout.agent_runner import AgentRunner
from asyncgrpo.rollout.episodes import ChatFormat

TOK = agent_tokenizer()
ROW = PromptRow(prompt=[{"role": "user", "content": "find qx"}], prompt_ids=[], columns={}, rendered="find qx")
EOS = 0


@pytest.fixture(scope="module")
def server(world, tmp_path_factory):
    """A server of this module's own, as test_episodes.py has (its logprobs are compared to the trainer's to 1e-3)."""
    from asyncgrpo.inference_node.vllm_server import VLLMServer, find_free_port

    s = VLLMServer(world.model_dir, find_free_port(), max_lora_rank=8, max_loras=4, max_model_len=256,
                   log_path=tmp_path_factory.mktemp("capture") / "vllm.log")
    s.start()
    try:
        s.wait_ready(600)  # health polled up to then: on a shared 2-core machine a start has taken over 180 s
        yield s
    finally:
        s.stop()


class Recording:
    """The real client, keeping every call's prompt ids and answer (what the server sampled, exactly)."""

    def __init__(self, client):
        self.client, self.calls = client, []

    def complete(self, model, prompt_ids, **kwargs):
        out = self.client.complete(model, prompt_ids, **kwargs)
        self.calls.append((list(prompt_ids), out[0]))
        return out


def test_a_three_turn_openai_agents_sampled_tokens_are_trained_on_exactly_and_score_the_same_in_the_trainer(
        world, server):
    import agent_fns

    from asyncgrpo.inference.client import InferenceClient

    cfg = make_cfg(num_generations=4, agent_function="agent_fns:three_turns", max_completion_length=12,
                   seeded_generation=True)
    endpoint = AgentEndpoint("127.0.0.1", 0, temperature=cfg.temperature, top_p=cfg.top_p)
    runner = AgentRunner(ChatFormat(TOK, TOK.response_template, stop_ids={EOS}), cfg, agent=agent_fns.three_turns,
                         endpoint=endpoint, max_model_len=256)
    try:
        with InferenceClient(server.base_url) as client:
            recording = Recording(client)
            episodes = runner.run_group(recording, ROW, n=4, adapter=client.base_model(), version=0, seed=11)
    finally:
        runner.close()
    samples = [s for e in episodes for s in e.samples]
    assert len(samples) == 4 and runner.stats.values()["capture/new_samples_total"] == 0  # one linked sample each
    three = [s for s in samples if s.turns == 3]
    assert three, [s.turns for s in samples]  # an episode stops earlier only on an empty turn
    # Every call the server answered is inside one sample: its prompt is the sample's ids so far, and what it
    # sampled follows, with mask 1 and the server's logprobs; nothing else has mask 1.
    for prompt, c in recording.calls:
        whole = prompt + c.token_ids
        s = next(s for s in samples if (s.prompt_ids + s.ids)[:len(whole)] == whole)  # two alike: either one
        at = len(prompt) - len(s.prompt_ids)
        assert s.ids[at:at + len(c.token_ids)] == c.token_ids
        assert s.loss_mask[at:at + len(c.token_ids)] == [1] * len(c.token_ids)
        assert s.logprobs[at:at + len(c.token_ids)] == c.logprobs
    assert sum(sum(s.loss_mask) for s in samples) == sum(len(c.token_ids) for _, c in recording.calls)
    assert all(s.loss_mask.count(0) > 0 for s in three)  # tool and template ids are context

    group = runner.group(ROW, episodes, [float(i) for i in range(4)], {}, index=0, version=0, adapter="base")
    gap, compared, _, _ = max_sampled_gap(world.model_dir, group, cfg.temperature, EOS)
    assert compared == group.n_sampled_tokens == sum(len(c.token_ids) for _, c in recording.calls)
    assert gap < 1e-3, gap


RUN = {"max_completion_length": 12, "num_generations": 4, "per_device_train_batch_size": 8,
       "max_steps": 2, "max_staleness": 0, "weight_sync_steps": 1, "lora_r": 8, "lora_alpha": 16,
       "lora_target_modules": ["q_proj", "v_proj"], "learning_rate": 1e-3, "vllm_server_timeout": 30,
       "vllm_request_timeout": 60, "torch_num_threads": 0, "lr_scheduler_type": "constant"}  # two steps, one rank


def test_a_run_with_an_async_openai_agent_function_trains_on_exactly_what_the_server_sampled(
        world, server, tmp_path, tb_scalars):
    """A whole run (in this process, one rank, staleness 0): the agent's float is the reward."""
    import shutil

    from asyncgrpo.config import AsyncGRPOConfig
    from asyncgrpo.trainer.recipe import GRPORecipe

    model_dir = tmp_path / "model"
    shutil.copytree(world.model_dir, model_dir)
    agent_tokenizer().save_pretrained(model_dir)  # the chat template and the response template go with it
    data = tmp_path / "agent.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"find {k}"}]}) + "\n"
                            for k in ("qx", "rk", "ab", "zz")))
    trainer = GRPORecipe(AsyncGRPOConfig.from_dict({
        "model_name_or_path": str(model_dir), "dataset_name": str(data),
        "agent_function": "agent_fns:three_turns_async", **RUN, "lora_name": "capture",
        "output_dir": str(tmp_path / "run"), "lora_adapter_path": str(tmp_path / "adapters"),
        "vllm_server_base_url": server.base_url}))
    try:
        trainer.setup()
        trainer.train()
    finally:
        trainer.cleanup()
    tb = tmp_path / "run" / "tensorboard"
    ratios = [v for _, v in tb_scalars(tb, "train/max_abs_log_ratio")]
    assert len(ratios) == 2 and max(ratios) < 1e-3, ratios  # every sampled token of every call, both steps
    calls = [v for _, v in tb_scalars(tb, "capture/calls_per_episode")]
    assert calls and calls[-1] > 1.0, calls  # episodes of several calls were trained on
    assert [v for _, v in tb_scalars(tb, "capture/new_samples_total")][-1] == 0  # each linked into one sample
    assert len(tb_scalars(tb, "train/rewards/three_turns_async/mean")) == 2  # the agent's float, every step
