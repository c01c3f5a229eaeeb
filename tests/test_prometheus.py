"""A real Prometheus (Debian's prometheus package) scraping a real worker and router on loopback,
as the chart's monitors have it scrape pods: the KEDA triggers' queries, rendered by the chart,
return a value; every series the external-metrics HPA, the Grafana dashboard and the Gateway API
mapping of docs/observability.md name has data; the vLLM-named series keep their colons.
Without a prometheus binary these tests are skipped, saying so."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from worker_process import REPO, WorkerProcess, free_port, module_command, python_path

PROMETHEUS = shutil.which("prometheus")
pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(PROMETHEUS is None, reason="needs a prometheus binary on PATH "
                                 "(Debian: apt-get install prometheus)")]

CHART = REPO / "helm" / "pagedserve"
RELEASE, NAMESPACE = "demo", "serving"
# The labels a ServiceMonitor or PodMonitor gives each pod's series: the chart's queries select by them.
WORKER_POD, ROUTER_POD = f"{RELEASE}-pagedserve-worker-0", f"{RELEASE}-pagedserve-router-5d9f8-x2x7q"
SCRAPE_INTERVAL_S = 1
TIMEOUT_S = 60


class Prometheus:
    """`prometheus` on a free loopback port, scraping `targets` (address -> labels) every
    second, with its storage in a temporary folder; its log is shown when it fails to start."""

    def __init__(self, targets: dict[str, dict[str, str]]) -> None:
        self._dir = tempfile.TemporaryDirectory()
        config = Path(self._dir.name) / "prometheus.yml"
        config.write_text(yaml.safe_dump({
            "global": {"scrape_interval": f"{SCRAPE_INTERVAL_S}s", "evaluation_interval": f"{SCRAPE_INTERVAL_S}s"},
            "scrape_configs": [{"job_name": labels["job"], "static_configs": [{"targets": [address], "labels": {
                name: value for name, value in labels.items() if name != "job"}}]}
                for address, labels in targets.items()]}))
        self.url = f"http://127.0.0.1:{free_port()}"
        self._log = open(Path(self._dir.name) / "prometheus.log", "w+")
        self.process = subprocess.Popen(
            [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={self._dir.name}/data",
             f"--web.listen-address={self.url.removeprefix('http://')}"],
            stdout=self._log, stderr=subprocess.STDOUT)

    def query(self, expr: str) -> list[dict]:
        """The instant vector `expr` evaluates to now (Prometheus' HTTP API)."""
        url = f"{self.url}/api/v1/query?{urllib.parse.urlencode({'query': expr})}"
        with urllib.request.urlopen(url, timeout=10) as reply:
            answer = json.load(reply)
        assert answer["status"] == "success", answer
        assert answer["data"]["resultType"] == "vector", answer
        return answer["data"]["result"]

    def wait_for(self, expr: str, what: str) -> list[dict]:
        """Polls `expr` until it has a series; fails with Prometheus' log after TIMEOUT_S."""
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            assert self.process.poll() is None, f"prometheus exited:\n{self.log()}"
            try:
                if result := self.query(expr):
                    return result
            except OSError:
                pass    # not listening yet
            assert time.monotonic() < deadline, f"{what}: no series for {expr} in {TIMEOUT_S} s:\n{self.log()}"
            time.sleep(0.5)

    def log(self) -> str:
        self._log.seek(0)
        return self._log.read()[-4000:]

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        self._log.close()
        self._dir.cleanup()


class RouterProcess:
    """`pagedserve serve --role router` in front of one worker, ready once its HTTP /health says so."""

    def __init__(self, worker_address: str) -> None:
        self.http_port, self.metrics_port = free_port(), free_port()
        self.process = subprocess.Popen(
            module_command("launcher.cli", "serve", "--role", "router", "--host", "127.0.0.1",
                           "--port", str(free_port()), "--http-port", str(self.http_port),
                           "--metrics-port", str(self.metrics_port), "--workers", worker_address),
            cwd=REPO, env={**os.environ, "PYTHONPATH": python_path()},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + TIMEOUT_S
        while not self._ready():
            assert self.process.poll() is None and time.monotonic() < deadline, "the router did not get ready"
            time.sleep(0.2)

    def _ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}/health", timeout=2):
                return True
        except OSError:
            return False

    def complete(self, prompt: str) -> None:
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.http_port}/v1/completions", headers={"Content-Type": "application/json"},
            data=json.dumps({"prompt": prompt, "max_tokens": 8, "temperature": 0}).encode())
        with urllib.request.urlopen(request, timeout=TIMEOUT_S) as reply:
            assert json.load(reply)["choices"][0]["text"]

    def close(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def prometheus() -> Iterator[Prometheus]:
    """Prometheus with a sample of a worker and a router after they served a few requests, and
    enough samples since for rate() over a minute."""
    metrics_port = free_port()
    with WorkerProcess(["--model", "default", "--device", "cpu", "--dtype", "float32",
                        "--metrics-port", str(metrics_port)]) as worker:
        router = RouterProcess(worker.address)
        server = None
        try:
            for prompt in ("The capital of France is", "def fibonacci(n):", "Once upon a time,"):
                router.complete(prompt)
            server = Prometheus({
                f"127.0.0.1:{metrics_port}": {"job": "worker", "namespace": NAMESPACE, "pod": WORKER_POD},
                f"127.0.0.1:{router.metrics_port}": {"job": "router", "namespace": NAMESPACE, "pod": ROUTER_POD}})
            server.wait_for('count(up == 1) == 2', "both targets scraped")
            router.complete("1, 2, 3, 4,")      # traffic between scrapes: rates of it are above 0
            server.wait_for('count_over_time(up{job="worker"}[1m]) >= 3', "three scrapes")
            yield server
        finally:
            if server is not None:
                server.close()
            router.close()


def render(values_file: str) -> list[dict]:
    import helm_python as helm
    values = yaml.safe_load((CHART / "ci" / values_file).read_text())
    with helm.Chart.load(CHART) as chart:
        manifests = chart.render(values=values, name=RELEASE, namespace=NAMESPACE)
    return [doc for path, text in manifests.items() if path.endswith(".yaml")
            for doc in yaml.safe_load_all(text) if doc]


def series_names(text: str) -> set[str]:
    """The pagedserve_ and vllm: series names in PromQL or Markdown text."""
    return set(re.findall(r"\b(pagedserve_[a-z0-9_]+|vllm:[a-z0-9_]+)", text))


def test_the_keda_triggers_queries_return_a_value(prometheus):
    [scaled] = [o for o in render("keda-values.yaml") if o["kind"] == "ScaledObject"]
    for trigger in scaled["spec"]["triggers"]:
        [sample] = prometheus.query(trigger["metadata"]["query"])
        assert float(sample["value"][1]) >= 0, trigger["metadata"]["query"]


def test_the_external_metrics_the_hpa_scales_on_have_the_workers_series(prometheus):
    [hpa] = [o for o in render("pvc-init-values.yaml") if o["kind"] == "HorizontalPodAutoscaler"]
    for metric in hpa["spec"]["metrics"]:
        name = metric["external"]["metric"]["name"]
        assert prometheus.query(f'{name}{{namespace="{NAMESPACE}",pod="{WORKER_POD}"}}'), name


def test_every_dashboard_query_returns_data(prometheus):
    """Each panel's query as Grafana sends it with every model selected, over a minute."""
    dashboard = json.loads((CHART / "dashboards" / "pagedserve.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel.get("targets", ())]
    assert exprs
    empty = [expr for expr in exprs
             if not prometheus.query(expr.replace("$model", ".*").replace("$__rate_interval", "1m"))]
    assert not empty, empty


def test_every_series_the_gateway_api_mapping_names_has_data(prometheus):
    docs = (REPO / "docs" / "observability.md").read_text()
    section = docs.split("### Gateway API Inference Extension", 1)[1].split("\n## ", 1)[0]
    names = series_names(section)
    assert {"vllm:num_requests_waiting", "pagedserve_worker_kv_cache_usage_ratio"} <= names
    missing = [name for name in sorted(names) if not prometheus.query(f'{{__name__="{name}"}}')]
    assert not missing, missing


def test_vllm_names_keep_their_colons_through_a_real_scrape(prometheus):
    assert prometheus.query('{__name__="vllm:num_requests_running", pod="%s"}' % WORKER_POD)
    assert not prometheus.query('{__name__=~"vllm_.+"}')
