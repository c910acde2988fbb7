"""``llm-gateway``: the one console script, with a subcommand per job."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from pydantic import ValidationError


def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "serve",
        help="run the gateway in front of vLLM (or simulated) backends",
        description=(
            "Serve the OpenAI-compatible API (/v1/completions, /v1/chat/completions, "
            "/v1/models) and route each request to the least loaded backend that serves its "
            "model. Settings come from --config (TOML), then GATEWAY_* environment variables "
            "(e.g. GATEWAY_BACKENDS=http://a:8000,http://b:8000, GATEWAY_POLICY=least_load), "
            "then these flags."
        ),
    )
    p.add_argument("--config", type=Path, help="TOML settings file")
    p.add_argument("--host", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, help="port to listen on (default 8080)")
    p.add_argument(
        "--backends", help="comma-separated backend URLs (overrides config and environment)"
    )
    p.add_argument(
        "--policy",
        choices=["least_load", "round_robin", "random", "power_of_two"],
        help="routing policy (default least_load)",
    )
    p.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from gateway.server import serve
    from gateway.settings import load_settings

    overrides = {
        "host": args.host,
        "port": args.port,
        "backends": args.backends,
        "policy": args.policy,
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
    serve(settings, loader=lambda: load_settings(args.config, **overrides))
    return 0


def _add_sim(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    import backends.sim.cli as sim_cli

    p = sub.add_parser(
        "sim",
        help="run a vLLM-compatible simulated backend (no GPU needed)",
        description=sim_cli.DESCRIPTION,
    )
    sim_cli.add_arguments(p)
    p.set_defaults(func=sim_cli.run)


def _add_plan(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    import gateway.plan.cli as plan_cli

    p = sub.add_parser(
        "plan",
        help="size GPUs, KV cache and vLLM engine arguments for a model",
        description=plan_cli.DESCRIPTION,
    )
    plan_cli.add_arguments(p)
    p.set_defaults(func=plan_cli.run)


def _add_demo(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "demo",
        help="run the gateway in front of simulated backends, all in one process",
        description=(
            "Start N simulated vLLM backends on loopback and the gateway in front of them. "
            "Try: curl localhost:8080/v1/chat/completions -H 'content-type: application/json' "
            '-d \'{"model":"sim-model","messages":[{"role":"user","content":"hi"}],'
            '"stream":true}\''
        ),
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--backends", type=int, default=2, help="number of simulated backends")
    p.add_argument("--model", default="sim-model", help="model name the simulators serve")
    p.add_argument("--backend-port", type=int, default=8001, help="first simulator port")
    p.set_defaults(func=_demo)


def _demo(args: argparse.Namespace) -> int:
    from gateway.demo import run_demo

    return run_demo(
        host=args.host,
        port=args.port,
        n_backends=args.backends,
        model=args.model,
        first_backend_port=args.backend_port,
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="llm-gateway",
        description=(
            "An OpenAI-compatible LLM inference gateway for a fleet of vLLM servers, "
            "with a vLLM-compatible simulator for trying it without GPUs."
        ),
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_serve(sub)
    _add_sim(sub)
    _add_plan(sub)
    _add_demo(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))


if __name__ == "__main__":
    raise SystemExit(main())
