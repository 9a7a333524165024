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
from collections.abc import Iterator, Mapping
from typing import Any

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
def headless_chromium() -> Iterator[Any]:
    """A Selenium ``WebDriver`` over a fresh headless Chromium, quit (and its profile removed)
    on exit. Raises ``RuntimeError`` naming what is missing when the browser is not installed."""
    for path in (CHROMIUM, CHROMEDRIVER):
        if not os.access(path, os.X_OK):
            raise RuntimeError(f"{path} is missing: run scripts/install_browser.sh (as root)")
    os.environ["SE_OFFLINE"] = "true"  # Selenium Manager must not look for a driver online
    from selenium import webdriver  # a test dependency (requirements/dev.txt), loaded late
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="dsh-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in (*_FLAGS, f"--user-data-dir={profile}"):
        options.add_argument(flag)
    driver = webdriver.Chrome(options=options, service=Service(executable_path=CHROMEDRIVER))
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


@contextlib.contextmanager
def web_view(node: str, token: str, *, env: Mapping[str, str] | None = None) -> Iterator[str]:
    """``dsh-mesh ui --port 0`` over the node at ``node`` (plaintext, cluster ``token``), as a
    person starts it, in a process of its own; yields its URL once it listens, and stops it
    (terminated, killed if it lingers, always reaped) on exit."""
    process = subprocess.Popen(
        [sys.executable, "-m", "dsh_mesh.cli", "ui", "--port", "0"],
        env={**os.environ, **(env or {}), "DSH_NODE": node, "DSH_CLUSTER_TOKEN": token},
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        if not line.startswith("dsh-mesh ui: http://"):
            raise RuntimeError(f"dsh-mesh ui did not start: it said {line!r}")
        yield line.split()[2]
    finally:
        process.terminate()
        try:
            process.wait(timeout=10)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
        if process.stdout is not None:
            process.stdout.close()
