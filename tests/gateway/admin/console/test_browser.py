"""The operator's console in a real headless Chromium, against a running gateway (the shipped
production configuration) in front of three simulators, with clients streaming through it.

Each test records every request the page makes: all of them go to the admin listener, none
carries the token in its URL, and nothing is left in the browser's storage.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from playwright.sync_api import Browser, Page, expect

from tests.gateway.admin.console.fleet import (
    KEYS,
    MODEL,
    Fleet,
    Traffic,
    another_replica,
    chat,
    running_fleet,
)
from tests.gateway.admin.console.page import (
    apply_in_dialog,
    opened,
    sign_in,
    signed_in,
    wait_until,
)

pytestmark = pytest.mark.slow


@pytest.fixture
def fleet(tmp_path: Path, redis_url: str, redis_prefix: str) -> Iterator[Fleet]:
    with running_fleet(tmp_path / "logs", redis_url, redis_prefix) as f:
        traffic = Traffic(f.url).start()
        try:
            yield f
        finally:
            traffic.stop()


@pytest.fixture
def page(browser: Browser, fleet: Fleet) -> Iterator[Page]:
    with opened(browser, fleet) as p:
        yield p


def test_the_page_loads_with_the_backends_and_their_live_figures(page: Page, fleet: Fleet) -> None:
    signed_in(page, fleet)
    for backend in ("gpu-a", "gpu-b", "gpu-canary"):
        row = page.locator(f'#backends tr[data-backend="{backend}"]')
        expect(row.locator("td").nth(1)).to_have_text("up")
        expect(row.locator("td").nth(2)).to_have_text("closed")
    expect(page.locator("#policy-name")).to_have_text("policy: prefix_affinity")
    # Traffic is flowing: the request rate and a chart line appear once two polls are in.
    rps = page.locator("#tiles .tile").filter(has_text="Requests/s").locator(".value")
    expect(rps).not_to_have_text("\N{EN DASH}", timeout=15_000)  # the page's "no figure yet"
    assert float(rps.inner_text()) > 0
    expect(page.locator("#chart-rps polyline").first).to_be_attached(timeout=15_000)
    # The default-tier key over its concurrency limit shows in the rejections, by key.
    expect(page.locator("#rejections tbody tr").filter(has_text="internal-tools")).to_be_visible(
        timeout=15_000
    )
    # The canary alias and its pools.
    expect(
        page.locator('#aliases tr[data-alias="chat"][data-pool="canary"] td').nth(1)
    ).to_have_text("5")
    expect(page.locator("#pools tbody tr")).to_have_count(2)
    # Capacity off (the production file's default), every engine awake: no capacity panel.
    expect(page.locator("#capacity-card")).to_be_hidden()


def test_a_wrong_token_is_refused_and_shows_nothing(page: Page, fleet: Fleet) -> None:
    with page.expect_response(lambda r: r.url.endswith("/admin/policy")) as answer:
        sign_in(page, "not-the-token")
    assert answer.value.status == 401
    expect(page.locator("#login-error")).to_have_text("The admin API refused the token.")
    expect(page.locator("#console")).to_be_hidden()
    assert page.locator("#backends tbody tr").count() == 0
    # The right one still works after a wrong one; a reload asks again (memory only).
    signed_in(page, fleet)
    page.reload()
    expect(page.locator("#login")).to_be_visible()
    expect(page.locator("#console")).to_be_hidden()


def test_draining_a_backend_from_the_page_stops_traffic_to_it(page: Page, fleet: Fleet) -> None:
    signed_in(page, fleet)
    row = page.locator('#backends tr[data-backend="gpu-b"]')
    row.locator("button.drain").click()
    apply_in_dialog(page, [("draining", "false", "true")])
    expect(row.locator("button.undrain")).to_be_visible()
    expect(page.locator("#banner")).to_have_text("Drained gpu-b.")
    assert fleet.backend("gpu-b")["draining"] is True
    # Once its last stream has ended, nothing more reaches it; the others keep serving.
    wait_until(lambda: fleet.backend("gpu-b")["in_flight"] == 0)
    before_b, before_a = fleet.requests_to("gpu-b"), fleet.requests_to("gpu-a")
    with httpx.Client(timeout=30) as client:
        for _ in range(30):
            assert chat(client, fleet.url, KEYS["web-app"], MODEL) == 200
    assert fleet.requests_to("gpu-b") == before_b
    assert fleet.requests_to("gpu-a") > before_a
    # Undrained from the page, it takes requests again.
    row.locator("button.undrain").click()
    apply_in_dialog(page, [("draining", "true", "false")])
    # The page says so once the admin API answered (not at the click).
    expect(page.locator("#banner")).to_have_text("Undrained gpu-b.")
    assert fleet.backend("gpu-b")["draining"] is False
    wait_until(lambda: fleet.requests_to("gpu-b") > before_b, within=20)


def test_a_weight_change_made_on_the_page_is_what_the_admin_api_reports(
    page: Page, fleet: Fleet
) -> None:
    signed_in(page, fleet)
    before = fleet.admin("GET", "/admin/policy").json()
    assert before["weights"]["queue"] == 3.0
    page.fill("#field-weights-queue", "7.5")
    page.fill("#field-affinity-balance_abs", "12")
    page.click("#policy-review")
    apply_in_dialog(page, [("weights.queue", "3", "7.5"), ("affinity.balance_abs", "8", "12")])
    expect(page.locator("#banner")).to_have_text("Policy changed.")
    after = fleet.admin("GET", "/admin/policy").json()
    assert after["weights"] == {**before["weights"], "queue": 7.5}
    assert after["affinity"] == {**before["affinity"], "balance_abs": 12.0}
    assert after["policy"] == before["policy"]
    # A value the API refuses: its message on the page, and nothing changed.
    page.fill("#field-weights-kv", "-1")
    page.click("#policy-review")
    apply_in_dialog(page, [("weights.kv", "1", "-1")])
    expect(page.locator("#banner")).to_contain_text("weights.kv")
    assert fleet.admin("GET", "/admin/policy").json() == after
    # Switching the policy itself.
    page.locator("#policy-select").select_option("least_load")
    page.fill("#field-weights-kv", "1")
    page.click("#policy-review")
    apply_in_dialog(page, [("policy", "prefix_affinity", "least_load")])
    expect(page.locator("#policy-name")).to_have_text("policy: least_load")
    assert fleet.admin("GET", "/admin/policy").json()["policy"] == "least_load"


def test_canary_weights_shift_from_the_page_and_roll_back(page: Page, fleet: Fleet) -> None:
    signed_in(page, fleet)
    block = page.locator('#aliases div.alias[data-alias="chat"]')
    block.locator('input[name="weight.canary"]').fill("50")
    block.locator('input[name="weight.stable"]').fill("50")
    block.locator("button.review-weights").click()
    apply_in_dialog(page, [("chat → stable", "95", "50"), ("chat → canary", "5", "50")])
    # The page sends the change once the dialog closes, maybe behind its poll's calls: its
    # answer first, then the admin API read.
    expect(page.locator("#banner")).to_have_text("chat's weights changed.")
    assert fleet.admin("GET", "/admin/aliases/chat").json()["weights"] == {
        "stable": 50.0,
        "canary": 50.0,
    }
    expect(block.locator('tr[data-pool="canary"] td').nth(1)).to_have_text("50")
    block.locator("button.rollback").click()
    apply_in_dialog(page, [("chat → stable", "50", "95"), ("chat → canary", "50", "5")])
    expect(page.locator("#banner")).to_have_text("chat rolled back.")
    assert fleet.admin("GET", "/admin/aliases/chat").json()["weights"] == {
        "stable": 95.0,
        "canary": 5.0,
    }
    expect(block.locator('tr[data-pool="canary"] td').nth(1)).to_have_text("5")


def test_the_pools_card_shows_the_fleets_traffic_split_not_this_replicas(
    browser: Browser, tmp_path: Path, redis_url: str, redis_prefix: str
) -> None:
    """In a fleet, the split beside the alias's weights (which every replica applied alike) is
    the fleet's, as the fleet-wide figures are: traffic through another replica shows on this
    one's page although none of it went through this one."""
    with (
        running_fleet(tmp_path / "logs", redis_url, redis_prefix) as fleet,
        another_replica(fleet, "pools-second") as second,
        opened(browser, fleet) as page,
    ):
        assert fleet.admin(
            "PUT", "/admin/aliases/chat", json={"stable": 50, "canary": 50}
        ).is_success
        traffic = Traffic(second.url).start(streams=4, over_limit=0)  # through the second only
        try:
            signed_in(page, fleet)
            block = page.locator('#aliases div.alias[data-alias="chat"]')
            for pool in ("stable", "canary"):
                share = block.locator(f'tr[data-pool="{pool}"] td').nth(2)
                expect(share).to_have_text(re.compile(r"^[1-9]\d* %$"), timeout=20_000)
            expect(page.locator("#traffic-source")).to_have_text(
                "traffic: the last 5 s, summed over the fleet's 2 replicas"
            )
        finally:
            traffic.stop()
        own = fleet.admin("GET", "/admin/stats").json()["aliases"].get("chat", {})
        assert sum(n for pool in own.values() for n in pool.values()) == 0


