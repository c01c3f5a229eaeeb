"""The Helm chart (helm/pagedserve), rendered by Helm's own engine (the helm-python-sdk package
binds Helm's Go library): `helm lint --strict` and the Kubernetes schema for the default values
and every value set in ci/, then what the rendered objects must say — GPUs, probes, discovery,
draining, budgets, secrets, the network policy, security, autoscaling — and that the chart's
engine and router defaults are the code's own."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import re
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

import grpc
import helm_python as helm
import jsonschema
import kubernetes_validate
import pytest
import yaml
from cloudcoil.models.keda.v1alpha1 import ScaledObject
from cloudcoil.models.prometheus_operator.v1 import PodMonitor, ServiceMonitor
from prometheus_client.parser import text_string_to_metric_families

from common.pb import worker_pb2, worker_pb2_grpc
from launcher import cli
from router.discovery import parse_target
from worker.config import EngineConfig
from worker.flags import engine_config_from_args
from worker_process import REPO, WorkerProcess, free_port, submit

CHART = REPO / "helm" / "pagedserve"
CI_VALUES = sorted((CHART / "ci").glob("*-values.yaml"))
RELEASE, NAMESPACE = "demo", "serving"
# The oldest Kubernetes the chart supports (Chart.yaml kubeVersion) and the newest schema known.
KUBERNETES_VERSIONS = ("1.27.0", kubernetes_validate.latest_version())
# Custom resources, checked against models generated from their projects' CRD schemas.
CUSTOM_RESOURCES = {"ScaledObject": ScaledObject, "ServiceMonitor": ServiceMonitor, "PodMonitor": PodMonitor}


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART) as loaded:
        yield loaded


@pytest.fixture(scope="module")
def defaults(chart) -> list[dict]:
    """The objects of the default values."""
    return render(chart)


def render(chart, values: dict | None = None) -> list[dict]:
    """Every object the chart renders with these values (NOTES.txt left out)."""
    manifests = chart.render(values=values, name=RELEASE, namespace=NAMESPACE)
    return [doc for path, text in sorted(manifests.items()) if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def ci(name: str) -> dict:
    """A value set of ci/."""
    return yaml.safe_load((CHART / "ci" / name).read_text())


def one(objects: list[dict], kind: str) -> dict:
    found = [o for o in objects if o["kind"] == kind]
    assert len(found) == 1, f"{len(found)} objects of kind {kind}"
    return found[0]


def workload(objects: list[dict], component: str) -> dict:
    kind = "StatefulSet" if component == "worker" else "Deployment"
    return one(objects, kind)


def container(objects: list[dict], component: str) -> dict:
    return workload(objects, component)["spec"]["template"]["spec"]["containers"][0]


def flags(args: list[str]) -> dict[str, str | bool]:
    """--name=value and --switch arguments as a dict."""
    parsed: dict[str, str | bool] = {}
    for arg in args:
        name, equals, value = arg.removeprefix("--").partition("=")
        parsed[name] = value if equals else True
    return parsed


def env_of(c: dict) -> dict[str, dict]:
    return {e["name"]: e for e in c.get("env", [])}


def matches(selector: dict, labels: dict) -> bool:
    return all(labels.get(key) == value for key, value in selector.items())


# The default values (None) and each value set of ci/, by name.
VALUE_SETS = [pytest.param(None, id="default")] + [pytest.param(p.name, id=p.name) for p in CI_VALUES]


def load(name: str | None) -> dict | None:
    return ci(name) if name else None


# ------------------------------------------------------------------------- lint and schemas

def test_ci_value_sets_cover_the_required_cases():
    names = {p.name for p in CI_VALUES}
    assert {"gpu2-tp2-values.yaml", "monitoring-values.yaml", "keda-values.yaml",
            "existing-pvc-values.yaml", "existing-secret-values.yaml"} <= names


@pytest.mark.parametrize("values_file", VALUE_SETS)
def test_helm_lint_strict_passes(values_file):
    report = helm.lint(CHART, load(values_file), strict=True, namespace=NAMESPACE)
    problems = [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]
    assert not problems, problems


@pytest.mark.parametrize("values_file", VALUE_SETS)
def test_every_object_validates_against_its_schema(chart, values_file):
    objects = render(chart, load(values_file))
    assert objects
    for obj in objects:
        model = CUSTOM_RESOURCES.get(obj["kind"])
        if model is not None:
            # The models ignore unknown fields: a field lost in the round trip is unknown to the CRD.
            parsed = model.model_validate(obj).model_dump(by_alias=True, exclude_none=True, mode="json")
            assert parsed == obj, f"{obj['kind']} {obj['metadata']['name']} has fields its CRD lacks"
            continue
        for version in KUBERNETES_VERSIONS:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.ValidationError as error:
                raise AssertionError(f"{obj['kind']} {obj['metadata']['name']} (Kubernetes {version}): "
                                     f"{error.message} at {list(error.path)}") from None


def test_every_value_is_commented():
    """Each key of values.yaml has a comment on its line or on the line above (entries of the
    example lists excepted)."""
    lines = (CHART / "values.yaml").read_text().splitlines()
    for number, line in enumerate(lines):
        stripped = line.strip()
        if not stripped or stripped.startswith("#") or _in_list(lines, number):
            continue
        above = lines[number - 1].strip() if number else ""
        assert "#" in line or above.startswith("#"), f"values.yaml:{number + 1} has no comment: {line}"


def _in_list(lines: list[str], number: int) -> bool:
    """Whether the line is part of an entry of a YAML list (a list item or a key inside one)."""
    indent = len(lines[number]) - len(lines[number].lstrip())
    for k in range(number, -1, -1):
        text = lines[k]
        if not text.strip() or text.strip().startswith("#"):
            continue
        k_indent = len(text) - len(text.lstrip())
        if text.lstrip().startswith("- ") and k_indent <= indent:
            return True
        if k_indent < indent:
            indent = k_indent
        if k_indent == 0 and k < number:
            return False
    return False


def test_schema_rejects_wrong_types_and_unknown_keys_naming_them(chart):
    with pytest.raises(helm.HelmValuesError) as wrong_type:
        render(chart, {"worker": {"engine": {"maxNumSeqs": "many"}}})
    assert "/worker/engine/maxNumSeqs" in str(wrong_type.value)
    assert "got string, want integer" in str(wrong_type.value)
    with pytest.raises(helm.HelmValuesError) as unknown:
        render(chart, {"worker": {"engine": {"maxNumBatchedToken": 4096}}})
    assert "at '/worker/engine': additional properties 'maxNumBatchedToken' not allowed" in str(unknown.value)
    with pytest.raises(helm.HelmValuesError) as choice:
        render(chart, {"worker": {"engine": {"blockSize": 12}}})
    assert "/worker/engine/blockSize" in str(choice.value) and "value must be one of" in str(choice.value)


@pytest.mark.parametrize("values, message", [
    ({"model": {"initContainer": {"enabled": True, "image": {"repository": "m"}}}},
     "model.initContainer.enabled needs a volume"),
    ({"model": {"path": "/models/m", "volume": {"type": "emptyDir"}, "initContainer": {"enabled": True}}},
     "model.initContainer.image.repository is empty"),
    ({"model": {"path": "/weights/x", "volume": {"type": "hostPath", "hostPath": "/srv"}}},
     'model.path "/weights/x" is outside model.mountPath'),
    ({"model": {"path": "/models/x", "volume": {"type": "existingClaim"}}},
     "needs model.volume.existingClaim"),
    ({"router": {"apiKey": {"value": "k", "existingSecret": "s"}}}, "not both"),
    ({"metrics": {"serviceMonitor": {"enabled": True}, "podMonitor": {"enabled": True}}},
     "serviceMonitor or podMonitor, not both"),
    ({"tls": {"enabled": True}}, "tls.enabled needs tls.secretName"),
    ({"router": {"gateway": {"enabled": True}}}, "router.gateway.enabled needs router.gateway.parentRefs"),
    ({"model": {"path": "/models-old/x", "volume": {"type": "hostPath", "hostPath": "/srv"}}},
     'model.path "/models-old/x" is outside model.mountPath'),
    ({"lora": {"modules": {"sql": "/adapters/sql"}}}, "lora.modules needs lora.enabled: true"),
    ({"worker": {"metricsPort": 50061}}, "worker.port, worker.metricsPort must differ"),
    ({"router": {"metricsPort": 8000}}, "router.grpcPort, router.httpPort and router.metricsPort must differ"),
    ({"worker": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
     "worker.autoscaling.minReplicas (5) is above maxReplicas (2)"),
    ({"router": {"autoscaling": {"enabled": True, "minReplicas": 5, "maxReplicas": 2}}},
     "router.autoscaling.minReplicas (5) is above maxReplicas (2)"),
])
def test_inconsistent_values_fail_saying_what_to_change(chart, values, message):
    with pytest.raises(helm.HelmRenderError, match=re.escape(message)):
        render(chart, values)


# ------------------------------------------------------------------------- defaults = the code's

# worker.engine's keys and the EngineConfig fields they set, with a value other than the default.
ENGINE_VALUES = {
    "dtype": ("dtype", "bfloat16"), "quantization": ("quantization", "fp8"),
    "kvCacheDtype": ("kv_cache_dtype", "fp8"),
    "tensorParallelSize": ("tensor_parallel_size", 2),
    "gpuMemoryUtilization": ("gpu_memory_utilization", 0.5),
    "maxNumSeqs": ("max_num_seqs", 8), "maxNumBatchedTokens": ("max_num_batched_tokens", 512),
    "longPrefillTokenThreshold": ("long_prefill_token_threshold", 256),
    "maxModelLen": ("max_model_len", 1024), "blockSize": ("block_size", 32),
    "swapSpace": ("swap_space_gb", 2.5), "preemptionMode": ("preemption_mode", "recompute"),
    "enablePrefixCaching": ("enable_prefix_caching", False),
    "schedulingPolicy": ("scheduling_policy", "priority"),
    "enforceEager": ("enforce_eager", True), "asyncScheduling": ("async_scheduling", False),
    "engineStallTimeout": ("stall_timeout_s", 0.0),
}


def _engine_config(objects: list[dict]) -> EngineConfig:
    """The EngineConfig the worker makes of its rendered flags, parsed by its own parser."""
    args = container(objects, "worker")["args"]
    return engine_config_from_args(cli._serve_parser().parse_args(["--role", "worker", *args]))


def test_chart_engine_defaults_are_the_engines(defaults):
    objects, values = defaults, yaml.safe_load((CHART / "values.yaml").read_text())
    engine_defaults = EngineConfig(model="default")
    assert set(values["worker"]["engine"]) == set(ENGINE_VALUES), "a worker.engine key has no test"
    for key, (field, _) in ENGINE_VALUES.items():
        chart_default, engine_default = values["worker"]["engine"][key], getattr(engine_defaults, field)
        assert chart_default == engine_default, (f"worker.engine.{key} is {chart_default!r} but "
                                                 f"EngineConfig.{field} defaults to {engine_default!r}")
    assert values["model"]["loadFormat"] == engine_defaults.load_format
    # And the worker the chart runs makes exactly that config.
    assert _engine_config(objects) == engine_defaults


def test_integers_of_a_million_and_more_reach_the_flags_as_integers(chart):
    """Helm holds the numbers of a values file as floats and prints 1e6 and above as 1e+06,
    which an integer flag refuses (the pod would crash-loop)."""
    objects = render(chart, {"worker": {"engine": {"maxModelLen": 1048576, "maxNumBatchedTokens": 1000000}},
                             "router": {"maxConcurrentRequests": 1000000, "maxQueueLen": 2000000}})
    worker, router = flags(container(objects, "worker")["args"]), flags(container(objects, "router")["args"])
    assert (worker["max-model-len"], worker["max-num-batched-tokens"]) == ("1048576", "1000000")
    assert (router["max-concurrent-requests"], router["max-queue-len"]) == ("1000000", "2000000")


@pytest.mark.parametrize("release", ["production-llama-3-1-8b-instruct-east", "a" * 52, "b" * 63])
def test_long_release_names_give_names_kubernetes_accepts_and_no_two_services_alike(chart, release):
    objects = [o for o in (yaml.safe_load(t) for path, t in chart.render(name=release, namespace=NAMESPACE).items()
                           if path.endswith(".yaml")) if o]
    names = {(o["kind"], o["metadata"]["name"]) for o in objects}
    # A StatefulSet's pods carry its name plus an 11-character hash in a label (63 at most).
    assert all(len(name) <= 52 for kind, name in names if kind == "StatefulSet"), names
    assert all(len(name) <= 63 for kind, name in names if kind in ("Service", "Deployment")), names
    services = [name for kind, name in names if kind == "Service"]
    assert len(services) == len(set(services)) == 2


@pytest.mark.parametrize("key", ENGINE_VALUES)
def test_each_engine_value_reaches_the_engine(chart, key):
    field, value = ENGINE_VALUES[key]
    config = _engine_config(render(chart, {"worker": {"engine": {key: value}}}))
    assert config == dataclasses.replace(EngineConfig(model="default"), **{field: value})


def test_chart_router_defaults_are_the_routers(defaults):
    args = container(defaults, "router")["args"]
    rendered = cli._serve_parser().parse_args(["--role", "router", *args])
    own = cli._serve_parser().parse_args(["--role", "router"])
    for name in ("max_concurrent_requests", "max_queue_len", "max_queue_wait", "overcommit",
                 "migrate_on_preemption", "worker_timeout", "discovery_interval", "shutdown_grace",
                 "allowed_origins"):
        assert getattr(rendered, name) == getattr(own, name), name


# ------------------------------------------------------------------------- workers

@pytest.mark.parametrize("values, gpus", [
    (None, 1),
    ({"worker": {"engine": {"tensorParallelSize": 2}}}, 2),
    ({"worker": {"engine": {"tensorParallelSize": 4}, "resources": {"limits": {"nvidia.com/gpu": 8}}}}, 8),
])
def test_worker_gpus_follow_tensor_parallel_size(chart, values, gpus):
    worker = container(render(chart, values), "worker")
    assert worker["resources"]["limits"]["nvidia.com/gpu"] == gpus
    assert flags(worker["args"])["tensor-parallel-size"] == str(
        (values or {}).get("worker", {}).get("engine", {}).get("tensorParallelSize", 1))


def test_gpu2_tp2_value_set(chart):
    objects = render(chart, ci("gpu2-tp2-values.yaml"))
    spec = workload(objects, "worker")["spec"]
    assert spec["replicas"] == 2
    pod = spec["template"]["spec"]
    assert pod["containers"][0]["resources"]["limits"]["nvidia.com/gpu"] == 2
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-H200"}
    spread = pod["topologySpreadConstraints"][0]
    assert matches(spread["labelSelector"]["matchLabels"], spec["template"]["metadata"]["labels"])
    shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
    assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": "16Gi"}


@pytest.mark.parametrize("values_file", VALUE_SETS)
def test_probe_ports_are_container_ports(chart, values_file):
    objects = render(chart, load(values_file))
    for kind in ("StatefulSet", "Deployment"):
        for c in one(objects, kind)["spec"]["template"]["spec"]["containers"]:
            ports = {p["name"] for p in c["ports"]} | {p["containerPort"] for p in c["ports"]}
            for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
                if probe in c:
                    handler = next(v for k, v in c[probe].items() if k in ("grpc", "httpGet", "tcpSocket"))
                    assert handler["port"] in ports, f"{kind} {probe} port {handler['port']} not in {ports}"
    # And every Service's targetPorts are ports of the pods it selects.
    for service in (o for o in objects if o["kind"] == "Service"):
        pods = [o["spec"]["template"] for o in objects if o["kind"] in ("StatefulSet", "Deployment")
                and matches(service["spec"]["selector"], o["spec"]["template"]["metadata"]["labels"])]
        assert len(pods) == 1, service["metadata"]["name"]
        names = {p["name"] for c in pods[0]["spec"]["containers"] for p in c["ports"]}
        assert {p["targetPort"] for p in service["spec"]["ports"]} <= names


def test_worker_probes_are_grpc_health_with_a_startup_long_enough_to_load(chart):
    worker = container(render(chart, {"worker": {"startupTimeoutSeconds": 3600}}), "worker")
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert "grpc" in worker[probe]
    startup = worker["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 3600


def test_router_discovery_target_is_the_workers_headless_service(defaults):
    objects = defaults
    target = flags(container(objects, "router")["args"])["workers"]
    assert target.startswith("dns:")
    host, _, port = target.removeprefix("dns:").rpartition(":")
    name, namespace, *_ = host.split(".")
    assert namespace == NAMESPACE and host.endswith(".svc.cluster.local")
    service = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == name)
    assert service["spec"]["clusterIP"] == "None"
    assert service["spec"]["publishNotReadyAddresses"] is False
    statefulset = workload(objects, "worker")
    assert statefulset["spec"]["serviceName"] == name
    assert matches(service["spec"]["selector"], statefulset["spec"]["template"]["metadata"]["labels"])
    worker_ports = {p["containerPort"] for p in container(objects, "worker")["ports"] if p["name"] == "grpc"}
    assert worker_ports == {int(port)}


def test_routers_can_find_the_workers_through_the_endpoint_slices_of_their_service(chart):
    objects = render(chart, ci("kubernetes-discovery-values.yaml"))
    target = parse_target(flags(container(objects, "router")["args"])["workers"])
    service, namespace = target.host.split(".")
    assert target.scheme == "k8s" and namespace == NAMESPACE
    headless = next(o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == service)
    assert headless["spec"]["clusterIP"] == "None"
    assert workload(objects, "worker")["spec"]["serviceName"] == service
    assert target.port == next(p["containerPort"] for p in container(objects, "worker")["ports"] if p["name"] == "grpc")


def test_endpoint_slice_discovery_may_list_endpoint_slices_and_nothing_else(chart):
    objects = render(chart, ci("kubernetes-discovery-values.yaml"))
    role, binding = one(objects, "Role"), one(objects, "RoleBinding")
    assert role["rules"] == [{"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"], "verbs": ["list"]}]
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role",
                                  "name": role["metadata"]["name"]}
    pod = workload(objects, "router")["spec"]["template"]["spec"]
    account = one(objects, "ServiceAccount")["metadata"]["name"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": account, "namespace": NAMESPACE}]
    assert pod["serviceAccountName"] == account and pod["automountServiceAccountToken"] is True
    # The workers get no token still.
    assert workload(objects, "worker")["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_endpoint_slice_discovery_binds_a_service_account_of_yours(chart):
    objects = render(chart, {"router": {"discoveryMode": "kubernetes", "serviceAccountName": "llm-router"}})
    assert not [o for o in objects if o["kind"] == "ServiceAccount"]
    assert one(objects, "RoleBinding")["subjects"][0]["name"] == "llm-router"
    assert workload(objects, "router")["spec"]["template"]["spec"]["serviceAccountName"] == "llm-router"


def test_dns_discovery_needs_no_kubernetes_api_access(defaults):
    assert not [o for o in defaults if o["kind"] in ("ServiceAccount", "Role", "RoleBinding")]
    assert workload(defaults, "router")["spec"]["template"]["spec"]["automountServiceAccountToken"] is False


def test_stopping_drains_within_the_grace_period(chart):
    """A worker's drain is its answer to SIGTERM, which the kubelet sends: no preStop hook, and
    a grace period covering the hand-back (5 s) and the exit. A router serves on through its
    preStop sleep, then lets requests finish for --shutdown-grace: its grace covers both."""
    objects = render(chart, {"worker": {"terminationMarginSeconds": 40},
                             "router": {"preStopSleepSeconds": 7, "shutdownGrace": 20}})
    worker_pod = workload(objects, "worker")["spec"]["template"]["spec"]
    assert "lifecycle" not in worker_pod["containers"][0]
    assert worker_pod["terminationGracePeriodSeconds"] == 5 + 40
    router_pod = workload(objects, "router")["spec"]["template"]["spec"]
    router = router_pod["containers"][0]
    assert router["lifecycle"]["preStop"]["exec"]["command"] == ["sleep", "7"]
    assert float(flags(router["args"])["shutdown-grace"]) == 20
    assert router_pod["terminationGracePeriodSeconds"] >= 7 + 20


@pytest.mark.parametrize("values_file", VALUE_SETS)
def test_pod_disruption_budgets_cover_each_component(chart, values_file):
    objects = render(chart, load(values_file))
    budgets = [o for o in objects if o["kind"] == "PodDisruptionBudget"]
    assert len(budgets) == 2
    for component in ("router", "worker"):
        labels = workload(objects, component)["spec"]["template"]["metadata"]["labels"]
        [budget] = [b for b in budgets if matches(b["spec"]["selector"]["matchLabels"], labels)]
        assert budget["spec"]["maxUnavailable"] == 1


def test_budgets_can_be_turned_off(chart):
    objects = render(chart, {"worker": {"pdb": {"enabled": False}}, "router": {"pdb": {"enabled": False}}})
    assert not [o for o in objects if o["kind"] == "PodDisruptionBudget"]


def test_model_from_an_existing_claim_is_mounted_read_only(chart):
    objects = render(chart, ci("existing-pvc-values.yaml"))
    pod = workload(objects, "worker")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "model")
    assert volume["persistentVolumeClaim"] == {"claimName": "llama-weights"}
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "model")
    assert mount == {"name": "model", "mountPath": "/models", "readOnly": True}
    assert flags(pod["containers"][0]["args"])["model"] == "/models/llama-3.1-8b-instruct"
    assert flags(container(objects, "router")["args"])["served-model-name"] == "llama-3.1-8b-instruct"


def test_model_on_a_claim_per_worker_is_filled_by_the_init_container(chart):
    statefulset = workload(render(chart, ci("pvc-init-values.yaml")), "worker")
    [claim] = statefulset["spec"]["volumeClaimTemplates"]
    assert claim["metadata"]["name"] == "model"
    assert claim["spec"]["resources"]["requests"]["storage"] == "40Gi"
    assert claim["spec"]["storageClassName"] == "fast-ssd"
    [init] = statefulset["spec"]["template"]["spec"]["initContainers"]
    assert init["image"] == "registry.example.com/models/qwen2-7b:2024-06"
    assert {"name": "model", "mountPath": "/models"} in init["volumeMounts"]


def test_model_from_a_host_path(chart):
    pod = workload(render(chart, ci("hostpath-values.yaml")), "worker")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "model")
    assert volume["hostPath"] == {"path": "/srv/models", "type": "Directory"}


def test_lora_values_reach_the_engine_and_mount_the_adapters(chart):
    objects = render(chart, ci("lora-values.yaml"))
    config = _engine_config(objects)
    assert (config.enable_lora, config.max_loras, config.max_lora_rank) == (True, 8, 64)
    assert config.lora_modules == {"sql": "/adapters/sql-lora", "poet": "/adapters/poet"}
    pod = workload(objects, "worker")["spec"]["template"]["spec"]
    volume = next(v for v in pod["volumes"] if v["name"] == "lora-adapters")
    assert volume["persistentVolumeClaim"] == {"claimName": "lora-adapters", "readOnly": True}
    mount = next(m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "lora-adapters")
    assert mount == {"name": "lora-adapters", "mountPath": "/adapters", "readOnly": True}


def test_lora_is_off_by_default(defaults):
    assert not _engine_config(defaults).enable_lora


def init_script(chart, model_path: str) -> list[str]:
    objects = render(chart, {"model": {"path": model_path, "volume": {"type": "emptyDir"},
                                       "initContainer": {"enabled": True, "image": {"repository": "m"}}}})
    [init] = workload(objects, "worker")["spec"]["template"]["spec"]["initContainers"]
    return init["command"]


def run_init(command: list[str], source, mount, model_path, pod: str = "worker-0") -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "MODEL_PATH": str(model_path), "MOUNT_PATH": str(mount),
           "SOURCE_PATH": str(source), "HOSTNAME": pod}
    return subprocess.run(command, env=env, capture_output=True, text=True)


def model_image(tmp_path):
    """An image's model folder (sourcePath) holding the files themselves, and an empty volume."""
    source, mount = tmp_path / "image" / "model", tmp_path / "volume"
    source.mkdir(parents=True)
    (source / "config.json").write_text("{}")
    (source / "model.safetensors").write_text("weights")
    mount.mkdir()
    return source, mount


