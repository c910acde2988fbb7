"""``llm-gateway``: help for every subcommand, and configuration errors said plainly."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

from gateway.cli import COMMANDS, build_parser, main
from gateway.config.settings import Settings


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


def test_a_port_in_use_is_one_line_naming_it_and_the_setting() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "gateway",
                "serve",
                "--backends",
                "http://127.0.0.1:9",
                "--port",
                str(port),
            ],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
    assert done.returncode == 2, done.stderr
    assert "Traceback" not in done.stderr + done.stdout
    [line] = [x for x in done.stderr.splitlines() if x.startswith("llm-gateway:")]
    assert f"127.0.0.1:{port}" in line
    assert "in use" in line
    assert "GATEWAY_PORT" in line


def test_serve_takes_the_admin_port_as_a_flag_over_the_environment_and_the_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """--admin-port enters through the settings as --port does; the rest of [admin] stays."""
    config = tmp_path / "gateway.toml"
    config.write_text('[admin]\nhost = "127.0.0.2"\nport = 9001\n')
    monkeypatch.setenv("GATEWAY_ADMIN__TOKEN", "cli-admin-token")
    monkeypatch.setenv("GATEWAY_ADMIN__PORT", "9002")
    started: list[Settings] = []

    def serve(settings: Settings, loader: Callable[[], Settings]) -> int:
        started.extend([settings, loader()])  # as run, and as a reload reads it again
        return 0

    monkeypatch.setattr("gateway.server.serve", serve)
    argv = ["serve", "--config", str(config), "--backends", "http://a:1"]
    assert main([*argv, "--admin-port", "9003"]) == 0
    assert main(argv) == 0
    assert [s.admin.port for s in started] == [9003, 9003, 9002, 9002]
    assert {s.admin.host for s in started} == {"127.0.0.2"}
    assert {s.admin.token.get_secret_value() for s in started if s.admin.token} == {
        "cli-admin-token"
    }


def test_an_admin_port_in_use_names_the_flag_that_moves_it() -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = subprocess.run(
            [sys.executable, "-m", "gateway", "serve", "--backends", "http://127.0.0.1:9",
             "--port", "0", "--admin-port", str(port)],
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
            env={**os.environ, "GATEWAY_ADMIN__TOKEN": "cli-admin-token"},
        )  # fmt: skip
    assert done.returncode == 2, done.stderr
    [line] = [x for x in done.stderr.splitlines() if x.startswith("llm-gateway:")]
    assert f"127.0.0.1:{port}" in line
    assert "--admin-port" in line


def test_the_readme_lists_every_subcommand() -> None:
    readme = (Path(__file__).parents[2] / "README.md").read_text()
    table = readme[readme.index("| subcommand | does |") :].split("\n\n", 1)[0]
    assert sorted(line.split("`")[1] for line in table.splitlines()[2:]) == sorted(COMMANDS)


def _options(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.Action]]:
    """Every option of ``parser`` and of its subcommands, with the command that has it."""
    out: list[tuple[str, argparse.Action]] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                out += [(f"{parser.prog} {name}", a) for _, a in _options(sub)]
        elif action.option_strings and not isinstance(action, argparse._HelpAction):
            out.append((parser.prog, action))
    return out


@pytest.mark.parametrize("name", sorted(COMMANDS))
def test_every_option_says_what_it_is_and_its_default_once(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Options without a description, and defaults printed twice or as None (issue 23)."""
    parser = build_parser([name])
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    command = sub.choices[name]
    bare = [
        f"{prog}: {'/'.join(a.option_strings)}"
        for prog, a in _options(command)
        if not (a.help or "").strip()
    ]
    assert bare == []
    with pytest.raises(SystemExit):
        main([name, "--help"])
    out = capsys.readouterr().out
    assert "(default: None)" not in out
    assert out.count("(default: from the config) (default:") == 0
