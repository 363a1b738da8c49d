"""Episodes against the real vLLM server: a 3-turn episode's sampled tokens, scored by the trainer's own logprob code
on the ids the group carries, equal the server's behaviour logprobs (fp32, staleness 0); tool tokens carry no loss;
and an episode keeps its start adapter while a new version is published between its turns (`episode_version:
pinned`), or moves its later turns to the new one, each token sampled by the version it is tagged with (`latest`).

The chat format is tests/agent_format.py's (the toy model knows no tool format: every non-empty turn parses as a
`lookup` call, so a 3-turn episode does not depend on what the model writes; max_turns 3 ends it)."""

from __future__ import annotations

import pytest
import torch
from agent_format import agent_model, agent_tokenizer, lookup
from fakes import cfg as make_cfg
from logprob_check import max_sampled_gap

from asyncgrpo.data import PromptRow
from asyncgrpo.rollout.episodes import ChatFormat, EpisodeRunner, episode_group
from asyncgrpo.store import AdapterStore
from asyncgrpo.trainer.logprobs import find_scoring_head, sequence_logprobs
from asyncgrpo.trainer.loss import LossSpec, grpo_loss

TOK = agent_tokenizer()
ROW = PromptRow(prompt=[{"role": "user", "content": "07,45>"}], prompt_ids=[], columns={}, rendered="07,45>")
EOS = 0


@pytest.fixture(scope="module")
def client(world, tmp_path_factory):
    """A server of this module's own: these tests compare the server's logprobs with the trainer's to 1e-3, and on
    the session's shared server they differed by up to 0.25 in 3 of 5 runs right after test_entropy.py's training
    run (never alone; cause not found yet), so nothing another test left on a server can reach them."""
    from asyncgrpo.inference.client import InferenceClient
    from asyncgrpo.inference_node.vllm_server import find_free_port
    from integration.runs import make_server

    with make_server(world.model_dir, find_free_port(), max_lora_rank=8, max_loras=4, max_model_len=256,
                     log_path=tmp_path_factory.mktemp("episodes") / "vllm.log") as server:
        with InferenceClient(server.base_url) as c:
            yield c


class Recording:
    """The real client, keeping each turn's answer (what the server sampled, exactly)."""

    def __init__(self, client):
        self.client, self.turns = client, []
        self.base_url = client.base_url

    def complete(self, *args, **kwargs):
        out = self.client.complete(*args, **kwargs)
        self.turns.append(out[0])
        return out


def run_episodes(client, model: str, n: int, tools, max_len: int = 256, seed: int = 11, latest=None):
    cfg = make_cfg(num_generations=2, tools=["agent_format:lookup"], max_turns=3, max_completion_length=12,
                   seeded_generation=True)
    runner = EpisodeRunner(ChatFormat(TOK, TOK.response_template, stop_ids={EOS}), cfg, tools=tools, factory=None,
                           max_model_len=max_len)
    episodes, recorded = [], []
    for j in range(n):  # one at a time, so that each episode's turns are recorded apart
        rec = Recording(client)
        e = runner.start(ROW)
        runner.run(rec, e, adapter=model, version=0, seed=seed + j, latest=latest)
        episodes.append(e)
        recorded.append(rec.turns)
    return cfg, episodes, recorded


def unload_all(client, names) -> None:
    """Unload each adapter a test loaded; one a failed test never loaded is skipped."""
    for name in names:
        try:
            client.unload_adapter(name)
        except Exception:  # noqa: BLE001 - v1 may not have been loaded
            pass


def test_a_three_turn_episodes_sampled_tokens_score_the_same_in_the_trainer_and_tool_tokens_carry_no_loss(
        world, client):
    cfg, episodes, recorded = run_episodes(client, client.base_model(), n=6, tools=[lookup])
    three = [(e, r) for e, r in zip(episodes, recorded) if e.turns == 3]
    assert three, [e.turns for e in episodes]  # max_turns 3: an episode stops earlier only on an empty turn
    for e, turns in three:
        # What the trainer trains on: exactly the ids the server sampled, in order, turn after turn
        assert [t for t, m in zip(e.ids, e.loss_mask) if m] == [t for c in turns for t in c.token_ids]
        assert e.tool_calls == 2 and e.loss_mask.count(0) > 0
    group = episode_group(ROW, [e for e, _ in three], [float(i) for i in range(len(three))], {}, index=0, version=0,
                          adapter="base", cfg=cfg)
    diff, compared, model, batch = max_sampled_gap(world.model_dir, group, cfg.temperature, EOS)
    sampled = batch["mask"] > 0
    assert compared == group.n_sampled_tokens == sum(len(c.token_ids) for _, r in three for c in r)
    assert diff < 1e-3, diff

    # Tool tokens carry no loss: whatever their behaviour logprobs say, the loss and its gradient are the same.
    spec = LossSpec(epsilon_low=0.2, epsilon_high=0.2)
    weight = model.model.layers[0].self_attn.q_proj.weight

    def loss_and_grad(behaviour):
        logprobs = sequence_logprobs(model, find_scoring_head(model), batch["input_ids"], batch["attention_mask"],
                                     batch["mask"], cfg.temperature)
        terms = grpo_loss(logprobs, behaviour, batch["advantages"], batch["mask"], spec, normaliser=1.0)
        return terms.loss.detach(), torch.autograd.grad(terms.loss, weight)[0], terms.n_tokens

    loss, grad, n_tokens = loss_and_grad(batch["behaviour"])
    tool_positions = (batch["attention_mask"][:, 1:] > 0) & ~sampled
    assert tool_positions.any()
    loss2, grad2, _ = loss_and_grad(torch.where(tool_positions, -7.0, batch["behaviour"]))
    assert n_tokens == sampled.sum()  # only sampled tokens are counted
    assert torch.equal(loss, loss2) and torch.equal(grad, grad2)
    assert grad.abs().sum() > 0  # the sampled tokens do train