def test_reload_from_the_page_reports_what_it_applied(page: Page, fleet: Fleet) -> None:
    signed_in(page, fleet)
    page.click("#reload")
    apply_in_dialog(page, [])
    expect(page.locator("#reload-result")).to_have_text("Applied: nothing.")
    expect(page.locator("#banner")).to_have_text("Configuration reloaded.")


def test_a_change_made_elsewhere_shows_in_the_inputs_not_being_edited(
    page: Page, fleet: Fleet
) -> None:
    signed_in(page, fleet)
    page.fill("#field-weights-active", "4")  # being edited on the page
    changed = {"weights": {"active": 2.0, "queue": 5.0, "kv": 1.0}}
    assert fleet.admin("PUT", "/admin/policy", json=changed).status_code == 200
    expect(page.locator("#field-weights-queue")).to_have_value("5")  # followed the gateway
    expect(page.locator("#field-weights-active")).to_have_value("4")  # kept what was typed
    expect(page.locator("#field-weights-active")).to_have_class("edited")
    # The review compares with what runs now, not with what the page first showed.
    page.click("#policy-review")
    apply_in_dialog(page, [("weights.active", "2", "4")])
    expect(page.locator("#banner")).to_have_text("Policy changed.")
    assert fleet.admin("GET", "/admin/policy").json()["weights"] == {
        "active": 4.0,
        "queue": 5.0,
        "kv": 1.0,
    }
    block = page.locator('#aliases div.alias[data-alias="chat"]')
    assert fleet.admin("PUT", "/admin/aliases/chat", json={"stable": 80, "canary": 20}).is_success
    expect(block.locator('input[name="weight.canary"]')).to_have_value("20")


