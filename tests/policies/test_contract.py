"""The policy contract is whole: each policy offers exactly the capabilities it claims
(``policies.capabilities``), the router finds them once, and no code outside ``policies/``
asks a policy anything by probing it or by its class."""

from __future__ import annotations

import ast
import importlib
from collections.abc import Iterator
from dataclasses import fields
from pathlib import Path

import pytest

from backends.pool import BackendPool
from backends.state import BackendSpec
from gateway.request.router import Router
from policies import (
    POLICY_NAMES,
    KvIndex,
    LatencyTracker,
    Policy,
    PolicyName,
    PredictionConfig,
    make_policy,
)
from policies.capabilities import NO_CAPABILITIES, Capabilities

ROOT = Path(__file__).resolve().parents[2]
# Where a policy may only be asked through the contract.
OUTSIDE = ("gateway", "backends", "tools", "loadtest")

# What each built-in policy offers beyond the contract: ``Capabilities``' fields. The metrics
# and the admin API read these, so one gained or lost changes what they show.
OFFERS: dict[PolicyName, set[str]] = {
    "least_load": set(),
    "round_robin": set(),
    "random": set(),
    "power_of_two": set(),
    "prefix_affinity": {"affinity_tuned", "approximate_prefix"},
    "precise_prefix": {"affinity_tuned", "approximate_prefix", "exact_prefix"},
    "predicted_latency": {
        "first_token_deadline",
        "hedging",
        "affinity_tuned",
        "latency_predicting",
    },
}


def build(name: PolicyName, prediction: PredictionConfig | None = None) -> Policy:
    return make_policy(
        name, kv_index=KvIndex(1000), tracker=LatencyTracker(), prediction=prediction
    )


def offered(caps: Capabilities) -> set[str]:
    return {f.name for f in fields(caps) if getattr(caps, f.name) is not None}


def test_every_policy_is_listed() -> None:
    assert set(OFFERS) == set(POLICY_NAMES)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_each_built_in_policy_offers_what_it_claims_and_nothing_else(name: PolicyName) -> None:
    policy = build(name)
    caps = Capabilities.of(policy)
    assert offered(caps) == OFFERS[name]
    for f in fields(caps):  # each capability is the policy itself, seen through its Protocol
        assert getattr(caps, f.name) in (None, policy)


@pytest.mark.parametrize("prefix", ["none", "approximate", "precise"])
def test_predicted_latency_never_exports_its_prefix_sources_metrics(prefix: str) -> None:
    """Its prefix knowledge is its own part, not a capability: the prefix index's and
    precise_prefix's decisions stay unexported under it, whatever the source."""
    policy = build("predicted_latency", PredictionConfig(prefix=prefix))  # type: ignore[arg-type]
    assert offered(Capabilities.of(policy)) == OFFERS["predicted_latency"]


def test_the_approximate_index_is_the_policys_own_or_its_fallbacks() -> None:
    affinity = build("prefix_affinity")
    source = Capabilities.of(affinity).approximate_prefix
    assert source is not None
    assert source.approximate is affinity
    precise = build("precise_prefix")
    source = Capabilities.of(precise).approximate_prefix
    assert source is not None
    assert source.approximate is precise.fallback  # type: ignore[attr-defined]


class Bare:
    """The contract and nothing more."""

    name = "bare"
    needs = build("least_load").needs
    weights = None

    def choose(self, facts: object, candidates: list[object]) -> None:
        return None

    def on_result(self, facts: object, decision: object, outcome: object) -> None:
        pass


def test_a_policy_with_only_the_contract_offers_nothing() -> None:
    assert Capabilities.of(Bare()) == NO_CAPABILITIES  # type: ignore[arg-type]


def test_the_router_finds_a_policys_capabilities_when_it_is_set_and_steps_carry_them() -> None:
    pool = BackendPool([BackendSpec("a", "http://a")], stale_after=1.0)
    first, second = build("least_load"), build("predicted_latency")
    router = Router(pool, first, prefill=first, decode=first)
    assert router.capabilities == NO_CAPABILITIES
    router.policy = second  # swapped live, as the admin API does
    assert router.capabilities.hedging is second
    step = router.route("m", {"messages": []}, {}).serve
    assert step.policy is second
    assert step.caps is router.capabilities


# -- nothing outside policies/ probes a policy or tests its class ------------------------------


def _names(node: ast.AST) -> Iterator[str]:
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            yield n.id
        elif isinstance(n, ast.Attribute):
            yield n.attr


