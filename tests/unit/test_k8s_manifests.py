"""The Kubernetes manifests (deploy/k8s, docs/kubernetes.md): the base and every overlay render with `kubectl
kustomize`, every object validates against the Kubernetes JSON schemas of K8S_VERSION (kubernetes-validate,
strict: an unknown or misplaced field fails), and what no schema sees holds: each tandem container is probed over
gRPC on the port its environment makes it serve, its grace period outlasts its drain, it sets only environment
variables its service reads (as `--help` names them), an engine pod's CPUs cover its tensor-parallel ranks'
threads, and the Services, PodDisruptionBudgets and HorizontalPodAutoscalers find their pods, each HPA on its
tier's metric with an adapter rule serving it.
test_checks_catch_broken_manifests breaks a rendered copy in each of those ways and expects each to be reported."""
import base64
import copy
import re
import shutil
import subprocess
import sys
from functools import cache
from pathlib import Path

import kubernetes_validate
import pytest
import yaml

from tandem.services.metrics import StatsCollector

REPO = Path(__file__).resolve().parents[2]
K8S = REPO / "deploy/k8s"
K8S_VERSION = "1.32"  # the schemas validated against (grpc probes need >= 1.27; docs/kubernetes.md)
BUILDS = ["base"] + sorted(p.parent.name for p in (K8S / "overlays").glob("*/kustomization.yaml"))
KUBECTL = shutil.which("kubectl")
TIERS = ("gateway", "prefill", "decode")
PROBES = ("startupProbe", "readinessProbe", "livenessProbe")
HPA_METRIC = {"prefill": "tandem_num_requests_waiting", "decode": "tandem_kv_cache_usage_perc"}  # Pods metrics
ENGINE_GAUGES = {f"tandem:{name}" for name, _, _ in StatsCollector.GAUGES}

pytestmark = pytest.mark.skipif(KUBECTL is None, reason="kubectl is not installed (Debian package kubectl): it "
                                "renders the kustomize manifests")  # fmt: skip