def test_the_fleet_panel_lists_replicas_and_changes_and_manages_keys(
    page: Page, fleet: Fleet
) -> None:
    signed_in(page, fleet)
    replicas = page.locator("#replicas tbody tr")
    expect(replicas).to_have_count(1)  # one replica of the production file's fleet
    expect(replicas.first).to_contain_text("(this one)")
    expect(page.locator("#fleet-summary")).to_contain_text("1 replicas, all up to date")
    # A key made on the page: shown once, works at once.
    page.fill("#key-name", "team-x")
    page.fill("#key-tier", "interactive")
    page.click("#key-form button[type=submit]")
    apply_in_dialog(page, [("tier", "none", "interactive")])
    expect(page.locator("#banner")).to_have_text("Made a key for team-x.")
    secret = page.locator("#key-secret").text_content() or ""
    assert secret.startswith("sk-gw-")
    with httpx.Client(timeout=30) as client:
        assert chat(client, fleet.url, secret, MODEL) == 200
    row = page.locator('#keys tr[data-key="team-x"]')
    expect(row).to_contain_text("runtime")
    # The audit trail shows it, newest first, without the secret.
    newest = page.locator("#changes tbody tr").first
    expect(newest).to_contain_text("POST /admin/keys")
    expect(page.locator("#changes")).not_to_contain_text(secret)
    # Rotated on the page: a new secret shown once; the old one still works (an hour's overlap).
    row.locator("button.rotate").click()
    apply_in_dialog(page, [("old key works for", "none", "3600 s")])
    expect(page.locator("#banner")).to_have_text("Rotated team-x's key.")
    expect(page.locator("#key-secret")).not_to_have_text(secret)
    rotated = page.locator("#key-secret").text_content() or ""
    assert rotated.startswith("sk-gw-")
    with httpx.Client(timeout=30) as client:
        assert chat(client, fleet.url, rotated, MODEL) == 200
        assert chat(client, fleet.url, secret, MODEL) == 200
    # Revoked on the page: refused at once, both secrets.
    row.locator("button.revoke").click()
    apply_in_dialog(page, [])
    expect(page.locator("#banner")).to_have_text("Revoked team-x.")
    expect(row).to_have_count(0)
    with httpx.Client(timeout=30) as client:
        assert chat(client, fleet.url, secret, MODEL) == 401
        assert chat(client, fleet.url, rotated, MODEL) == 401
    expect(page.locator("#changes tbody tr").first).to_contain_text("DELETE /admin/keys/team-x")
    # The fleet's figures, summed over its replicas: with one, its own; every figure there.
    figures = page.locator("#fleet-figures")
    for key in ("requests", "errors", "ttft-p50", "ttft-p99", "routed:gpu-a", "canary:chat:stable"):
        expect(figures.locator(f'tr[data-key="{key}"]')).to_be_visible(timeout=15_000)
    # The default-tier key over its concurrency limit, by key.
    expect(figures.locator('tr[data-key="rejected:key:internal-tools"]')).to_be_visible(
        timeout=15_000
    )
    expect(figures.locator('tr[data-key="ttft-p99"] td').nth(1)).not_to_have_text("\N{EN DASH}")
    # A second replica joins; requests through it are its own and the fleet's too.
    with another_replica(fleet, "console-second") as second:
        with httpx.Client(timeout=30) as client:
            for _ in range(5):
                assert chat(client, second.url, KEYS["nightly-batch"], MODEL) == 200
        expect(replicas).to_have_count(2, timeout=20_000)
        page.wait_for_function(FLEET_TOTAL_IS_THE_SUM, arg=["console-second", 5], timeout=20_000)
        first = page.locator("#replicas tbody tr").filter(has_text="(this one)").locator("td")
        assert int(first.nth(5).inner_text()) > 0  # the traffic through the first


