# Two commands do all set-up on a fresh Debian 12 machine (as root): `make demo` and `make test`.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench soak check lint typecheck unit protos wheel clean

$(STAMP): requirements/dev.txt pyproject.toml scripts/bootstrap.sh scripts/install_etcd.sh scripts/install_postgres.sh scripts/install_node.sh scripts/install_browser.sh scripts/install_peers.sh bench/peer_runtimes/requirements.txt clients/node/package-lock.json
	bash scripts/bootstrap.sh $(VENV)
	bash scripts/install_etcd.sh $(VENV)
	bash scripts/install_postgres.sh
	bash scripts/install_testbed_tools.sh
	bash scripts/install_browser.sh
	bash scripts/install_peers.sh
	$(PY) -m pip install --quiet --disable-pip-version-check -r requirements/dev.txt
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	bash scripts/install_node.sh && npm ci --prefix clients/node --no-audit --no-fund
	touch $(STAMP)

demo: $(STAMP)
	$(PY) -m dsh_mesh.demo $(DEMO_ARGS)

test: $(STAMP) check unit

bench: $(STAMP)
	$(PY) -m bench

# The long fault run: 30 minutes on the multi-host test bed (root), lease TTL 2 s, every fault
# (etcd outages among them), nothing nudging the trees; then up to TTL + sweep + 30 s for every
# tree to finish its round, and the history checker's verdict, liveness counts included
# (docs/faults.md). SOAK_ARGS passes options, for example SOAK_ARGS="--seed 7 --minutes 5".
soak: $(STAMP)
	$(PY) -m dsh_mesh.testing.soak $(SOAK_ARGS)

check: $(STAMP)
	$(PY) scripts/gen_protos.py --check
	$(VENV)/bin/buf lint
	$(VENV)/bin/buf breaking --against proto/baseline/dsh-mesh-v1.binpb
	$(PY) -m ruff format --check .
	$(PY) -m ruff check .
	$(PY) -m mypy

lint: check

# The suite starts hundreds of Python processes: compile the project's modules once first, so
# none compiles them again (also where PYTHONDONTWRITEBYTECODE keeps Python from caching them).
unit: $(STAMP)
	$(PY) -m compileall -q dsh_mesh tests bench
	$(PY) -m pytest

protos: $(STAMP)
	$(PY) scripts/gen_protos.py

# The package a user installs (docs/python.md): dist/dsh_mesh-<version>-py3-none-any.whl.
wheel: $(STAMP)
	$(PY) -m pip wheel --quiet --disable-pip-version-check --no-deps --no-build-isolation -w dist .

clean:
	rm -rf $(VENV) .venv-peers .mypy_cache .ruff_cache .pytest_cache build dist