@pytest.mark.parametrize("mode", ["pause", "versioned"])
def test_an_episode_keeps_its_start_adapter_when_a_version_is_published_between_its_turns(
        world, client, tmp_path, random_adapter, mode):
    store = AdapterStore(tmp_path)
    names = [f"episode-{mode}-v0", f"episode-{mode}-v1"]

    def scaled(seed: int, scale: float):
        tensors, config = random_adapter(seed=seed)
        return {k: v * scale for k, v in tensors.items()}, config

    # v0 close to the base model, so that its turns end (eos) as the base model's do; v1 far from it
    client.load_adapter(names[0], store.write(0, *scaled(21, 0.05), base_model=str(world.model_dir)))
    published = []

    def lookup(key: str) -> str:  # noqa: F811 - the format's tool name; this one publishes v1 on its first call
        """Answer, publishing version 1 the first time.

        Args:
            key: what the model wrote
        """
        if not published:
            v1 = store.write(1, *scaled(22, 1.0), base_model=str(world.model_dir))
            if mode == "pause":
                client.pause(mode="keep")
                try:
                    client.load_adapter(names[1], v1)
                finally:
                    client.resume()
            else:
                client.load_adapter(names[1], v1)
            published.append(names[1])
        return f"[{len(key)}]"

    try:
        _, episodes, _ = run_episodes(client, names[0], n=4, tools=[lookup], seed=31)
        # a version went live during the first tool call
        assert published, [(e.turns, e.finish_reason, TOK.decode(e.ids)) for e in episodes]
        several = [e for e in episodes if e.turns >= 2]
        assert several, [e.turns for e in episodes]
        for e in several:
            assert set(e.versions) == {0}
            seq = e.prompt_ids + e.ids
            positions = [len(e.prompt_ids) + i for i, m in enumerate(e.loss_mask) if m]
            under = {name: client.score(name, seq) for name in names}
            sampled = [e.logprobs[p - len(e.prompt_ids)] for p in positions]
            v0 = max(abs(under[names[0]][p] - s) for p, s in zip(positions, sampled))
            v1 = max(abs(under[names[1]][p] - s) for p, s in zip(positions, sampled))
            assert v0 < 1e-3 < 1e-2 < v1, (v0, v1)  # every turn, before and after the publish, sampled by v0
    finally:
        unload_all(client, names)


def test_with_latest_the_turns_after_a_publish_are_sampled_by_the_new_version_and_tagged_with_it(
        world, client, tmp_path, random_adapter):
    from asyncgrpo.rollout.admission import Admission

    store = AdapterStore(tmp_path)
    names = ["episode-latest-v0", "episode-latest-v1"]

    def scaled(seed: int, scale: float):
        tensors, config = random_adapter(seed=seed)
        return {k: v * scale for k, v in tensors.items()}, config

    # v0 close to the base model, so that its turns end (eos) as the base model's do; v1 far from it
    client.load_adapter(names[0], store.write(0, *scaled(21, 0.05), base_model=str(world.model_dir)))
    schedule = Admission(make_cfg(), groups_per_step=1, max_inflight=4)
    schedule.set_policy(0, names[0])

    def lookup(key: str) -> str:  # noqa: F811 - the format's tool name; this one publishes v1 on its first call
        """Answer, publishing version 1 the first time.

        Args:
            key: what the model wrote
        """
        if schedule.version == 0:
            client.load_adapter(names[1], store.write(1, *scaled(22, 1.0), base_model=str(world.model_dir)))
            schedule.set_policy(1, names[1])  # as the rollout side does once the version is served
        return f"[{len(key)}]"

    try:
        _, episodes, _ = run_episodes(client, names[0], n=4, tools=[lookup], seed=31, latest=schedule.latest)
        assert schedule.version == 1, [(e.turns, TOK.decode(e.ids)) for e in episodes]
        diffs = {0: [0.0], 1: [0.0]}  # |server logprob under v0 - sampled| per token, by the version it is tagged
        for e in episodes:
            seq = e.prompt_ids + e.ids
            under = {v: client.score(name, seq) for v, name in enumerate(names)}
            for i, (m, v, lp) in enumerate(zip(e.loss_mask, e.versions, e.logprobs)):
                if m:
                    position = len(e.prompt_ids) + i
                    assert abs(under[v][position] - lp) < 1e-3, (v, i)  # sampled by the version it is tagged with
                    diffs[v].append(abs(under[0][position] - lp))
        assert len(diffs[0]) > 1 and len(diffs[1]) > 1  # turns before the publish on v0, after it on v1
        assert max(diffs[1]) > 1e-2  # and those after it were not sampled by v0
        assert schedule.adapters_in_use() == set()  # every turn let its adapter go
    finally:
        unload_all(client, names)