def test_the_audit_trail_shows_each_changes_id_and_the_page_sends_one_per_action(
    page: Page, fleet: Fleet
) -> None:
    """A change's id (its caller's Idempotency-Key, or one made by the gateway) is in the audit
    trail; a change made on the page carries a key of its own, which becomes its id."""
    signed_in(page, fleet)
    made = fleet.admin(
        "PUT",
        "/admin/aliases/chat",
        json={"stable": 90, "canary": 10},
        headers={"Idempotency-Key": "shift-from-curl-1"},
    )
    assert made.headers["X-Gateway-Change-Id"] == "shift-from-curl-1"
    newest = page.locator("#changes tbody tr").first
    expect(newest.locator("td").nth(1)).to_have_text("shift-from-curl-1")
    expect(newest.locator("td").nth(2)).to_have_text("PUT /admin/aliases/chat")
    # Made on the page: its key is sent with it, and is the id the trail and the API show.
    with page.expect_request(lambda r: r.method == "POST" and "/drain" in r.url) as sent:
        page.locator('#backends tr[data-backend="gpu-b"] button.drain').click()
        apply_in_dialog(page, [("draining", "false", "true")])
    key = sent.value.headers["idempotency-key"]
    assert re.fullmatch(r"console_[0-9a-f]{24}", key)
    expect(page.locator("#banner")).to_have_text("Drained gpu-b.")
    expect(newest.locator("td").nth(1)).to_have_text(key)
    expect(newest.locator("td").nth(2)).to_have_text("POST /admin/backends/gpu-b/drain")
    fate = fleet.admin("GET", f"/admin/changes/{key}").json()
    assert (fate["state"], fate["outcome"]["body"]["draining"]) == ("applied", True)
    # Another action on the page: another key.
    with page.expect_request(lambda r: r.method == "POST" and "/undrain" in r.url) as again:
        page.locator('#backends tr[data-backend="gpu-b"] button.undrain').click()
        apply_in_dialog(page, [("draining", "true", "false")])
    assert again.value.headers["idempotency-key"] not in (key, "shift-from-curl-1")
    expect(page.locator("#banner")).to_have_text("Undrained gpu-b.")