def _policy_ish(node: ast.AST) -> bool:
    """An expression that reads a policy: a name or attribute that says so (``policy``,
    ``step.policy``, ``self._policy()``, ``app[ROUTER].prefill_policy``...)."""
    return any("polic" in name.lower() for name in _names(node))


def _classes(node: ast.expr) -> Iterator[ast.expr]:
    """The classes an ``isinstance`` tests against: ``C``, ``(A, B)``, ``A | B``."""
    if isinstance(node, ast.Tuple):
        for elt in node.elts:
            yield from _classes(elt)
    elif isinstance(node, ast.BinOp) and isinstance(node.op, ast.BitOr):
        yield from _classes(node.left)
        yield from _classes(node.right)
    else:
        yield node


def _from_policies(tree: ast.AST) -> dict[str, object]:
    """The local names bound to ``policies``' modules or to what is imported from them."""
    bound: dict[str, object] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            if node.module.split(".")[0] == "policies":
                module = importlib.import_module(node.module)
                for alias in node.names:
                    bound[alias.asname or alias.name] = getattr(module, alias.name)
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == "policies":
                    module = importlib.import_module(alias.name)
                    bound[alias.asname or "policies"] = (
                        module if alias.asname else importlib.import_module("policies")
                    )
    return bound


def _resolve(node: ast.expr, bound: dict[str, object]) -> object:
    """What ``node`` (``C``, ``module.C``) names among ``bound``, or None."""
    if isinstance(node, ast.Name):
        return bound.get(node.id)
    if isinstance(node, ast.Attribute):
        owner = _resolve(node.value, bound)
        return None if owner is None else getattr(owner, node.attr, None)
    return None


def _is_policy_class(obj: object) -> bool:
    """A routing policy (it chooses and is told outcomes), or one of the contract's Protocols.
    ``policies``' values (``Stored``, ``BackendSnapshot``...) may be told apart by class."""
    if not isinstance(obj, type):
        return False
    is_protocol = getattr(obj, "_is_protocol", False) and obj.__module__.startswith("policies")
    return bool(is_protocol) or (hasattr(obj, "choose") and hasattr(obj, "on_result"))


def violations(source: str, where: str = "<source>") -> list[str]:
    """Each ``getattr``/``hasattr`` on a policy, and each ``isinstance``/``issubclass``/``case``
    against a policy class or a Protocol of ``policies``, in ``source``."""
    tree = ast.parse(source)
    bound = _from_policies(tree)
    found: list[str] = []

    def against_policies(cls: ast.expr) -> bool:
        return any(_is_policy_class(_resolve(c, bound)) for c in _classes(cls))

    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            func, first = node.func.id, node.args[0]
            if func in ("getattr", "hasattr") and _policy_ish(first):
                found.append(f"{where}:{node.lineno}: {func} on {ast.unparse(first)}")
            elif (
                func in ("isinstance", "issubclass")
                and len(node.args) == 2
                and against_policies(node.args[1])
            ):
                found.append(f"{where}:{node.lineno}: {func} against {ast.unparse(node.args[1])}")
        elif isinstance(node, ast.MatchClass) and against_policies(node.cls):
            found.append(f"{where}:{node.lineno}: case {ast.unparse(node.cls)}()")
    return found


def test_the_check_catches_each_kind_of_probe() -> None:
    source = """
from policies import PrefixAffinity as PA, Weights
from policies.kv_index import Stored
import policies.capabilities
from gateway.request.router import Step

def f(step, policy, app, x, snap, event):
    getattr(step.policy, "hedges", False)
    hasattr(policy, "kv_index")
    getattr(app[ROUTER].prefill_policy, "x")
    isinstance(x, PA | int)
    isinstance(x, (int, policies.capabilities.Hedging))
    match x:
        case PA():
            pass
    # Not probes: another object; classes that are not policies (a KV event, a gateway type).
    getattr(snap, "id")
    isinstance(event, Stored)
    isinstance(x, Weights)
    isinstance(step, Step)
"""
    found = violations(source)
    assert [line.split(": ", 1)[1] for line in found] == [
        "getattr on step.policy",
        "hasattr on policy",
        "getattr on app[ROUTER].prefill_policy",
        "isinstance against PA | int",
        "isinstance against (int, policies.capabilities.Hedging)",
        "case PA()",
    ]


def test_no_code_outside_policies_probes_a_policy_or_tests_its_class() -> None:
    files = [p for package in OUTSIDE for p in sorted((ROOT / package).rglob("*.py"))]
    assert len(files) > 100  # the walk found the packages
    found = [v for p in files for v in violations(p.read_text(), p.relative_to(ROOT).as_posix())]
    assert found == [], "ask a policy through policies.capabilities:\n" + "\n".join(found)