def test_init_container_copies_the_model_folder_to_model_path_once(chart, tmp_path):
    """The init container's default script, run here with sh: sourcePath's files become
    model.path's, and the next start finds them there and leaves them."""
    source, mount = model_image(tmp_path)
    command = init_script(chart, "/models/m")
    first = run_init(command, source, mount, mount / "m")
    assert first.returncode == 0, first.stderr
    assert sorted(p.name for p in (mount / "m").iterdir()) == ["config.json", "model.safetensors"]
    assert sorted(p.name for p in mount.iterdir()) == ["m"]
    second = run_init(command, source, mount, mount / "m")
    assert second.returncode == 0 and "model present" in second.stdout


def test_init_container_fills_the_volume_root_when_the_model_is_there(chart, tmp_path):
    """Even on a new ext4 volume, whose root holds lost+found."""
    source, mount = model_image(tmp_path)
    (mount / "lost+found").mkdir()
    done = run_init(init_script(chart, "/models"), source, mount, mount)
    assert done.returncode == 0, done.stderr
    assert sorted(p.name for p in mount.iterdir()) == ["config.json", "lost+found", "model.safetensors"]


def test_init_container_copies_a_gguf_file_to_model_path(chart, tmp_path):
    mount = tmp_path / "volume"
    mount.mkdir()
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    done = run_init(init_script(chart, "/models/m/model.gguf"), tmp_path / "model.gguf", mount,
                    mount / "m" / "model.gguf")
    assert done.returncode == 0, done.stderr
    assert (mount / "m" / "model.gguf").read_bytes() == b"GGUF"


