"""The parts of a rollout side, built and connected in one place: `build_parts` (what RolloutSide.start runs),
`build_producer` (the producer wired to its queue and recovery) and `make_group_scorer` (in-thread or worker
processes). Every callback between parts is passed here, where it can be read: no part registers itself on another.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from asyncgrpo.config import AGENT_KEY_ENV

from asyncgrpo.data import (EvalPromptSettings, PromptRow, PromptSettings, load_eval_prompts, load_prompt_set,
                            model_type_of, response_template_for, server_max_model_len)
from asyncgrpo.errors import ConfigError
from asyncgrpo.inference.client import InferenceClient
from asyncgrpo.inference.recovery import ServerRecovery
from asyncgrpo.rewards import RewardScorer
from asyncgrpo.rollout.agent_endpoint import AgentEndpoint
from asyncgrpo.rollout.agent_runner import AgentRunner, AgentRunnerSettings, agent_reward, load_agent_function
from asyncgrpo.rollout.delivery import make_delivery
from asyncgrpo.rollout.episodes import ChatFormat, EpisodeRunner, environment_reward
from asyncgrpo.rollout.preflight import require_healthy_setup
from asyncgrpo.rollout.producer import ProducerSettings, RolloutProducer
from asyncgrpo.rollout.publish import AdapterPublisher, run_prefix
from asyncgrpo.rollout.served_check import ServedCheck, ServedCheckSettings
from asyncgrpo.rollout.queue import RolloutQueue
from asyncgrpo.rollout.reward_pool import RewardPool, TokenizerRef
from asyncgrpo.rollout.scoring import GroupScorer, InThreadScoring
from asyncgrpo.rollout.tools import environment_class, load_environment_factory, load_tools
from asyncgrpo.store import AdapterStore, clean_stale_temporaries


@dataclass
class RolloutParts:
    """What RolloutSide.start builds: each part, already connected to the others."""

    clients: list[InferenceClient]  # one per server in vllm_server_base_url
    store: AdapterStore  # this run's adapter versions on disk
    recovery: ServerRecovery  # which servers are up; brings one back (and restores the live adapter on it)
    publisher: AdapterPublisher  # writes nothing itself: loads versions on the servers, retires old ones
    queue: RolloutQueue  # scored groups, handed to the trainer by version
    scorer: GroupScorer  # decodes and scores groups: in the request threads or in reward worker processes
    producer: RolloutProducer  # keeps requests in flight and fills the queue (not started)
    prompts_skipped_too_long: int  # prompts dropped at load: no room left for max_completion_length tokens
    eval_rows: list[PromptRow]  # eval_dataset's prompts (empty without one)


def build_parts(cfg, *, tokenizer, model_path: str, run_id: str, groups_per_step: int,
                start_position: int = 0, start_batch: int = 0) -> RolloutParts:  # pragma: no mutate block
    """Check every server (`asyncgrpo doctor`: fail now, naming the fix), then build the parts of one run's rollout
    side. `start_position`: where the data stream resumes; `start_batch`: the first batch the producer fills."""
    clients = [InferenceClient(url, api_key=cfg.api_key, timeout_s=cfg.vllm_request_timeout)
               for url in cfg.server_urls]
    for client in clients:
        client.wait_healthy(cfg.vllm_server_timeout)
    require_healthy_setup(cfg, clients, model_path)
    clean_stale_temporaries(cfg.lora_adapter_path)  # what writers of killed runs left in their directories
    store = AdapterStore(Path(cfg.lora_adapter_path) / run_id)
    # A server that stops answering is waited for (vllm_server_timeout) and gets the live adapter back before any
    # generation goes to it; rollouts and syncs share this one view of which servers are up. Recovery and the
    # publisher need each other: the publisher, built just below, is reached when a server comes back.
    recovery = ServerRecovery(cfg.vllm_server_timeout, restore=lambda client: publisher.restore(client))
    publisher = AdapterPublisher(clients, run_prefix(cfg.lora_name, run_id), cfg.sync_mode, cfg.sync_pause_mode,
                                 recovery=recovery, adapter_root=cfg.lora_adapter_path,  # paths sent never leave it
                                 delivery=make_delivery(cfg),  # adapter_delivery: shared_fs | http
                                 served_check=ServedCheck.from_config(cfg.section(ServedCheckSettings)))  # None: off
    # Prompts that leave the server no room for max_completion_length tokens are skipped (and counted). The first
    # server answers for what all share: the base model, max_model_len.
    prompts = load_prompt_set(cfg.section(PromptSettings), tokenizer, model_path=model_path,
                              server_max_model_len=server_max_model_len(clients[0].models()))
    eval_rows = load_eval_prompts(cfg.section(EvalPromptSettings), tokenizer,
                                  server_max_model_len=server_max_model_len(clients[0].models()))
    queue = RolloutQueue(cfg.max_staleness, scale_rewards=cfg.scale_rewards, dynamic_sampling=cfg.dynamic_sampling)
    # With tools or an environment, completions are episodes (docs/agents.md); else this is None.
    episodes = build_episode_runner(cfg, tokenizer, model_path, server_max_model_len(clients[0].models()))
    scorer = make_group_scorer(cfg, tokenizer, prompts.response_template)
    try:
        producer = build_producer(cfg, clients=clients, rows=prompts.rows, scorer=scorer, queue=queue,
                                  groups_per_step=groups_per_step, recovery=recovery, start_position=start_position,
                                  start_batch=start_batch, end_token_ids=end_token_ids(tokenizer, model_path),
                                  episodes=episodes)
    except BaseException:
        scorer.close()  # reward worker processes, if any: nothing else will
        raise
    return RolloutParts(clients=clients, store=store, recovery=recovery, publisher=publisher, queue=queue,
                        scorer=scorer, producer=producer, prompts_skipped_too_long=prompts.skipped_too_long,
                        eval_rows=eval_rows)


def build_producer(cfg, *, clients: list[InferenceClient], rows: list[PromptRow], scorer: GroupScorer,
                   queue: RolloutQueue, groups_per_step: int, recovery: ServerRecovery | None = None,
                   start_position: int = 0, start_batch: int = 0,
                   end_token_ids: frozenset[int] = frozenset(),
                   episodes: EpisodeRunner | None = None) -> RolloutProducer:
    """A producer (not started) whose schedule hears what changes its send rule: a server going down or coming back
    (`recovery`; a fresh one if None) and groups leaving the queue. The unit tests and `asyncgrpo bench producer`
    build theirs here too, so that theirs is wired the same way."""
    recovery = recovery if recovery is not None else ServerRecovery(cfg.vllm_server_timeout)
    producer = RolloutProducer(clients=clients, rows=rows, scorer=scorer, queue=queue, groups_per_step=groups_per_step,
                               cfg=cfg.section(ProducerSettings), max_inflight=cfg.inflight_requests(groups_per_step),
                               inflight_ceiling=(cfg.inflight_ceiling(groups_per_step) if cfg.adaptive_inflight
                                                 else None),
                               recovery=recovery, start_position=start_position, start_batch=start_batch,
                               end_token_ids=end_token_ids, episodes=episodes)
    recovery.listeners.append(producer.admission.wake)  # a server went down or came back: decide again
    queue.removal_listeners.append(producer.admission.removed)  # groups taken or dropped free their batch's slots
    return producer


def end_token_ids(tokenizer, model_path: str) -> frozenset[int]:
    """The tokens vLLM stops a completion on by default: the tokenizer's EOS and the model's generation config's
    `eos_token_id` (one id or a list), which vLLM adds to every request's stop tokens."""
    # heavy: transformers is imported already (the tokenizer); GenerationConfig reads generation_config.json only
    from transformers import GenerationConfig

    ids = {tokenizer.eos_token_id} - {None}
    try:
        eos = GenerationConfig.from_pretrained(model_path).eos_token_id
    except (OSError, ValueError):  # no (readable) generation_config.json: the tokenizer's EOS alone
        eos = None
    ids |= set(eos if isinstance(eos, list) else [eos]) - {None}
    return frozenset(ids)


