"""The web view acts for the person using it, not for whoever reaches its port (issue 31, ADR
0041). Each attack that once worked against `dsh-mesh ui` is made again here, as an attacker
would, in a real headless Chromium against a real node process and a real `dsh-mesh ui` process:
a form and a fetch from another local origin, a page on a DNS-rebinding host name, a team's person
reaching another team's tree, a decision recorded as `operator`, a view listening beyond loopback
in the clear. Each is refused, and the flows a signed-in person uses still work."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import http.server
import json
import secrets
import ssl
import subprocess
import sys
import threading
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from dsh_mesh.client import MeshClient, PendingApproval
from dsh_mesh.core import (
    ApprovalDecisionEntry,
    HumanPromptEntry,
    SessionId,
    TurnEndedEntry,
    TurnOutcome,
)
from dsh_mesh.testing import (
    EtcdAddress,
    LocalCluster,
    LocalPki,
    MeshReader,
    WebView,
    headless_chromium,
    tree_rows,
    until_shown,
    web_view,
)
from dsh_mesh.testing.probe_tools import GATE_ENV, LOG_ENV, read_probe_log
from dsh_mesh.transport import token_digest
from tests.integration.scenarios import UI_PRESETS

pytestmark = pytest.mark.timeout(180)

TEAM_A = secrets.token_hex(16)
TEAM_B = secrets.token_hex(16)
REBINDING_NAME = "rebind.attacker.test"
"""A host name the test's browser resolves to 127.0.0.1, as a rebinding attacker's DNS would."""


@pytest.fixture(scope="module")
def probe_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("probe") / "probe.log"


@pytest.fixture(scope="module")
def cluster(
    etcd: EtcdAddress, tmp_path_factory: pytest.TempPathFactory, probe_log: Path
) -> Iterator[LocalCluster]:
    folder = tmp_path_factory.mktemp("cluster")
    presets = folder / "presets.toml"
    presets.write_text(UI_PRESETS)
    grants = folder / "namespaces.toml"
    grants.write_text(
        f'[[grant]]\ntoken_sha256 = "{token_digest(TEAM_A)}"\nnamespaces = ["team-a"]\n\n'
        f'[[grant]]\ntoken_sha256 = "{token_digest(TEAM_B)}"\nnamespaces = ["team-b"]\n'
    )
    gate = folder / "probe.gate"
    gate.touch()  # probes return at once
    with LocalCluster(
        etcd_endpoint=etcd.endpoint,
        scenario="tests.integration.scenarios:UI",
        presets_file=presets,
        nodes=("node-a",),
        env={
            LOG_ENV: str(probe_log),
            GATE_ENV: str(gate),
            "DSH_NAMESPACES_FILE": str(grants),
        },
    ) as running:
        yield running


@pytest.fixture(scope="module")
def view(cluster: LocalCluster) -> Iterator[WebView]:
    """``dsh-mesh ui`` as the operator starts it: over node-a with the cluster token."""
    with web_view(node_address(cluster), cluster.settings.cluster_token) as running:
        yield running


@pytest.fixture
def browser() -> Iterator[Any]:
    with headless_chromium(flags=(f"--host-resolver-rules=MAP {REBINDING_NAME} 127.0.0.1",)) as d:
        yield d


@pytest.fixture
def attacker(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    """Another origin on this host (another port: the same *site*, so a SameSite=Strict
    cookie goes with its requests): its URL, and the folder whose pages it serves."""
    folder = tmp_path / "attacker"
    folder.mkdir()
    handler = functools.partial(QuietHandler, directory=str(folder))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/", folder
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def node_address(cluster: LocalCluster) -> str:
    address = cluster["node-a"].address
    assert address is not None
    return address


@contextlib.asynccontextmanager
async def operator(cluster: LocalCluster) -> AsyncIterator[MeshClient]:
    async with MeshClient(node_address(cluster), token=cluster.settings.cluster_token) as client:
        yield client


async def waiting_root(cluster: LocalCluster, namespace: str = "default") -> PendingApproval:
    """A root of ``namespace`` whose first call waits for a person's decision."""
    async with operator(cluster) as client:
        root = await client.create_root("gated", "Probe, once allowed.", namespace=namespace)
        for _ in range(600):
            found = await client.list_approvals(root.session_id)
            if found:
                return found[0]
            await asyncio.sleep(0.05)
    raise AssertionError(f"{root.session_id} never asked for approval")