@cache
def render(build: str) -> tuple[dict, ...]:
    directory = K8S / "base" if build == "base" else K8S / "overlays" / build
    done = subprocess.run([KUBECTL, "kustomize", str(directory)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"kubectl kustomize {directory}: {done.stderr}"
    return tuple(d for d in yaml.safe_load_all(done.stdout) if d)


@cache
def help_env() -> dict[str, set[str] | None]:
    """{tier: the $VARIABLES its --help names}, or None for every tier while the services do not yet read each
    flag from TANDEM_<FLAG> (decode's --help does not name $TANDEM_PORT)."""
    procs = {t: subprocess.Popen([sys.executable, "-m", f"tandem.services.{t}", "--help"], cwd=REPO, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE) for t in TIERS}  # fmt: skip
    names = {}
    for tier, proc in procs.items():
        out, err = proc.communicate(timeout=120)
        assert proc.returncode == 0, f"python -m tandem.services.{tier} --help: {err}"
        names[tier] = set(re.findall(r"\$([A-Z][A-Z0-9_]*)", out))
    return names if "TANDEM_PORT" in names["decode"] else dict.fromkeys(TIERS)


def find(objects, kind: str, name: str | None = None) -> list[dict]:
    return [o for o in objects if o["kind"] == kind and (name is None or o["metadata"]["name"] == name)]


def selects(selector: dict, labels: dict) -> bool:
    assert set(selector) <= {"matchLabels"}, f"only matchLabels selectors are checked here: {selector}"
    return bool(selector.get("matchLabels")) and selector["matchLabels"].items() <= labels.items()


def tandem_containers(objects):
    """(deployment, pod spec, container, tier) of every container that runs a tandem service."""
    for deployment in find(objects, "Deployment"):
        pod = deployment["spec"]["template"]["spec"]
        for container in pod["containers"]:
            command = container.get("command", [])
            if command[:2] == ["python", "-m"] and command[2].removeprefix("tandem.services.") in TIERS:
                yield deployment, pod, container, command[2].removeprefix("tandem.services.")


def container_env(objects, container: dict) -> tuple[dict[str, str], list[str]]:
    """({name: value} as the container sees it: envFrom's ConfigMaps and Secrets, then env; a downward-API value
    reads "fieldRef:PATH"), [problems: a missing source, a name set twice]."""
    env, problems = {}, []
    for source in container.get("envFrom", []):
        kind = "ConfigMap" if "configMapRef" in source else "Secret"
        ref = source["configMapRef"] if kind == "ConfigMap" else source["secretRef"]
        found = find(objects, kind, ref["name"])
        if not found:
            problems.append(f"{container['name']}: envFrom names {kind} {ref['name']}, which is not rendered")
            continue
        data = found[0].get("data", {})
        if kind == "Secret":
            data = {k: base64.b64decode(v).decode() for k, v in data.items()}
        env.update(data)
    names = [e["name"] for e in container.get("env", [])]
    problems += [f"{container['name']}: env sets {n} twice" for n in sorted({n for n in names if names.count(n) > 1})]
    for e in container.get("env", []):
        ref = e.get("valueFrom", {}).get("fieldRef")
        env[e["name"]] = f"fieldRef:{ref['fieldPath']}" if ref else e.get("value", "")
    return env, problems


def schema_problems(objects) -> list[str]:
    problems = []
    for o in objects:
        try:
            kubernetes_validate.validate(o, K8S_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            problems.append(f"{o['kind']} {o['metadata'].get('name')}: {e.message} at {list(e.absolute_path)}")
        except kubernetes_validate.SchemaNotFoundError as e:
            problems.append(f"{o['kind']} {o['metadata'].get('name')}: {e}")
    return problems


def wiring_problems(objects) -> list[str]:
    problems = []
    deployments = find(objects, "Deployment")
    pods = {d["metadata"]["name"]: d["spec"]["template"]["metadata"]["labels"] for d in deployments}
    for d in deployments:
        if not selects(d["spec"]["selector"], pods[d["metadata"]["name"]]):
            problems.append(f"Deployment {d['metadata']['name']}: its selector does not select its own pods")
    tiers_seen = set()
    for deployment, pod, c, tier in tandem_containers(objects):
        where = f"Deployment {deployment['metadata']['name']} ({tier})"
        tiers_seen.add(tier)
        env, env_problems = container_env(objects, c)
        problems += [f"{where}: {p}" for p in env_problems]
        read = help_env()[tier]
        for name in env:
            if read is not None and name not in read:
                problems.append(f"{where}: sets {name}, which `python -m tandem.services.{tier} --help` does not name")
            elif read is None and not (name.startswith(("TANDEM_", "OTEL_")) or name == "REDIS_URL"):
                problems.append(f"{where}: sets {name}, which no tandem service reads")
        for required in ("TANDEM_PORT", "TANDEM_DRAIN_TIMEOUT", "REDIS_URL"):
            if required not in env:
                problems.append(f"{where}: sets no {required}")
        if "TANDEM_PORT" not in env or "TANDEM_DRAIN_TIMEOUT" not in env:
            continue
        port = int(env["TANDEM_PORT"])
        ports = {p["containerPort"] for p in c.get("ports", [])}
        served = [port] + [int(env[n]) for n in ("TANDEM_METRICS_PORT", "TANDEM_HTTP_PORT") if n in env]
        problems += [f"{where}: serves port {p}, not among its containerPorts {sorted(ports)}"
                     for p in served if p not in ports]  # fmt: skip
        for probe in PROBES:
            grpc = c.get(probe, {}).get("grpc")
            if grpc is None or grpc.get("port") != port or grpc.get("service", "") != "":
                problems.append(f"{where}: {probe} is {c.get(probe)}, not a grpc probe of port {port} (service '')")
        if tier != "gateway" and env.get("TANDEM_ADVERTISE_HOST") != "fieldRef:status.podIP":
            problems.append(f"{where}: TANDEM_ADVERTISE_HOST is not the pod's IP (the registry hands it out)")
        pre_stop = c.get("lifecycle", {}).get("preStop", {}).get("exec", {}).get("command", [])
        sleep = float(pre_stop[1]) if pre_stop[:1] == ["sleep"] else 0.0
        grace = pod.get("terminationGracePeriodSeconds", 30)
        if not grace > sleep + float(env["TANDEM_DRAIN_TIMEOUT"]):
            problems.append(f"{where}: terminationGracePeriodSeconds {grace} <= preStop {sleep} s + "
                            f"TANDEM_DRAIN_TIMEOUT {env['TANDEM_DRAIN_TIMEOUT']} s: the drain would be killed")
        for kind in ("requests", "limits"):
            if "memory" not in c.get("resources", {}).get(kind, {}):
                problems.append(f"{where}: no memory {kind}")
        problems += [f"{where}: {p}" for p in rank_problems(env, c)]
    if tiers_seen != set(TIERS):
        problems.append(f"tandem Deployments run {sorted(tiers_seen)}, not each of {TIERS}")
    for pdb in find(objects, "PodDisruptionBudget"):
        matched = [n for n, labels in pods.items() if selects(pdb["spec"]["selector"], labels)]
        if len(matched) != 1:
            problems.append(f"PodDisruptionBudget {pdb['metadata']['name']} selects the pods of {matched}")
    for service in find(objects, "Service"):
        matched = [d for d in deployments if selects({"matchLabels": service["spec"]["selector"]},
                                                     pods[d["metadata"]["name"]])]  # fmt: skip
        if len(matched) != 1:
            problems.append(f"Service {service['metadata']['name']} selects {len(matched)} Deployments' pods")
            continue
        ports = [p for c in matched[0]["spec"]["template"]["spec"]["containers"] for p in c.get("ports", [])]
        for p in service["spec"]["ports"]:
            if p["targetPort"] not in {q.get("name") for q in ports} | {q["containerPort"] for q in ports}:
                problems.append(f"Service {service['metadata']['name']}: targetPort {p['targetPort']} is no port "
                                f"of its pods")  # fmt: skip
    served = adapter_metrics(objects)
    for hpa in find(objects, "HorizontalPodAutoscaler"):
        ref, name = hpa["spec"]["scaleTargetRef"], hpa["metadata"]["name"]
        if ref["kind"] != "Deployment" or ref["name"] not in pods:
            problems.append(f"HorizontalPodAutoscaler {name} scales {ref['kind']} {ref['name']}: not rendered")
        elif "replicas" in find(objects, "Deployment", ref["name"])[0]["spec"]:
            problems.append(f"Deployment {ref['name']} sets replicas, which its HPA owns (a re-apply resets them)")
        metrics = [m["pods"]["metric"]["name"] for m in hpa["spec"]["metrics"] if m["type"] == "Pods"]
        if ref["name"] in HPA_METRIC and metrics != [HPA_METRIC[ref["name"]]]:
            problems.append(f"HPA {name} scales {ref['name']} on {metrics}, not {HPA_METRIC[ref['name']]}")
        problems += [f"HPA {name}: no prometheus-adapter rule serves {m}" for m in metrics if m not in served]
    return problems


def cpus(quantity: str | None) -> float | None:
    """A CPU quantity ("6", "500m") in CPUs; None when unset."""
    if quantity is None:
        return None
    return float(quantity[:-1]) / 1000 if str(quantity).endswith("m") else float(quantity)


def rank_problems(env: dict[str, str], container: dict) -> list[str]:
    """An engine pod is one instance of TANDEM_TENSOR_PARALLEL_SIZE ranks, each a process in its container with
    TANDEM_THREADS torch threads and TANDEM_KERNEL_THREADS kernel threads (docs/parallelism.md, "Deployment"): its
    CPU request must cover every rank's threads, and at TP > 1 the kernel threads must be set (unset, each rank
    takes every CPU it sees: the node's, not the pod's)."""
    ranks = int(env.get("TANDEM_TENSOR_PARALLEL_SIZE", "1"))
    requested = cpus(container.get("resources", {}).get("requests", {}).get("cpu"))
    if ranks > 1 and "TANDEM_KERNEL_THREADS" not in env:
        return [f"{ranks} tensor-parallel ranks without TANDEM_KERNEL_THREADS (each would take every CPU it sees)"]
    needed = ranks * max(int(env.get("TANDEM_THREADS", "1")), int(env.get("TANDEM_KERNEL_THREADS", "1")))
    if requested is not None and requested < needed:
        return [f"requests {requested:g} CPUs for {ranks} tensor-parallel ranks of {needed // ranks} threads each"]
    return []


def adapter_metrics(objects) -> set[str]:
    """The custom metric names the rendered prometheus-adapter rules serve, each from an engine gauge."""
    names = set()
    for config in find(objects, "ConfigMap", "tandem-prometheus-adapter-rules"):
        for rule in yaml.safe_load(config["data"]["config.yaml"])["rules"]:
            series = re.match(r"[\w:]+", rule["seriesQuery"])[0]
            assert series in ENGINE_GAUGES, f"adapter rule on {series}, which no engine exports"
            as_name = rule["name"]["as"].replace("${1}", "$1")
            names.add(re.sub(rule["name"]["matches"], as_name.replace("$1", r"\1"), series))
    return names


@pytest.mark.parametrize("build", BUILDS)
def test_objects_validate_against_kubernetes_schemas(build):
    objects = render(build)
    assert objects
    assert schema_problems(objects) == []


@pytest.mark.parametrize("build", BUILDS)
def test_probes_drain_env_and_selectors_fit(build):
    assert wiring_problems(render(build)) == []


def test_overlays():
    assert {"example", "external-redis", "autoscaling", "tensor-parallel"} <= set(BUILDS)
    external = render("external-redis")
    assert not [o for o in external if o["metadata"]["name"] == "redis"], "external-redis keeps the redis pod"
    for _, _, c, _ in tandem_containers(external):
        assert container_env(external, c)[0]["REDIS_URL"] != "redis://redis:6379/0"
    scaled = render("autoscaling")
    assert {h["spec"]["scaleTargetRef"]["name"] for h in find(scaled, "HorizontalPodAutoscaler")} == set(TIERS)
    assert adapter_metrics(scaled) == set(HPA_METRIC.values())
    # one pod per instance, its ranks inside: the engines at TP 3 with the CPUs and memory of three ranks
    base, parallel = render("base"), render("tensor-parallel")
    for (_, _, c, tier), (_, _, one, _) in zip(tandem_containers(parallel), tandem_containers(base)):
        env = container_env(parallel, c)[0]
        assert env.get("TANDEM_TENSOR_PARALLEL_SIZE") == ("3" if tier != "gateway" else None), tier
        if tier != "gateway":
            assert cpus(c["resources"]["requests"]["cpu"]) == 3 * cpus(one["resources"]["requests"]["cpu"]), tier
            assert c["resources"]["requests"]["memory"] != one["resources"]["requests"]["memory"], tier
            assert c["resources"]["requests"] == c["resources"]["limits"], tier  # (Guaranteed QoS, as the base)
    example = render("example")
    assert all(o["metadata"].get("namespace") == "tandem" for o in example if o["kind"] != "Namespace")
    assert all(c["image"] != "tandem:latest" for _, _, c, _ in tandem_containers(example))


def _edit(objects, kind, name, change):
    objects = copy.deepcopy(list(objects))
    change(find(objects, kind, name)[0])
    return objects


def _container(deployment):
    return deployment["spec"]["template"]["spec"]["containers"][0]


BREAKAGES = {  # name: (kind, name, change, the check that must report it)
    "unknown field": ("Deployment", "decode", lambda d: _container(d).update(livenesProbe={}), schema_problems),
    "misplaced field": ("Deployment", "gateway", lambda d: d["spec"].update(terminationGracePeriodSeconds=45),
                        schema_problems),
    "probe on another port": ("Deployment", "prefill", lambda d: _container(d)["readinessProbe"]
                              .update(grpc={"port": 50061}), wiring_problems),
    "http probe": ("Deployment", "decode", lambda d: _container(d).update(
        livenessProbe={"httpGet": {"path": "/", "port": 9090}}), wiring_problems),
    "grace period below the drain": ("Deployment", "decode", lambda d: d["spec"]["template"]["spec"].update(
        terminationGracePeriodSeconds=30), wiring_problems),
    "unread variable": ("Deployment", "gateway", lambda d: _container(d)["env"].append(
        {"name": "TANDEM_NO_SUCH_FLAG", "value": "1"}), wiring_problems),
    "engine flag on the gateway": ("Deployment", "gateway", lambda d: _container(d)["env"].append(
        {"name": "TANDEM_NUM_BLOCKS", "value": "8"}), wiring_problems),
    "ranks without their CPUs": ("Deployment", "decode", lambda d: _container(d)["env"].extend(
        [{"name": "TANDEM_TENSOR_PARALLEL_SIZE", "value": "3"}, {"name": "TANDEM_KERNEL_THREADS", "value": "2"}]),
        wiring_problems),
    "ranks without kernel threads": ("Deployment", "prefill", lambda d: _container(d)["env"].append(
        {"name": "TANDEM_TENSOR_PARALLEL_SIZE", "value": "3"}), wiring_problems),
    "PDB selecting nothing": ("PodDisruptionBudget", "decode", lambda p: p["spec"]["selector"]["matchLabels"].update(
        {"app.kubernetes.io/component": "decoder"}), wiring_problems),
    "HPA on a missing Deployment": ("HorizontalPodAutoscaler", "prefill", lambda h: h["spec"]["scaleTargetRef"].update(
        name="prefiller"), wiring_problems),
    "HPA on the wrong metric": ("HorizontalPodAutoscaler", "decode", lambda h: h["spec"]["metrics"][0]["pods"]["metric"]
                                .update(name="tandem_num_requests_waiting"), wiring_problems),
}  # fmt: skip


@pytest.mark.parametrize("breakage", BREAKAGES)
def test_checks_catch_broken_manifests(breakage):
    kind, name, change, check = BREAKAGES[breakage]
    objects = render("autoscaling")
    assert check(objects) == []
    if breakage == "engine flag on the gateway" and help_env()["gateway"] is None:
        pytest.skip("the services do not name their TANDEM_<FLAG> variables in --help yet")
    assert check(_edit(objects, kind, name, change)), f"{breakage} went unreported"
