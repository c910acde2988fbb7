"""Reading vLLM's load gauges out of its Prometheus page."""

from __future__ import annotations

import pytest

from backends.vllm_metrics import MetricsFormatError, parse_load

PAGE = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="tiny"} 7.0
# TYPE vllm:num_requests_waiting_by_reason gauge
vllm:num_requests_waiting_by_reason{engine="0",model_name="tiny",reason="capacity"} 99.0
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.4375
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="tiny"} 0.0
vllm:num_requests_running_fake_suffix 1000.0
"""


def test_reads_waiting_running_and_kv_usage() -> None:
    r = parse_load(PAGE)
    assert (r.waiting, r.running, r.kv_cache_usage) == (7, 3, 0.4375)


def test_sums_over_engines_and_takes_the_highest_kv() -> None:
    page = PAGE + (
        'vllm:num_requests_waiting{engine="1",model_name="tiny"} 2\n'
        'vllm:kv_cache_usage_perc{engine="1",model_name="tiny"} 0.9\n'
    )
    r = parse_load(page)
    assert r.waiting == 9
    assert r.kv_cache_usage == 0.9


def test_pre_0_9_kv_name_is_understood() -> None:
    page = PAGE.replace("kv_cache_usage_perc", "gpu_cache_usage_perc")
    assert parse_load(page).kv_cache_usage == 0.4375


def test_unlabelled_lines_and_timestamps() -> None:
    r = parse_load("vllm:num_requests_waiting 4 1700000000000\nvllm:num_requests_running 1\n")
    assert (r.waiting, r.running, r.kv_cache_usage) == (4, 1, None)


@pytest.mark.parametrize(
    "page",
    [
        "",
        "<html>not metrics</html>",
        'vllm:num_requests_waiting{model_name="x"} NaN\n',
        'vllm:num_requests_waiting{model_name="x"} -3\n',
        'vllm:num_requests_waiting{model_name="x"} lots\n',
    ],
)
def test_a_page_without_sane_gauges_is_refused(page: str) -> None:
    with pytest.raises(MetricsFormatError):
        parse_load(page)
