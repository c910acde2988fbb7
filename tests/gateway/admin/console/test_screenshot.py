"""``scripts/console_screenshot.py --admin URL``: a running gateway's console photographed as it
is, in a real headless Chromium, the token from the gateway's own variable."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest

from tests.helpers import FakeBackend, gateway_for

SCRIPT = Path(__file__).resolve().parents[4] / "scripts" / "console_screenshot.py"
TOKEN = "screenshot-token"
PNG = b"\x89PNG\r\n\x1a\n"


async def screenshot(*args: str, token: str) -> tuple[int, str]:
    """The script run as a shell runs it, ``GATEWAY_ADMIN__TOKEN`` set to ``token``: its exit
    status and what it said on stderr."""
    env = {**os.environ, "GATEWAY_ADMIN__TOKEN": token}
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        str(SCRIPT),
        *args,
        env=env,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.PIPE,
    )
    _, err = await asyncio.wait_for(proc.communicate(), 50)
    assert proc.returncode is not None
    return proc.returncode, err.decode()


async def test_it_photographs_a_running_gateways_console_and_changes_nothing(
    tmp_path: Path,
) -> None:
    out = tmp_path / "console.png"
    async with gateway_for(FakeBackend(), admin={"token": TOKEN}) as (gw, s):
        assert gw.admin_url is not None
        auth = {"Authorization": f"Bearer {TOKEN}"}
        async with s.get(gw.admin_url + "/admin/keys", headers=auth) as r:
            keys_before = await r.json()
        status, err = await screenshot(
            "--admin", gw.admin_url, "--seconds", "0", "--out", str(out), token=TOKEN
        )
        assert status == 0, err
        async with s.get(gw.admin_url + "/admin/keys", headers=auth) as r:
            assert await r.json() == keys_before
    assert out.read_bytes().startswith(PNG)
    assert (tmp_path / "console-rollout.png").read_bytes().startswith(PNG)


@pytest.mark.parametrize("given", ["--token", "environment"])
async def test_a_wrong_token_is_said_and_nothing_is_written(tmp_path: Path, given: str) -> None:
    out = tmp_path / "console.png"
    async with gateway_for(FakeBackend(), admin={"token": TOKEN}) as (gw, _):
        assert gw.admin_url is not None
        flags = ["--token", "not-the-token"] if given == "--token" else []
        token = TOKEN if given == "--token" else "not-the-token"  # the flag wins
        status, err = await screenshot(
            "--admin", gw.admin_url, "--seconds", "0", "--out", str(out), *flags, token=token
        )
    assert status == 2
    assert "The admin API refused the token." in err
    assert not out.exists()
