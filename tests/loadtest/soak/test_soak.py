"""The soak runner: its configuration, fault schedule, request mix and outcomes on synthetic
data (the invariants: ``test_soak_invariants.py``), and one short end-to-end soak of the
production configuration under faults."""

from __future__ import annotations

import json
import shutil
import tomllib
from pathlib import Path
from typing import Any

import pytest

from gateway.config.settings import load_settings
from loadtest.soak import config as soak_config
from loadtest.soak import prom as soak_prom
from loadtest.soak.faults import (
    BACKEND_FAULTS,
    CANARY,
    PAUSE_HOLD_S,
    REDIS_FAULTS,
    STABLE,
    FaultWindow,
    healthy_backends_at,
    overlapping,
    plan_faults,
    probe_times,
    probed_key_quiet,
)
from loadtest.soak.mix import BAD_INPUT, DISCONNECTS, NESTING, PROBED_KEY, Mix
from loadtest.soak.outcomes import (
    Observation,
    classify,
    gateway_error_documented,
    parse_envelope,
    stream_error_event,
)
from loadtest.soak.runner import SoakOptions, run_soak
from tests.loadtest.soak.soak_data import BACKENDS, envelope, kill, obs
from tests.redis_server import HOW_TO_GET_REDIS

# -- the configuration ------------------------------------------------------------------------


def production() -> dict[str, Any]:
    return tomllib.loads(soak_config.PRODUCTION_TOML.read_text())


