"""The Kubernetes manifests in deploy/: render every kustomize target offline, validate the output against the
Kubernetes schemas (kubernetes-validate --strict, fixed version), and check the structure the pool depends on.

Needs `kubectl` (kustomize built in) on PATH and the `kubernetes-validate` and `pyyaml` packages (the `test`
extra). Without kubectl every test here is skipped with the reason; nothing talks to a cluster.
"""

from __future__ import annotations

import functools
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from umbp.config import ETCD_TXN_OPS

yaml = pytest.importorskip("yaml", reason="PyYAML is missing: pip install -e '.[test]' (tests/test_deploy.py)")

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "deploy"
TARGETS = ["base", "overlays/dev", "overlays/tcp", "overlays/rdma", "overlays/monitoring", "overlays/partitioned",
           "overlays/nvme"]
# Kinds from CRDs (the Prometheus operator's): no schema in kubernetes-validate; checked by hand below.
CRD_KINDS = {"ServiceMonitor"}
K8S_VERSION = "1.30.0"  # validated against this schema version (bundled in kubernetes-validate, offline)
NAMESPACE = "umbp"
IMAGE = "umbp:0.1.0"
IMAGES = {"overlays/rdma": "umbp-rdma:0.1.0"}  # targets whose image is not IMAGE
METAS_METRICS, NODE_METRICS = 7701, 7801  # --metrics-listen ports (the node's is a host port: hostNetwork)

KUBECTL = shutil.which("kubectl")
if KUBECTL is None:
    _why = ("SKIPPING ALL deploy/ TESTS: `kubectl` is not on PATH, so the kustomize targets in deploy/ cannot be "
            "rendered or validated. Install kubectl (>= 1.27, kustomize built in) to run tests/test_deploy.py.")
    print(f"\n*** {_why}", file=sys.stderr)
    warnings.warn(_why)
    pytest.skip(_why, allow_module_level=True)


# -- helpers ---------------------------------------------------------------------------------------------------

