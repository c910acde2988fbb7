"""``loadtest pool``: runs' per-request TTFTs pooled per label, and files it cannot use refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gateway.cli import main as cli
from loadtest.pool import PoolError, pool, table


def result(path: Path, runs: dict[str, list[float]]) -> Path:
    doc = {"runs": [{"label": k, "ttft_ms": sorted(v)} for k, v in runs.items()]}
    path.write_text(json.dumps(doc))
    return path


def test_runs_are_pooled_per_label_and_the_p99_compared_to_the_baseline(tmp_path: Path) -> None:
    a = result(tmp_path / "a.json", {"fast": [10.0] * 99 + [500.0], "slow": [20.0] * 100})
    b = result(tmp_path / "b.json", {"fast": [10.0] * 100, "slow": [20.0] * 99 + [1000.0]})
    pooled = pool([a, b])
    assert list(pooled) == ["fast", "slow"]
    assert len(pooled["fast"].ttft_ms) == 200
    # Pooled, the one slow request of 200 is past the 99th percentile; in its own run it is not.
    assert pooled["fast"].p99 == pytest.approx(10.0)
    assert pooled["fast"].run_p99s == [pytest.approx(14.9), 10.0]
    text = table(pooled, "slow")
    assert "| fast | 2 | 200 | 10.0 | 10.0 | 500.0 | 15, 10 | 0.50 |" in text
    assert "| slow | 2 | 200 | 20.0 | 20.0 | 1000.0 |" in text


def test_a_file_without_per_request_ttfts_or_not_a_result_is_refused(tmp_path: Path) -> None:
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"runs": [{"label": "x", "summary": {}}]}))
    with pytest.raises(PoolError, match="keeps no ttft_ms"):
        pool([old])
    junk = tmp_path / "junk.json"
    junk.write_text("[1, 2]")
    with pytest.raises(PoolError, match="not a loadtest result"):
        pool([junk])


def test_the_command_prints_the_table_or_says_what_is_wrong(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    a = result(tmp_path / "a.json", {"p": [1.0, 2.0], "q": [2.0, 4.0]})
    assert cli(["loadtest", "pool", str(a), "--baseline", "q"]) == 0
    assert "| p | 1 | 2 |" in capsys.readouterr().out
    assert cli(["loadtest", "pool", str(a), "--baseline", "nobody"]) == 2
    assert "no runs labelled 'nobody'" in capsys.readouterr().out
    assert cli(["loadtest", "pool", str(tmp_path / "missing.json")]) == 2