def make_group_scorer(cfg, tokenizer, response_template: dict | None) -> GroupScorer:
    """The scorer `reward_workers` asks for. The pool's workers load the tokenizer from the directory the trainer
    loaded it from (`tokenizer.name_or_path`, a local directory: `data.local_model_dir`)."""
    scorer = RewardScorer(list(cfg.reward_funcs or []), cfg.reward_weights, cfg.reward_fallback, cfg.reward_kwargs)
    scorer.state.max_steps = cfg.max_steps  # TRL's trainer_state.max_steps
    factory = load_environment_factory(cfg.environment_factory) if cfg.environment_factory else None
    kind = environment_class(factory, cfg.environment_factory) if factory is not None else None
    owns_reward = kind is not None and callable(getattr(kind, "get_reward", None))
    if cfg.agent_function:
        # An agent function's float return is one more reward, named after the function, weight 1
        scorer.refs.append(cfg.agent_function)
        scorer.functions.append(agent_reward)
        scorer.weights = [*scorer.weights, 1.0]
    elif not cfg.reward_funcs and not owns_reward:
        raise ConfigError("reward_funcs", f"is empty and {cfg.environment_factory} has no get_reward(), so nothing "
                          "scores the episodes", "name a reward function, or give the environment a get_reward()")
    if owns_reward:
        # TRL: an environment's get_reward() is one more reward, named after its class, weight 1
        scorer.refs.append(f"{kind.__module__}:{kind.__name__}")
        scorer.functions.append(environment_reward)
        scorer.weights = [*scorer.weights, 1.0]
    if not scorer.functions:
        raise ConfigError("reward_funcs", f"is not given, and {cfg.environment_factory} has no get_reward() "
                          "method: the run would have no reward", "name reward functions in reward_funcs, or give the "
                          "environment class a get_reward()")
    if cfg.reward_workers == 0:
        return InThreadScoring(scorer, tokenizer, response_template, timeout_s=cfg.reward_timeout)
    return RewardPool(cfg.reward_workers, scorer, TokenizerRef.of(tokenizer), response_template,
                      timeout_s=cfg.reward_timeout)