@functools.cache
def _render(target: str) -> str:
    r = subprocess.run([KUBECTL, "kustomize", str(DEPLOY / target)], check=False, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, f"kubectl kustomize deploy/{target} failed:\n{r.stderr}"
    return r.stdout


@pytest.fixture(scope="module", params=TARGETS)
def target(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def docs(target) -> list[dict]:
    return [d for d in yaml.safe_load_all(_render(target)) if d]


def _docs(target: str) -> list[dict]:
    return [d for d in yaml.safe_load_all(_render(target)) if d]


def _one(docs: list[dict], kind: str, name: str | None = None) -> dict:
    found = [d for d in docs if d["kind"] == kind and (name is None or d["metadata"]["name"] == name)]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {[d['metadata']['name'] for d in found]}"
    return found[0]


def _container(workload: dict, name: str | None = None) -> dict:
    cs = workload["spec"]["template"]["spec"]["containers"]
    if name is None:
        assert len(cs) == 1, f"{workload['metadata']['name']}: expected one container"
        return cs[0]
    return next(c for c in cs if c["name"] == name)


def _cmdline(c: dict) -> list[str]:
    return [str(x) for x in c.get("command", []) + c.get("args", [])]


def _flags(argv: list[str]) -> dict[str, str | None]:
    """--flag value / --flag=value -> {flag: value}."""
    out: dict[str, str | None] = {}
    i = 0
    while i < len(argv):
        a = argv[i]
        if a.startswith("--"):
            if "=" in a:
                k, v = a.split("=", 1)
                out[k] = v
            elif i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                out[a] = argv[i + 1]
                i += 1
            else:
                out[a] = None
        i += 1
    return out


def _env(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def _expand(s: str, values: dict[str, str]) -> str:
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: values.get(m.group(1), m.group(0)), s)


_UNITS = {"Ki": 1 << 10, "Mi": 1 << 20, "Gi": 1 << 30, "Ti": 1 << 40, "k": 10**3, "M": 10**6, "G": 10**9,
          "T": 10**12, "": 1}


def _quantity(q) -> int:
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(q))
    assert m, f"cannot parse quantity {q!r}"
    return int(float(m.group(1)) * _UNITS[m.group(2) or ""])


def _port(c: dict, port) -> int:
    if isinstance(port, int):
        return port
    return next(p["containerPort"] for p in c.get("ports", []) if p.get("name") == port)


@functools.cache
def _help_flags(sub: str) -> frozenset[str]:
    r = subprocess.run([sys.executable, "-m", "umbp", sub, "--help"], check=False, capture_output=True, text=True,
                       timeout=60, cwd=REPO)
    assert r.returncode == 0, f"umbp {sub} --help failed:\n{r.stderr}"
    return frozenset(re.findall(r"(?<![\w-])(--[a-z][a-z0-9-]*)", r.stdout))


def _configmap_env(docs: list[dict], c: dict) -> dict[str, str]:
    env: dict[str, str] = {}
    for src in c.get("envFrom", []):
        cm = _one(docs, "ConfigMap", src["configMapRef"]["name"])
        env.update(cm.get("data", {}))
    return env


def _selects(selector: dict, labels: dict) -> bool:
    return all(labels.get(k) == v for k, v in selector.items())


# -- schema validation -----------------------------------------------------------------------------------------

def test_validates_against_kubernetes_schema_strict(target, tmp_path):
    pytest.importorskip("kubernetes_validate",
                        reason="kubernetes-validate is missing: pip install -e '.[test]' (tests/test_deploy.py)")
    f = tmp_path / "rendered.yaml"
    docs = [d for d in yaml.safe_load_all(_render(target)) if d]
    f.write_text(yaml.safe_dump_all([d for d in docs if d["kind"] not in CRD_KINDS]))
    r = subprocess.run([sys.executable, "-m", "kubernetes_validate", "-k", K8S_VERSION, "--strict", "--quiet",
                        str(f)], check=False, capture_output=True, text=True, timeout=120)
    out = r.stdout + r.stderr
    assert r.returncode == 0, f"deploy/{target} does not validate against Kubernetes {K8S_VERSION}:\n{out}"
    # a kind without a schema (a typo in apiVersion/kind) is only a warning there: here it fails
    assert not re.search(r"^(WARN|ERROR|FATAL)", out, re.MULTILINE), out


def test_every_object_in_the_namespace_and_images_pinned(docs, target):
    ns = _one(docs, "Namespace")
    assert ns["metadata"]["name"] == NAMESPACE
    for d in docs:
        if d["kind"] != "Namespace":
            assert d["metadata"].get("namespace") == NAMESPACE, f"{d['kind']}/{d['metadata']['name']}"
    for kind, name in (("StatefulSet", "metaserver"), ("DaemonSet", "umbp-node")):
        assert _container(_one(docs, kind, name))["image"] == IMAGES.get(target, IMAGE)


def _check_http_probes(c: dict, metrics_port: int, ready_on_startup: bool) -> None:
    """Liveness on /healthz and readiness on /readyz, both on the container port that --metrics-listen binds."""
    for probe, path in (("startupProbe", "/readyz" if ready_on_startup else "/healthz"),
                        ("readinessProbe", "/readyz"), ("livenessProbe", "/healthz")):
        get = c[probe]["httpGet"]
        assert get["path"] == path and _port(c, get["port"]) == metrics_port, (c["name"], probe, get)


# -- etcd ------------------------------------------------------------------------------------------------------

def test_etcd_three_members_with_compaction_and_quota(docs):
    sts = _one(docs, "StatefulSet", "etcd")
    assert sts["spec"]["replicas"] == 3
    headless = _one(docs, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None"
    assert headless["spec"].get("publishNotReadyAddresses") is True
    labels = sts["spec"]["template"]["metadata"]["labels"]
    client = _one(docs, "Service", "etcd-client")
    assert _selects(client["spec"]["selector"], labels)
    assert [p["port"] for p in client["spec"]["ports"]] == [2379]

    c = _container(sts)
    flags = _flags(_cmdline(c))
    assert flags["--auto-compaction-mode"] == "periodic"
    assert flags["--auto-compaction-retention"] == "5m"
    assert int(flags["--max-txn-ops"]) == ETCD_TXN_OPS  # the metaserver's transactions (metaserver/store/batcher.py)
    quota = int(flags["--quota-backend-bytes"])
    members = flags["--initial-cluster"].split(",")
    assert [m.split("=")[0] for m in members] == [f"etcd-{i}" for i in range(sts["spec"]["replicas"])]
    assert set(re.findall(r"\$\((\w+)\)", " ".join(_cmdline(c)))) <= set(_env(c))

    (pvc,) = sts["spec"]["volumeClaimTemplates"]
    storage = _quantity(pvc["spec"]["resources"]["requests"]["storage"])
    assert quota < storage, "the etcd backend quota must fit on its volume"
    assert _quantity(c["resources"]["limits"]["memory"]) > quota, "etcd maps its backend: memory above the quota"
    assert any(m["name"] == pvc["metadata"]["name"] for m in c["volumeMounts"])
    pdb = _one(docs, "PodDisruptionBudget", "etcd")
    assert _selects(pdb["spec"]["selector"]["matchLabels"], labels) and pdb["spec"]["minAvailable"] == 2


# -- metaserver ------------------------------------------------------------------------------------------------

def _metaserver_names(sts: dict) -> list[str]:
    """The stable address of every replica of the metaserver StatefulSet: pod name . headless Service . namespace."""
    return [f"{sts['metadata']['name']}-{i}.{sts['spec']['serviceName']}.{NAMESPACE}.svc:7700"
            for i in range(sts["spec"]["replicas"])]


def test_metaserver_statefulset(docs, target):
    """The metaservers are a StatefulSet of N (>= 3) processes of one pool behind a headless Service: each advertises
    its stable DNS name, and the nodes are given every one of them. One slot (a leader and warm standbys) unless the
    partitioned overlay creates the pool with 64."""
    sts = _one(docs, "StatefulSet", "metaserver")
    n = sts["spec"]["replicas"]
    assert n >= 3, "at least three processes (one may die, two share its slots)"
    assert sts["spec"]["podManagementPolicy"] == "Parallel"
    labels = sts["spec"]["template"]["metadata"]["labels"]
    c = _container(sts)
    argv = _cmdline(c)
    assert argv[:2] == ["umbp", "metaserver"], argv
    flags = _flags(argv[2:])
    assert set(flags) <= _help_flags("metaserver"), f"flags unknown to `umbp metaserver`: {set(flags)}"
    etcd_host, etcd_port = flags["--etcd"].rsplit(":", 1)
    assert _one(docs, "Service", etcd_host)["spec"]["ports"][0]["port"] == int(etcd_port)
    assert flags["--listen"] == "0.0.0.0:7700"
    assert int(flags["--slots"]) == (6 if target == "overlays/partitioned" else 1)
    headless = _one(docs, "Service", sts["spec"]["serviceName"])
    assert headless["spec"]["clusterIP"] == "None" and headless["spec"].get("publishNotReadyAddresses") is True
    assert flags["--advertise"] == f"$(POD_NAME).{headless['metadata']['name']}.{NAMESPACE}.svc:7700"
    assert _env(c)["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
    assert flags["--metrics-listen"] == f"0.0.0.0:{METAS_METRICS}"
    _check_http_probes(c, METAS_METRICS, ready_on_startup=True)

    assert _selects(headless["spec"]["selector"], labels)
    ports = {p["name"]: p for p in headless["spec"]["ports"]}
    assert set(ports) == {"control", "metrics"}
    assert ports["control"]["port"] == 7700 and _port(c, ports["control"]["targetPort"]) == 7700
    assert _port(c, ports["metrics"]["targetPort"]) == METAS_METRICS
    pdb = _one(docs, "PodDisruptionBudget", "metaserver")
    assert _selects(pdb["spec"]["selector"]["matchLabels"], labels)
    assert n - 1 <= pdb["spec"]["minAvailable"] < n, "one process away at a time"

    node = _flags(_cmdline(_container(_one(docs, "DaemonSet", "umbp-node")))[2:])
    assert node["--metaserver"].split(",") == _metaserver_names(sts), "the nodes must be given every process"


# -- storage node ----------------------------------------------------------------------------------------------

def test_node_daemonset_host_shm_and_network(docs):
    ds = _one(docs, "DaemonSet", "umbp-node")
    pod = ds["spec"]["template"]["spec"]
    assert pod["hostNetwork"] is True
    assert pod["dnsPolicy"] == "ClusterFirstWithHostNet", "hostNetwork pods need it to resolve the metaserver"
    assert pod["terminationGracePeriodSeconds"] > 0
    c = _container(ds)
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert "/dev/shm" in mounts, "the node must mount the host's /dev/shm"
    vol = next(v for v in pod["volumes"] if v["name"] == mounts["/dev/shm"])
    assert vol["hostPath"]["path"] == "/dev/shm", "the arena must live in the host's /dev/shm (outlives the pod)"
    _check_http_probes(c, NODE_METRICS, ready_on_startup=False)

    argv = _cmdline(c)
    assert argv[:2] == ["umbp", "node"], argv
    flags = _flags(argv[2:])
    assert flags["--capacity"] == "$(UMBP_CAPACITY)"
    assert flags["--listen"] == "0.0.0.0:7800" and flags["--advertise"] == "$(POD_IP):7800"
    assert flags["--node-id"] == "$(NODE_NAME)"
    assert flags["--metrics-listen"] == f"0.0.0.0:{NODE_METRICS}"
    metrics_svc = _one(docs, "Service", "umbp-node")
    assert metrics_svc["spec"]["clusterIP"] == "None"
    assert _selects(metrics_svc["spec"]["selector"], ds["spec"]["template"]["metadata"]["labels"])
    (mp,) = metrics_svc["spec"]["ports"]
    assert mp["name"] == "metrics" and _port(c, mp["targetPort"]) == NODE_METRICS
    env = _env(c)
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    assert env["POD_IP"]["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP"
    for addr in flags["--metaserver"].split(","):  # pod.service.namespace.svc:7700 of the metaserver StatefulSet
        host, port = addr.rsplit(":", 1)
        assert int(port) == 7700 and _one(docs, "Service", host.split(".")[1])

    from umbp.sizes import parse_size

    capacity = parse_size(env["UMBP_CAPACITY"]["value"], "UMBP_CAPACITY")
    for kind in ("requests", "limits"):
        mem = _quantity(c["resources"][kind]["memory"])
        assert mem >= capacity + (512 << 20), f"node memory {kind} must cover the {capacity}-byte arena"


def test_node_command_line_uses_only_flags_umbp_node_accepts(docs):
    c = _container(_one(docs, "DaemonSet", "umbp-node"))
    flags = _flags(_cmdline(c)[2:])
    accepted = _help_flags("node")
    assert "--capacity" in accepted and "--node-id" in accepted, f"unexpected `umbp node --help`: {accepted}"
    unknown = set(flags) - accepted
    assert not unknown, f"the DaemonSet passes flags `umbp node --help` does not list: {sorted(unknown)}"


def test_variable_references_are_defined(docs):
    """Kubernetes leaves an undefined $(VAR) in command/args as literal text: each must be an env entry."""
    for d in docs:
        if d["kind"] not in ("Deployment", "DaemonSet", "StatefulSet"):
            continue
        for c in d["spec"]["template"]["spec"]["containers"]:
            refs = set(re.findall(r"\$\((\w+)\)", " ".join(_cmdline(c))))
            assert refs <= set(_env(c)), f"{d['metadata']['name']}/{c['name']}: undefined {refs - set(_env(c))}"


def test_command_lines_and_configmap_resolve_with_the_real_config(docs, target):
    """Expand the pods' command lines with sample downward-API values and build the components' configs exactly
    as `umbp metaserver` / `umbp node` do (flags > UMBP_* from the ConfigMap): bad values fail here."""
    from umbp.cli import build_parser
    from umbp.config import MetaserverConfig, NodeConfig, resolve

    sample = {"POD_IP": "10.1.2.3", "POD_NAME": "metaserver-1", "NODE_NAME": "gpu-host-07.rack1"}
    ms = _container(_one(docs, "StatefulSet", "metaserver"))
    node = _container(_one(docs, "DaemonSet", "umbp-node"))
    for c in (ms, node):
        cm = _configmap_env(docs, c)
        for key in ("UMBP_LEASE_TTL", "UMBP_HIGH_WATERMARK", "UMBP_LOW_WATERMARK", "UMBP_EVICTION_POLICY"):
            assert key in cm, f"{c['name']}: {key} not in its envFrom ConfigMap"

    cm = _configmap_env(docs, ms)
    args = build_parser().parse_args([_expand(a, sample) for a in _cmdline(ms)[1:]])
    cfg = resolve(MetaserverConfig, {"etcd": args.etcd, "listen": args.listen, "advertise": args.advertise,
                                     "eviction_policy": args.eviction_policy, "slots": args.slots}, env=cm)
    assert cfg.advertise == f"metaserver-1.metaserver.{NAMESPACE}.svc:7700"
    assert cfg.slots == (6 if target == "overlays/partitioned" else 1)
    assert cfg.eviction_policy == cm["UMBP_EVICTION_POLICY"]
    assert cfg.high_watermark == float(cm["UMBP_HIGH_WATERMARK"])

    values = dict(sample, UMBP_CAPACITY=_env(node)["UMBP_CAPACITY"]["value"])
    cm = _configmap_env(docs, node)
    args = build_parser().parse_args([_expand(a, values) for a in _cmdline(node)[1:]])
    cfg = resolve(NodeConfig, {"metaserver": args.metaserver, "capacity": args.capacity, "listen": args.listen,
                               "advertise": args.advertise, "lease_ttl": args.lease_ttl, "node_id": args.node_id},
                  env=cm)
    assert cfg.node_id == "gpu-host-07.rack1" and cfg.lease_ttl == float(cm["UMBP_LEASE_TTL"])
    assert cfg.arena_dir == "/dev/shm"


def test_dev_overlay_is_smaller_with_the_same_topology():
    base, dev = _docs("base"), _docs("overlays/dev")

    def cap(docs):
        return _env(_container(_one(docs, "DaemonSet", "umbp-node")))["UMBP_CAPACITY"]["value"]

    from umbp.sizes import parse_size

    assert parse_size(cap(dev), "dev") < parse_size(cap(base), "base")
    for kind, name in (("StatefulSet", "etcd"), ("StatefulSet", "metaserver")):
        assert _one(dev, kind, name)["spec"]["replicas"] == _one(base, kind, name)["spec"]["replicas"]
        b, d = (_quantity(_container(_one(x, kind, name))["resources"]["limits"]["memory"]) for x in (base, dev))
        assert d < b, f"{kind}/{name}: dev memory limit not smaller"


# -- transport overlays and monitoring --------------------------------------------------------------------------

def _node_container(docs: list[dict]) -> dict:
    return _container(_one(docs, "DaemonSet", "umbp-node"))


def _rdma_resources(c: dict) -> dict[str, dict]:
    return {kind: {k: v for k, v in c["resources"].get(kind, {}).items() if k.startswith("rdma/")}
            for kind in ("requests", "limits")}


def test_rdma_overlay_device_capability_and_pinned_memory():
    from umbp.sizes import parse_size

    docs = _docs("overlays/rdma")
    ds = _one(docs, "DaemonSet", "umbp-node")
    pod = ds["spec"]["template"]["spec"]
    c = _node_container(docs)
    assert pod["hostNetwork"] is True, "RDMA needs the host's NIC and address"
    assert pod["nodeSelector"] == {"umbp.io/rdma": "true"}
    assert "IPC_LOCK" in c["securityContext"]["capabilities"]["add"], "registering the arena pins it"
    rdma = _rdma_resources(c)
    assert rdma["requests"] and rdma["requests"] == rdma["limits"], "an extended resource: requests == limits"
    assert all(int(v) >= 1 for v in rdma["limits"].values())
    capacity = parse_size(_env(c)["UMBP_CAPACITY"]["value"], "UMBP_CAPACITY")
    for kind in ("requests", "limits"):  # the pinned arena counts against the memory cgroup
        assert _quantity(c["resources"][kind]["memory"]) >= capacity + (1 << 30), kind
    assert c["image"] == "umbp-rdma:0.1.0"
    assert ds["metadata"]["labels"]["umbp.io/transport"] == "rdma"
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    assert "ARG WITH_RDMA=0" in dockerfile and "python3-pyverbs" in dockerfile, "the image the overlay names"


def test_tcp_overlay_asks_for_no_rdma_and_more_node_cpu():
    base, tcp = _docs("base"), _docs("overlays/tcp")
    c, b = _node_container(tcp), _node_container(base)
    assert not any(_rdma_resources(c).values())
    assert "IPC_LOCK" not in str(c.get("securityContext", {}))
    assert _one(tcp, "DaemonSet", "umbp-node")["spec"]["template"]["spec"]["hostNetwork"] is True
    assert _quantity(c["resources"]["requests"]["cpu"]) > _quantity(b["resources"]["requests"]["cpu"])
    assert c["resources"]["limits"]["memory"] == b["resources"]["limits"]["memory"]
    for d in tcp:
        if d["kind"] in ("Deployment", "DaemonSet", "StatefulSet"):
            assert d["metadata"]["labels"]["umbp.io/transport"] == "tcp"


def test_nvme_overlay_gives_each_node_a_disk_tier_on_a_host_path():
    docs = _docs("overlays/nvme")
    c = _node_container(docs)
    args = c["args"]
    disk = args[args.index("--disk") + 1]
    assert disk.startswith("/var/lib/umbp-disk/") and "$(NODE_NAME)" in disk  # one file a host, named by the node
    assert args[args.index("--disk-capacity") + 1] == "$(UMBP_DISK_CAPACITY)"
    env = {e["name"]: e for e in c["env"]}
    from umbp.sizes import parse_size
    assert parse_size(env["UMBP_DISK_CAPACITY"]["value"], "UMBP_DISK_CAPACITY") >= 1 << 30  # as the node parses it
    assert "NODE_NAME" in env
    mount = {m["name"]: m for m in c["volumeMounts"]}["nvme"]
    assert mount["mountPath"] == "/var/lib/umbp-disk"
    vols = {v["name"]: v for v in _one(docs, "DaemonSet", "umbp-node")["spec"]["template"]["spec"]["volumes"]}
    assert vols["nvme"]["hostPath"]["path"].startswith("/mnt/") and "host-shm" in vols  # the DRAM arena as before


def test_monitoring_servicemonitors_reach_the_metrics_ports():
    docs = _docs("overlays/monitoring")
    monitors = [d for d in docs if d["kind"] == "ServiceMonitor"]
    assert {m["metadata"]["name"] for m in monitors} == {"umbp-metaserver", "umbp-node"}
    workloads = {"umbp-metaserver": ("StatefulSet", "metaserver", METAS_METRICS),
                 "umbp-node": ("DaemonSet", "umbp-node", NODE_METRICS)}
    for m in monitors:
        assert m["apiVersion"] == "monitoring.coreos.com/v1" and m["metadata"]["namespace"] == NAMESPACE
        svcs = [d for d in docs if d["kind"] == "Service" and _selects(m["spec"]["selector"]["matchLabels"],
                                                                      d["metadata"].get("labels", {}))]
        assert svcs, f"{m['metadata']['name']} selects no Service"
        kind, name, port = workloads[m["metadata"]["name"]]
        c = _container(_one(docs, kind, name))
        for ep in m["spec"]["endpoints"]:
            assert ep["path"] == "/metrics"
            for svc in svcs:
                sp = next((p for p in svc["spec"]["ports"] if p.get("name") == ep["port"]), None)
                if sp is not None:
                    assert _port(c, sp["targetPort"]) == port
                    break
            else:
                raise AssertionError(f"no selected Service has a port named {ep['port']!r}")
    cm = _one(docs, "ConfigMap", "umbp-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    import json

    (text,) = cm["data"].values()
    assert json.loads(text) == json.loads((DEPLOY / "grafana" / "umbp-dashboard.json").read_text())
    # the other targets carry no CRD kinds: they apply on a cluster without the Prometheus operator
    for t in TARGETS:
        if t != "overlays/monitoring":
            assert not [d for d in _docs(t) if d["kind"] in CRD_KINDS], t
