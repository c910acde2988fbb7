"""docs/bench holds the runs the docs cite, each listed in its index, and every citation of a run
resolves."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "docs" / "bench"
CITED = r"bench/((?:peers|latency|kv-events|pa-|rollout-|capacity-|overload-)[\w.-]*)"


def cited_runs() -> set[str]:
    """The docs/bench entries (a file's stem or a folder) cited by the pages of docs/."""
    cited = set()
    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md")]:
        for path in re.findall(CITED, doc.read_text()):
            cited.add(path.removesuffix(".md").removesuffix(".json"))
    return cited


def test_every_run_in_docs_bench_is_in_its_index() -> None:
    index = (BENCH / "README.md").read_text()
    entries = {p.name.removesuffix(".json").removesuffix(".md") for p in BENCH.iterdir()}
    missing = sorted(e for e in entries - {"README"} if e not in index)
    assert missing == []


def test_every_cited_run_exists() -> None:
    names = {p.name.removesuffix(".json").removesuffix(".md") for p in BENCH.iterdir()}
    cited = cited_runs()
    assert len(cited) > 10  # the pattern still finds the citations
    assert sorted(cited - names) == []


def test_every_peer_page_has_its_json() -> None:
    """The JSON is the source of its page (``python -m loadtest.peers --render``)."""
    pages = {p.stem for p in BENCH.glob("peers-*.md")}
    assert pages == {p.stem for p in BENCH.glob("peers-*.json")}
