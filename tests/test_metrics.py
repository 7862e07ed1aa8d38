"""Prometheus metrics from every node agent, and stragglers named while the job runs."""

from __future__ import annotations

import http.server
import json
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from harness.metrics import PREFIX, Exporter, Source, metric_names
from tests.conftest import REPO, free_port, harness, training_job

DASHBOARD = REPO / "manifests" / "monitoring" / "grafana-dashboard.json"
# Counts, not seconds: windows of 10 steps after the 5 calibration steps close five windows in 60 steps on
# any machine. The scraped campaign's rank 0 stalls 10 s at STALL_STEP (--inject-failure ...:stall), so the
# run is still training while it is scraped however fast the machine trains.
MAX_STEPS = 60
WINDOW = "10steps"
STALL_STEP = 20


def _scrape(port: int) -> dict:
    """name -> family, or {} while nothing answers."""
    try:
        text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    except OSError:
        return {}
    return {family.name: family for family in text_string_to_metric_families(text)}


def _events(result: Path) -> list[dict]:
    return [json.loads(line.split(":::MLLOG ", 1)[1]) for line in result.read_text().splitlines()
            if ":::MLLOG " in line]


@pytest.fixture(scope="module")
def scraped_campaign(tmp_path_factory):
    """`harness run resnet` with metrics on, scraped all through its run."""
    out = tmp_path_factory.mktemp("metrics") / "run"
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "harness", "run", "resnet", "--seed", "11",
                             "--max-steps", str(MAX_STEPS), "--straggler-window", WINDOW, "--metrics-port", str(port),
                             "--inject-failure", f"0:{STALL_STEP}:stall", "--out", str(out)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "HARNESS_METRICS_TTL_S": "1"})
    scrapes = []
    while proc.poll() is None:
        families = _scrape(port)
        if families:
            scrapes.append(families)
        time.sleep(0.5)
    stdout, stderr = proc.communicate()
    return out, scrapes, proc.returncode, stdout + stderr


def _samples(families: dict, name: str) -> list:
    family = families.get(name)
    return family.samples if family else []


def test_metrics_are_served_while_the_run_trains_and_agree_with_its_log(scraped_campaign):
    out, scrapes, code, output = scraped_campaign
    assert code in (0, 1), output  # MAX_STEPS steps need not reach the target
    assert scrapes, f"no scrape of /metrics answered during the run: {output}"
    training = [f for f in scrapes if any(s.value == 1 and s.labels["state"] == "training"
                                          for s in _samples(f, PREFIX + "state"))]
    assert training, "no scrape saw a rank training"
    stalled = [f for f in training if any(s.value == STALL_STEP for s in _samples(f, PREFIX + "train_step"))]
    assert stalled, "no scrape saw the step the run stalled at"
    last = scrapes[-1]
    steps = {s.labels["rank"]: s.value for s in _samples(last, PREFIX + "train_step")}
    assert set(steps) == {"0", "1"} and all(0 < v <= MAX_STEPS for v in steps.values())
    assert all(s.value == 0 for s in _samples(last, PREFIX + "restarts"))  # no failure, no restart
    logged = {e["value"] for r in out.glob("result_*.txt") for e in _events(r) if e["key"] == "eval_accuracy"}
    quality = [s.value for s in _samples(last, PREFIX + "eval_quality")]
    assert quality and set(quality) <= logged
    counts = [s.value for s in _samples(last, PREFIX + "step_seconds") if s.name.endswith("_count")]
    assert counts and all(c > 0 for c in counts)
    assert any(s.value > 0 for s in _samples(last, PREFIX + "goodput_seconds"))
    assert "harness: metrics: http://" in output


def test_the_logs_and_results_are_the_same_with_metrics_off(scraped_campaign, tmp_path):
    out, _, _, _ = scraped_campaign
    plain = tmp_path / "plain"
    result = harness("run", "resnet", "--seed", "11", "--max-steps", str(MAX_STEPS),
                     "--straggler-window", WINDOW, "--metrics-port", "0", "--out", str(plain))
    assert result.returncode in (0, 1), result.stderr
    assert "harness: metrics:" not in result.stdout + result.stderr
    with_metrics, without = (_events(folder / "result_0.txt") for folder in (out, plain))
    assert [e["key"] for e in with_metrics] == [e["key"] for e in without]
    assert not (plain / "prometheus-targets.json").exists()


