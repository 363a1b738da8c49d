"""Reading a vLLM server's load from its Prometheus text (the shape vLLM 0.32's `/metrics` has: HELP/TYPE comments,
one sample per engine and model label set, counters beside the gauges)."""

from asyncgrpo.inference.server_load import ServerLoad, parse_server_load

TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="toy"} 3.0
vllm:num_requests_running{engine="1",model_name="toy"} 2.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
vllm:num_requests_waiting{engine="0",model_name="toy"} 4.0 1733000000000
vllm:num_requests_waiting{engine="1",model_name="toy"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="toy"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="toy"} 0.75
vllm:num_requests_running_total{engine="0"} 99.0
vllm:request_success_total{engine="0",finished_reason="stop",model_name="toy"} 7.0
"""


def test_requests_are_summed_over_engines_and_the_fullest_cache_counts():
    assert parse_server_load(TEXT) == ServerLoad(running=5.0, waiting=4.0, kv_cache_usage=0.75)


def test_names_must_match_whole_and_samples_without_labels_count():
    text = "vllm:num_requests_waiting_sum 8\nvllm:num_requests_waiting 2\nvllm:kv_cache_usage_perc NaN\n"
    assert parse_server_load(text) == ServerLoad(running=0.0, waiting=2.0, kv_cache_usage=0.0)


def test_text_without_vllms_gauges_is_no_load_at_all():
    assert parse_server_load("# just a comment\nprocess_cpu_seconds_total 12.5\n") is None
    assert parse_server_load("vllm:num_requests_running{engine=\"0\"} many\n") is None
