"""``llm-gateway state export``: what a running gateway (or fleet) has applied, written as its
configuration file's TOML (``GET /admin/state``), so that the run-time changes can be
committed; ``state plan``: what ``POST /admin/reload`` would change (its dry run)."""

from __future__ import annotations

import argparse
import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path
from typing import Final

TOKEN_ENV: Final = "GATEWAY_ADMIN__TOKEN"  # the one the gateway reads (``admin.token``)

DESCRIPTION: Final = (
    "The running state of a gateway through its admin API. `export`: the configuration file "
    "with what is running written in (aliases after a rollout, policy and weights, drained "
    "backends and pools, keys by their hashes with their budgets), to stdout or --output. "
    "`plan`: what a reload of the configuration file would change now (nothing is changed)."
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    sub = p.add_subparsers(dest="state_command", metavar="ACTION", required=True)
    export = sub.add_parser("export", help="the running state as the configuration file's TOML")
    plan = sub.add_parser("plan", help="what a reload would change (POST /admin/reload?dry_run=1)")
    for q in (export, plan):
        q.add_argument("--admin", required=True, help="admin API URL, e.g. http://127.0.0.1:8081")
        q.add_argument("--token", help=f"admin bearer token (default: ${TOKEN_ENV})")
    export.add_argument("-o", "--output", type=Path, help="write it here (default: stdout)")
    export.set_defaults(func=run_export)
    plan.set_defaults(func=run_plan)


def _call(args: argparse.Namespace, method: str, path: str) -> bytes | None:
    token = args.token or os.environ.get(TOKEN_ENV)
    if not token:
        print(f"llm-gateway state: give --token or set {TOKEN_ENV}", file=sys.stderr)
        return None
    request = urllib.request.Request(
        args.admin.rstrip("/") + path,
        method=method,
        headers={"Authorization": f"Bearer {token}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            body: bytes = r.read()
            return body
    except urllib.error.HTTPError as exc:
        detail = exc.read().decode(errors="replace")
        print(f"llm-gateway state: {exc.code} from the admin API: {detail}", file=sys.stderr)
    except (urllib.error.URLError, OSError) as exc:
        print(f"llm-gateway state: cannot reach {args.admin}: {exc}", file=sys.stderr)
    return None


def run_export(args: argparse.Namespace) -> int:
    body = _call(args, "GET", "/admin/state")
    if body is None:
        return 1
    if args.output is None:
        sys.stdout.write(body.decode())
        return 0
    tmp = args.output.with_name(f".{args.output.name}.tmp")
    tmp.write_bytes(body)
    tmp.replace(args.output)
    print(f"llm-gateway state: written to {args.output}", file=sys.stderr)
    return 0


def run_plan(args: argparse.Namespace) -> int:
    body = _call(args, "POST", "/admin/reload?dry_run=1")
    if body is None:
        return 1
    print(json.dumps(json.loads(body), indent=2))
    return 0
