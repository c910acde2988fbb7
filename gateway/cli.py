"""``llm-gateway``: the one console script, with a subcommand per job.

Each subcommand's module is imported only when that subcommand runs: ``serve`` does not pay
for the load tester's plotting library, and a problem in one tool cannot stop another.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys
from collections.abc import Callable, Sequence
from pathlib import Path

from pydantic import ValidationError

from gateway.helpfmt import DefaultsHelp
from policies import POLICY_NAMES

Setup = Callable[[argparse.ArgumentParser], None]


def _setup_serve(p: argparse.ArgumentParser) -> None:
    p.description = (
        "Serve the OpenAI-compatible API (/v1/completions, /v1/chat/completions, /v1/models) "
        "and route each request to the least loaded backend that serves its model. Settings "
        "come from --config (TOML), then GATEWAY_* environment variables (e.g. "
        "GATEWAY_BACKENDS=http://a:8000,http://b:8000, GATEWAY_POLICY=least_load), then these "
        "flags. SIGHUP re-reads the configuration; SIGTERM drains and exits."
    )
    p.add_argument("--config", type=Path, help="TOML settings file")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default 8080; 0 picks one)")
    p.add_argument(
        "--admin-port",
        type=int,
        help="port of the admin API, served when admin.token is set (default 8081)",
    )
    p.add_argument(
        "--backends", help="comma-separated backend URLs (overrides config and environment)"
    )
    p.add_argument(
        "--policy",
        choices=POLICY_NAMES,
        help="routing policy (default least_load)",
    )
    p.add_argument(
        "--workers",
        help="gateway processes sharing the port and one view of the fleet (default 1; "
        "auto: one per core this process may use)",
    )
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from gateway.config.settings import FileLoader, load_settings
    from gateway.server import ListenError, serve

    overrides = {
        "host": args.host,
        "port": args.port,
        "admin": None if args.admin_port is None else {"port": args.admin_port},
        "backends": args.backends,
        "policy": args.policy,
        "workers": args.workers,
    }
    try:
        settings = load_settings(args.config, **overrides)
    except (ValidationError, FileNotFoundError, ValueError) as exc:
        print(f"llm-gateway: bad configuration: {exc}", file=sys.stderr)
        return 2
    if not settings.backends and not settings.discovery.dns:
        print(
            "llm-gateway: no backends configured (set GATEWAY_BACKENDS, --backends, "
            "GATEWAY_DISCOVERY__DNS or 'backends' in the config file)",
            file=sys.stderr,
        )
        return 2
    for model, spec in settings.tokenizers.items():  # loaded again by the app: fail here first
        from gateway.tokenizer import load_tokenizer

        try:
            load_tokenizer(spec)
        except ValueError as exc:
            print(f"llm-gateway: bad configuration: tokenizers.{model}: {exc}", file=sys.stderr)
            return 2
    if settings.worker_count > 1 and (why := settings.per_process_limits()) is not None:
        print(f"llm-gateway: bad configuration: {why}", file=sys.stderr)
        return 2
    if (why := settings.unshared_changes()) is not None:
        print(f"llm-gateway: bad configuration: {why}", file=sys.stderr)
        return 2
    try:
        return serve(settings, loader=FileLoader(args.config, overrides))
    except ListenError as exc:
        print(f"llm-gateway: {exc}", file=sys.stderr)
        return 2


def _setup_sim(p: argparse.ArgumentParser) -> None:
    import tools.sim.cli as sim_cli

    p.description = sim_cli.DESCRIPTION
    sim_cli.add_arguments(p)
    p.set_defaults(func=sim_cli.run)


def _setup_plan(p: argparse.ArgumentParser) -> None:
    import tools.plan.cli as plan_cli

    p.description = plan_cli.DESCRIPTION
    plan_cli.add_arguments(p)
    p.set_defaults(func=plan_cli.run)


def _setup_demo(p: argparse.ArgumentParser) -> None:
    p.formatter_class = DefaultsHelp
    p.description = (
        "Start N simulated vLLM backends on loopback and the gateway in front of them.\n\n"
        "Then try:\n"
        "  curl -N localhost:8080/v1/chat/completions -H 'content-type: application/json' \\\n"
        '    -d \'{"model": "sim-model", "messages": [{"role": "user", "content": "hi"}], '
        '"stream": true}\''
    )
    p.add_argument("--host", default="127.0.0.1", help="address the gateway listens on")
    p.add_argument("--port", type=int, default=8080, help="port the gateway listens on")
    p.add_argument("--backends", type=int, default=2, help="number of simulated backends")
    p.add_argument("--model", default="sim-model", help="model name the simulators serve")
    p.add_argument("--backend-port", type=int, default=8001, help="first simulator port")
    p.add_argument("--admin-port", type=int, default=8081, help="port of the admin API")
    p.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from gateway.server import ListenError
    from tools.demo import run_demo

    try:
        return run_demo(
            host=args.host,
            port=args.port,
            n_backends=args.backends,
            model=args.model,
            first_backend_port=args.backend_port,
            admin_port=args.admin_port,
        )
    except (ListenError, OSError) as exc:  # OSError: a simulator's port is taken
        print(f"llm-gateway demo: {exc}", file=sys.stderr)
        return 2


def _setup_keys(p: argparse.ArgumentParser) -> None:
    p.description = "Helpers for the API keys in the [limits] configuration."
    keys_sub = p.add_subparsers(dest="keys_command", metavar="ACTION", required=True)
    h = keys_sub.add_parser(
        "hash",
        help="print the hash of a key read from stdin, for [[limits.keys]] hash = ...",
        description=(
            'Read one API key from stdin (e.g. `printf %s "$KEY" | llm-gateway keys hash`) '
            "and print the sha256:... form the configuration stores instead of the key."
        ),
    )
    h.set_defaults(func=_keys_hash)


def _keys_hash(args: argparse.Namespace) -> int:
    from gateway.limits.keys import hash_key

    key = sys.stdin.readline().strip()
    if not key:
        print("llm-gateway: no key on stdin", file=sys.stderr)
        return 2
    print(hash_key(key))
    return 0


def _setup_loadtest(p: argparse.ArgumentParser) -> None:
    import loadtest.cli as loadtest_cli

    p.description = loadtest_cli.DESCRIPTION
    loadtest_cli.add_arguments(p)


def _setup_top(p: argparse.ArgumentParser) -> None:
    from tools import top

    p.description = top.DESCRIPTION
    top.add_arguments(p)
    p.set_defaults(func=top.run)


def _setup_state(p: argparse.ArgumentParser) -> None:
    from tools import state

    p.description = state.DESCRIPTION
    state.add_arguments(p)


def _setup_kv_events(p: argparse.ArgumentParser) -> None:
    from tools import kv_check

    p.description = (
        "Tools for vLLM's KV-cache events (what the precise_prefix policy routes on). "
        "`check URL`: connect to a backend's publisher, send a probe prompt, and report block "
        "size, token agreement, sequence health and lag."
    )
    sub = p.add_subparsers(dest="kv_command", metavar="ACTION", required=True)
    c = sub.add_parser("check", help="check one backend's KV-event publisher")
    kv_check.add_arguments(c)
    c.set_defaults(func=kv_check.run)


# What a subcommand needs beyond the gateway itself: the extra to install, and its modules.
EXTRAS: dict[str, tuple[str, tuple[str, ...]]] = {
    "top": ("tools", ("rich",)),
    "plan": ("tools", ("rich",)),
    "loadtest": ("loadtest", ("rich", "matplotlib")),
}


def missing_extra(
    command: str, have: Callable[[str], object] = importlib.util.find_spec
) -> str | None:
    """What to install for ``command`` if a module it needs is absent; None if nothing."""
    extra, modules = EXTRAS.get(command, ("", ()))
    absent = [m for m in modules if have(m) is None]
    if not absent:
        return None
    return (
        f"llm-gateway {command} needs {', '.join(absent)}: "
        f"pip install 'llm-gateway[{extra}]' (the gateway alone does not install it)"
    )


COMMANDS: dict[str, tuple[str, Setup]] = {
    "serve": ("run the gateway in front of vLLM (or simulated) backends", _setup_serve),
    "sim": ("run a vLLM-compatible simulated backend (no GPU needed)", _setup_sim),
    "demo": ("run the gateway in front of simulated backends, in one process", _setup_demo),
    "top": ("live terminal view of a running gateway's backends", _setup_top),
    "loadtest": (
        "load tests, scenarios, policy comparisons and the gateway's overhead",
        _setup_loadtest,
    ),
    "plan": ("size GPUs, KV cache and vLLM engine arguments for a model", _setup_plan),
    "keys": ("API key helpers", _setup_keys),
    "state": (
        "a running gateway's state as its configuration file (export), a reload's plan",
        _setup_state,
    ),
    "kv-events": ("check a backend's KV-cache event publisher", _setup_kv_events),
}


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser, with the arguments of the subcommand named in ``argv`` (only that one)."""
    parser = argparse.ArgumentParser(
        prog="llm-gateway",
        description=(
            "An OpenAI-compatible LLM inference gateway for a fleet of vLLM servers, "
            "with a vLLM-compatible simulator for trying it without GPUs."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, (help_text, setup) in COMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        if name == chosen:
            problem = missing_extra(name)
            if problem is not None:
                parser.exit(2, problem + "\n")
            setup(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = build_parser(argv).parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