# True once the replicas table lists two, ``second`` having served ``sent`` requests, and the
# fleet's requests (the figures table) are the replicas' summed: read in one go, as rendered.
FLEET_TOTAL_IS_THE_SUM = """([second, sent]) => {
  const rows = [...document.querySelectorAll("#replicas tbody tr")];
  const own = Object.fromEntries(rows.map((r) => [r.dataset.key, Number(r.cells[5].textContent)]));
  const fleet = document.querySelector('#fleet-figures tr[data-key="requests"]');
  const total = fleet ? Number(fleet.cells[1].textContent) : NaN;
  const summed = Object.values(own).reduce((a, b) => a + b, 0);
  return rows.length === 2 && own[second] === sent && total === summed && total > sent;
}"""


def start_rollout_on_page(page: Page, steps: str, hold_s: str, min_requests: str) -> None:
    """Fill the page's form for a rollout of ``chat`` from stable to canary, and review it."""
    expect(page.locator("#rollout-alias")).to_have_value("chat")
    expect(page.locator("#rollout-stable")).to_have_value("stable")  # the most weight now
    expect(page.locator("#rollout-canary")).to_have_value("canary")
    page.fill("#rollout-steps", steps)
    page.fill("#rollout-hold", hold_s)
    page.fill("#rollout-min", min_requests)
    page.fill("#rollout-ttft-factor", "100")  # the simulators' latency varies on two cores
    page.fill("#rollout-itl-factor", "100")
    page.click("#rollout-review")