RUN = {"max_turns": 3, "max_completion_length": 12, "num_generations": 4, "per_device_train_batch_size": 8,
       "max_steps": 2, "max_staleness": 0, "weight_sync_steps": 1, "lora_r": 8, "lora_alpha": 16,
       "lora_target_modules": ["q_proj", "v_proj"], "learning_rate": 1e-3, "vllm_server_timeout": 30,
       "vllm_request_timeout": 60, "torch_num_threads": 0, "lr_scheduler_type": "constant"}  # two steps, one rank


def train(values: dict) -> None:
    """A whole run in this process."""
    from asyncgrpo.config import AsyncGRPOConfig
    from asyncgrpo.trainer.recipe import GRPORecipe

    trainer = GRPORecipe(AsyncGRPOConfig.from_dict(values))
    try:
        trainer.setup()
        trainer.train()
    finally:
        trainer.cleanup()


def test_a_tool_calling_run_trains_on_exactly_the_tokens_the_server_sampled(world, vllm_server, tmp_path, tb_scalars):
    """A whole run (in this process, one rank, staleness 0) with `tools`."""
    import json

    model_dir = agent_model(world, tmp_path)
    data = tmp_path / "agent.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{a:02d},{b:02d}>"}]}) + "\n"
                            for a, b in [(7, 45), (81, 3), (12, 60), (44, 9)]))
    train({"model_name_or_path": str(model_dir), "dataset_name": str(data),
           "reward_funcs": ["agent_tools:messages_reward"], "tools": ["agent_format:lookup"], **RUN,
           "lora_name": "agent", "output_dir": str(tmp_path / "run"), "lora_adapter_path": str(tmp_path / "adapters"),
           "vllm_server_base_url": vllm_server.base_url})
    tb = tmp_path / "run" / "tensorboard"
    ratios = [v for _, v in tb_scalars(tb, "train/max_abs_log_ratio")]
    assert len(ratios) == 2 and max(ratios) < 1e-3, ratios  # every sampled token of every turn, both steps
    turns = [v for _, v in tb_scalars(tb, "episode/turns_mean")]
    assert len(turns) == 2 and max(turns) > 1.0, turns  # episodes of several turns were trained on
    calls = [v for _, v in tb_scalars(tb, "episodes/tool_calls_total")]
    assert calls[-1] > 0


def test_a_trl_environment_without_a_dataset_trains_scored_by_its_get_reward_and_a_function_that_logs(
        world, vllm_server, tmp_path, tb_scalars):
    """TRL's contract, unchanged: no dataset (reset() returns the prompt), get_reward() as a reward, and a reward
    function taking environments, log_metric, log_extra and trainer_state, whose metric reaches TensorBoard."""
    train({"model_name_or_path": str(agent_model(world, tmp_path)), "dataset_name": "environment",
           "environment_factory": "agent_tools:Riddles", "reward_funcs": ["agent_tools:said_reward"], **RUN,
           "lora_name": "riddles", "output_dir": str(tmp_path / "run"), "lora_adapter_path": str(tmp_path / "adapters"),
           "vllm_server_base_url": vllm_server.base_url})
    tb = tmp_path / "run" / "tensorboard"
    said = tb_scalars(tb, "train/said_mean")  # log_metric: the mean since the step before, at each step
    assert said and {step for step, _ in said} <= {1, 2} and all(v >= 0 for _, v in said), said
    assert len(tb_scalars(tb, "train/rewards/Riddles/mean")) == 2  # get_reward scored every step
    assert len(tb_scalars(tb, "train/rewards/said_reward/mean")) == 2
    ratios = [v for _, v in tb_scalars(tb, "train/max_abs_log_ratio")]
    assert len(ratios) == 2 and max(ratios) < 1e-3, ratios
