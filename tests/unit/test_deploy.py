"""deploy/ is checked offline: the Kubernetes objects against Kubernetes' JSON schemas
(kubernetes-validate), the compose file against the compose-spec schema (check-jsonschema),
every YAML file with yamllint, the Dockerfile with hadolint, the shell scripts with ShellCheck,
the systemd units with ``systemd-analyze verify`` where it exists. Each validator is also shown
a broken file, so a validator that quietly passes everything fails here.

Then the files are checked against each other and against the node: the etcd members of each
deployment form one cluster, nodes wait for etcd and present their own certificates, probes ask
the gRPC health service, every ``DSH_*`` variable is a node setting, every setting and every etcd
flag used is in docs/configuration.md, the image pins what pyproject.toml pins, and the
certificates deploy/secrets/generate.sh makes name every host each deployment dials. The log
store: PostgreSQL runs with TLS (its key where and as PostgreSQL accepts it, network connections
over TLS only), and the nodes read its DSN, password included, from what generate.sh writes (an
env file, a Secret), which names the database's host, a CA file the nodes have and the password.

No network: the schemas ship inside the validators' packages (``make test`` installs them from
requirements/dev.txt).
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import io
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import kubernetes_validate  # type: ignore[import-untyped]
import pytest
import yaml
from cryptography import x509
from cryptography.x509.oid import NameOID

from dsh_mesh.logstore import check_log_store
from dsh_mesh.node import parse_args

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
K8S = DEPLOY / "kubernetes"
COMPOSE = DEPLOY / "compose" / "compose.yaml"
SYSTEMD = DEPLOY / "systemd"
CONTAINER = DEPLOY / "container"
CONFIG_DOC = ROOT / "docs" / "configuration.md"
PG_HBA = DEPLOY / "compose" / "pg_hba.conf"
SCRIPTS = Path(sysconfig.get_path("scripts"))

# The oldest and the newest Kubernetes whose schemas kubernetes-validate ships: the manifests use
# nothing newer than 1.25's API (policy/v1 budgets, appProtocol, pod security labels).
K8S_VERSIONS = ("1.25.0", "1.37.0")

# Variables deploy/ sets that are not node settings, and who reads them.
NOT_SETTINGS = {
    "NODE_RESTART_DELAY",  # deploy/container/entrypoint.sh
    "NODE_STATE_DIR",  # deploy/container/entrypoint.sh
    "HEALTHCHECK_SERVER_NAME",  # deploy/container/healthcheck.py
    "HEALTHCHECK_TIMEOUT",  # deploy/container/healthcheck.py
    "PYTHONUNBUFFERED",
    "PYTHONDONTWRITEBYTECODE",
    "PATH",
    "POD_NAME",  # Kubernetes downward API, for $(POD_NAME)
    "POD_NAMESPACE",
}
# Variables of the postgres image's entry point (deploy/README.md, The log store), set for the
# PostgreSQL servers only. A literal POSTGRES_PASSWORD is not among them.
POSTGRES_IMAGE_VARIABLES = {"POSTGRES_USER", "POSTGRES_DB", "POSTGRES_PASSWORD_FILE", "PGDATA"}
# The compose service and the Kubernetes StatefulSet that run PostgreSQL.
POSTGRES = "postgres"


# -- reading the files ----------------------------------------------------------------------------


def yaml_documents(path: Path) -> list[dict[str, Any]]:
    with path.open() as handle:
        return [doc for doc in yaml.safe_load_all(handle) if doc is not None]


def kustomization() -> dict[str, Any]:
    (doc,) = yaml_documents(K8S / "kustomization.yaml")
    return doc


def k8s_objects() -> list[dict[str, Any]]:
    return [obj for name in kustomization()["resources"] for obj in yaml_documents(K8S / name)]


def k8s_object(kind: str, name: str) -> dict[str, Any]:
    (obj,) = [o for o in k8s_objects() if o["kind"] == kind and o["metadata"]["name"] == name]
    return obj


def compose() -> dict[str, Any]:
    (doc,) = yaml_documents(COMPOSE)
    return doc


def read_unit(path: Path) -> dict[str, list[tuple[str, str]]]:
    """A systemd unit as {section: [(key, value), ...]}: repeated keys kept in order, comments
    dropped, backslash continuations joined (as systemd does)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current: list[tuple[str, str]] | None = None
    pending = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith(("#", ";"))):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        if line.startswith("[") and line.endswith("]"):
            current = sections.setdefault(line[1:-1], [])
            continue
        assert current is not None, f"{path}: {line!r} outside a section"
        key, sep, value = line.partition("=")
        assert sep, f"{path}: {line!r} is not KEY=VALUE"
        current.append((key.strip(), value.strip()))
    return sections


