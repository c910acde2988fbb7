"""The peer bench's load generator and its fake backends (``tools.fake_vllm``) speak to each
other, in process; every built-in target's templates render; the driver starts its backends."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from loadtest.peers import cli, driver, loadgen
from loadtest.peers.report import render_md
from loadtest.peers.targets import BUILTIN_TARGETS, render_ctx
from tools.fake_vllm import create_app


@pytest.fixture
async def backend() -> AsyncIterator[str]:
    """The fake backend, as fast as it can stream, on a port of its own."""
    runner = web.AppRunner(create_app("tiny"))
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await runner.cleanup()


async def _load(url: str, *more: str) -> dict[str, Any]:
    args = loadgen.parse_args(["--url", url, "-c", "2", "-n", "6", "-t", "5", *more])
    return await loadgen.run(args)


async def test_chat_streams_count_every_token(backend: str) -> None:
    result = await _load(backend)
    assert (result["requests_ok"], result["errors"], result["timeouts"]) == (6, 0, 0)
    assert result["token_mismatch"] == 0
    assert result["endpoint"] == "/v1/chat/completions"
    assert result["ttft_ms"]["p50"] is not None
    # the role chunk, 5 tokens, the usage chunk and [DONE] are events; only the tokens are content
    assert result["all_events_per_s"] / result["events_per_s"] == pytest.approx(8 / 5, rel=1e-3)


async def test_completions_without_usage(backend: str) -> None:
    result = await _load(backend, "--endpoint", "completions", "--no-include-usage")
    assert (result["requests_ok"], result["errors"], result["token_mismatch"]) == (6, 0, 0)
    assert result["all_events_per_s"] / result["events_per_s"] == pytest.approx(6 / 5, rel=1e-3)


async def test_an_error_answer_counts_as_an_error(backend: str) -> None:
    result = await _load(backend + "/nowhere")
    assert (result["requests_ok"], result["errors"]) == (0, 6)
    assert list(result["error_samples"]) == ["HTTP 404: b'404: Not Found'"]


async def test_metrics_name_the_model(backend: str) -> None:
    await _load(backend)
    async with aiohttp.ClientSession() as session, session.get(backend + "/metrics") as resp:
        text = await resp.text()
    assert 'vllm:generation_tokens_total{engine="0",model_name="tiny"} 30.0' in text


def test_every_builtin_target_renders(tmp_path: Path) -> None:
    args = cli.parse_args([])
    args.venvs = str(tmp_path / "venvs")
    for name, spec in BUILTIN_TARGETS.items():
        ctx = render_ctx(args, name, str(tmp_path), [18001, 18002], spec.get("api_key", ""))
        if spec["cmd"] is None:
            continue
        templates = [spec["cmd"], *(spec.get("files") or {}).values()]
        rendered = [t.format(**ctx) for t in [*templates, *(spec.get("env") or {}).values()]]
        assert any(
            f"127.0.0.1:{args.proxy_port}" in r
            or f"--port {args.proxy_port}" in r
            or f" {args.proxy_port} " in r
            for r in rendered
        ), name


def test_the_repository_targets_run_from_this_checkout(tmp_path: Path) -> None:
    args = cli.parse_args([])
    args.venvs = str(tmp_path)
    root = Path(__file__).resolve().parents[3]
    for name in ("raw", "lean", "bare"):
        ctx = render_ctx(args, name, str(tmp_path), [18001, 18002])
        cmd = BUILTIN_TARGETS[name]["cmd"].format(**ctx)
        assert f"{root}/scripts/proxy_cost/{name}_proxy.py 18100 18001 18002" in cmd


def test_render_remakes_the_page_from_the_json(tmp_path: Path) -> None:
    docs = Path(__file__).resolve().parents[3] / "docs" / "bench"
    stored = min(docs.glob("peers-*.json"))
    copy = tmp_path / stored.name
    copy.write_text(stored.read_text())
    cli.main(["--render", str(copy)])
    page = copy.with_suffix(".md").read_text()
    assert page == render_md(json.loads(stored.read_text()))
    assert page.startswith("# Gateway SSE forwarding benchmark")


def test_results_dir_is_recorded_relative_to_the_checkout() -> None:
    assert cli._shown(driver.RESULTS) == "docs/bench"
    assert cli._shown("/tmp/elsewhere") == "/tmp/elsewhere"


def test_the_backends_cpu_gets_a_table_only_in_runs_that_measured_it() -> None:
    docs = Path(__file__).resolve().parents[3] / "docs" / "bench"
    res = json.loads(min(docs.glob("peers-*.json")).read_text())
    assert "## The fake backends" not in render_md(res)
    target = next(iter(res["targets"].values()))
    level = next(iter(next(iter(target["profiles"].values()))["levels"].values()))
    level.update(backends_cpu_pct=97.5, backends_cpu_us_per_event=4.25)
    page = render_md(res)
    assert "## The fake backends" in page
    assert "| 97.5 | 4.25 |" in page
