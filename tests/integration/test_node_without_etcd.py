"""A node started while etcd does not answer (ADR 0048): it waits, saying so every few seconds
and each broken watch once, not once a try; it serves as soon as etcd answers, and a SIGTERM
while it waits stops it at once. Before, it wrote 2,293 lines in 30 s and then died of a bare
``TimeoutError`` (issue 36)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from dsh_mesh.node._node import WAITING_SAID_EVERY
from dsh_mesh.testing import EtcdServer

FLAGS = ["--log-store", "sqlite:log.db", "--cluster-token", "t" * 32, "--plaintext"]
READY_WITHIN = 30.0


def _start(tmp_path: Path, endpoint: str) -> subprocess.Popen[str]:
    with (tmp_path / "out.txt").open("w") as out, (tmp_path / "err.txt").open("w") as err:
        return subprocess.Popen(
            [sys.executable, "-m", "dsh_mesh.node", *FLAGS, "--etcd", endpoint],
            stdout=out,
            stderr=err,
            cwd=tmp_path,
            text=True,
        )


def _ready(tmp_path: Path, node: subprocess.Popen[str]) -> dict[str, str]:
    deadline = time.monotonic() + READY_WITHIN
    while time.monotonic() < deadline:
        for line in (tmp_path / "out.txt").read_text().splitlines():
            event = json.loads(line)
            if event.get("event") == "ready":
                return dict(event)
        assert node.poll() is None, (tmp_path / "err.txt").read_text()[-3000:]
        time.sleep(0.1)
    raise AssertionError(f"not ready within {READY_WITHIN} s")


def _stopped(node: subprocess.Popen[str]) -> int:
    node.send_signal(signal.SIGTERM)
    try:
        return node.wait(timeout=20)
    finally:
        if node.poll() is None:
            node.kill()
            node.wait()


def test_a_node_started_before_etcd_waits_says_why_and_serves_once_etcd_answers(
    tmp_path: Path,
) -> None:
    with EtcdServer() as etcd:
        endpoint = etcd.endpoint
        etcd.terminate()  # its ports and data kept: it comes back where the node looks
        node = _start(tmp_path, endpoint)
        try:
            time.sleep(WAITING_SAID_EVERY.total_seconds() + 2)
            assert node.poll() is None, (tmp_path / "err.txt").read_text()[-3000:]
            waited = (tmp_path / "err.txt").read_text()
            etcd.restart()
            ready = _ready(tmp_path, node)
        finally:
            code = _stopped(node)
    assert ready["address"]
    assert code == 0
    assert "Traceback" not in waited
    assert f"waiting for etcd at {endpoint} before serving" in waited
    # A few lines: each broken watch once, and the wait's line every few seconds.
    assert len(waited.splitlines()) < 30, waited
    log = (tmp_path / "err.txt").read_text()
    assert "works again after" in log  # each watch says once that it is back


def test_a_node_waiting_for_etcd_stops_at_once_when_told(tmp_path: Path) -> None:
    with EtcdServer() as etcd:
        endpoint = etcd.endpoint
        etcd.terminate()
        node = _start(tmp_path, endpoint)
        time.sleep(2)
        began = time.monotonic()
        code = _stopped(node)
    assert code == 0 and time.monotonic() - began < 10
    assert "Traceback" not in (tmp_path / "err.txt").read_text()