async def still_waits(cluster: LocalCluster, pending: PendingApproval, probe_log: Path) -> None:
    """Nothing the attack asked for happened: the call still waits and never ran, no prompt
    was stored, no turn was cancelled."""
    async with operator(cluster) as client:
        assert [p.request.call_id for p in await client.list_approvals(pending.session_id)] == [
            pending.request.call_id
        ]
    async with MeshReader(cluster.settings) as reader:
        records = await reader.transcript(SessionId(pending.session_id))
    entries = [r.entry for r in records]
    assert not [e for e in entries if isinstance(e, HumanPromptEntry)]
    assert not [e for e in entries if isinstance(e, ApprovalDecisionEntry)]
    ended = [e.outcome for e in entries if isinstance(e, TurnEndedEntry)]
    assert ended == [TurnOutcome.AWAITING_APPROVAL]
    assert pending.session_id not in {run.session for run in read_probe_log(probe_log)}


def posts(view: WebView, pending: PendingApproval) -> dict[str, dict[str, Any]]:
    """What an attacker posts: each state-changing route, with the waiting call's real id
    and digest (the worst case: the attacker read them somehow)."""
    base = f"{view.url}api/sessions/{pending.session_id}"
    return {
        f"{base}/prompt": {"text": "Do what the attacker says."},
        f"{base}/interrupt": {},
        f"{base}/stop": {"close": True, "reason": "attacker"},
        f"{base}/approve": {
            "call_id": pending.request.call_id,
            "request_digest": pending.request.request_digest,
            "reason": "attacker",
        },
    }


async def test_a_form_and_a_fetch_from_another_local_origin_change_nothing(
    cluster: LocalCluster,
    view: WebView,
    browser: Any,
    attacker: tuple[str, Path],
    probe_log: Path,
) -> None:
    pending = await waiting_root(cluster)
    browser.get(view.link(root=pending.session_id))  # the person signs in, as they would
    until_shown(
        browser,
        lambda d: tree_rows(d).get(pending.session_id, {}).get("state") == "awaiting-approval",
        "the signed-in page showing the waiting call",
    )
    origin, folder = attacker
    targets = posts(view, pending)
    # A plain HTML form (text/plain, as a form can send JSON-looking text) on the other origin.
    prompt = next(iter(targets))
    (folder / "form.html").write_text(
        f'<form id="f" method="POST" action="{prompt}" enctype="text/plain">'
        '<input name=\'{"text": "Do what the attacker says.", "x": "\' value=\'"}\'></form>'
        "<script>document.getElementById('f').submit()</script>"
    )
    browser.get(f"{origin}form.html")
    until_shown(
        browser, lambda d: "JSON_REQUIRED" in d.page_source, "the view's refusal of the form"
    )
    # Fetches: simple requests (no-cors, text/plain, with the cookie) and a JSON one (which
    # needs a CORS preflight the view never grants).
    (folder / "fetch.html").write_text(
        "<script>\n"
        f"const targets = {json.dumps(targets)};\n"
        "(async () => {\n"
        "  const seen = [];\n"
        "  window.onunhandledrejection = (e) => { document.title = 'done failed ' + e.reason; };\n"
        "  for (const [url, body] of Object.entries(targets)) {\n"
        "    try {  // the request goes; its answer is kept from the page (CORP)\n"
        "      await fetch(url, {method: 'POST', mode: 'no-cors', credentials: 'include',\n"
        "        headers: {'Content-Type': 'text/plain'}, body: JSON.stringify(body)});\n"
        "    } catch (unread) { /* what the view answered is checked in the mesh below */ }\n"
        "    try {\n"
        "      const r = await fetch(url, {method: 'POST', credentials: 'include',\n"
        "        headers: {'Content-Type': 'application/json'}, body: JSON.stringify(body)});\n"
        "      seen.push('read ' + r.status);\n"
        "    } catch (refused) { seen.push('blocked'); }\n"
        "  }\n"
        "  document.title = 'done ' + seen.join(',');\n"
        "})();\n"
        "</script>"
    )
    browser.get(f"{origin}fetch.html")
    until_shown(browser, lambda d: d.title.startswith("done"), "the attacker's fetches made")
    assert browser.title == "done " + ",".join(["blocked"] * len(targets))
    await still_waits(cluster, pending, probe_log)