def build_episode_runner(cfg, tokenizer, model_path: str,
                         max_model_len: int | None) -> EpisodeRunner | AgentRunner | None:
    """The runner of multi-turn episodes when `tools` or `environment_factory` is set, of the agent function's
    episodes (and its endpoint, listening from now on) with `agent_function`, else None (one completion per prompt).
    Turns end at the tokenizer's eos or one of generation_config.json's (the server stops there too)."""
    if not cfg.uses_episodes:
        return None
    stop_ids = set(end_token_ids(tokenizer, model_path))
    fmt = ChatFormat(tokenizer, response_template_for(tokenizer, model_type_of(model_path)), stop_ids=stop_ids,
                     template_kwargs=cfg.chat_template_kwargs, system_prompt=cfg.system_prompt)
    if cfg.agent_function:
        agent = load_agent_function(cfg.agent_function)
        endpoint = AgentEndpoint(cfg.agent_endpoint_host, cfg.agent_endpoint_port, temperature=cfg.temperature,
                                 top_p=cfg.top_p, key=os.environ.get(AGENT_KEY_ENV) or None)
        return AgentRunner(fmt, cfg.section(AgentRunnerSettings), agent=agent, endpoint=endpoint,
                           max_model_len=max_model_len)
    factory = load_environment_factory(cfg.environment_factory) if cfg.environment_factory else None
    # The config itself, which holds EpisodeSettings' keys (tests/unit/rollout/test_build.py checks the runner gets
    # that very object); scripts/layout_report.py checks that the runner reads no other keys.
    return EpisodeRunner(fmt, cfg, tools=load_tools(cfg.tools), factory=factory, max_model_len=max_model_len)
