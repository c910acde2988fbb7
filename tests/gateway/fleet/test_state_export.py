"""The running state back to the file (two real replicas on a real Redis): what the admin
changes made is written into the configuration file, comments kept, by any replica alike; the
file it gives loads, a reload's dry run says the reload would change nothing that runs, and the
reload itself then changes nothing."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path
from typing import Any

import tomlkit

from gateway.config.settings import load_settings
from gateway.limits.keys import hash_key
from tests.gateway.fleet.replicas import ALIAS, AUTH, TOKEN, Fleet, running_fleet

TEAM = "sk-team-export"


async def exported(fleet: Fleet, i: int) -> str:
    async with fleet.session.get(fleet[i].admin + "/admin/state", headers=AUTH) as r:
        assert r.status == 200
        assert r.content_type == "application/toml"
        return await r.text()


def body(text: str) -> str:
    """The file without the header's comment (it names the time)."""
    return "\n".join(line for line in text.splitlines() if not line.startswith("# Written by"))


def with_secrets(text: str, original: Any) -> str:
    """The exported file with the secrets set again from ``original``, as an operator would."""
    doc = tomlkit.parse(text)
    doc["admin"]["token"] = original["admin"]["token"]
    doc["limits"]["redis"]["url"] = original["limits"]["redis"]["url"]
    return tomlkit.dumps(doc)


async def dry_run(fleet: Fleet) -> dict[str, Any]:
    url = fleet[0].admin + "/admin/reload?dry_run=1"
    async with fleet.session.post(url, headers=AUTH) as r:
        assert r.status == 200
        doc: dict[str, Any] = await r.json()
        return doc


async def test_the_running_state_is_written_as_the_config_file_and_a_reload_then_changes_nothing(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    async with running_fleet(tmp_path, redis_url, redis_prefix, n=2, auth=True) as fleet:
        r0, r1 = fleet
        config = r0.config
        config.write_text("# Our fleet: edit with care\n" + config.read_text())
        made = {
            "name": "team",
            "hash": hash_key(TEAM),
            "tier": "default",
            "tokens_per_day": 50_000,
            "limits": {"requests_per_minute": 600},
            "labels": {"team": "search"},
        }
        for replica, method, path, doc in [
            (r0, "POST", "/admin/backends/b/drain", None),
            (r1, "PUT", f"/admin/aliases/{ALIAS}", {"stable": 60, "canary": 40}),
            (r0, "PUT", "/admin/policy", {"weights": {"active": 2, "queue": 1, "kv": 0.5}}),
            (r1, "POST", "/admin/keys", made),
            (r0, "DELETE", "/admin/keys/ops", None),
        ]:
            status, _, answer = await fleet.change(replica, method, path, doc)
            assert status == 200, answer
        before = [await fleet.state(r) for r in fleet]

        text = await exported(fleet, 0)
        assert body(text) == body(await exported(fleet, 1))  # any replica: the same file
        assert "# Our fleet: edit with care" in text
        assert TEAM not in text  # keys by their hashes only
        assert TOKEN not in text  # and no secret of the file: named, to set again
        assert "# NOTE: secrets not written, to set again: admin.token, limits.redis.url" in text
        text = with_secrets(text, tomlkit.parse(config.read_text()))
        out = tmp_path / "exported.toml"
        out.write_text(text)
        settings = load_settings(out)
        assert [b.drain for b in settings.backends] == [False, True, False]
        assert settings.aliases == {ALIAS: {"stable": 60.0, "canary": 40.0}}
        assert (settings.weights.active, settings.weights.queue, settings.weights.kv) == (2, 1, 0.5)
        [team] = settings.limits.keys  # ops revoked: gone
        assert (team.name, team.hash, team.tokens_per_day) == (
            "team",
            hash_key(TEAM).removeprefix("sha256:"),
            50_000,
        )
        assert (team.limits, team.labels) == ({"requests_per_minute": 600}, {"team": "search"})

        # The exported file in place: a reload would change nothing that runs...
        config.write_text(text)
        plan = await dry_run(fleet)
        changed = {c["setting"]: c for c in plan["changes"]}
        assert changed["aliases"]["aliases"] == {}
        assert changed["weights"]["now"] == changed["weights"]["after"]
        # Only the keys differ in [limits] (made and revoked at run time; the log keeps them)
        assert (plan["restart_required"], changed["limits"]["fields"]) == (["limits"], ["keys"])
        assert [await fleet.state(r) for r in fleet] == before  # the dry run changed nothing
        changes = (await fleet.read(r0, "/admin/changes"))["changes"]
        assert all("dry_run" not in c["path"] for c in changes)  # and logged nothing
        # ...and does not.
        status, _, _ = await fleet.change(r1, "POST", "/admin/reload")
        assert status == 200
        assert [await fleet.state(r) for r in fleet] == before
        assert await fleet.status_with(r0, TEAM) == 200

        # The CLI writes the same file.
        cli = tmp_path / "cli.toml"
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "gateway", "state", "export", "--admin", r1.admin, "-o", str(cli),
            env={"GATEWAY_ADMIN__TOKEN": TOKEN, "PATH": "/usr/bin:/bin"},
            stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        _, err = await proc.communicate()
        assert proc.returncode == 0, err
        assert body(with_secrets(cli.read_text(), tomlkit.parse(config.read_text()))) == body(text)


async def test_a_dry_run_is_offered_only_where_it_says_what_it_would_do(
    tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    async with running_fleet(tmp_path, redis_url, redis_prefix, n=1) as fleet:
        status, _, doc = await fleet.change(fleet[0], "POST", "/admin/backends/a/drain?dry_run=1")
        assert (status, doc["error"]["type"]) == (400, "invalid_request_error")
        assert (await fleet.draining(fleet[0]))["a"] is False
        fleet[0].config.write_text(fleet[0].config.read_text().replace("least_load", "round_robin"))
        plan = await dry_run(fleet)
        assert plan["changes"] == [
            {"setting": "policy", "live": True, "now": "least_load", "after": "round_robin"}
        ]
        assert (await fleet.read(fleet[0], "/admin/policy"))["policy"] == "least_load"
