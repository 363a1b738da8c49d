"""InferenceClient against the real vLLM CPU server: adapter endpoints, pause/resume, completions, errors."""

import uuid

import pytest

from asyncgrpo.errors import InferenceServerError

PROMPT = [3 + b for b in b"12,34>"]


@pytest.fixture()
def adapter_dir(world, tmp_path, random_adapter):
    from asyncgrpo.store import AdapterStore

    tensors, config = random_adapter(seed=5)
    return AdapterStore(tmp_path).write(1, tensors, config, base_model=str(world.model_dir))


def test_completions_return_exact_token_ids_with_one_logprob_each_and_the_eos(client):
    completions = client.complete(client.base_model(), PROMPT, n=8, max_tokens=4, temperature=1.0)
    assert len(completions) == 8
    for c in completions:
        assert len(c.token_ids) == len(c.logprobs) >= 1
        assert all(lp <= 0.0 for lp in c.logprobs)
        if c.finish_reason == "stop":
            assert c.token_ids[-1] == 0  # the eos is part of the completion the trainer trains on


def test_load_read_back_and_unload_an_adapter(client, adapter_dir):
    name = f"probe-{uuid.uuid4().hex[:6]}"
    client.load_adapter(name, adapter_dir)
    assert client.adapter_paths()[name] == str(adapter_dir)
    served = client.complete(name, PROMPT, n=1, max_tokens=3, temperature=0.0)[0]
    assert served.model == name
    assert client.score(name, PROMPT + served.token_ids)[len(PROMPT):] == pytest.approx(served.logprobs, abs=1e-5)
    client.unload_adapter(name)
    assert name not in client.adapter_paths()


def test_pause_and_resume_are_read_back(client):
    client.pause(mode="keep")
    try:
        assert client.is_paused() is True
    finally:
        client.resume()
    assert client.is_paused() is False


def test_server_errors_quote_the_server_and_say_what_to_check(client, tmp_path):
    with pytest.raises(InferenceServerError) as err:
        client.unload_adapter("never-loaded")
    assert err.value.status == 404 and "never-loaded" in err.value.body
    assert "VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in str(err.value)
    with pytest.raises(InferenceServerError) as err:
        client.load_adapter("missing", tmp_path / "no-such-adapter")
    assert err.value.status == 404 and "HTTP 404" in str(err.value)
    with pytest.raises(InferenceServerError, match="does not exist"):
        client.complete("no-such-model", PROMPT, n=1, max_tokens=2)


def test_start_up_check_names_the_server_flag_to_change(client):
    from types import SimpleNamespace

    from asyncgrpo.inference.checks import ServerContext, check_lora_enabled, check_max_lora_rank, check_max_loras

    def lora_checks(lora_r: int, max_staleness: int) -> dict:
        ctx = ServerContext(SimpleNamespace(lora_r=lora_r, max_staleness=max_staleness), client, model_path="")
        return {r.name: r for r in (c(ctx) for c in (check_lora_enabled, check_max_lora_rank, check_max_loras))}

    config = client.server_config()
    assert config["lora_config"]["max_loras"] == 4 and config["lora_config"]["max_lora_rank"] == 8
    # What the session server was started for: rank 8, max_staleness 2 (2 + 2 adapters at once).
    assert all(r.ok is True for r in lora_checks(lora_r=8, max_staleness=2).values())
    rank = lora_checks(lora_r=16, max_staleness=1)["max_lora_rank"]
    assert rank.ok is False and "restart it with --max-lora-rank 16" in rank.line()
    loras = lora_checks(lora_r=8, max_staleness=3)["max_loras"]
    assert loras.ok is False and "restart it with --max-loras 5" in loras.line()

def test_the_servers_load_is_read_from_its_metrics_idle_and_while_it_generates(client):
    """vLLM 0.32's /metrics as adaptive_inflight reads it: nothing running when idle, the request's sequences counted
    while they are sampled (ignore_eos keeps them going for max_tokens)."""
    import threading

    idle = client.server_load()
    assert idle is not None and idle.running == 0 and idle.waiting == 0 and 0 <= idle.kv_cache_usage < 0.9
    outcome = []

    def generate():
        try:
            outcome.append(client.complete(client.base_model(), PROMPT, n=4, max_tokens=96, extra={"ignore_eos": True}))
        except Exception as exc:  # noqa: BLE001 - reported by the assertion below
            outcome.append(exc)

    worker = threading.Thread(target=generate)
    worker.start()
    busy = []
    while worker.is_alive():
        busy.append(client.server_load())
        worker.join(0.05)  # a read every 50 ms while the request runs
    assert len(outcome) == 1 and [len(c.token_ids) for c in outcome[0]] == [96] * 4, outcome
    assert max(b.running for b in busy) >= 1, busy[-3:]
    assert max(b.kv_cache_usage for b in busy) > idle.kv_cache_usage  # the sequences' KV blocks were counted