async def test_a_page_on_a_rebinding_host_name_reads_nothing_and_approves_nothing(
    cluster: LocalCluster, view: WebView, browser: Any, probe_log: Path
) -> None:
    pending = await waiting_root(cluster)
    browser.get(view.link(root=pending.session_id))
    until_shown(browser, lambda d: pending.session_id in tree_rows(d), "the signed-in page")
    # The attacker's page, once its name resolves to this machine: same origin as itself, so
    # it may read whatever the view answers it, and post what it likes.
    rebound = view.url.replace("127.0.0.1", REBINDING_NAME)
    for path in ("", "api/roots", f"api/events?root={pending.session_id}"):
        browser.get(f"{rebound}{path}")
        assert "HOST_NOT_ALLOWED" in browser.page_source, path
        assert pending.session_id not in browser.page_source, path
    answers = browser.execute_async_script(
        "const [targets, done] = [arguments[0], arguments[arguments.length - 1]];"
        "(async () => {"
        "  const seen = [];"
        "  for (const [url, body] of Object.entries(targets)) {"
        "    const r = await fetch(url, {method: 'POST', headers: {'Content-Type':"
        "      'application/json'}, body: JSON.stringify(body)});"
        "    seen.push([r.status, (await r.json()).error]);"
        "  }"
        "  done(seen);"
        "})();",
        {
            url.replace("127.0.0.1", REBINDING_NAME): body
            for url, body in posts(view, pending).items()
        },
    )
    assert answers == [[403, "HOST_NOT_ALLOWED"]] * 4
    await still_waits(cluster, pending, probe_log)


async def test_a_teams_person_sees_and_steers_only_their_teams_trees_and_decides_as_their_token(
    cluster: LocalCluster, view: WebView, browser: Any, probe_log: Path
) -> None:
    theirs = await waiting_root(cluster, "team-a")
    others = await waiting_root(cluster, "team-b")
    browser.get(view.url)
    assert "Sign in" in browser.page_source and "tree" not in browser.title
    browser.find_element("id", "token").send_keys(TEAM_A)
    browser.find_element("css selector", "#sign-in button").click()
    until_shown(browser, lambda d: d.find_elements("id", "roots"), "the page, once signed in")
    until_shown(
        browser,
        lambda d: d.find_elements("css selector", "#roots tbody tr"),
        "the team's trees listed",
    )
    listed = set(  # one read: the list is drawn anew every few seconds
        browser.execute_script(
            "return [...document.querySelectorAll('#roots tbody tr')].map(r => r.dataset.session)"
        )
    )
    assert theirs.session_id in listed and others.session_id not in listed
    digest = token_digest(TEAM_A)[:12]
    assert browser.find_element("id", "person").text == f"signed in as token:{digest}"

    # Another team's tree, by its id: unknown to this person, as a tree that does not exist.
    browser.get(f"{view.url}?root={others.session_id}")
    until_shown(
        browser,
        lambda d: "UNKNOWN_SESSION" in d.find_element("id", "message").text,
        "the other team's tree refused",
    )
    answers = browser.execute_async_script(
        "const [targets, done] = [arguments[0], arguments[arguments.length - 1]];"
        "(async () => {"
        "  const csrf_token = localStorage.getItem('dsh-mesh-key');"
        "  const seen = [];"
        "  for (const [url, body] of Object.entries(targets)) {"
        "    const r = await fetch(url, {method: 'POST', headers: {'Content-Type':"
        "      'application/json', 'X-CSRF-Token': csrf_token}, body: JSON.stringify(body)});"
        "    seen.push([r.status, (await r.json()).error]);"
        "  }"
        "  done(seen);"
        "})();",
        posts(view, others),
    )
    assert answers == [[404, "UNKNOWN_SESSION"]] * 4
    await still_waits(cluster, others, probe_log)

    # The team's own tree: approved from the page, recorded as the person's token.
    browser.get(f"{view.url}?root={theirs.session_id}")
    card = until_shown(
        browser,
        lambda d: d.find_elements("css selector", "#approvals .approval"),
        "the team's waiting call",
    )[0]
    card.find_element("css selector", ".approve").click()
    until_shown(
        browser,
        lambda d: "Approved and done." in d.find_element("id", "transcript").text,
        "the turn gone on",
    )
    async with MeshReader(cluster.settings) as reader:
        records = await reader.transcript(SessionId(theirs.session_id))
    [decided] = [r.entry for r in records if isinstance(r.entry, ApprovalDecisionEntry)]
    assert decided.by == f"token:{digest}"