def test_the_dashboard_queries_only_metrics_a_scrape_has(scraped_campaign):
    _, scrapes, _, _ = scraped_campaign
    dashboard = json.loads(DASHBOARD.read_text())
    queried = {name for panel in dashboard["panels"] for target in panel["targets"]
               for name in re.findall(r"\bmlperf_harness_\w+", target["expr"])}
    assert queried and queried <= set(metric_names())
    scraped = {sample.name for families in scrapes for family in families.values() for sample in family.samples}
    scraped |= {name for families in scrapes for name in families}  # families the run had no value for
    exposed = {n.removesuffix("_total").removesuffix("_bucket").removesuffix("_sum").removesuffix("_count")
               for n in queried}
    assert exposed <= scraped, exposed - scraped
    dcgm = {name for panel in dashboard["panels"] for target in panel["targets"]
            for name in re.findall(r"\bDCGM_FI_\w+", target["expr"])}
    assert dcgm == {"DCGM_FI_DEV_GPU_UTIL", "DCGM_FI_DEV_POWER_USAGE", "DCGM_FI_DEV_XID_ERRORS"}


def test_a_clean_run_names_no_straggler(scraped_campaign):
    out, scrapes, _, _ = scraped_campaign
    windows = [json.loads(line) for line in (out / "run_0.jsonl").read_text().splitlines()
               if '"stragglers"' in line]
    assert [w["window_steps"] for w in windows] == [10] * 5
    report = json.loads(harness("report", str(out), "--format", "json").stdout)
    assert all(not run["stragglers"] for group in report for run in group["runs"])


@pytest.mark.slow
def test_a_slow_rank_is_named_while_the_job_runs_and_in_the_report(tmp_path):
    out = tmp_path / "run"
    # Slowed from step 3, 5-step windows from step 6: the third slow window in a row closes at step 20.
    result = harness("run", "resnet", "--max-steps", "25", "--straggler-window", "5steps",
                     "--inject-failure", "1:3:slow",
                     "--metrics-port", "0", "--out", str(out))
    assert result.returncode in (0, 1), result.stderr
    assert re.search(r"straggler: rank 1 on \S+ computes at 0\.\d\d of the fastest rank's speed", result.stdout)
    (group,) = json.loads(harness("report", str(out), "--format", "json").stdout)
    (named,) = group["runs"][0]["stragglers"]
    assert named["rank"] == 1 and named["score"] < 0.75
    table = harness("report", str(out)).stdout
    assert "rank 1" in table


def test_a_pushgateway_receives_the_nodes_metrics(tmp_path):
    pushed = []

    class Gateway(http.server.BaseHTTPRequestHandler):
        def do_PUT(self):
            pushed.append((self.path, self.rfile.read(int(self.headers["Content-Length"])).decode()))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Gateway)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    feeds = tmp_path / "feeds"
    feeds.mkdir()
    (feeds / "rank_0.json").write_text(json.dumps({"rank": 0, "run": 0, "state": "training", "step": 7}))
    try:
        exporter = Exporter(Source(tmp_path, feeds, "job-a", "resnet", "node-1"), free_port(),
                            pushgateway=f"http://127.0.0.1:{server.server_port}")
        exporter.close()  # the final push
    finally:
        server.shutdown()
    ((path, body),) = pushed
    assert path == "/metrics/job/mlperf-harness-job-a/node/node-1"
    families = {f.name: f for f in text_string_to_metric_families(body)}
    (step,) = families[PREFIX + "train_step"].samples
    assert step.value == 7 and step.labels["node"] == "node-1"