def unit_values(unit: Mapping[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    return [value for k, value in unit[section] if k == key]


def read_env_file(path: Path) -> dict[str, str]:
    """KEY=VALUE lines of a systemd EnvironmentFile (no quoting is used in deploy/)."""
    values = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, sep, value = line.partition("=")
            assert sep, f"{path}: {line!r} is not KEY=VALUE"
            values[key.strip()] = value.strip()
    return values


def flags(args: Sequence[str]) -> dict[str, str]:
    """``--name=value`` arguments as {name: value}; a bare ``--switch`` maps to ``""``."""
    found = {}
    for arg in args:
        if arg.startswith("--"):
            name, _, value = arg[2:].partition("=")
            found[name] = value
    return found


def host_of(url: str) -> str:
    return re.sub(r"^\w+://", "", url).rpartition(":")[0]


def initial_cluster(value: str) -> dict[str, str]:
    return dict(member.split("=", 1) for member in value.split(","))


def postgres_settings(argv: Sequence[str]) -> dict[str, str]:
    """The ``-c name=value`` arguments of a ``postgres`` command line as {name: value}."""
    assert argv[0] == "postgres", argv
    found = {}
    for flag, setting in zip(argv[1::2], argv[2::2], strict=True):
        assert flag == "-c", argv
        name, _, value = setting.partition("=")
        found[name] = value
    return found


def hba_lines(text: str) -> list[list[str]]:
    """The rules of a pg_hba.conf, each as its fields."""
    lines = (line.split("#", 1)[0].split() for line in text.splitlines())
    return [fields for fields in lines if fields]


def _assert_tls_only(rules: list[list[str]]) -> None:
    """Network connections over TLS only, to dsh as dsh, with a password; the socket stays."""
    assert {r[0] for r in rules} == {"local", "hostssl"}, rules
    for rule in rules:
        if rule[0] == "hostssl":
            assert rule[1:3] == ["dsh", "dsh"] and rule[-1] == "scram-sha-256", rule


def log_store_dsn(dsn: str) -> dict[str, Any]:
    """A PostgreSQL DSN the node accepts, taken apart."""
    check_log_store(dsn)
    url = urlsplit(dsn)
    query = {k: v for k, (v,) in parse_qs(url.query, strict_parsing=True).items()}
    assert url.scheme == "postgresql" and url.hostname and url.port, dsn
    return {
        "user": url.username,
        "password": url.password,
        "host": url.hostname,
        "port": url.port,
        "database": url.path.removeprefix("/"),
        **query,
    }


def strings(value: Any) -> Iterator[str]:
    """Every string in a parsed YAML document."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from strings(item)
    elif isinstance(value, list):
        for item in value:
            yield from strings(item)


def node_settings() -> list[str]:
    """Every node setting, from the node's own command line."""
    return sorted(name for name in vars(parse_args([])) if name != "config")


def script(name: str) -> str:
    path = SCRIPTS / name
    assert path.is_file(), f"{path} is missing: install requirements/dev.txt"
    return str(path)


def run(
    *argv: str, cwd: Path = ROOT, env: Mapping[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        list(argv), cwd=cwd, env=env, capture_output=True, text=True, timeout=120, check=False
    )


# -- Kubernetes ----------------------------------------------------------------------------------


@pytest.mark.parametrize("version", K8S_VERSIONS)
def test_kubernetes_manifests_pass_the_kubernetes_schemas(version: str) -> None:
    objects = k8s_objects()
    assert {o["kind"] for o in objects} >= {
        "Namespace",
        "Service",
        "StatefulSet",
        "ConfigMap",
        "PodDisruptionBudget",
    }
    for obj in objects:
        # strict: a misspelt or misplaced field is an error, not an ignored extra.
        kubernetes_validate.validate(obj, version, strict=True)


def _generator_files(generator: Mapping[str, Any]) -> dict[str, str]:
    """A secretGenerator's files as {key: path}: ``KEY=PATH``, or the file's name for a key."""
    files = {}
    for entry in generator["files"]:
        key, sep, path = entry.partition("=")
        files[key if sep else Path(entry).name] = path if sep else entry
    return files


def _generated_secrets() -> list[dict[str, Any]]:
    """The Secrets kustomize generates from kustomization.yaml (placeholder contents)."""
    secrets = []
    for generator in kustomization()["secretGenerator"]:
        data = {
            key: base64.b64encode(b"placeholder").decode() for key in _generator_files(generator)
        }
        secrets.append(
            {
                "apiVersion": "v1",
                "kind": "Secret",
                "metadata": {"name": generator["name"], "namespace": "dsh-mesh"},
                "type": "Opaque",
                "data": data,
            }
        )
    return secrets


def test_the_generated_secrets_hold_every_file_a_pod_reads() -> None:
    secrets = {s["metadata"]["name"]: set(s["data"]) for s in _generated_secrets()}
    for secret in _generated_secrets():
        kubernetes_validate.validate(secret, K8S_VERSIONS[-1], strict=True)
    config_files = {
        o["metadata"]["name"]: set(o["data"]) for o in k8s_objects() if o["kind"] == "ConfigMap"
    }
    for sts in (o for o in k8s_objects() if o["kind"] == "StatefulSet"):
        pod = sts["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        mounts = {
            m["mountPath"]: v["secret"]["secretName"]
            for m in container["volumeMounts"]
            for v in pod["volumes"]
            if v["name"] == m["name"] and "secret" in v
        }
        assert mounts, f"{sts['metadata']['name']} mounts no certificates"
        # Variables from a Secret: a generated one, with that key.
        for env in container.get("env", ()):
            ref = env.get("valueFrom", {}).get("secretKeyRef")
            if ref is not None:
                assert ref["key"] in secrets[ref["name"]], (env["name"], ref)
        # Files from a ConfigMap (pg_hba.conf): keys of that ConfigMap.
        config_mounts = {
            m["mountPath"]: v["configMap"]["name"]
            for m in container["volumeMounts"]
            for v in pod["volumes"]
            if v["name"] == m["name"] and "configMap" in v
        }
        for mount, config_map in config_mounts.items():
            read = re.findall(re.escape(mount) + r"/([\w.-]+)", " ".join(container.get("args", ())))
            assert read and set(read) <= config_files[config_map], (mount, read)
        used = " ".join(
            [*container.get("args", ()), *(e.get("value", "") for e in container.get("env", ()))]
        )
        config_maps = [
            k8s_object("ConfigMap", ref["configMapRef"]["name"])
            for ref in container.get("envFrom", ())
        ]
        used += " " + " ".join(v for cm in config_maps for v in cm["data"].values())
        for ordinal in range(sts["spec"]["replicas"]):
            pod_name = f"{sts['metadata']['name']}-{ordinal}"
            for mount, secret in mounts.items():
                for file in re.findall(re.escape(mount) + r"/([\w.$()-]+)", used):
                    file = file.replace("$(POD_NAME)", pod_name)
                    assert file in secrets[secret], f"{pod_name} reads {file}, not in {secret}"


def test_kustomize_builds_the_whole_cluster(tmp_path: Path) -> None:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl (its built-in kustomize) is not installed")
    shutil.copytree(K8S, tmp_path / "k8s")
    for generator in kustomization()["secretGenerator"]:
        for file in _generator_files(generator).values():
            (tmp_path / "k8s" / file).parent.mkdir(exist_ok=True)
            (tmp_path / "k8s" / file).write_text("placeholder\n")
    built = run(kubectl, "kustomize", str(tmp_path / "k8s"))
    assert built.returncode == 0, built.stderr
    objects = [o for o in yaml.safe_load_all(built.stdout) if o]
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSIONS[-1], strict=True)
        assert obj["metadata"].get("namespace", "dsh-mesh") == "dsh-mesh"
    # The StatefulSets mount the generated (hash-suffixed) Secrets, and read variables from them.
    names = {o["metadata"]["name"] for o in objects if o["kind"] == "Secret"}
    for sts in (o for o in objects if o["kind"] == "StatefulSet"):
        for volume in sts["spec"]["template"]["spec"]["volumes"]:
            if "secret" in volume:
                assert volume["secret"]["secretName"] in names
        for container in sts["spec"]["template"]["spec"]["containers"]:
            for env in container.get("env", ()):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref is not None:
                    assert ref["name"] in names, (env["name"], ref)


@pytest.mark.parametrize(
    ("breakage", "why"),
    [
        (lambda s: s["spec"].update(replica=3), "misspelt field"),
        (lambda s: s["spec"].update(replicas="three"), "wrong type"),
        (lambda s: s["spec"]["template"]["spec"]["containers"][0].pop("name"), "missing field"),
    ],
)
def test_the_schema_check_refuses_a_broken_manifest(breakage: Any, why: str) -> None:
    statefulset = k8s_object("StatefulSet", "node")
    breakage(statefulset)
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(statefulset, K8S_VERSIONS[-1], strict=True)


def test_kubernetes_etcd_members_form_one_cluster() -> None:
    sts = k8s_object("StatefulSet", "etcd")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    args = flags(container["args"])
    headless = k8s_object("Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    # Members must find each other before any of them is ready (quorum).
    assert headless["spec"]["publishNotReadyAddresses"] is True
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    members = initial_cluster(args["initial-cluster"])
    pods = [f"etcd-{i}" for i in range(sts["spec"]["replicas"])]
    assert sorted(members) == pods
    domain = f".{headless['metadata']['name']}.$(POD_NAMESPACE).svc"
    for pod, url in members.items():
        assert url == f"https://{pod}{domain}:2380"
    assert args["name"] == "$(POD_NAME)"
    assert args["initial-advertise-peer-urls"] == f"https://$(POD_NAME){domain}:2380"
    _assert_etcd_tls(args)
    budget = k8s_object("PodDisruptionBudget", "etcd")
    assert budget["spec"]["minAvailable"] == len(pods) // 2 + 1  # a quorum survives


def test_kubernetes_nodes_dial_etcd_and_are_ready_on_grpc_health() -> None:
    sts = k8s_object("StatefulSet", "node")
    (container,) = sts["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e.get("value") for e in container["env"]}
    assert env["DSH_NODE_ID"] == "$(POD_NAME)"
    assert env["DSH_TLS_CERT"].endswith("/$(POD_NAME).crt")
    assert env["DSH_TLS_KEY"].endswith("/$(POD_NAME).key")
    # $(VAR) expands only from variables defined before it.
    order = [e["name"] for e in container["env"]]
    for name, value in env.items():
        for ref in re.findall(r"\$\((\w+)\)", value or ""):
            assert order.index(ref) < order.index(name), f"{name} uses {ref} before it is set"
    etcd_host, _, etcd_port = env["DSH_ETCD"].rpartition(":")
    client = k8s_object("Service", etcd_host.split(".")[0])
    assert int(etcd_port) in [p["port"] for p in client["spec"]["ports"]]
    assert "clusterIP" not in client["spec"]  # a load-balanced ClusterIP Service
    assert (
        env["DSH_ADVERTISE_HOST"]
        == f"$(POD_NAME).{sts['spec']['serviceName']}.$(POD_NAMESPACE).svc"
    )
    assert k8s_object("Service", sts["spec"]["serviceName"])["spec"]["publishNotReadyAddresses"]
    assert container["readinessProbe"]["exec"]["command"] == ["dsh-mesh-healthcheck"]
    budget = k8s_object("PodDisruptionBudget", "node")
    assert budget["spec"]["maxUnavailable"] == 1


def test_services_and_budgets_select_the_pods_of_their_statefulset() -> None:
    objects = k8s_objects()
    pods = {
        o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"]
        for o in objects
        if o["kind"] == "StatefulSet"
    }
    for obj in objects:
        if obj["kind"] == "StatefulSet":
            own = pods[obj["metadata"]["name"]]
            assert obj["spec"]["selector"]["matchLabels"].items() <= own.items()
        if obj["kind"] in ("Service", "PodDisruptionBudget"):
            selector = obj["spec"]["selector"]
            selector = selector.get("matchLabels", selector)
            matching = [name for name, labels in pods.items() if selector.items() <= labels.items()]
            assert len(matching) == 1, f"{obj['kind']} {obj['metadata']['name']}: {matching}"
        assert obj["metadata"].get("namespace", "dsh-mesh") == "dsh-mesh"


def test_only_node_pods_and_etcd_members_reach_etcds_client_port() -> None:
    """ADR 0032: the NetworkPolicy on etcd admits the node pods (and the members themselves)
    to the client port, the members alone to the peer port; PostgreSQL's pods reach neither."""
    pods = {
        o["metadata"]["name"]: o["spec"]["template"]["metadata"]["labels"]
        for o in k8s_objects()
        if o["kind"] == "StatefulSet"
    }

    def selected(selector: Mapping[str, Any]) -> set[str]:
        labels = selector["matchLabels"]
        return {name for name, own in pods.items() if labels.items() <= own.items()}

    policy = k8s_object("NetworkPolicy", "etcd-from-nodes-only")
    assert selected(policy["spec"]["podSelector"]) == {"etcd"}
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    admitted: dict[int, set[str] | None] = {}
    for rule in policy["spec"]["ingress"]:
        sources = rule.get("from")
        for port in rule["ports"]:
            admitted[port["port"]] = (
                None
                if sources is None
                else set().union(*(selected(s["podSelector"]) for s in sources))
            )
    assert admitted == {2379: {"etcd", "node"}, 2380: {"etcd"}, 2381: None}


def _mount_of(pod: Mapping[str, Any], path: str) -> dict[str, Any]:
    """The volume mount a file of the pod's one container lies under."""
    (container,) = pod["containers"]
    mounts: list[dict[str, Any]] = container["volumeMounts"]
    (mount,) = [m for m in mounts if path.startswith(m["mountPath"] + "/")]
    return mount


def _volume_of(pod: Mapping[str, Any], path: str) -> dict[str, Any]:
    """The pod's volume (not a claim template's) a file of its one container lies in."""
    volumes: list[dict[str, Any]] = pod["volumes"]
    (volume,) = [v for v in volumes if v["name"] == _mount_of(pod, path)["name"]]
    return volume


def test_kubernetes_nodes_read_the_log_store_from_a_secret() -> None:
    (container,) = k8s_object("StatefulSet", "node")["spec"]["template"]["spec"]["containers"]
    (env,) = [e for e in container["env"] if e["name"] == "DSH_LOG_STORE"]
    # A managed database replaces this Secret; nothing else names the log store.
    assert env == {
        "name": "DSH_LOG_STORE",
        "valueFrom": {"secretKeyRef": {"name": "dsh-mesh-log-store", "key": "dsn"}},
    }
    assert "DSH_LOG_STORE" not in k8s_object("ConfigMap", "dsh-mesh-node")["data"]
    for obj in k8s_objects():
        for value in strings(obj):
            assert "postgresql://" not in value, f"{obj['metadata']['name']}: {value}"


def test_kubernetes_postgres_serves_tls_only_and_is_ready_on_pg_isready() -> None:
    sts = k8s_object("StatefulSet", POSTGRES)
    pod = sts["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert container["image"] == "postgres:15"
    assert sts["spec"]["replicas"] == 1
    headless = k8s_object("Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    # Only a ready server is dialled.
    assert not headless["spec"].get("publishNotReadyAddresses", False)
    settings = postgres_settings(container["args"])
    assert settings["ssl"] == "on"
    # The Secret's files are root's, in group fsGroup: PostgreSQL takes a key owned by root with
    # no more than u=rw,g=r, and its user (runAsUser) reads it through that group.
    context = pod["securityContext"]
    assert context["runAsNonRoot"] and context["fsGroup"] == context["runAsUser"] == 999
    for setting in ("ssl_cert_file", "ssl_key_file"):
        assert _mount_of(pod, settings[setting])["readOnly"]
        assert _volume_of(pod, settings[setting])["secret"]["defaultMode"] & 0o037 == 0
    # The kubelet would otherwise make the data directory group-writable, which PostgreSQL
    # refuses.
    assert context["fsGroupChangePolicy"] == "OnRootMismatch"
    hba = k8s_object("ConfigMap", _volume_of(pod, settings["hba_file"])["configMap"]["name"])
    rules = hba_lines(hba["data"][Path(settings["hba_file"]).name])
    _assert_tls_only(rules)
    assert rules == hba_lines(PG_HBA.read_text())  # the same rules as compose's
    env = {e["name"]: e["value"] for e in container["env"]}
    assert set(env) == POSTGRES_IMAGE_VARIABLES
    assert env["POSTGRES_USER"] == env["POSTGRES_DB"] == "dsh"
    assert "secret" in _volume_of(pod, env["POSTGRES_PASSWORD_FILE"])
    (claim,) = sts["spec"]["volumeClaimTemplates"]
    # Below the volume's root, which may hold lost+found.
    assert _mount_of(pod, env["PGDATA"])["name"] == claim["metadata"]["name"]
    probe = ["pg_isready", "--host=127.0.0.1", "--port=5432", "--username=dsh", "--dbname=dsh"]
    assert container["readinessProbe"]["exec"]["command"] == probe
    assert container["startupProbe"]["exec"]["command"] == probe
    # SIGTERM is a smart shutdown, which waits for the nodes' pools: a fast one instead.
    stop = container["lifecycle"]["preStop"]["exec"]["command"]
    assert stop == ["pg_ctl", "stop", "--mode=fast", f"--pgdata={env['PGDATA']}"]
    assert [p["port"] for p in headless["spec"]["ports"]] == [5432]


# -- compose -------------------------------------------------------------------------------------


def _check_compose(path: Path) -> subprocess.CompletedProcess[str]:
    return run(
        sys.executable,
        "-m",
        "check_jsonschema",
        "--builtin-schema",
        "vendor.compose-spec",
        str(path),
    )


def test_the_compose_file_passes_the_compose_spec_schema() -> None:
    checked = _check_compose(COMPOSE)
    assert checked.returncode == 0, checked.stdout + checked.stderr


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("condition: service_healthy", "condition: service_happy"),
        ("stop_grace_period: 20s", "stop_grace_periods: 20s"),
        ("      interval: 5s", "      interval: [5s]"),
        ("      - source: pg_hba.conf", "      - sources: pg_hba.conf"),
    ],
)
def test_the_compose_schema_check_refuses_a_broken_file(tmp_path: Path, old: str, new: str) -> None:
    text = COMPOSE.read_text()
    assert old in text
    broken = tmp_path / "compose.yaml"
    broken.write_text(text.replace(old, new, 1))
    assert _check_compose(broken).returncode != 0


def _compose_services(prefix: str) -> dict[str, dict[str, Any]]:
    return {n: s for n, s in compose()["services"].items() if n.startswith(prefix)}


def test_compose_etcd_members_form_one_cluster() -> None:
    members = _compose_services("etcd-")
    assert sorted(members) == ["etcd-1", "etcd-2", "etcd-3"]
    clusters = set()
    for name, service in members.items():
        command = service["command"]
        assert command[0] == "/usr/local/bin/etcd"
        args = flags(command)
        clusters.add(args["initial-cluster"])
        assert args["name"] == name
        assert args["initial-advertise-peer-urls"] == f"https://{name}:2380"
        assert args["advertise-client-urls"] == f"https://{name}:2379"
        _assert_etcd_tls(args)
        assert args["cert-file"] == f"/run/secrets/{name}.crt"
        assert args["key-file"] == f"/run/secrets/{name}.key"
        assert set(service["secrets"]) == {"ca.crt", f"{name}.crt", f"{name}.key"}
        assert "endpoint" in service["healthcheck"]["test"]
        assert any(v.endswith(":/var/lib/etcd") for v in service["volumes"])
    (cluster,) = clusters  # the same --initial-cluster on every member
    assert initial_cluster(cluster) == {name: f"https://{name}:2380" for name in members}


def test_compose_nodes_wait_for_etcd_and_present_their_own_certificates() -> None:
    nodes = _compose_services("node-")
    assert sorted(nodes) == ["node-a", "node-b", "node-c"]
    etcd = _compose_services("etcd-")
    secrets = compose()["secrets"]
    published = set()
    for name, service in nodes.items():
        assert service["depends_on"] == {
            m: {"condition": "service_healthy"} for m in (*etcd, POSTGRES)
        }
        assert service["healthcheck"]["test"] == ["CMD", "dsh-mesh-healthcheck"]
        assert service["build"]["dockerfile"] == "deploy/container/Dockerfile"
        assert (COMPOSE.parent / service["build"]["context"]).resolve() == ROOT
        env = service["environment"]
        assert env["DSH_NODE_ID"] == name == env["DSH_ADVERTISE_HOST"]
        # A name every member answers to: the node moves to another member when its own goes.
        etcd_host = env["DSH_ETCD"].rpartition(":")[0]
        for member in etcd.values():
            assert etcd_host in member["networks"]["default"]["aliases"]
        assert "DSH_PLAINTEXT" not in env and "DSH_CLUSTER_TOKEN" not in env
        for setting, suffix in (("DSH_TLS_CERT", ".crt"), ("DSH_TLS_KEY", ".key")):
            assert env[setting] == f"/run/secrets/{name}{suffix}"
        for setting in ("DSH_TLS_CERT", "DSH_TLS_KEY", "DSH_TLS_CA"):
            secret = env[setting].removeprefix("/run/secrets/")
            assert secret in service["secrets"] and secret in secrets
        # SIGTERM drains for DSH_SHUTDOWN_GRACE seconds; compose must wait longer.
        assert int(service["stop_grace_period"].rstrip("s")) > float(env["DSH_SHUTDOWN_GRACE"])
        (port,) = service["ports"]
        published.add(port.split(":")[1])
        assert port.startswith("127.0.0.1:") and port.endswith(":50051")
    assert len(published) == len(nodes)
    for secret in secrets.values():
        assert secret["file"].startswith("./tls/") and not secret["file"].endswith("ca.key")


def _compose_entrypoint_script() -> str:
    """The shell script of the postgres service's entry point, as compose runs it."""
    entrypoint = compose()["services"][POSTGRES]["entrypoint"]
    assert entrypoint[:2] == ["/bin/sh", "-c"] and len(entrypoint) == 4
    return str(entrypoint[2]).replace("$$", "$")  # compose's escape of a literal $


def test_compose_postgres_serves_tls_only_with_a_key_it_accepts() -> None:
    service = compose()["services"][POSTGRES]
    assert service["image"] == "postgres:15"
    settings = postgres_settings(service["command"])
    assert settings["ssl"] == "on"
    assert settings["ssl_cert_file"] == "/run/secrets/postgres.crt"
    # The mounted key is the host's file (0644, not the server's user's): the entry point
    # copies it, as root, to the file PostgreSQL reads, the postgres user's with mode 0600, and
    # only then runs the image's entry point with the command.
    steps = [shlex.split(step) for step in _compose_entrypoint_script().split("&&")]
    copy = ["install", "-o", "postgres", "-g", "postgres", "-m", "0600"]
    assert [*copy, "/run/secrets/postgres.key", settings["ssl_key_file"]] in steps
    assert steps[-1] == ["exec", "docker-entrypoint.sh", "$@"]
    assert {"postgres.crt", "postgres.key"} <= set(service["secrets"])
    (config,) = service["configs"]
    assert config["target"] == settings["hba_file"]
    assert COMPOSE.parent / compose()["configs"][config["source"]]["file"] == PG_HBA
    _assert_tls_only(hba_lines(PG_HBA.read_text()))
    env = service["environment"]
    assert set(env) <= POSTGRES_IMAGE_VARIABLES and "POSTGRES_PASSWORD" not in env
    assert env["POSTGRES_USER"] == env["POSTGRES_DB"] == "dsh"
    assert env["POSTGRES_PASSWORD_FILE"].removeprefix("/run/secrets/") in service["secrets"]
    assert any(v.endswith(":/var/lib/postgresql/data") for v in service["volumes"])
    # Healthy once the real server listens on TCP (the first-start setup's is socket-only).
    test = ["CMD", "pg_isready", "--host=127.0.0.1", "--port=5432", "--username=dsh"]
    assert service["healthcheck"]["test"] == [*test, "--dbname=dsh"]


def test_compose_nodes_read_the_log_store_from_the_generated_env_file() -> None:
    for name, service in _compose_services("node-").items():
        assert service["env_file"] == ["./tls/log-store.env"], name
        assert "DSH_LOG_STORE" not in service["environment"]
        assert service["depends_on"][POSTGRES] == {"condition": "service_healthy"}
    for value in strings(compose()):
        assert "postgresql://" not in value, value


# -- systemd -------------------------------------------------------------------------------------


def _expand(value: str, env: Mapping[str, str], instance: str) -> str:
    """What systemd makes of ``value`` in a unit: ``%i`` and ``${VAR}`` from the env file."""
    return re.sub(r"\$\{(\w+)\}", lambda m: env[m.group(1)], value.replace("%i", instance))


def test_systemd_etcd_members_agree_on_one_cluster() -> None:
    unit = read_unit(SYSTEMD / "dsh-etcd@.service")
    (exec_start,) = unit_values(unit, "Service", "ExecStart")
    argv = exec_start.split()
    assert argv[0] == "/usr/bin/etcd"
    assert unit_values(unit, "Service", "EnvironmentFile") == ["/etc/dsh-mesh/%i.env"]
    assert unit_values(unit, "Service", "Restart") == ["on-failure"]
    assert unit_values(unit, "Service", "Type") == ["notify"]
    args = flags(argv)
    assert args["name"] == "%i"
    _assert_etcd_tls(args)
    assert args["cert-file"] == "/etc/dsh-mesh/tls/%i.crt"
    needed = set(re.findall(r"\$\{(\w+)\}", exec_start))
    env_files = sorted((SYSTEMD / "env").glob("etcd-*.env"))
    assert [f.stem for f in env_files] == ["etcd-1", "etcd-2", "etcd-3"]
    clusters = set()
    for env_file in env_files:
        env = read_env_file(env_file)
        assert needed <= env.keys(), f"{env_file.name} lacks {needed - env.keys()}"
        expanded = {k: _expand(v, env, env_file.stem) for k, v in args.items()}
        members = initial_cluster(expanded["initial-cluster"])
        assert members[env_file.stem] == expanded["initial-advertise-peer-urls"]
        assert host_of(expanded["listen-peer-urls"]) == env["MEMBER_IP"]
        clusters.add(env["INITIAL_CLUSTER"])
    (cluster,) = clusters
    assert sorted(initial_cluster(cluster)) == [f.stem for f in env_files]


def test_systemd_nodes_read_their_env_files_and_restart_after_their_lease() -> None:
    unit = read_unit(SYSTEMD / "dsh-mesh-node@.service")
    (exec_start,) = unit_values(unit, "Service", "ExecStart")
    assert exec_start == "/opt/dsh-mesh/bin/dsh-mesh-node"
    assert unit_values(unit, "Service", "EnvironmentFile") == [
        "/etc/dsh-mesh/cluster.env",
        "/etc/dsh-mesh/log-store.env",  # root-only: the DSN holds the database password
        "/etc/dsh-mesh/%i.env",
    ]
    assert "DSH_NODE_ID=%i" in unit_values(unit, "Service", "Environment")
    assert unit_values(unit, "Service", "Restart") == ["on-failure"]
    assert unit_values(unit, "Service", "RestartPreventExitStatus") == ["2"]  # a refused config
    shared = read_env_file(SYSTEMD / "env" / "cluster.env")
    (restart_sec,) = unit_values(unit, "Service", "RestartSec")
    assert float(restart_sec.rstrip("s")) > float(shared["DSH_LEASE_TTL"])
    (stop,) = unit_values(unit, "Service", "TimeoutStopSec")
    assert float(stop.rstrip("s")) > float(shared["DSH_SHUTDOWN_GRACE"]) + 1
    members = {read_env_file(f)["MEMBER_IP"] for f in (SYSTEMD / "env").glob("etcd-*.env")}
    node_files = sorted((SYSTEMD / "env").glob("node-*.env"))
    assert [f.stem for f in node_files] == ["node-a", "node-b", "node-c"]
    for env_file in node_files:
        env = read_env_file(env_file)
        assert "DSH_NODE_ID" not in env  # the instance name is the node id
        assert env["DSH_TLS_CERT"] == f"/etc/dsh-mesh/tls/{env_file.stem}.crt"
        assert env["DSH_TLS_KEY"] == f"/etc/dsh-mesh/tls/{env_file.stem}.key"
        etcd_host, _, etcd_port = env["DSH_ETCD"].rpartition(":")
        assert etcd_host in members and etcd_port == "2379"
        assert env["DSH_LISTEN"].rpartition(":")[0] == env["DSH_ADVERTISE_HOST"]
        assert "DSH_LOG_STORE" not in env
    assert "DSH_TLS_CA" in shared and "DSH_PLAINTEXT" not in shared
    assert "DSH_LOG_STORE" not in shared


def test_systemd_nodes_name_postgresql_or_a_sqlite_file_the_unit_lets_them_write() -> None:
    unit = read_unit(SYSTEMD / "dsh-mesh-node@.service")
    sample = SYSTEMD / "env" / "log-store.env"
    dsn = log_store_dsn(read_env_file(sample)["DSH_LOG_STORE"])
    assert dsn["password"] == "PASSWORD"  # a placeholder: generate.sh writes the real file
    assert (dsn["user"], dsn["database"], dsn["sslmode"]) == ("dsh", "dsh", "verify-full")
    shared = read_env_file(SYSTEMD / "env" / "cluster.env")
    assert dsn["sslrootcert"] == shared["DSH_TLS_CA"]
    # One host: a SQLite file in the unit's state directory, the one place ProtectSystem=strict
    # leaves the node to write.
    assert unit_values(unit, "Service", "ProtectSystem") == ["strict"]
    (state,) = unit_values(unit, "Service", "StateDirectory")
    (sqlite,) = re.findall(r"^#DSH_LOG_STORE=(\S+)$", sample.read_text(), flags=re.M)
    check_log_store(sqlite)
    assert sqlite.startswith(f"sqlite:/var/lib/{state}/")


def test_systemd_analyze_accepts_the_units(tmp_path: Path) -> None:
    analyze = shutil.which("systemd-analyze")
    if analyze is None:
        pytest.skip("systemd-analyze is not installed")
    # verify wants an instance and an executable ExecStart; the paths are checked above.
    for template, instance in (("dsh-etcd@", "etcd-1"), ("dsh-mesh-node@", "node-a")):
        text = (SYSTEMD / f"{template}.service").read_text()
        text = re.sub(r"^ExecStart=\S+", "ExecStart=/bin/true", text, flags=re.M)
        (tmp_path / f"{template}{instance}.service").write_text(text)
    units = sorted(str(p) for p in tmp_path.glob("*.service"))
    verified = run(analyze, "verify", "--man=no", *units, cwd=tmp_path)
    assert verified.returncode == 0 and not verified.stderr.strip(), verified.stderr


# -- the container image -------------------------------------------------------------------------


def _dockerfile() -> list[tuple[str, str]]:
    """The Dockerfile's instructions as (INSTRUCTION, arguments), continuations joined."""
    instructions, pending = [], ""
    for raw in (CONTAINER / "Dockerfile").read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        line, pending = pending + line, ""
        keyword, _, rest = line.partition(" ")
        instructions.append((keyword.upper(), rest.strip()))
    return instructions


def test_the_dockerfile_passes_hadolint(tmp_path: Path) -> None:
    hadolint = script("hadolint")
    config = tmp_path / "hadolint.yaml"
    config.write_text("failure-threshold: style\n")  # every finding fails, none ignored
    linted = run(hadolint, "--config", str(config), "--no-color", str(CONTAINER / "Dockerfile"))
    assert linted.returncode == 0, linted.stdout + linted.stderr
    broken = tmp_path / "Dockerfile"
    broken.write_text("FROM python:latest\nRUN pip install grpcio\nCMD dsh-mesh-node\n")
    assert run(hadolint, "--config", str(config), str(broken)).returncode != 0


def test_the_shell_scripts_pass_shellcheck(tmp_path: Path) -> None:
    shellcheck = script("shellcheck")
    # compose's postgres entry point too: sh -c SCRIPT, with the command as "$@".
    inline = tmp_path / "postgres-entrypoint.sh"
    inline.write_text("#!/bin/sh\n" + _compose_entrypoint_script() + "\n")
    scripts = [
        DEPLOY / "secrets" / "generate.sh",
        DEPLOY / "etcd" / "grant-mesh-access.sh",
        CONTAINER / "entrypoint.sh",
        inline,
    ]
    checked = run(shellcheck, "--severity=style", *map(str, scripts))
    assert checked.returncode == 0, checked.stdout + checked.stderr
    broken = tmp_path / "broken.sh"
    broken.write_text("#!/bin/sh\nrm -rf $1/*\n")  # unquoted: a classic
    assert run(shellcheck, str(broken)).returncode != 0


def test_the_image_runs_the_node_unprivileged_and_probes_its_health() -> None:
    instructions = _dockerfile()
    froms = [args for keyword, args in instructions if keyword == "FROM"]
    args = dict(a.split("=", 1) for keyword, a in instructions if keyword == "ARG" and "=" in a)
    assert args["PYTHON_IMAGE"].startswith("python:3.11-slim")
    assert all(f.startswith("${PYTHON_IMAGE}") for f in froms)
    (user,) = [a for k, a in instructions if k == "USER"]
    assert not user.startswith(("0", "root"))
    (healthcheck,) = [a for k, a in instructions if k == "HEALTHCHECK"]
    assert healthcheck.endswith('CMD ["dsh-mesh-healthcheck"]')
    (expose,) = [a for k, a in instructions if k == "EXPOSE"]
    env = " ".join(a for k, a in instructions if k == "ENV")
    assert f"DSH_LISTEN=0.0.0.0:{expose}" in env
    assert ("ENTRYPOINT", '["dsh-mesh-entrypoint"]') in instructions
    # Everything copied from the build context exists and is let through the dockerignore.
    ignore = (CONTAINER / "Dockerfile.dockerignore").read_text().splitlines()
    allowed = [line[1:].rstrip("/") for line in ignore if line.startswith("!")]
    for keyword, arguments in instructions:
        if keyword == "COPY" and "--from=" not in arguments:
            sources = [a for a in arguments.split() if not a.startswith("--")][:-1]
            for source in sources:
                assert (ROOT / source).exists(), source
                assert any(source == a or source.startswith(a + "/") for a in allowed), source


def _pins(path: Path) -> dict[str, str]:
    pins = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].split(";", 1)[0].strip()  # a comment, a marker aside
        if "==" in line:
            name, version = line.split("==", 1)
            pins[re.sub(r"[-_.]+", "-", name).lower()] = version.strip()
    return pins


def test_the_image_pins_what_pyproject_and_the_dev_requirements_pin() -> None:
    import tomllib

    constraints = _pins(CONTAINER / "constraints.txt")
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    for requirement in project["dependencies"]:
        name = re.sub(r"[-_.]+", "-", re.split(r"[=<>!~;\[ ]", requirement, maxsplit=1)[0]).lower()
        assert name in constraints, f"{name} (pyproject.toml) is not in constraints.txt"
        if "==" in requirement:
            pin = requirement.split(";")[0].strip()  # an environment marker aside
            assert pin.endswith("==" + constraints[name]), requirement
    dev = _pins(ROOT / "requirements" / "dev.txt")
    for name, version in constraints.items():
        if name in dev:
            assert dev[name] == version, f"{name}: dev.txt {dev[name]}, constraints {version}"
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]
    assert [r.split(">=")[0] for r in build["requires"]] == ["setuptools"]
    assert "setuptools" in constraints


# -- YAML ----------------------------------------------------------------------------------------


def test_every_yaml_file_of_deploy_passes_yamllint(tmp_path: Path) -> None:
    config = DEPLOY / "yamllint.yaml"
    files = sorted(str(p) for p in DEPLOY.rglob("*.y*ml") if "testbed" not in p.parts)
    assert len(files) >= 5
    linted = run(sys.executable, "-m", "yamllint", "--strict", "-c", str(config), *files)
    assert linted.returncode == 0, linted.stdout + linted.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text("a: 1\na: 2\nb:   [ 1,2 ]\n")  # a duplicate key, bad spacing
    assert run(
        sys.executable, "-m", "yamllint", "--strict", "-c", str(config), str(broken)
    ).returncode


# -- the settings and docs/configuration.md ------------------------------------------------------


def _doc_rows(section: str) -> list[list[str]]:
    """The rows of the tables in one ``## `` section of docs/configuration.md."""
    text = CONFIG_DOC.read_text().split(f"\n## {section}\n", 1)[1].split("\n## ", 1)[0]
    rows = []
    for line in text.splitlines():
        if line.startswith("| ") and not line.startswith("| ---"):
            rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


def test_every_node_setting_is_in_the_configuration_reference() -> None:
    settings = node_settings()
    assert {"tls_cert", "tls_key", "tls_ca", "plaintext", "cluster_token"} <= set(settings)
    rows = {row[0]: row for row in _doc_rows("Node settings")}
    for setting in settings:
        assert f"`{setting}`" in rows, f"{setting} is not in docs/configuration.md"
        row = rows[f"`{setting}`"]
        flag = "--" + setting.replace("_", "-")
        assert row[1].startswith(f"`{flag}`"), row
        assert row[2] == f"`DSH_{setting.upper()}`", row
        # The flag really is the node's.
        with contextlib.redirect_stderr(io.StringIO()):
            try:
                parsed = parse_args([flag])
            except SystemExit:
                parsed = parse_args([flag, "x"])
        assert getattr(parsed, setting) is not None


def _deploy_variables() -> Iterator[tuple[str, str]]:
    """(file, VARIABLE) for every environment variable deploy/ sets."""
    # etcd-*.env hold the etcd unit's own ${VARIABLES} (test_systemd_etcd_members_...).
    for env_file in (SYSTEMD / "env").glob("[!e]*.env"):
        for line in env_file.read_text().splitlines():
            match = re.match(r"#?([A-Z][A-Z0-9_]*)=", line)
            if match:
                yield env_file.name, match.group(1)
    for unit in SYSTEMD.glob("*.service"):
        for value in unit_values(read_unit(unit), "Service", "Environment"):
            yield unit.name, value.split("=", 1)[0]
    for service_name, service in compose()["services"].items():
        for name in service.get("environment", {}):
            yield f"compose.yaml {service_name}", name
    # ConfigMaps a container takes its environment from (envFrom); others hold files.
    env_maps = {
        ref["configMapRef"]["name"]
        for obj in k8s_objects()
        if obj["kind"] == "StatefulSet"
        for container in obj["spec"]["template"]["spec"]["containers"]
        for ref in container.get("envFrom", ())
    }
    for obj in k8s_objects():
        if obj["kind"] == "ConfigMap" and obj["metadata"]["name"] in env_maps:
            for name in obj["data"]:
                yield obj["metadata"]["name"], name
        if obj["kind"] == "StatefulSet":
            for container in obj["spec"]["template"]["spec"]["containers"]:
                for env in container.get("env", ()):
                    yield obj["metadata"]["name"], env["name"]
    for keyword, arguments in _dockerfile():
        for name in re.findall(r"\b([A-Z][A-Z0-9_]+)=", arguments):
            # pip's settings apply to the build stage only.
            if keyword == "ENV" and not name.startswith("PIP_"):
                yield "Dockerfile", name
    commented = (K8S / "node.yaml").read_text()
    for name in re.findall(r"#\s+(OTEL_[A-Z_]+):", commented):
        yield "node.yaml", name


def test_deploy_sets_only_variables_the_node_or_the_image_knows() -> None:
    settings = {f"DSH_{s.upper()}" for s in node_settings()}
    documented = CONFIG_DOC.read_text()
    readme = (DEPLOY / "README.md").read_text()
    for where, name in _deploy_variables():
        if name in POSTGRES_IMAGE_VARIABLES:
            # The postgres image's own, for PostgreSQL only.
            assert where in (f"compose.yaml {POSTGRES}", POSTGRES), f"{where}: {name}"
            assert f"`{name}`" in readme, f"{where}: {name} is not in deploy/README.md"
        elif name.startswith("DSH_"):
            assert name in settings, f"{where}: {name} is not a node setting"
        elif name.startswith("OTEL_"):
            assert f"`{name}`" in documented, f"{where}: {name} is not in the reference"
        else:
            assert name in NOT_SETTINGS, f"{where}: what reads {name}?"
            if not name.startswith(("PYTHON", "PATH", "POD_")):
                assert f"`{name}`" in documented, f"{where}: {name} is not in the reference"


def _etcd_flag_sets() -> Iterator[tuple[str, dict[str, str]]]:
    (exec_start,) = unit_values(read_unit(SYSTEMD / "dsh-etcd@.service"), "Service", "ExecStart")
    env = read_env_file(SYSTEMD / "env" / "etcd-1.env")
    yield "systemd", {k: _expand(v, env, "etcd-1") for k, v in flags(exec_start.split()).items()}
    for name, service in _compose_services("etcd-").items():
        yield name, flags(service["command"])
    (container,) = k8s_object("StatefulSet", "etcd")["spec"]["template"]["spec"]["containers"]
    yield "kubernetes", flags(container["args"])


def _assert_etcd_tls(args: Mapping[str, str]) -> None:
    """Mutual TLS for clients and peers, with one CA."""
    for prefix in ("", "peer-"):
        assert args[f"{prefix}client-cert-auth"] in ("", "true")
        assert args[f"{prefix}trusted-ca-file"].endswith("/ca.crt")
        assert args[f"{prefix}cert-file"].endswith(".crt")
        assert args[f"{prefix}key-file"].endswith(".key")
    for url in ("listen-client-urls", "advertise-client-urls", "listen-peer-urls"):
        assert args[url].startswith("https://"), url


def test_the_deployments_run_etcd_alike_and_every_flag_is_documented() -> None:
    documented = CONFIG_DOC.read_text()
    (exec_start,) = unit_values(read_unit(SYSTEMD / "dsh-etcd@.service"), "Service", "ExecStart")
    for name in re.findall(r"\$\{(\w+)\}", exec_start):
        assert f"`{name}`" in documented, f"the etcd unit's {name} is not in the reference"
    flag_sets = dict(_etcd_flag_sets())
    for where, args in flag_sets.items():
        _assert_etcd_tls(args)
        for name in args:
            assert f"`--{name}`" in documented, f"{where}: --{name} is not in the reference"
    same = ("auto-compaction-mode", "auto-compaction-retention", "quota-backend-bytes")
    for name in (*same, "initial-cluster-token", "initial-cluster-state"):
        assert len({args[name] for args in flag_sets.values()}) == 1, name


# -- the scripts ---------------------------------------------------------------------------------


def _healthcheck() -> Any:
    import importlib.util

    spec = importlib.util.spec_from_file_location("dsh_healthcheck", CONTAINER / "healthcheck.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_the_health_probe_dials_the_node_as_the_node_is_configured(tmp_path: Path) -> None:
    from dsh_mesh.transport import CertificateAuthority

    probe_from = _healthcheck().probe_from
    plain = probe_from({"DSH_LISTEN": "0.0.0.0:50051"})
    assert (plain.target, plain.tls) == ("127.0.0.1:50051", False)
    assert probe_from({"DSH_LISTEN": "10.1.2.3:7000"}).target == "10.1.2.3:7000"
    with pytest.raises(ValueError, match="fixed HOST:PORT"):
        probe_from({"DSH_LISTEN": "127.0.0.1:0"})
    authority = CertificateAuthority.create()
    cert, key = authority.issue_node("node-7").write(tmp_path)
    tls_env = {"DSH_TLS_CERT": str(cert), "DSH_TLS_KEY": str(key), "DSH_TLS_CA": "ca.crt"}
    probe = probe_from(tls_env)
    assert probe.tls and probe.server_name == "node-7"  # the certificate's CN
    assert probe_from({**tls_env, "DSH_NODE_ID": "n"}).server_name == "n"
    assert not probe_from({**tls_env, "DSH_PLAINTEXT": "true"}).tls
    with pytest.raises(ValueError, match="DSH_TLS_KEY"):
        probe_from({"DSH_TLS_CERT": str(cert)})
    # Nothing listens there: one line, exit 1.
    status = _healthcheck().main({"DSH_LISTEN": "127.0.0.1:1", "HEALTHCHECK_TIMEOUT": "0.5"})
    assert status == 1


def test_the_entry_point_waits_only_when_its_container_restarts(tmp_path: Path) -> None:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "dsh-mesh-node"
    fake.write_text('#!/bin/sh\necho "node $*"\n')
    fake.chmod(0o755)
    env = {
        "PATH": f"{bin_dir}:/usr/bin:/bin",
        "NODE_STATE_DIR": str(tmp_path),
        "NODE_RESTART_DELAY": "0",
    }
    entrypoint = str(CONTAINER / "entrypoint.sh")
    first = run("/bin/sh", entrypoint, "--placement", "local", env=env)
    assert (first.returncode, first.stdout, first.stderr) == (0, "node --placement local\n", "")
    assert (tmp_path / "started").exists()
    again = run("/bin/sh", entrypoint, env=env)
    assert again.returncode == 0 and "restarted; waiting 0s" in again.stderr
    # Without NODE_RESTART_DELAY: the lease TTL in whole seconds, plus one.
    del env["NODE_RESTART_DELAY"]
    default = run("/bin/sh", entrypoint, env={**env, "DSH_LEASE_TTL": "0.5"})
    assert default.returncode == 0 and "waiting 1s" in default.stderr


PROFILES = ("compose", "kubernetes", "systemd")
# The systemd profile's directory holds a database password before generate.sh runs, as after a
# first run: the script must keep it (the database was created with it).
KEPT_PASSWORD = "0123456789abcdef" * 3


@pytest.fixture(scope="module")
def certificates(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """deploy/secrets/generate.sh run for each profile (concurrently: each is a few seconds)."""
    base = tmp_path_factory.mktemp("certs")
    # The script's defaults: the sample addresses and namespace the deployments name.
    env = {k: v for k, v in os.environ.items() if k not in ("HOSTS", "DATABASE_HOST", "NAMESPACE")}
    env["DSH_MESH"] = script("dsh-mesh")
    (base / "systemd").mkdir()
    (base / "systemd" / "postgres-password").write_text(KEPT_PASSWORD)

    def generate(profile: str) -> tuple[str, subprocess.CompletedProcess[str]]:
        out = base / profile
        return profile, run(
            "bash", str(DEPLOY / "secrets" / "generate.sh"), profile, str(out), env=env
        )

    with concurrent.futures.ThreadPoolExecutor(len(PROFILES)) as pool:
        results = dict(pool.map(generate, PROFILES))
    for profile, result in results.items():
        assert result.returncode == 0, f"{profile}: {result.stderr}"
    return {profile: base / profile for profile in PROFILES}


def _names(path: Path) -> tuple[str, set[str]]:
    certificate = x509.load_pem_x509_certificate(path.read_bytes())
    (common,) = certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)
    san = certificate.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    hosts = set(san.get_values_for_type(x509.DNSName))
    hosts |= {str(ip) for ip in san.get_values_for_type(x509.IPAddress)}
    return str(common.value), hosts


def _covers(hosts: set[str], host: str) -> bool:
    return host in hosts or any(
        h.startswith("*.") and host.endswith(h[1:]) and "." not in host[: -len(h) + 1]
        for h in hosts
    )


def _assert_log_store(tls: Path, dsn: Mapping[str, Any], database: Mapping[str, str]) -> None:
    """What every form's generated DSN must say: TLS that checks the server's certificate, which
    names the host dialled; the role, database and password the server was set up with."""
    assert dsn["sslmode"] == "verify-full"
    common, hosts = _names(tls / "postgres.crt")
    assert common == "etcd:postgres"  # the server kind of `dsh-mesh certs`
    assert dsn["host"] in hosts
    assert dsn["port"] == 5432
    assert (dsn["user"], dsn["database"]) == (database["user"], database["database"])
    password = (tls / "postgres-password").read_text()
    assert re.fullmatch(r"[0-9a-f]{48}", password) and dsn["password"] == password
    # The password's files are closed to others, or their directory is (compose).
    for secret in ("postgres-password", "log-store.env", "log-store-dsn"):
        if (tls / secret).exists():
            assert not (tls / secret).stat().st_mode & 0o077 or not tls.stat().st_mode & 0o077


def test_compose_certificates_name_what_compose_dials(certificates: dict[str, Path]) -> None:
    tls = certificates["compose"]
    for secret in compose()["secrets"].values():
        assert (COMPOSE.parent / secret["file"]).name in os.listdir(tls)
    for name, service in _compose_services("etcd-").items():
        common, hosts = _names(tls / f"{name}.crt")
        assert common == f"etcd:{name}"
        args = flags(service["command"])
        for url in ("advertise-client-urls", "initial-advertise-peer-urls"):
            assert host_of(args[url]) in hosts
        assert "127.0.0.1" in hosts  # its healthcheck dials loopback
    for name, service in _compose_services("node-").items():
        common, hosts = _names(tls / f"{name}.crt")
        assert common == name and name in hosts and "127.0.0.1" in hosts  # published ports
        etcd_host = service["environment"]["DSH_ETCD"].rpartition(":")[0]
        for member in _compose_services("etcd-"):
            assert etcd_host in _names(tls / f"{member}.crt")[1]
    # Keys are readable by the containers' users; the directory is closed instead.
    assert (tls / "node-a.key").stat().st_mode & 0o044 and not (
        tls / "ca.key"
    ).stat().st_mode & 0o077
    assert not tls.stat().st_mode & 0o077
    # The log store: what every node's env_file sets, naming the service postgres as its
    # certificate does, with the CA the nodes mount.
    postgres = compose()["services"][POSTGRES]
    nodes = _compose_services("node-")
    (env_file,) = {file for service in nodes.values() for file in service["env_file"]}
    assert env_file.startswith("./tls/")
    generated = read_env_file(tls / Path(env_file).name)
    assert set(generated) == {"DSH_LOG_STORE"}
    dsn = log_store_dsn(generated["DSH_LOG_STORE"])
    assert dsn["host"] == POSTGRES
    env = postgres["environment"]
    _assert_log_store(tls, dsn, {"user": env["POSTGRES_USER"], "database": env["POSTGRES_DB"]})
    for service in nodes.values():
        assert dsn["sslrootcert"] == service["environment"]["DSH_TLS_CA"]
    secret = env["POSTGRES_PASSWORD_FILE"].removeprefix("/run/secrets/")
    assert compose()["secrets"][secret]["file"] == "./tls/postgres-password"
    assert (tls / "postgres.key").stat().st_mode & 0o044  # its entry point copies it (root)


def test_kubernetes_certificates_name_what_the_pods_dial(certificates: dict[str, Path]) -> None:
    tls = certificates["kubernetes"]
    for generator in kustomization()["secretGenerator"]:
        for file in _generator_files(generator).values():
            assert (tls / Path(file).name).is_file(), file
    ns = kustomization()["namespace"]
    etcd = k8s_object("StatefulSet", "etcd")
    (container,) = etcd["spec"]["template"]["spec"]["containers"]
    node_env = {
        e["name"]: e.get("value", "")
        for e in k8s_object("StatefulSet", "node")["spec"]["template"]["spec"]["containers"][0][
            "env"
        ]
    }
    for i in range(etcd["spec"]["replicas"]):
        pod = f"etcd-{i}"
        common, hosts = _names(tls / f"{pod}.crt")
        assert common == f"etcd:{pod}"
        args = {
            k: v.replace("$(POD_NAME)", pod).replace("$(POD_NAMESPACE)", ns)
            for k, v in flags(container["args"]).items()
        }
        for url in ("advertise-client-urls", "initial-advertise-peer-urls"):
            assert _covers(hosts, host_of(args[url])), (pod, url)
        # Peers connect from pod addresses whose reverse lookup is the cluster-domain name.
        assert _covers(hosts, f"{pod}.etcd.{ns}.svc.cluster.local")
        etcd_host = node_env["DSH_ETCD"].replace("$(POD_NAMESPACE)", ns).rpartition(":")[0]
        assert etcd_host in hosts
    for i in range(3):
        pod = f"node-{i}"
        common, hosts = _names(tls / f"{pod}.crt")
        assert common == pod and pod in hosts  # DSH_NODE_ID=$(POD_NAME)
        advertised = node_env["DSH_ADVERTISE_HOST"].replace("$(POD_NAME)", pod)
        assert advertised.replace("$(POD_NAMESPACE)", ns) in hosts
        assert f"dsh-mesh.{ns}.svc" in hosts  # clients dial the Service dsh-mesh
    # The log store: the Secret's value is the file's bytes, which must be the DSN alone.
    (generator,) = [
        g for g in kustomization()["secretGenerator"] if g["name"] == "dsh-mesh-log-store"
    ]
    text = (tls / Path(_generator_files(generator)["dsn"]).name).read_text()
    assert text == text.strip()
    dsn = log_store_dsn(text)
    postgres = k8s_object("StatefulSet", POSTGRES)
    (container,) = postgres["spec"]["template"]["spec"]["containers"]
    env = {e["name"]: e["value"] for e in container["env"]}
    _assert_log_store(tls, dsn, {"user": env["POSTGRES_USER"], "database": env["POSTGRES_DB"]})
    service = postgres["spec"]["serviceName"]
    assert dsn["host"] == f"{service}.{ns}.svc"
    assert dsn["port"] in [p["port"] for p in k8s_object("Service", service)["spec"]["ports"]]
    assert _covers(_names(tls / "postgres.crt")[1], f"{POSTGRES}-0.{service}.{ns}.svc")
    # The CA file it names is in the node's certificate Secret, where the node mounts it.
    volume = _volume_of(
        k8s_object("StatefulSet", "node")["spec"]["template"]["spec"], dsn["sslrootcert"]
    )
    (node_tls,) = [
        g for g in kustomization()["secretGenerator"] if g["name"] == volume["secret"]["secretName"]
    ]
    assert Path(dsn["sslrootcert"]).name in _generator_files(node_tls)


def test_systemd_certificates_name_what_the_hosts_dial(certificates: dict[str, Path]) -> None:
    tls = certificates["systemd"]
    for env_file in (SYSTEMD / "env").glob("etcd-*.env"):
        common, hosts = _names(tls / f"{env_file.stem}.crt")
        assert common == f"etcd:{env_file.stem}"
        assert read_env_file(env_file)["MEMBER_IP"] in hosts
    for env_file in (SYSTEMD / "env").glob("node-*.env"):
        env = read_env_file(env_file)
        common, hosts = _names(tls / Path(env["DSH_TLS_CERT"]).name)
        assert common == env_file.stem
        assert (tls / Path(env["DSH_TLS_KEY"]).name).is_file()
        etcd_host = env["DSH_ETCD"].rpartition(":")[0]
        etcd_members = [
            f.stem
            for f in (SYSTEMD / "env").glob("etcd-*.env")
            if read_env_file(f)["MEMBER_IP"] == etcd_host
        ]
        (member,) = etcd_members
        assert etcd_host in _names(tls / f"{member}.crt")[1]
    assert (tls / "ca.crt").is_file() and (tls / "admin.crt").is_file()
    # The log store: the sample's DSN with the password the directory already held (kept).
    generated = read_env_file(tls / "log-store.env")
    assert set(generated) == {"DSH_LOG_STORE"}
    assert KEPT_PASSWORD in generated["DSH_LOG_STORE"]
    sample = read_env_file(SYSTEMD / "env" / "log-store.env")["DSH_LOG_STORE"]
    assert generated["DSH_LOG_STORE"].replace(KEPT_PASSWORD, "PASSWORD") == sample
    _assert_log_store(
        tls, log_store_dsn(generated["DSH_LOG_STORE"]), {"user": "dsh", "database": "dsh"}
    )
