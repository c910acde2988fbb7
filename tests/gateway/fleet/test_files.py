"""The change log in files (no Redis), run for real: the workers of one host apply every change
through the same log as a fleet on Redis, the state outlives a restart of the gateway when the
log is in ``fleet.dir``, and the log is compacted there too."""

from __future__ import annotations

from pathlib import Path

from gateway.fleet.files import FileLog
from tests.gateway.fleet.replicas import ALIAS, poll, running_fleet


async def test_workers_without_redis_apply_each_change_and_keep_the_state_across_restarts(
    tmp_path: Path,
) -> None:
    async with running_fleet(tmp_path, None, "", n=1, workers=(2,), compact_every=16) as fleet:
        [gw] = fleet
        status, headers, _ = await fleet.change(gw, "POST", "/admin/backends/a/drain")
        assert (status, headers["X-Gateway-Replicas"]) == (200, "2/2")
        status, headers, _ = await fleet.change(
            gw, "PUT", f"/admin/aliases/{ALIAS}", {"stable": 0, "canary": 100}
        )
        assert (status, headers["X-Gateway-Replicas"]) == (200, "2/2")
        # Connections spread over both workers: every one of them follows both changes.
        assert (await fleet.send(gw, 8, fresh_connections=True))["a"] == 0
        sent = await fleet.send(gw, 8, ALIAS, fresh_connections=True)
        assert sent == {"a": 0, "b": 0, "c": 8}
        replicas = await fleet.read(gw, "/admin/replicas")
        assert [r["id"] for r in replicas["replicas"]] == ["r0/w0", "r0/w1"]
        assert replicas["summary"]["lagging"] == []
        changes = (await fleet.read(gw, "/admin/changes"))["changes"]
        assert [c["path"] for c in changes] == [
            f"/admin/aliases/{ALIAS}",
            "/admin/backends/a/drain",
        ]
        # Enough changes to compact the log past compact_every (16).
        for _ in range(10):
            for verb in ("drain", "undrain"):
                status, _, _ = await fleet.change(gw, "POST", f"/admin/backends/b/{verb}")
                assert status == 200
        log = FileLog(tmp_path / "fleet", "default")
        length, _ = await poll(log.extent, lambda e: e[1] is not None, what="compacted")
        assert length < 22
        before = await fleet.state(gw)
        await gw.stop()
        await gw.start()
        after = await fleet.state(gw)
        assert after == before
        assert after[0] == {"a": True, "b": False, "c": False}
        assert (await fleet.send(gw, 4, fresh_connections=True))["a"] == 0