def test_kubernetes_pods_expose_the_metrics_port_and_a_pod_monitor_scrapes_it(tmp_path):
    args = ("resnet", "--backend", "k8s", "--profile", "coreweave-h100", "--nodes", "2", "--out", str(tmp_path / "o"))
    job = training_job(harness("run", *args, "--dry-run").stdout)
    for replica in job["spec"]["pytorchReplicaSpecs"].values():
        (container,) = replica["template"]["spec"]["containers"]
        assert container["ports"] == [{"containerPort": 9410, "name": "metrics"}]
        assert "--metrics-port" in container["args"]
    monitor = yaml.safe_load(harness("run", *args, "--pod-monitor").stdout)
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1" and monitor["kind"] == "PodMonitor"
    # Each run's job has a name of its own: without --name every resnet job's pods are scraped, with it that job's
    assert monitor["spec"]["selector"]["matchLabels"] == {"app.kubernetes.io/name": "mlperf-harness",
                                                          "mlperf-harness/benchmark": "resnet"}
    named = yaml.safe_load(harness("run", *args, "--pod-monitor", "--name", "rn").stdout)
    assert named["spec"]["selector"]["matchLabels"] == {"training.kubeflow.org/job-name": "rn"}
    assert monitor["spec"]["podMetricsEndpoints"][0]["port"] == "metrics"
    off = harness("run", *args, "--pod-monitor", "--metrics-port", "0")
    assert off.returncode == 2 and "--pod-monitor needs metrics" in off.stderr
    slurm = harness("run", "resnet", "--backend", "slurm", "--pod-monitor")
    assert slurm.returncode == 2 and "prometheus-targets/*.json" in slurm.stderr


def test_the_training_pods_scrape_the_preflight_verdicts_that_stayed_on_the_submitting_side(tmp_path, monkeypatch):
    """Kubernetes: preflight.json is written where `harness run` runs, not in the training job's folder on the
    volume; the verdicts of the nodes training may use reach the pods in their environment, and a pod's scrape
    shows what a local run's scrape shows from preflight.json: one series per check (every GPU's ECC at once)."""
    from harness import preflight, profiles
    from harness.health import at_most, skipped
    from harness.launchers import get_launcher
    from harness.remediation import without_excluded
    from harness.spec import JobSpec
    from tests.test_preflight import _report

    here = tmp_path / "run"  # the submitting side's run folder
    for node, busbw in (("gpu-a", 470), ("gpu-b", 120), ("gpu-c", 480)):
        _report(here, node, busbw)
    report = here / "preflight" / "nodes" / "gpu-a.json"
    node = json.loads(report.read_text())
    node["checks"] += [at_most("ecc_uncorrected", 0, 0, where=f"gpu {i}").to_dict() for i in range(2)]
    node["checks"].append(skipped("ib_port_state", "no InfiniBand device").to_dict())
    report.write_text(json.dumps(node))
    record = preflight.decide(here, ["gpu-a", "gpu-b", "gpu-c"], 1)
    spec = JobSpec("resnet", nodes=1, spare_nodes=1, preflight=True, out_dir=here,
                   profile=profiles.load("h100-ib")).resolved()
    body = get_launcher("k8s").render(without_excluded(spec, record)).payload["body"]
    (container,) = body["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["containers"]
    handed = {e["name"]: e.get("value") for e in container["env"]}[preflight.VERDICTS_ENV]
    monkeypatch.setenv(preflight.VERDICTS_ENV, handed)
    pod_folder, feeds = tmp_path / "pvc" / "run-token", tmp_path / "feeds"
    pod_folder.mkdir(parents=True)
    feeds.mkdir()

    def verdicts(out: Path, node: str) -> dict:
        exporter = Exporter(Source(out, feeds, "job-a", "resnet", node), free_port())
        try:
            family = _scrape(exporter.port)[PREFIX + "preflight_passed"]
        finally:
            exporter.close()
        assert all(s.labels["node"] == node for s in family.samples)
        return {s.labels["check"]: s.value for s in family.samples}

    assert verdicts(pod_folder, "gpu-a") == {"allreduce_busbw": 1.0, "ecc_uncorrected": 1.0, "pair_busbw": 1.0}
    assert verdicts(pod_folder, "gpu-a") == verdicts(here, "gpu-a")  # a local run reads preflight.json itself
    assert verdicts(pod_folder, "gpu-c") == {"allreduce_busbw": 1.0, "pair_busbw": 1.0}
    assert verdicts(pod_folder, "gpu-b") == {}  # kept out: no training pod lands there
    assert verdicts(here, "gpu-b") == {"allreduce_busbw": 0.0, "pair_busbw": 1.0}
    assert len(handed) < 300  # one character per check per node: 448 nodes fit one environment variable
