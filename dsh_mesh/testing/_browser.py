"""A headless Chromium for the web view's tests and figures: Debian's ``chromium`` driven by
Debian's ``chromium-driver`` through Selenium (scripts/install_browser.sh installs both). No
browser or driver is ever downloaded, and each browser gets a fresh profile directory."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"
_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--window-size=1600,1000",
)


@contextlib.contextmanager
def headless_chromium(*, flags: Sequence[str] = ()) -> Iterator[Any]:
    """A Selenium ``WebDriver`` over a fresh headless Chromium, quit (and its profile removed)
    on exit; ``flags`` are more command-line flags (``--host-resolver-rules=...`` to point a
    host name at loopback, as DNS rebinding does). Raises ``RuntimeError`` naming what is
    missing when the browser is not installed."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            raise RuntimeError(f"{path} is missing: run scripts/install_browser.sh (as root)")
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not look for a driver online
    from selenium import webdriver  # a test dependency (requirements/dev.txt), loaded late
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="dsh-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*_FLAGS, *flags, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@dataclass(frozen=True)
class WebView:
    """A running ``dsh-mesh ui``: its address (``url``, ending in ``/``) and the launch link it
    printed (``sign_in_url``, which carries its token)."""

    url: str
    sign_in_url: str

    @property
    def origin(self) -> str:
        """``scheme://host:port``, as a browser sends it in ``Origin``."""
        return self.url.rstrip("/")

    def link(self, **query: str) -> str:
        """The launch link with more query parameters (``root=...``): it signs a browser in
        and lands on the page they ask for."""
        return self.sign_in_url + "".join(f"&{k}={v}" for k, v in query.items())

    @contextlib.asynccontextmanager
    async def signed_in(self, **headers: str) -> AsyncIterator[httpx.AsyncClient]:
        """An HTTP client of the view signed in by the launch link, sending what the page
        sends with a change of state: its ``Origin`` and its CSRF token (and ``headers``)."""
        async with httpx.AsyncClient(base_url=self.url, timeout=30, headers=headers) as http:
            signed = await http.get(self.sign_in_url)
            if signed.status_code != 303:  # the link answers with the page to go to
                raise RuntimeError(f"the launch link did not sign in: {signed.status_code}")
            # The page's key rides in the fragment of the page the link sends the browser to.
            fragment = urlsplit(signed.headers["location"]).fragment
            http.headers.update(
                {"origin": self.origin, "x-csrf-token": parse_qs(fragment)["key"][0]}
            )
            yield http


@contextlib.contextmanager
def web_view(
    node: str,
    token: str,
    *,
    env: Mapping[str, str] | None = None,
    args: Sequence[str] = (),
) -> Iterator[WebView]:
    """``dsh-mesh ui --port 0`` over the node at ``node`` (plaintext, cluster ``token``), as a
    person starts it (with more ``args``), in a process of its own; yields it once it listens,
    and stops it (terminated, killed if it lingers, always reaped) on exit."""
    process = subprocess.Popen(
        [sys.executable, "-m", "dsh_mesh.cli", "ui", "--port", "0", *args],
        env={**os.environ, **(env or {}), "DSH_NODE": node, "DSH_CLUSTER_TOKEN": token},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line.startswith("dsh-mesh ui: http"):
            raise RuntimeError(f"dsh-mesh ui did not start: it said {line!r}")
        link = line.split()[2]
        yield WebView(url=link.split("?", 1)[0], sign_in_url=link)
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()


PAGE_WAIT_S = 60.0
"""How long a browser test waits for what it expects the web view's page to show."""


def until_shown(
    driver: Any, condition: Callable[[Any], Any], what: str, *, timeout: float = PAGE_WAIT_S
) -> Any:
    """Wait for ``condition`` on the page; on a timeout the page's state goes into the error
    (and a screenshot beside the others, when the test takes them)."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    try:
        return WebDriverWait(driver, timeout, poll_frequency=0.1).until(condition, message=what)
    except TimeoutException as expired:
        shown = driver.execute_script(
            "return [...document.querySelectorAll('#message, #connection')]"
            ".map(e => e.textContent).join(' | ') || document.body.innerText.slice(0, 2000)"
        )
        raise AssertionError(
            f"{what}: never seen; at {driver.current_url}: tree {tree_rows(driver)};"
            f" page says {shown}"
        ) from expired


def tree_rows(driver: Any) -> dict[str, dict[str, str]]:
    """The tree as the page shows it: session -> its row's state and node."""
    found = driver.execute_script(
        "return [...document.querySelectorAll('#tree tbody tr')].map(r =>"
        " [r.dataset.session, r.dataset.state, r.dataset.node])"
    )
    return {session: {"state": state, "node": node} for session, state, node in found}


def click_redrawn(driver: Any, selector: str) -> None:
    """Click what ``selector`` finds; the live page redraws the tree as events arrive, so an
    element found may be replaced before the click lands: then find it again."""
    from selenium.common.exceptions import StaleElementReferenceException

    until_shown(driver, lambda d: d.find_elements("css selector", selector), f"{selector} shown")
    for _ in range(20):
        try:
            driver.find_element("css selector", selector).click()
            return
        except StaleElementReferenceException:
            continue
    raise AssertionError(f"{selector} kept being redrawn under the click")