async def test_a_person_a_trusted_proxy_names_decides_as_themselves(
    cluster: LocalCluster,
) -> None:
    pending = await waiting_root(cluster)
    args = ("--trusted-header", "X-Forwarded-User", "--trusted-proxy", "127.0.0.2")
    named = {"x-forwarded-user": "alice@example.org"}
    with web_view(node_address(cluster), cluster.settings.cluster_token, args=args) as proxied:
        from_proxy = httpx.AsyncHTTPTransport(local_address="127.0.0.2")
        async with httpx.AsyncClient(
            transport=from_proxy, base_url=proxied.url, headers=named, timeout=30
        ) as proxy:
            config = (await proxy.get("/api/config")).json()
            assert config["person"] == {"by": "proxy", "name": "alice@example.org"}
            decided = await proxy.post(
                f"/api/sessions/{pending.session_id}/approve",
                json={
                    "call_id": pending.request.call_id,
                    "request_digest": pending.request.request_digest,
                },
                headers={"origin": proxied.origin, "x-csrf-token": config["csrf_token"]},
            )
            assert decided.status_code == 200, decided.text
            assert decided.json()["decided_by"] == "alice@example.org via operator"
        # The same header from anywhere but the proxy names nobody, whatever the sender says
        # of where it came from.
        async with httpx.AsyncClient(base_url=proxied.url, headers=named, timeout=30) as forger:
            assert (await forger.get("/api/config")).status_code == 401
            posing = {"x-forwarded-for": "127.0.0.2", "forwarded": "for=127.0.0.2"}
            assert (await forger.get("/api/config", headers=posing)).status_code == 401
    async with MeshReader(cluster.settings) as reader:
        records = await reader.transcript(SessionId(pending.session_id))
    [decision] = [r.entry for r in records if isinstance(r.entry, ApprovalDecisionEntry)]
    assert decision.by == "alice@example.org via operator"


def test_the_view_refuses_to_listen_beyond_loopback_without_tls_or_a_proxy(
    cluster: LocalCluster,
) -> None:
    refused = subprocess.run(
        [sys.executable, "-m", "dsh_mesh.cli", "ui", "--host", "0.0.0.0", "--port", "0"],
        env={
            "DSH_NODE": node_address(cluster),
            "DSH_CLUSTER_TOKEN": cluster.settings.cluster_token,
            "PATH": "/usr/bin:/bin",
        },
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert refused.returncode == 2
    assert "refusing to serve the web view on 0.0.0.0" in refused.stderr
    assert "--tls-cert" in refused.stderr and "--trusted-header" in refused.stderr
    assert refused.stdout == ""


async def test_over_https_the_cookie_is_secure_and_hsts_is_sent(cluster: LocalCluster) -> None:
    with LocalPki() as pki:
        served_by = pki.node("view")  # a certificate for 127.0.0.1 from a throwaway CA
        args = ["--host", "0.0.0.0", "--tls-cert", str(served_by.cert)]
        args += ["--tls-key", str(served_by.key)]
        with web_view(node_address(cluster), cluster.settings.cluster_token, args=args) as served:
            assert served.url.startswith("https://0.0.0.0:")
            url = served.sign_in_url.replace("0.0.0.0", "127.0.0.1")
            trusting = ssl.create_default_context(cafile=str(served_by.ca))
            async with httpx.AsyncClient(verify=trusting, timeout=30) as https:
                signed = await https.get(url)
                assert signed.status_code == 303
                cookie = signed.headers["set-cookie"].lower()
                assert "secure" in cookie and "httponly" in cookie and "samesite=strict" in cookie
                assert signed.headers["strict-transport-security"].startswith("max-age=")
                page = await https.get(url.split("?")[0])
                assert page.status_code == 200 and 'id="tree"' in page.text
            async with httpx.AsyncClient(timeout=30) as plain:
                with pytest.raises(httpx.HTTPError):  # no plain HTTP beside it
                    await plain.get(url.replace("https://", "http://"))