def rewritten(**kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = {
        "sims": {n: f"http://127.0.0.1:{9000 + i}" for i, n in enumerate(BACKENDS)},
        "redis_url": "redis://127.0.0.1:7000/0",
        "key_prefix": "soak:abc:",
        "otlp_endpoint": "http://127.0.0.1:4318/v1/traces",
        "port": 8100,
        "admin_port": 8101,
    }
    return soak_config.rewrite(production(), **(args | kw))


def test_the_rewritten_production_file_points_at_the_run_and_keeps_the_rest() -> None:
    doc = rewritten()
    assert [(b["name"], b["url"]) for b in doc["backends"]] == [
        ("gpu-a", "http://127.0.0.1:9000"),
        ("gpu-b", "http://127.0.0.1:9001"),
        ("gpu-canary", "http://127.0.0.1:9002"),
    ]
    assert doc["limits"]["redis"]["url"] == "redis://127.0.0.1:7000/0"
    assert doc["limits"]["redis"]["key_prefix"] == "soak:abc:"
    assert doc["limits"]["redis"]["failure_mode"] == "open"  # production's, kept
    assert doc["tracing"]["otlp_endpoint"] == "http://127.0.0.1:4318/v1/traces"
    assert (doc["host"], doc["port"], doc["admin"]["port"]) == ("127.0.0.1", 8100, 8101)
    assert doc["log_level"] == "warning"
    assert doc["health"]["interval"] == 0.5
    assert doc["pools"] == production()["pools"]
    assert doc["aliases"] == {"chat": {"stable": 95, "canary": 5}}
    assert doc["limits"]["keys"] == production()["limits"]["keys"]


def test_the_rewritten_file_round_trips_through_toml_and_the_gateway_accepts_it(
    tmp_path: Path,
) -> None:
    doc = rewritten(aliases={"chat": {"stable": 80, "canary": 20}})
    text = soak_config.dumps(doc)
    assert tomllib.loads(text) == doc
    path = tmp_path / "gateway.toml"
    path.write_text(text)
    settings = load_settings(path)
    assert [b.id for b in settings.backends] == list(BACKENDS)
    assert settings.aliases == {"chat": {"stable": 80.0, "canary": 20.0}}
    assert settings.limits.store == "redis"
    assert settings.limits.admission.enabled


def test_toml_strings_with_quotes_and_odd_keys_survive() -> None:
    doc = {"a b": 'say "hi"\\n', "t": {"x.y": [1, 2.5, True]}, "arr": [{"k": 1}, {"k": 2}]}
    assert tomllib.loads(soak_config.dumps(doc)) == doc


def test_a_file_without_the_runner_s_backends_is_refused() -> None:
    with pytest.raises(soak_config.SoakConfigError):
        rewritten(sims={"gpu-a": "http://127.0.0.1:1"})


def test_the_probed_key_is_the_default_tier_at_60_a_minute() -> None:
    tier = soak_config.tier_of(production(), PROBED_KEY)
    assert tier["requests_per_minute"] == 60
    assert tier["max_concurrent"] == 4


# -- the fault schedule -----------------------------------------------------------------------


def test_a_short_run_gets_every_fault_once() -> None:
    plan = plan_faults(120)
    kinds = [f.kind for f in plan]
    for kind in ("kill", "hang", "error_burst", "redis_kill", "redis_pause", "reload", "policy",
                 "canary_shift", "canary_rollback", "limits_probe"):  # fmt: skip
        assert kind in kinds
    assert all(0 <= f.at < 120 for f in plan)
    assert [f.at for f in plan] == sorted(f.at for f in plan)
    assert probe_times(plan) == [0.0]


def test_backend_faults_come_one_at_a_time_and_the_canary_is_only_marked_down() -> None:
    for duration in (112, 120, 180, 600, 1800):
        plan = plan_faults(duration)
        assert overlapping(plan) == []
        targets = {f.target for f in plan if f.kind in BACKEND_FAULTS and f.kind != "down"}
        assert targets == set(STABLE)  # never killed or hung: the canary pool's only backend
        assert {f.target for f in plan if f.kind == "down"} == {CANARY}


def test_a_long_run_repeats_the_cycle() -> None:
    plan = plan_faults(1800)
    assert sum(f.kind == "kill" for f in plan) == 12
    assert len(probe_times(plan)) == 6
    assert sum(f.kind == "redis_pause" for f in plan) == 6
    assert all(
        not any(w.kind in REDIS_FAULTS and p - 5 < w.at + w.hold and w.at < p + 5 for w in plan)
        for p in probe_times(plan)
    )  # a probe never runs near a Redis outage


def test_too_short_a_run_for_the_faults_is_noticed() -> None:
    assert overlapping(plan_faults(60)) != []
    assert overlapping(plan_faults(100)) != []  # the Redis pause meets a backend fault


def test_redis_is_paused_a_few_seconds_and_killed_apart_from_backend_faults() -> None:
    plan = plan_faults(130)
    pause = next(f for f in plan if f.kind == "redis_pause")
    assert pause.hold == PAUSE_HOLD_S
    assert 1.5 * 2.0 < pause.hold < 6.0  # past a change's wait for Redis, within a report TTL
    for f in plan:
        if f.kind in BACKEND_FAULTS:
            assert not (f.at < pause.at + pause.hold + 5 and pause.at < f.at + f.hold + 5), f


def test_the_probed_key_rests_before_each_probe() -> None:
    assert probed_key_quiet(0.0, [0.0])
    assert probed_key_quiet(240.0, [300.0])
    assert not probed_key_quiet(200.0, [300.0])
    assert not probed_key_quiet(40.0, [0.0])


def test_healthy_backends_follow_the_fault_windows() -> None:
    windows = [kill("gpu-a", 20, 25), FaultWindow("redis_kill", None, 21, 23)]
    assert healthy_backends_at(windows, BACKENDS, 22) == {"gpu-b", "gpu-canary"}
    assert healthy_backends_at(windows, BACKENDS, 30) == set(BACKENDS)


# -- the request mix --------------------------------------------------------------------------


def test_the_mix_is_seeded_and_has_every_behaviour() -> None:
    a, b = Mix(7), Mix(7)
    plans = [a.next(i) for i in range(3000)]
    assert plans[:50] == [b.next(i) for i in range(50)]
    behaviours = {p.behaviour for p in plans}
    assert behaviours >= DISCONNECTS | BAD_INPUT | {"normal", "slow_reader", "wrong_key"}
    assert {p.replica for p in plans} == {0, 1}
    assert {p.key for p in plans} == {"web-app", "nightly-batch", PROBED_KEY, "wrong"}
    assert {json.loads(p.body)["model"] for p in plans if p.behaviour == "normal"} == {
        "chat",
        "llama",
    }


def test_leavers_ask_for_long_answers_and_streams_when_they_leave_mid_way() -> None:
    mix = Mix(1)
    for p in (mix.next(i) for i in range(3000)):
        if p.behaviour in DISCONNECTS:
            body = json.loads(p.body)
            assert body["max_tokens"] >= 128
            assert body["ignore_eos"] is True
        if p.behaviour in ("disconnect_mid_stream", "disconnect_after_head", "slow_reader"):
            assert p.stream
        if p.behaviour == "disconnect_mid_stream":
            assert 1 <= p.leave_after_tokens <= 8


def test_the_probed_key_is_left_out_when_asked() -> None:
    mix = Mix(3)
    assert all(mix.next(i, probed_key_allowed=False).key != PROBED_KEY for i in range(2000))


def test_bad_bodies_are_what_they_say() -> None:
    mix = Mix(5)
    bad = {
        p.behaviour: p.body for p in (mix.next(i) for i in range(5000)) if p.behaviour in BAD_INPUT
    }
    with pytest.raises(json.JSONDecodeError):
        json.loads(bad["bad_malformed"])
    with pytest.raises(RecursionError):
        json.loads(bad["bad_nested"])
    assert bad["bad_nested"].count(b"[") == NESTING
    assert isinstance(json.loads(bad["bad_list"]), list)
    assert json.loads(bad["bad_unknown_model"])["model"] == "no-such-model"


# -- outcomes ---------------------------------------------------------------------------------


def test_envelopes_are_read_and_told_apart() -> None:
    gw = parse_envelope(
        b'{"error":{"message":"x","type":"bad_gateway","param":null,"code":"backend_down"}}'
    )
    assert gw is not None
    assert gw.well_formed
    assert not gw.from_backend
    vllm = parse_envelope(
        b'{"error":{"message":"x","type":"ServiceUnavailableError","param":null,"code":503}}'
    )
    assert vllm is not None
    assert vllm.from_backend
    partial = parse_envelope(b'{"error":{"message":"x"}}')
    assert partial is not None
    assert not partial.well_formed
    assert parse_envelope(b"not json") is None
    assert parse_envelope(b"[1]") is None
    tail = (
        b'data: {"id":1}\n\ndata: {"error":{"message":"cut","type":"bad_gateway","param":null,'
        b'"code":"backend_unreachable"}}\n\ndata: [DONE]\n\n'
    )
    event = stream_error_event(tail)
    assert event is not None
    assert event.code == "backend_unreachable"


@pytest.mark.parametrize(
    ("observation", "outcome"),
    [
        (obs(), "ok"),
        (obs(left="mid_stream", left_at=10.5), "left_mid_stream"),
        (obs(status=0, exception="connect"), "connection_error"),
        (obs(status=0, exception="stall"), "client_timeout"),
        (obs(error=envelope("backend_unreachable", "bad_gateway")), "stream_cut"),
        (obs(done=False), "stream_incomplete"),
        (obs(status=502, error=envelope("backend_unreachable", "bad_gateway")), "gateway_error"),
        (obs(status=503, error=envelope("no_backend_available")), "no_backend_available"),
        (obs(status=503, error=envelope("queue_full")), "admission_rejected"),
        (obs(status=503, error=envelope("limits_unavailable")), "limits_unavailable"),
        (obs(status=503, error=envelope(503, "ServiceUnavailableError")), "backend_refused"),
        (obs(status=500, error=envelope(500, "InternalServerError")), "backend_error"),
        (obs(status=500, error=envelope(None, "internal_error")), "internal_error"),
        (obs(status=502), "undocumented_5xx"),
        (obs(status=429, error=envelope("rate_limit_exceeded", "requests")), "rate_limited"),
        (obs(behaviour="wrong_key", status=401, error=envelope("invalid_api_key")),
         "auth_rejected"),
        (obs(behaviour="wrong_key", status=200), "auth_not_rejected"),
        (obs(behaviour="bad_nested", status=400, error=envelope("invalid_json")),
         "bad_input_rejected"),
        (obs(behaviour="bad_list", status=400), "bad_input_not_rejected"),
        (obs(behaviour="bad_list", status=500, error=envelope(None, "internal_error")),
         "bad_input_not_rejected"),
    ],
)  # fmt: skip
def test_each_ending_has_its_outcome(observation: Observation, outcome: str) -> None:
    assert classify(observation) == outcome


def test_documented_gateway_errors() -> None:
    assert gateway_error_documented(envelope("queue_timeout"))
    assert gateway_error_documented(envelope(503, "ServiceUnavailableError"))  # a backend's own
    assert not gateway_error_documented(envelope(None, "internal_error"))
    assert not gateway_error_documented(envelope("made_up_code"))
    assert not gateway_error_documented(None)


# -- Prometheus text --------------------------------------------------------------------------

PAGE = """# HELP llm_gateway_backend_in_flight x
# TYPE llm_gateway_backend_in_flight gauge
llm_gateway_backend_in_flight{backend="gpu-a"} 2.0
llm_gateway_backend_in_flight{backend="gpu-b"} 0.0
llm_gateway_upstream_aborts_total{backend="gpu-a",reason="client_disconnect"} 5.0
llm_gateway_upstream_aborts_total{backend="gpu-b",reason="client_disconnect"} 3.0
llm_gateway_upstream_aborts_total{backend="gpu-b",reason="error"} 1.0
llm_gateway_admission_queue_length 0.0
weird{a="x\\"y"} NaN
"""


def test_labelled_samples_series_and_totals() -> None:
    found = soak_prom.samples(PAGE)
    assert soak_prom.series_count(PAGE) == 7
    assert soak_prom.by_label(found, "llm_gateway_backend_in_flight", "backend") == {
        "gpu-a": 2.0,
        "gpu-b": 0.0,
    }
    aborts = "llm_gateway_upstream_aborts_total"
    assert soak_prom.total(found, aborts, reason="client_disconnect") == 8.0
    assert soak_prom.by_label(found, aborts, "reason") == {"client_disconnect": 8.0, "error": 1.0}
    assert all(s.name != "weird" for s in found)  # NaN is no figure


# -- end to end -------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.soak
@pytest.mark.timeout(600)
async def test_a_short_soak_holds_every_invariant(tmp_path: Path) -> None:
    if shutil.which("redis-server") is None:  # the soak kills and restarts a Redis of its own
        pytest.fail(HOW_TO_GET_REDIS)
    result = await run_soak(SoakOptions(duration=130.0, concurrency=16, seed=1, out=tmp_path))
    for v in result.verdicts:  # shown by pytest when the test fails
        print(f"{'PASS' if v.passed else 'FAIL'}  {v.name}: {v.why}")
    for name in ("result.json", "report.md", "plot.png"):
        assert (tmp_path / name).stat().st_size > 0
    doc = json.loads((tmp_path / "result.json").read_text())
    assert doc["requests"]["total"] > 500
    failures = "\n".join(f"{v.name}: {v.why}" for v in result.failed)
    assert result.passed, f"invariants failed:\n{failures}"
