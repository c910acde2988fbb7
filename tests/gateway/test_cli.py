"""``llm-gateway``: help for every subcommand, and configuration errors said plainly."""

from __future__ import annotations

import subprocess
import sys

import pytest

from gateway.cli import COMMANDS, main


def test_top_level_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for name, (help_text, _) in COMMANDS.items():
        assert name in out
        assert help_text.split()[0] in out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_each_subcommand_help_says_what_it_does(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        main([name, "--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert f"llm-gateway {name}" in out
    assert len(out.splitlines()) > 3


def test_serve_without_backends_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("GATEWAY_BACKENDS", raising=False)
    monkeypatch.delenv("GATEWAY_DISCOVERY__DNS", raising=False)
    assert main(["serve"]) == 2
    assert "no backends configured" in capsys.readouterr().err


def test_serve_with_a_bad_setting_says_which(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("GATEWAY_WEIGHTS__QUEUE", "-2")
    assert main(["serve", "--backends", "http://a:1"]) == 2
    err = capsys.readouterr().err
    assert "bad configuration" in err
    assert "weights.queue" in err


def test_console_script_runs() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "gateway", "--help"], capture_output=True, text=True, check=True
    )
    assert "serve" in out.stdout


def test_a_subcommand_whose_extra_is_not_installed_says_which_to_install() -> None:
    from gateway.cli import missing_extra

    assert missing_extra("loadtest") is None  # the dev install has every extra
    assert missing_extra("serve", have=lambda m: None) is None  # the gateway needs none
    message = missing_extra("loadtest", have=lambda m: None if m == "matplotlib" else object())
    assert message == (
        "llm-gateway loadtest needs matplotlib: pip install 'llm-gateway[loadtest]' "
        "(the gateway alone does not install it)"
    )
    assert "llm-gateway[tools]" in (missing_extra("top", have=lambda m: None) or "")