def test_a_rollout_started_on_the_page_shows_its_gates_and_is_paused_and_aborted_there(
    page: Page, fleet: Fleet
) -> None:
    signed_in(page, fleet)
    expect(page.locator("#rollouts")).to_contain_text("None yet")
    # A plan the gateway refuses: its reason on the page, nothing started.
    start_rollout_on_page(page, "10, 5", "600", "2")
    dialog = page.locator("#confirm")
    expect(dialog.locator("#confirm-diff")).to_contain_text("10, 5")
    page.click("#confirm-apply")
    expect(page.locator("#banner")).to_contain_text("steps must rise")
    assert fleet.admin("GET", "/admin/rollouts").json() == {"rollouts": []}
    # A long hold: it stays at its first step while the page is looked at.
    start_rollout_on_page(page, "10, 50, 100", "600", "2")
    page.click("#confirm-apply")
    expect(page.locator("#banner")).to_have_text("chat's rollout started.")
    block = page.locator('#rollouts div.rollout[data-alias="chat"]')
    expect(block.locator(".name")).to_have_text("chat: stable → canary")
    expect(block.locator(".state")).to_have_text("running")
    expect(block.locator("ol.steps li")).to_have_text(["10 %", "50 %", "100 %"])
    expect(block.locator("ol.steps li.current")).to_have_text("10 %")
    run = fleet.admin("GET", "/admin/rollouts/chat").json()
    assert (run["status"], run["step"], run["weights"]) == (
        "running",
        0,
        {"stable": 90.0, "canary": 10.0},
    )
    # The driver's look: who drives, the gates' figures once canary requests are in, the
    # requests against the plan's least, the hold and the whole rollout's time left.
    expect(block.locator(".driver")).to_contain_text("(this one)", timeout=15_000)
    errors = block.locator('table.gates tr[data-key="errors"] td')
    expect(errors.nth(4)).to_have_text("passes", timeout=30_000)
    expect(errors.nth(1)).to_have_text("0.0 %")
    for gate in ("ttft_p99", "itl_p50"):
        expect(block.locator(f'table.gates tr[data-key="{gate}"] td').nth(4)).to_have_text("passes")
    summary = block.locator(".summary")
    expect(summary).to_contain_text("At step 1 of 3 (10 % to canary): holding (")
    expect(summary).to_contain_text("this step's hold")
    expect(summary).to_contain_text("the rollout at least 2")  # 20-30 min: 600 s a step
    # Paused on the page: held where it is, on the admin API too.
    block.locator("button.pause").click()
    apply_in_dialog(page, [])
    expect(page.locator("#banner")).to_have_text("chat's rollout paused.")
    expect(block.locator(".state")).to_have_text("paused")
    assert fleet.admin("GET", "/admin/rollouts/chat").json()["status"] == "paused"
    expect(summary).to_contain_text("Paused at step 1 of 3", timeout=15_000)
    expect(block.locator("button.pause")).to_be_hidden()
    block.locator("button.resume").click()
    apply_in_dialog(page, [])
    expect(block.locator(".state")).to_have_text("running")
    # Aborted on the page: back to stable at once, the canary drained, the page says why.
    block.locator("button.abort").click()
    apply_in_dialog(page, [("chat → canary", "10", "0")])
    expect(page.locator("#banner")).to_have_text("chat's rollout aborted.")
    expect(block.locator(".state")).to_have_text("aborted")
    expect(block.locator("ol.steps li.failed")).to_have_text("10 %")
    expect(summary).to_contain_text("Rolled back to stable at step 1 of 3")
    expect(summary).to_contain_text("aborted from the console")
    expect(block.locator("button.abort")).to_be_hidden()
    events = block.locator("table.events tbody tr")
    expect(events).to_have_count(4)
    expect(events.first.locator("td").nth(1)).to_have_text("abort")
    assert fleet.admin("GET", "/admin/aliases/chat").json()["weights"] == {
        "stable": 100.0,
        "canary": 0.0,
    }
    expect(page.locator('#pools tr[data-key="canary"] td').nth(3)).to_have_text("drained")


def test_a_healthy_rollout_started_on_the_page_is_promoted_step_by_step(
    page: Page, fleet: Fleet
) -> None:
    signed_in(page, fleet)
    start_rollout_on_page(page, "20, 100", "1", "2")
    page.click("#confirm-apply")
    block = page.locator('#rollouts div.rollout[data-alias="chat"]')
    expect(block.locator(".state")).to_have_text("promoted", timeout=60_000)
    expect(block.locator("ol.steps li.done")).to_have_count(2)
    expect(block.locator(".summary")).to_have_text("Promoted: canary serves all of chat.")
    actions = block.locator("table.events tbody tr td:nth-child(2)")
    expect(actions).to_have_text(["promote", "advance", "start"])  # newest first
    # The step's final figures stay on the page: every gate passed.
    expect(block.locator("table.gates tbody tr td:nth-child(5)")).to_have_text(["passes"] * 3)
    assert fleet.admin("GET", "/admin/aliases/chat").json()["weights"] == {"canary": 100.0}
    expect(
        page.locator('#aliases tr[data-alias="chat"][data-pool="canary"] td').nth(1)
    ).to_have_text("100")