def test_init_containers_of_workers_sharing_a_volume_copy_once_and_both_succeed(chart, tmp_path):
    source, mount = model_image(tmp_path)
    for i in range(40):      # large enough that the copies overlap
        (source / f"shard-{i}.safetensors").write_bytes(bytes(200_000))
    env = {"PATH": "/usr/bin:/bin", "MODEL_PATH": str(mount / "m"), "MOUNT_PATH": str(mount), "SOURCE_PATH": str(source)}
    runs = [subprocess.Popen(init_script(chart, "/models/m"), env=env | {"HOSTNAME": f"worker-{i}"},
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(3)]
    results = [(run.wait(), *run.communicate()) for run in runs]
    assert all(code == 0 for code, _, _ in results), results
    assert sorted(p.name for p in (mount / "m").iterdir()) == sorted(p.name for p in source.iterdir())
    assert sorted(p.name for p in mount.iterdir()) == ["m"]


# ------------------------------------------------------------------------- routers

def test_api_key_from_a_secret_the_chart_makes(chart):
    objects = render(chart, {"router": {"apiKey": {"value": "s3cret"}}})
    secret = one(objects, "Secret")
    ref = env_of(container(objects, "router"))["PAGEDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": secret["metadata"]["name"], "key": "api-key"}
    assert secret["data"]["api-key"] == "czNjcmV0"      # base64 of s3cret
    assert "s3cret" not in json.dumps(workload(objects, "router"))


def test_api_key_from_an_existing_secret(chart):
    objects = render(chart, ci("existing-secret-values.yaml"))
    assert not [o for o in objects if o["kind"] == "Secret"]
    ref = env_of(container(objects, "router"))["PAGEDSERVE_API_KEY"]["valueFrom"]["secretKeyRef"]
    assert ref == {"name": "pagedserve-api-key", "key": "token"}
    # Its Ingress leads to the routers' HTTP port.
    backend = one(objects, "Ingress")["spec"]["rules"][0]["http"]["paths"][0]["backend"]["service"]
    [routers] = [o for o in objects if o["kind"] == "Service"
                 and o["metadata"]["labels"]["app.kubernetes.io/component"] == "router"]
    assert backend == {"name": routers["metadata"]["name"], "port": {"name": "http"}}


def test_no_api_key_by_default(defaults):
    objects = defaults
    assert "PAGEDSERVE_API_KEY" not in env_of(container(objects, "router"))
    assert not [o for o in objects if o["kind"] == "Secret"]


# Routes from a Gateway (Gateway API v1), HTTP and gRPC.
GATEWAY = {"enabled": True, "parentRefs": [{"name": "public", "namespace": "gateway-system", "sectionName": "https"}],
           "hostnames": ["llm.example.com"], "paths": ["/v1"], "requestTimeout": "0s", "grpc": True}


def _backend_port_name(objects: list[dict], backend: dict) -> str:
    """The routers' container port a route's backendRef reaches through their Service."""
    [service] = [o for o in objects if o["kind"] == "Service" and o["metadata"]["name"] == backend["name"]]
    assert matches(service["spec"]["selector"], workload(objects, "router")["spec"]["template"]["metadata"]["labels"])
    [port] = [p for p in service["spec"]["ports"] if p["port"] == backend["port"]]
    return port["targetPort"]


def test_gateway_routes_pass_helm_lint_strict():
    report = helm.lint(CHART, {"router": {"gateway": GATEWAY}}, strict=True, namespace=NAMESPACE)
    assert not [m for m in report["messages"] if m["severity"] >= 2] + report["errors"]


def test_http_route_leads_the_gateways_paths_to_the_routers_http_port(chart):
    objects = render(chart, {"router": {"gateway": GATEWAY}})
    route = one(objects, "HTTPRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == GATEWAY["parentRefs"]
    assert route["spec"]["hostnames"] == ["llm.example.com"]
    [rule] = route["spec"]["rules"]
    assert rule["matches"] == [{"path": {"type": "PathPrefix", "value": "/v1"}}]
    assert rule["timeouts"] == {"request": "0s"}
    [backend] = rule["backendRefs"]
    assert _backend_port_name(objects, backend) == "http"


def test_grpc_route_leads_to_the_routers_grpc_port(chart):
    objects = render(chart, {"router": {"gateway": GATEWAY}})
    route = one(objects, "GRPCRoute")
    assert route["apiVersion"] == "gateway.networking.k8s.io/v1"
    assert route["spec"]["parentRefs"] == GATEWAY["parentRefs"]
    [rule] = route["spec"]["rules"]
    assert "matches" not in rule        # every service: pagedserve.v1, health and reflection
    [backend] = rule["backendRefs"]
    assert _backend_port_name(objects, backend) == "grpc"


def test_no_gateway_routes_unless_asked(chart, defaults):
    assert not [o for o in defaults if o["kind"] in ("HTTPRoute", "GRPCRoute")]
    http_only = render(chart, {"router": {"gateway": {**GATEWAY, "grpc": False, "requestTimeout": ""}}})
    assert [o["kind"] for o in http_only if o["kind"] in ("HTTPRoute", "GRPCRoute")] == ["HTTPRoute"]
    assert "timeouts" not in one(http_only, "HTTPRoute")["spec"]["rules"][0]


def test_router_scales_on_cpu(chart):
    hpa = one(render(chart, {"router": {"autoscaling": {"enabled": True}}}), "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "Deployment"
    assert hpa["spec"]["metrics"][0]["resource"]["name"] == "cpu"


# ------------------------------------------------------------------------- security

def _tls_files(objects: list[dict], component: str) -> dict[str, str]:
    """The component's TLS flags that name a file, each checked to lie in its mounted Secret."""
    pod = workload(objects, component)["spec"]["template"]["spec"]
    [volume] = [v for v in pod["volumes"] if v["name"] == "tls"]
    [mount] = [m for m in pod["containers"][0]["volumeMounts"] if m["name"] == "tls"]
    assert volume["secret"]["secretName"] == "pagedserve-internal-tls" and mount["readOnly"] is True
    files = {name: value for name, value in flags(pod["containers"][0]["args"]).items()
             if name.endswith("-file")}
    for path in files.values():
        directory, _, file = path.rpartition("/")
        assert directory == mount["mountPath"] and file in ("tls.crt", "tls.key", "ca.crt"), path
    return files


def test_mutual_tls_gives_both_sides_the_secrets_files(chart):
    objects = render(chart, ci("tls-values.yaml"))
    assert {name: path.rpartition("/")[2] for name, path in _tls_files(objects, "worker").items()} == {
        "tls-cert-file": "tls.crt", "tls-key-file": "tls.key", "tls-client-ca-file": "ca.crt"}
    assert {name: path.rpartition("/")[2] for name, path in _tls_files(objects, "router").items()} == {
        "worker-tls-ca-file": "ca.crt", "worker-tls-cert-file": "tls.crt", "worker-tls-key-file": "tls.key"}
    # The flags are what the CLI accepts of each role, pairs complete.
    for component in ("worker", "router"):
        args = cli._serve_parser().parse_args(["--role", component, *container(objects, component)["args"]])
        cli._check_tls_flags(args, cli._serve_parser())


def test_routers_check_the_workers_certificate_for_their_services_name(chart):
    objects = render(chart, ci("tls-values.yaml"))
    name = flags(container(objects, "router")["args"])["worker-tls-server-name"]
    service = flags(container(objects, "router")["args"])["workers"].removeprefix("dns:").rpartition(":")[0]
    assert name == f"{RELEASE}-pagedserve-workers.{NAMESPACE}.svc" and service.startswith(name + ".")
    custom = render(chart, {"tls": {"enabled": True, "secretName": "s", "serverName": "workers.internal"}})
    assert flags(container(custom, "router")["args"])["worker-tls-server-name"] == "workers.internal"


def test_tls_without_mutual_leaves_routers_without_a_certificate(chart):
    objects = render(chart, {"tls": {"enabled": True, "secretName": "pagedserve-internal-tls", "mutual": False}})
    assert set(_tls_files(objects, "worker")) == {"tls-cert-file", "tls-key-file"}
    assert set(_tls_files(objects, "router")) == {"worker-tls-ca-file"}


def test_with_tls_the_probes_ask_the_plaintext_health_port(chart):
    """The kubelet's gRPC probes speak no TLS: the worker serves health alone on a port of its own."""
    worker = container(render(chart, ci("tls-values.yaml")), "worker")
    health_port = int(flags(worker["args"])["health-port"])
    assert {"name": "health", "containerPort": health_port} in worker["ports"]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert worker[probe]["grpc"]["port"] == health_port
    # Without TLS there is no such port: the probes ask the worker port itself.
    plain = container(render(chart), "worker")
    assert "health-port" not in flags(plain["args"]) and "health" not in {p["name"] for p in plain["ports"]}


def test_only_router_pods_reach_the_workers_port(defaults):
    objects = defaults
    policy = one(objects, "NetworkPolicy")
    worker_labels = workload(objects, "worker")["spec"]["template"]["metadata"]["labels"]
    router_labels = workload(objects, "router")["spec"]["template"]["metadata"]["labels"]
    assert matches(policy["spec"]["podSelector"]["matchLabels"], worker_labels)
    grpc_rules = [r for r in policy["spec"]["ingress"] if any(p["port"] == "grpc" for p in r["ports"])]
    assert len(grpc_rules) == 1 and len(grpc_rules[0]["from"]) == 1
    peer = grpc_rules[0]["from"][0]
    assert set(peer) == {"podSelector"} and matches(peer["podSelector"]["matchLabels"], router_labels)
    assert not matches(peer["podSelector"]["matchLabels"], worker_labels)
    # The other rule opens only the metrics port.
    others = [r for r in policy["spec"]["ingress"] if r not in grpc_rules]
    assert [p["port"] for r in others for p in r["ports"]] == ["metrics"]


@pytest.mark.parametrize("values_file", VALUE_SETS)
def test_containers_run_as_non_root_on_a_read_only_root(chart, values_file):
    objects = render(chart, load(values_file))
    for kind in ("StatefulSet", "Deployment"):
        pod = one(objects, kind)["spec"]["template"]["spec"]
        assert pod["securityContext"]["runAsNonRoot"] is True
        # No token, except for routers that ask the Kubernetes API for the workers' endpoints.
        api_discovery = kind == "Deployment" and values_file == "kubernetes-discovery-values.yaml"
        assert pod["automountServiceAccountToken"] is api_discovery
        for c in pod["containers"] + pod.get("initContainers", []):
            assert c["securityContext"]["allowPrivilegeEscalation"] is False
            assert c["securityContext"]["readOnlyRootFilesystem"] is True
            assert c["securityContext"]["capabilities"]["drop"] == ["ALL"]
            assert "/tmp" in {m["mountPath"] for m in c["volumeMounts"]}


def test_otel_resource_attributes_carry_the_pods_identity(chart):
    objects = render(chart, ci("monitoring-values.yaml"))
    for component in ("router", "worker"):
        names = [e["name"] for e in container(objects, component)["env"]]
        by_name = env_of(container(objects, component))
        assert by_name["POD_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"
        assert by_name["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
        attributes = dict(a.split("=", 1) for a in by_name["OTEL_RESOURCE_ATTRIBUTES"]["value"].split(","))
        assert attributes["k8s.pod.name"] == "$(POD_NAME)" == attributes["service.instance.id"]
        assert attributes["k8s.namespace.name"] == "$(POD_NAMESPACE)"
        assert attributes["deployment.environment"] == "staging"
        # $(VAR) references only expand to variables defined earlier in the list.
        assert names.index("POD_NAME") < names.index("OTEL_RESOURCE_ATTRIBUTES")
        assert by_name["OTEL_SERVICE_NAME"]["value"] == f"pagedserve-{component}"
        assert by_name["OTEL_EXPORTER_OTLP_ENDPOINT"]["value"] == "http://otel-collector.monitoring.svc:4317"


def test_monitors_scrape_each_components_metrics_port(chart):
    for kind, values in (("ServiceMonitor", "serviceMonitor"), ("PodMonitor", "podMonitor")):
        objects = render(chart, {"metrics": {values: {"enabled": True, "labels": {"release": "kps"}}}})
        monitors = [o for o in objects if o["kind"] == kind]
        assert len(monitors) == 2
        for monitor in monitors:
            assert monitor["metadata"]["labels"]["release"] == "kps"
            endpoints = monitor["spec"].get("endpoints") or monitor["spec"]["podMetricsEndpoints"]
            assert [e["port"] for e in endpoints] == ["metrics"]


# ------------------------------------------------------------------------- worker autoscaling

def test_keda_scales_the_worker_statefulset_on_queue_depth(chart):
    objects = render(chart, ci("keda-values.yaml"))
    scaled = one(objects, "ScaledObject")
    statefulset = workload(objects, "worker")
    assert "replicas" not in statefulset["spec"]          # the autoscaler owns it
    assert scaled["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "StatefulSet",
                                                "name": statefulset["metadata"]["name"]}
    assert scaled["spec"]["minReplicaCount"] == 1
    down = scaled["spec"]["advanced"]["horizontalPodAutoscalerConfig"]["behavior"]["scaleDown"]
    assert down["policies"] == [{"type": "Pods", "value": 1, "periodSeconds": 60}]
    queries = [t["metadata"]["query"] for t in scaled["spec"]["triggers"]]
    assert any("pagedserve_worker_requests_waiting" in q for q in queries)
    assert any("pagedserve_worker_kv_cache_usage_ratio" in q for q in queries)
    pods = f'pod=~"{statefulset["metadata"]["name"]}-[0-9]+"'
    for query in queries:
        assert f'namespace="{NAMESPACE}"' in query and pods in query


def keda_scaled_object_schema() -> dict:
    """The openAPIV3Schema of KEDA's own ScaledObject CRD (tests/crds, vendored from KEDA)."""
    crd = yaml.safe_load((Path(__file__).parent / "crds" / "keda.sh_scaledobjects.yaml").read_text())
    return next(v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1")["schema"]["openAPIV3Schema"]


def test_the_scaled_object_validates_against_kedas_own_crd_schema(chart):
    jsonschema.validate(one(render(chart, ci("keda-values.yaml")), "ScaledObject"), keda_scaled_object_schema())


def test_kedas_crd_schema_refuses_a_scaled_object_of_a_wrong_type(chart):
    scaled = one(render(chart, ci("keda-values.yaml")), "ScaledObject")
    scaled["spec"]["minReplicaCount"] = "one"
    with pytest.raises(jsonschema.ValidationError, match="'one' is not of type 'integer'"):
        jsonschema.validate(scaled, keda_scaled_object_schema())


def test_workers_scale_on_external_metrics_without_keda(chart):
    objects = render(chart, ci("pvc-init-values.yaml"))
    hpa = one(objects, "HorizontalPodAutoscaler")
    assert hpa["spec"]["scaleTargetRef"]["kind"] == "StatefulSet"
    assert {m["external"]["metric"]["name"] for m in hpa["spec"]["metrics"]} == {
        "pagedserve_worker_requests_waiting", "pagedserve_worker_kv_cache_usage_ratio"}


def _metric_names(query: str) -> set[str]:
    return set(re.findall(r"\b(pagedserve_[a-z_]+|vllm:[a-z_]+)\{", query))


@pytest.mark.slow
def test_autoscaling_metrics_exist_in_a_real_workers_metrics(chart):
    """Every series the KEDA triggers and the external-metrics HPA name is in a worker's /metrics."""
    wanted = set()
    scaled = one(render(chart, ci("keda-values.yaml")), "ScaledObject")
    for trigger in scaled["spec"]["triggers"]:
        wanted |= _metric_names(trigger["metadata"]["query"])
    hpa = one(render(chart, ci("pvc-init-values.yaml")), "HorizontalPodAutoscaler")
    wanted |= {m["external"]["metric"]["name"] for m in hpa["spec"]["metrics"]}
    metrics_port = free_port()
    with WorkerProcess(["--model", "default", "--device", "cpu", "--dtype", "float32",
                        "--metrics-port", str(metrics_port)]):
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/metrics", timeout=10) as reply:
            exposition = reply.read().decode()
    names = {family.name for family in text_string_to_metric_families(exposition)}
    assert wanted and wanted <= names, wanted - names


@pytest.mark.slow
def test_a_worker_stops_within_the_charts_grace_period(defaults):
    """SIGTERM, as the kubelet sends it, to a worker in the middle of requests: it drains (ends
    its sessions; routers re-dispatch what it held) and exits with 0 before the chart's grace
    period ends, so that Kubernetes never has to kill it."""
    grace = workload(defaults, "worker")["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
    worker = WorkerProcess(["--model", "default", "--device", "cpu", "--dtype", "float32"])
    with worker:
        async def session() -> float:
            """Streams four long requests; signals the worker at their first step; returns when."""
            outbox: asyncio.Queue = asyncio.Queue()
            for message in [worker_pb2.RouterMessage(hello=worker_pb2.Hello(router_id="test")),
                            *(submit(f"r{i}", [1, 2, 3, 4], max_tokens=2000) for i in range(4))]:
                outbox.put_nowait(message)

            async def requests():
                while (message := await outbox.get()) is not None:
                    yield message

            signalled = None
            async with grpc.aio.insecure_channel(worker.address) as channel:
                async for message in worker_pb2_grpc.WorkerStub(channel).Session(requests()):
                    if message.WhichOneof("kind") == "step" and signalled is None:
                        worker.process.send_signal(signal.SIGTERM)
                        signalled = time.monotonic()
            outbox.put_nowait(None)
            return signalled

        signalled = asyncio.run(asyncio.wait_for(session(), 120))
        code = worker.process.wait(timeout=grace)
        elapsed = time.monotonic() - signalled
    assert code == 0 and elapsed < grace, f"exit {code} after {elapsed:.1f} s (grace {grace} s)"


def test_the_schema_allows_exactly_the_engines_quantization_methods_and_kv_cache_dtypes():
    from worker.config import KV_CACHE_DTYPES, QUANTIZATION_METHODS
    schema = json.loads((CHART / "values.schema.json").read_text())
    engine = schema["properties"]["worker"]["properties"]["engine"]["properties"]
    assert engine["quantization"]["enum"] == list(QUANTIZATION_METHODS)
    assert engine["kvCacheDtype"]["enum"] == list(KV_CACHE_DTYPES)
