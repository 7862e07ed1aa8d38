"""Preflight: node checks against fake NVML and sysfs readings, the verdicts, the table, the JSON and the report."""

from __future__ import annotations

import re
from pathlib import Path

import jsonschema
import pytest

from harness.health import FAIL, NO_THRESHOLD, PASS, SKIPPED
from harness.health.allreduce import pair_rounds
from harness.health.gpu import nvml_checks
from harness.health.ib import ib_checks, nccl_selects
from harness.health.thresholds import resolve
from tests.conftest import free_port


class FakeNVML:
    """The pynvml functions the checks call, over a list of fake GPUs."""

    NVML_MEMORY_ERROR_TYPE_UNCORRECTED, NVML_VOLATILE_ECC, NVML_TEMPERATURE_GPU = 1, 0, 0
    nvmlClocksThrottleReasonHwSlowdown, nvmlClocksThrottleReasonSwThermalSlowdown = 0x8, 0x20
    nvmlClocksThrottleReasonHwThermalSlowdown, nvmlClocksThrottleReasonHwPowerBrakeSlowdown = 0x40, 0x80

    class NVMLError(Exception):
        pass

    class NVMLError_NotSupported(NVMLError):
        pass

    def __init__(self, count=8, **gpu):
        self.gpus = [{**dict(name="NVIDIA H100 80GB HBM3", ecc=0, rows=(0, 0, 0, 0), throttle=0, temp=40,
                             pcie=(5, 16)), **gpu} for _ in range(count)]

    def nvmlDeviceGetCount(self):
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, i):
        return self.gpus[i]

    def nvmlDeviceGetName(self, h):
        return h["name"]

    def nvmlDeviceGetTotalEccErrors(self, h, kind, counter):
        return h["ecc"]

    def nvmlDeviceGetRemappedRows(self, h):
        return h["rows"]

    def nvmlDeviceGetRetiredPagesPendingStatus(self, h):
        raise self.NVMLError_NotSupported()

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, h):
        return h["throttle"]

    def nvmlDeviceGetTemperature(self, h, sensor):
        return h["temp"]

    def nvmlDeviceGetHandleByUUID(self, uuid):
        index = int(uuid.removeprefix("GPU-"))
        if index >= len(self.gpus):
            raise self.NVMLError("not found")
        return self.gpus[index]

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h):
        return h["pcie"][0]

    def nvmlDeviceGetCurrPcieLinkWidth(self, h):
        return h["pcie"][1]


H100 = resolve({"gpu_model": "H100"}, "NVIDIA H100 80GB HBM3")


def _verdicts(checks, name):
    return [c.verdict for c in checks if c.name == name]


def test_a_healthy_h100_node_passes_every_nvml_check():
    checks = nvml_checks(FakeNVML(), 8, H100)
    assert {c.verdict for c in checks} == {PASS}
    # The PCIe link is not read here, at idle, where it drops to a lower generation: under_load reads it.
    assert {"gpu_count", "gpu_model", "ecc_uncorrected", "remapped_rows", "throttle", "temperature"} == {
        c.name for c in checks}


def test_the_pcie_link_is_read_by_uuid_and_judged_against_the_model():
    """under_load reads each GPU's link while its matmul runs (an idle link downshifts); CUDA's device i is found in
    NVML by its UUID, since the two number GPUs differently."""
    from harness.health.gpu import link_of, pcie_link

    nvml = FakeNVML(count=2)
    nvml.gpus[1]["pcie"] = (3, 8)
    assert link_of(nvml, "GPU-1") == (3, 8) and link_of(nvml, "GPU-9") is None and link_of(None, "GPU-1") is None
    assert pcie_link("gpu 0", link_of(nvml, "GPU-0"), H100).verdict == PASS
    slow = pcie_link("gpu 1", link_of(nvml, "GPU-1"), H100)
    assert (slow.verdict, slow.measured, slow.threshold) == (FAIL, "gen3 x8", ">= gen5 x16")
    assert pcie_link("gpu 1", None, H100).note == "not reported"
    assert pcie_link("gpu 1", (5, 16), resolve({}, "NVIDIA GB200")).note == "no threshold"


@pytest.mark.parametrize("name, matmul, allreduce, pair", [
    ("NVIDIA H100 80GB HBM3", 594, 460.0, 40.0), ("NVIDIA H200", 594, 460.0, 40.0),  # HGX boards
    ("NVIDIA H100 PCIe", 454, None, None), ("NVIDIA H100 NVL", 501, None, None),  # PCIe cards: no NVSwitch
    ("NVIDIA B200", 1350, None, 40.0), (" NVIDIA B200 ", 1350, None, 40.0),
    ("NVIDIA H100", None, None, None), ("NVIDIA H200 NVL", None, None, None), ("NVIDIA GB200", None, None, None)])
def test_thresholds_follow_the_exact_model_never_a_substring(name, matmul, allreduce, pair):
    """Each model its own row: an H100 PCIe or NVL has "H100" in its name but neither the SXM's speed nor its
    NVSwitch, so it never gets the SXM's thresholds (which would fail every such node); a model without a row gets
    none (its checks are skipped and say so)."""
    th = resolve({}, name)
    assert (th["min_matmul_tflops"], th["min_allreduce_busbw_gbps"], th["min_pair_busbw_gbps"]) == (matmul, allreduce,
                                                                                                  pair)
    assert th["min_pcie_gen"] == (5 if matmul else None)


def test_a_pcie_card_without_an_infiniband_figure_skips_the_rate_and_says_why(tmp_path):
    _port(tmp_path, "mlx5_0", rate="200 Gb/sec (4X HDR)")
    [rate] = [c for c in ib_checks(resolve({}, "NVIDIA H100 PCIe"), 1, tmp_path) if c.name == "ib_port_rate"]
    assert (rate.verdict, rate.note) == (SKIPPED, NO_THRESHOLD)
    [rate] = [c for c in ib_checks(resolve({"ib_rate_gbps": 0}, "NVIDIA H100 PCIe"), 1, tmp_path)
              if c.name == "ib_port_rate"]
    assert rate.note.startswith("any rate accepted")


def test_a_missing_gpu_fails_the_count_with_what_was_seen():
    [count] = [c for c in nvml_checks(FakeNVML(count=7), 8, H100) if c.name == "gpu_count"]
    assert (count.verdict, count.measured, count.threshold) == (FAIL, 7, "== 8")


@pytest.mark.parametrize("gpu, check", [(dict(ecc=3), "ecc_uncorrected"), (dict(rows=(0, 1, 1, 0)), "remapped_rows"),
                                        (dict(throttle=0x40), "throttle"), (dict(temp=91), "temperature")])
def test_each_nvml_reading_fails_its_own_check(gpu, check):
    checks = nvml_checks(FakeNVML(**gpu), 8, H100)
    assert {c.name for c in checks if c.verdict == FAIL} == {check}


def test_no_gpu_is_skipped_where_none_is_promised_and_failed_where_one_is():
    assert {c.verdict for c in nvml_checks(None, 0, resolve({}, None))} == {SKIPPED}
    assert all(c.note == "no GPU" for c in nvml_checks(None, 0, resolve({}, None)))
    [count] = nvml_checks(None, 8, H100)
    assert (count.name, count.verdict, count.measured) == ("gpu_count", FAIL, 0)


def _port(root: Path, hca: str, state="4: ACTIVE", rate="400 Gb/sec (4X NDR)", link_downed=0, number=1):
    port = root / hca / "ports" / str(number)
    (port / "counters").mkdir(parents=True)
    (port / "state").write_text(state + "\n")
    (port / "rate").write_text(rate + "\n")
    (port / "counters" / "link_downed").write_text(f"{link_downed}\n")
    (port / "counters" / "link_error_recovery").write_text("0\n")


EIGHT_NICS = ",".join(f"mlx5_{i}" for i in range(8))


@pytest.mark.parametrize("selection", [EIGHT_NICS, "=" + EIGHT_NICS, "^mlx5_8"])
def test_only_the_hcas_nccl_uses_are_judged(tmp_path, selection):
    """8 NDR ports that NCCL trains on and a 200 Gb/s front-end NIC beside them: no failure."""
    for i in range(8):
        _port(tmp_path, f"mlx5_{i}")
    _port(tmp_path, "mlx5_8", rate="200 Gb/sec (4X HDR)", state="1: DOWN")  # the front-end (or storage) NIC
    checks = ib_checks(H100, 8, tmp_path, selection)
    assert not [c for c in checks if c.verdict == FAIL], [c for c in checks if c.verdict == FAIL]
    assert {c.where for c in checks if c.name == "ib_port_state"} == {f"mlx5_{i}/1" for i in range(8)}
    unselected = {c.name for c in ib_checks(H100, 8, tmp_path, None) if c.where == "mlx5_8/1" and c.verdict == FAIL}
    assert unselected == {"ib_port_state", "ib_port_rate"}  # what every node failed before


def test_a_selection_by_port_leaves_an_uncabled_second_port_alone(tmp_path):
    for i in range(8):
        _port(tmp_path, f"mlx5_{i}")
    _port(tmp_path, "mlx5_0", state="1: DOWN", rate="10 Gb/sec (4X SDR)", number=2)  # never cabled
    checks = ib_checks(H100, 8, tmp_path, ",".join(f"mlx5_{i}:1" for i in range(8)))
    assert not [c for c in checks if c.verdict == FAIL] and "mlx5_0/2" not in {c.where for c in checks}


def test_nccl_reads_hca_names_as_prefixes_unless_exact():
    assert nccl_selects("mlx5", "mlx5_3", "1") and nccl_selects("ibp", "ibp0", "1")
    assert not nccl_selects("=mlx5", "mlx5_3", "1") and nccl_selects("=mlx5_3", "mlx5_3", "1")
    assert not nccl_selects("mlx5_0:1", "mlx5_0", "2") and not nccl_selects("^mlx5_8", "mlx5_8", "1")
    assert nccl_selects(None, "anything", "1") and nccl_selects("", "anything", "1")


def test_infiniband_ports_from_a_fake_sysfs(tmp_path):
    for i in range(7):
        _port(tmp_path, f"mlx5_{i}")
    _port(tmp_path, "mlx5_7", state="1: DOWN", rate="10 Gb/sec (4X SDR)", link_downed=9)
    checks = ib_checks(H100, 8, tmp_path)
    failed = {(c.name, c.where) for c in checks if c.verdict == FAIL}
    assert failed == {("ib_port_state", "mlx5_7/1"), ("ib_port_rate", "mlx5_7/1"), ("ib_link_errors", "mlx5_7/1"),
                      ("ib_ports", "")}
    [state] = [c for c in checks if c.name == "ib_port_state" and c.where == "mlx5_7/1"]
    assert state.measured == "DOWN" and state.threshold == "ACTIVE"
    assert ib_checks(H100, 8, tmp_path / "none")[0].note == "no InfiniBand ports found"
    assert ib_checks(resolve({}, None), 0, tmp_path / "none")[0].verdict == SKIPPED


def test_the_pair_rounds_meet_new_partners_and_stay_bounded():
    rounds = pair_rounds(448, 3)
    assert len(rounds) == 3 and all(len(r) == 224 for r in rounds)
    assert len({p for r in rounds for p in r}) == 672  # no pair twice
    for r in rounds:
        seen = [n for p in r for n in p]
        assert len(seen) == len(set(seen))  # every node in one pair per round
    assert pair_rounds(2, 3) == [[(0, 1)]]


def _report(out: Path, node: str, busbw: float, pairs: list | None = None) -> None:
    """A node's own report as harness.health writes it: an H100 node with one all-reduce measurement."""
    import json

    from harness.health import NODES_DIR, at_least

    th = resolve({}, "NVIDIA H100 80GB HBM3")
    checks = [at_least("allreduce_busbw", busbw, th["min_allreduce_busbw_gbps"], "GB/s", "8 GPUs, 16384 MiB")]
    path = out / NODES_DIR / f"{node}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"node": node, "started": 1.0, "gpu": "NVIDIA H100 80GB HBM3", "thresholds": th,
                                "checks": [c.to_dict() for c in checks],
                                "pairs": [{"peer": "peer", "gpu": 0, "busbw_gbps": 45.0}] if pairs is None else
                                [{"gpu": 0, **p} for p in pairs]}))


def test_the_json_the_table_and_the_report_agree(tmp_path):
    from harness import preflight
    from harness.report import preflight_notes

    _report(tmp_path, "a", 470, [{"peer": "b", "busbw_gbps": 45.0}, {"peer": "c", "busbw_gbps": 46.0}])
    _report(tmp_path, "b", 120, [{"peer": "a", "busbw_gbps": 45.0}, {"peer": "c", "busbw_gbps": 44.0}])
    _report(tmp_path, "c", 480, [{"peer": "a", "busbw_gbps": 12.0}, {"peer": "b", "busbw_gbps": 11.0}])
    record = preflight.decide(tmp_path, ["a", "b", "c", "d"], 1, max_marked_share=1.0)  # 3 of 4: not systemic here
    assert record == preflight.read(tmp_path)
    assert record["passed"] and record["kept"] == ["a"] and record["spare"] == []
    # b: slow inside; c: slow with every partner (its link), while a and b are slow only with c; d: no report.
    assert record["excluded"] == {"b": ["allreduce_busbw 120 GB/s < 460 (8 GPUs, 16384 MiB)"],
                                  "c": ["pair_busbw 11.5 GB/s < 40 (gpu 0: median with a, b)"],
                                  "d": ["health_report missing, expected written by the node: "
                                        "the node did not run or finish the checks"]}
    text = preflight.table(record)
    for node, verdict in record["nodes"].items():
        for check in verdict["checks"]:
            row = [line for line in text.splitlines() if line.split()[:2] == [node, check["name"]]]
            assert len(row) == 1 and row[0].endswith(check["verdict"]) and str(check["measured"]) in row[0]
    assert preflight_notes([tmp_path]) == [f"preflight: kept out {n}: {r[0]}" for n, r in record["excluded"].items()]
    too_few = preflight.decide(tmp_path, ["a", "b"], 2)
    assert not too_few["passed"] and "there is no spare node" in too_few["message"] and "b: allreduce_busbw" in \
        too_few["message"]


def test_preflight_time_is_never_one_clock_minus_another(tmp_path, monkeypatch):
    """The nodes' clocks are skewed (one an hour ahead, one an hour behind the decider's): the whole is the
    decider's own measure (run_health_job's monotonic time; the Slurm judge's boot clock since the batch script
    read it) and each node's figure its own end minus its own start. Subtracting a node's start from the
    decider's clock gave -3600 s or +3600 s here."""
    import json
    import time

    from harness import preflight

    for node, skew, took in (("a", 3600.0, 12.5), ("b", -3600.0, 20.0)):
        _report(tmp_path, node, 470, [{"peer": "b" if node == "a" else "a", "busbw_gbps": 45.0}])
        path = tmp_path / "preflight" / "nodes" / f"{node}.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "started": time.time() + skew, "seconds": took}))
    record = preflight.decide(tmp_path, ["a", "b"], 2, seconds=42.0)
    assert (record["seconds"], record["seconds_total"]) == (42.0, 42.0)
    assert {n: v["seconds"] for n, v in record["nodes"].items()} == {"a": 12.5, "b": 20.0}
    assert preflight.table(record).endswith("(42.0 s)")
    # A second pass (a requeued job's) adds its own; a judge told no start counts the slowest node's own time.
    assert preflight.decide(tmp_path, ["a", "b"], 2)["seconds"] == 20.0
    assert preflight.read(tmp_path)["seconds_total"] == 62.0
    # The Slurm judge: the batch script's /proc/uptime before the health step, the judge's at its verdict.
    monkeypatch.setattr(preflight, "boot_clock", lambda: 1042.5)
    assert preflight.main(["--out", str(tmp_path), "--nodes", "2", "--allocated", "a,b", "--began", "1000"]) == 0
    assert preflight.read(tmp_path)["seconds"] == 42.5
    # A batch script that could not read the clock hands over nothing: the allocation is judged all the same.
    assert preflight.main(["--out", str(tmp_path), "--nodes", "2", "--allocated", "a,b", "--began", ""]) == 0
    assert preflight.read(tmp_path)["seconds"] == 20.0


def test_the_slurm_judge_is_told_when_preflight_began_on_its_own_hosts_clock():
    """The batch script reads /proc/uptime before the health step and hands it to the judge, which runs on the
    same host (--nodelist the batch host) and reads the same clock (boot_clock) at its verdict."""
    import subprocess

    from harness import preflight, profiles
    from harness.launchers import get_launcher
    from harness.spec import JobSpec

    spec = JobSpec("gpt3", nodes=4, preflight=True, profile=profiles.load("coreweave-h100"),
                   out_dir=Path("/mnt/results/x")).resolved()
    lines = get_launcher("slurm").render(spec).text.splitlines()
    (stamp,) = [line for line in lines if line.startswith("preflight_began=")]
    (health,) = [i for i, line in enumerate(lines) if "-m harness.health" in line]
    (judge,) = [i for i, line in enumerate(lines) if "-m harness.preflight" in line]
    assert lines.index(stamp) < health < judge and '--began "${preflight_began}"' in lines[judge]
    began = float(subprocess.run(["bash", "-c", f'{stamp}; echo "$preflight_began"'], capture_output=True, text=True,
                                 check=True).stdout)
    assert 0 <= preflight.boot_clock() - began < 600  # one clock: read after, never before


def test_every_report_format_names_the_nodes_kept_out_and_why(tmp_path):
    import csv
    import html
    import io
    import json

    from harness import preflight
    from harness.report import render
    from harness.results import load
    from tests.test_results import write_run

    _report(tmp_path, "a", 470, [{"peer": "b", "busbw_gbps": 45.0}])
    _report(tmp_path, "b", 120, [{"peer": "a", "busbw_gbps": 45.0}])
    record = preflight.decide(tmp_path, ["a", "b"], 1)
    for i in range(2):
        write_run(tmp_path / f"result_{i}.txt", 1.0 + i, accuracy=0.76)
    results = load([tmp_path])
    why = "allreduce_busbw 120 GB/s < 460 (8 GPUs, 16384 MiB)"
    assert record["excluded"] == {"b": [why]}
    expected = [{"folder": str(tmp_path), "node": "b", "check": "allreduce_busbw", "measured": 120, "unit": "GB/s",
                 "threshold": ">= 460", "reason": why}]
    [group] = json.loads(render(results, "json"))
    assert group["kept_out"] == expected
    rows = list(csv.DictReader(io.StringIO(render(results, "csv"))))
    assert len(rows) == 2 and all(json.loads(row["kept_out"]) == expected for row in rows)
    markdown = render(results, "markdown").split("## Nodes kept out")[1]
    assert "| b " in markdown and why in markdown and ">= 460" in markdown
    page = render(results, "html").split("<h2>Nodes kept out</h2>")[1]
    assert "<td>b</td>" in page and html.escape(why) in page and html.escape(">= 460") in page
    (tmp_path / preflight.PREFLIGHT_FILE).unlink()  # no preflight: nothing kept out, no section
    assert json.loads(render(load([tmp_path]), "json"))[0]["kept_out"] == []
    assert "Nodes kept out" not in render(load([tmp_path]), "markdown")


def _failed_attempt(out: Path, b_signal: str) -> None:
    """Healthy reports for nodes a and b, and attempt 0 failed: a's rank stopped by SIGTERM (the peer of a failed
    rank), b's by `b_signal`."""
    import json

    for node in ("a", "b"):
        _report(out, node, 470)
    (out / "attempts.jsonl").write_text("".join(json.dumps(r) + "\n" for r in [
        {"event": "start", "attempt": 0, "node": "a"}, {"event": "start", "attempt": 0, "node": "b"},
        {"event": "end", "attempt": 0, "node": "a", "ok": False, "kind": "infrastructure", "signal": "SIGTERM",
         "cause": "rank 0 killed by SIGTERM"},
        {"event": "end", "attempt": 0, "node": "b", "ok": False, "kind": "infrastructure", "signal": b_signal,
         "cause": f"rank 1 killed by {b_signal}"}]))


def test_the_node_of_a_lost_rank_is_kept_out_of_the_next_attempt(tmp_path):
    from harness import preflight

    _failed_attempt(tmp_path, "SIGKILL")
    record = preflight.decide(tmp_path, ["a", "b"], 1, blame_failures=True)
    assert record["kept"] == ["a"] and record["excluded"] == {
        "b": ["training_failure rank 1 killed by SIGKILL, expected no failure in the last attempt"]}
    assert preflight.decide(tmp_path, ["a", "b"], 1)["spare"] == ["b"]  # without --blame-failures: both healthy


def test_a_requeued_job_judges_its_newest_attempt_even_when_no_node_ended_it(tmp_path):
    """Slurm killed the whole of attempt 1 (no agent recorded an end): nothing in it points at a node, and
    attempt 0's culprit (since repaired, and healthy in this preflight) is not blamed again."""
    import json

    from harness import preflight

    _failed_attempt(tmp_path, "SIGKILL")
    with open(tmp_path / "attempts.jsonl", "a") as f:
        f.write("".join(json.dumps({"event": "start", "attempt": 1, "node": node}) + "\n" for node in ("a", "b")))
    assert preflight.blamed_nodes(tmp_path) == {}
    assert list(preflight.blamed_nodes(tmp_path, attempt=0)) == ["b"]  # what the Kubernetes watcher names
    assert preflight.decide(tmp_path, ["a", "b"], 1, blame_failures=True)["excluded"] == {}


def test_the_node_of_a_persistent_straggler_is_kept_out_of_the_next_attempt(tmp_path):
    import json

    from harness import preflight

    _failed_attempt(tmp_path, "SIGTERM")  # no rank to blame by its signal
    window = {"attempt": 0, "kind": "stragglers", "start": 1.0, "end": 1.0, "steps": [10, 10],
              "stragglers": [{"rank": 1, "node": "b", "score": 0.4}]}
    (tmp_path / "run_0.jsonl").write_text("".join(json.dumps(window) + "\n" for _ in range(3)))
    record = preflight.decide(tmp_path, ["a", "b"], 1, blame_failures=True)
    assert record["kept"] == ["a"] and list(record["excluded"]) == ["b"]
    assert "straggler: rank 1 computed at 0.40 of the fastest rank's speed for 3 windows" in record["excluded"]["b"][0]


def test_a_straggler_is_named_from_the_first_run_that_found_it_where_run_10_sorts_before_run_2(tmp_path):
    """One attempt spans several runs of a campaign; a node slow in run 2 and again in run 10 is named with run 2's
    figures. By name, run_10.jsonl comes before run_2.jsonl."""
    import json

    from harness import preflight

    _failed_attempt(tmp_path, "SIGTERM")
    for index, score in ((2, 0.4), (10, 0.7)):
        window = {"attempt": 0, "kind": "stragglers", "start": 1.0, "end": 1.0, "steps": [10, 10],
                  "stragglers": [{"rank": 1, "node": "b", "score": score}]}
        (tmp_path / f"run_{index}.jsonl").write_text("".join(json.dumps(window) + "\n" for _ in range(3)))
    assert "computed at 0.40 of the fastest rank's speed" in preflight.blamed_nodes(tmp_path)["b"]


@pytest.mark.parametrize("slow_windows, blamed", [(1, []), (2, []), (3, ["b"])])
def test_a_straggler_is_blamed_only_after_three_slow_windows_in_a_row(tmp_path, slow_windows, blamed):
    """An attempt that closed one or two windows, every one slow, blames nobody: one slow window is no verdict."""
    import json

    from harness import preflight

    _failed_attempt(tmp_path, "SIGTERM")
    window = {"attempt": 0, "kind": "stragglers", "start": 1.0, "end": 1.0, "steps": [10, 10],
              "stragglers": [{"rank": 1, "node": "b", "score": 0.4}]}
    (tmp_path / "run_0.jsonl").write_text("".join(json.dumps(window) + "\n" for _ in range(slow_windows)))
    assert list(preflight.decide(tmp_path, ["a", "b"], 1, blame_failures=True)["excluded"]) == blamed


def test_kubernetes_nodes_are_conditioned_tainted_and_told_and_the_next_render_avoids_the_bad_one(tmp_path,
                                                                                               monkeypatch):
    from harness import preflight, profiles
    from harness.launchers import get_launcher
    from harness.launchers.kubernetes_nodes import CONDITION, TAINT
    from harness.remediation import without_excluded
    from harness.spec import JobSpec
    from tests.fake_kube_api import FakeKubeAPI

    out = tmp_path / "run"
    _report(out, "gpu-a", 470)
    _report(out, "gpu-b", 120)
    record = preflight.decide(out, ["gpu-a", "gpu-b"], 1)
    spec = JobSpec("resnet", nodes=1, spare_nodes=1, preflight=True, taint_bad_nodes=True, out_dir=out,
                   profile=profiles.load("h100-ib")).resolved()
    launcher = get_launcher("k8s")
    with FakeKubeAPI() as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path)))
        api.add_node("gpu-a")
        api.add_node("gpu-b")
        raced = []

        def node_controller(name):  # between the harness's read and its patch, the first time: a taint of its own
            if name == "gpu-b" and not raced and len(api.patches) >= 3:
                raced.append(name)
                node = api.nodes[name]
                node["spec"]["taints"].append({"key": "node.kubernetes.io/unreachable", "effect": "NoExecute"})
                node["metadata"]["resourceVersion"] = str(int(node["metadata"]["resourceVersion"]) + 1)

        api.before_node_patch = node_controller
        done = launcher.remediate(spec, record)
    why = "harness preflight: allreduce_busbw 120 GB/s < 460 (8 GPUs, 16384 MiB)"
    assert done == [f"gpu-b: condition {CONDITION}=True ({why})",
                    "gpu-b: tainted mlperf-harness/preflight=failed:NoSchedule"]
    conditions = {n: {c["type"]: c for c in node["status"]["conditions"]} for n, node in api.nodes.items()}
    bad, good = conditions["gpu-b"][CONDITION], conditions["gpu-a"][CONDITION]
    assert (bad["status"], bad["reason"], bad["message"]) == ("True", "PreflightFailed", why)
    assert (good["status"], good["reason"]) == ("False", "PreflightPassed")
    assert conditions["gpu-b"]["Ready"]["status"] == "True"  # merged by type, nothing else touched
    # The conflicting write made the first taint patch a 409; the retry kept the other controller's taint.
    assert raced and [t["key"] for t in api.nodes["gpu-b"]["spec"]["taints"]] == [
        "example.com/other", "node.kubernetes.io/unreachable", TAINT.key]
    assert api.nodes["gpu-b"]["spec"]["taints"][-1]["effect"] == "NoSchedule"
    assert [t["key"] for t in api.nodes["gpu-a"]["spec"]["taints"]] == ["example.com/other"]
    assert {ctype for _, ctype in api.patches} == {"application/strategic-merge-patch+json"}
    told = {(e["involvedObject"]["kind"], e["involvedObject"]["name"], e["reason"]) for e in api.events}
    assert told == {("Node", "gpu-b", "PreflightFailed"), ("PyTorchJob", "resnet-tiny-preflight", "PreflightFailed")}
    body = launcher.render(without_excluded(spec, record)).payload["body"]
    [term] = body["spec"]["pytorchReplicaSpecs"]["Master"]["template"]["spec"]["affinity"]["nodeAffinity"][
        "requiredDuringSchedulingIgnoredDuringExecution"]["nodeSelectorTerms"]
    assert term == {"matchFields": [{"key": "metadata.name", "operator": "NotIn", "values": ["gpu-b"]}]}


def test_the_slurm_health_step_has_a_deadline_from_the_profile():
    """srun's --time ends the health step of a node whose check hangs; the judge step then runs."""
    from harness import profiles
    from harness.launchers import get_launcher
    from harness.spec import JobSpec

    profile = profiles.apply_overrides(profiles.load("coreweave-h100"), ["preflight.deadline_s=300",
                                                                         "preflight.start_allowance_s=0"])
    spec = JobSpec("gpt3", nodes=4, preflight=True, profile=profile, out_dir=Path("/mnt/results/x")).resolved()
    script = get_launcher("slurm").render(spec).text
    (health,) = [line for line in script.splitlines() if "-m harness.health" in line]
    assert "srun --ntasks-per-node=1 --time=5 " in health and health.rstrip().endswith("|| true  # a node "
                                                                                       "without a report is judged failed below")


def test_the_kubernetes_health_job_puts_one_checking_pod_on_each_node():
    from harness import profiles
    from harness.launchers import get_launcher
    from harness.spec import JobSpec

    spec = JobSpec("resnet", nodes=2, spare_nodes=1, preflight=True, exclude_nodes=["gpu-x"],
                   profile=profiles.load("h100-ib")).resolved()
    request = get_launcher("k8s").render_preflight(spec)
    body = request.payload["body"]
    # A name of its own per run (the job's token), so that no earlier run's health job is in its way.
    assert re.fullmatch(r"resnet-tiny-[0-9a-f]{8}-preflight", body["metadata"]["name"])
    assert body["spec"]["nprocPerNode"] == "1" and body["spec"]["runPolicy"]["backoffLimit"] == 0
    # Its pods stay when it ends (the harness reads their Nodes, then deletes the job); the operator removes it
    # an hour after it ended where no harness did.
    assert body["spec"]["runPolicy"]["cleanPodPolicy"] == "None"
    assert body["spec"]["runPolicy"]["ttlSecondsAfterFinished"] == 3600
    from tests.test_kubernetes import CRD, pytorchjob_schema

    if CRD.is_file():
        jsonschema.validate(body, pytorchjob_schema())
    # A hung check cannot hold every node: the operator fails the job at the profile's deadline.
    assert body["spec"]["runPolicy"]["activeDeadlineSeconds"] == spec.profile.preflight.deadline_s + 600 == 1800
    replicas = body["spec"]["pytorchReplicaSpecs"]
    assert replicas["Master"]["replicas"] + replicas["Worker"]["replicas"] == 3  # spares are checked too
    for replica in replicas.values():
        pod = replica["template"]["spec"]
        [container] = pod["containers"]
        assert container["args"][:2] == ["-m", "harness.health"] and "--gpus" in container["args"]
        assert {"name": "NODE_NAME", "valueFrom": {"fieldRef": {"fieldPath": "spec.nodeName"}}} in container["env"]
        [anti] = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
        assert anti["topologyKey"] == "kubernetes.io/hostname"
        assert pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
            "nodeSelectorTerms"][0]["matchFields"][0]["values"] == ["gpu-x"]
    assert "&id" not in request.text  # no YAML anchors: every pod spec is its own


def test_preflight_options_refuse_what_cannot_work_in_one_line(tmp_path):
    from tests.conftest import harness

    spares = harness("run", "resnet", "--spare-nodes", "1", "--no-preflight", "--out", str(tmp_path / "a"), "--dry-run")
    assert spares.returncode == 2 and spares.stderr == ("harness: error: --spare-nodes needs --preflight: the spares "
                                                        "replace the nodes preflight keeps out\n")
    local = harness("preflight", "--nodes", "2", "--out", str(tmp_path / "b"))
    assert local.returncode == 2 and "Traceback" not in local.stderr
    assert local.stderr == ("harness: error: the local backend checks this machine only: --nodes 1 and no "
                            "--spare-nodes\n")
    assert not (tmp_path / "b").exists()


def test_a_node_whose_between_node_checks_never_ran_does_not_pass(tmp_path):
    """One node's crash stops the pairs' all-reduces: a report without pair results fails, never passes silently."""
    from harness import preflight

    _report(tmp_path, "a", 470)
    _report(tmp_path, "b", 470, pairs=[])
    verdicts = preflight.judge(tmp_path, ["a", "b"])
    assert verdicts["a"]["ok"] and not verdicts["b"]["ok"]
    (failed,) = [c for c in verdicts["b"]["checks"] if c.verdict == "fail"]
    assert failed.name == "pair_busbw" and failed.note == "the between-node checks did not finish"


def test_a_between_node_phase_that_timed_out_everywhere_fails_every_node(tmp_path):
    """A NIC that breaks NCCL's set-up times the between-node phase out on every node: each report holds only
    what the node wrote before it (no "pairs" at all), and no node passes the link check untested."""
    import json

    from harness import preflight
    from harness.health import NODES_DIR

    for node in ("a", "b", "c"):
        _report(tmp_path, node, 470)
        path = tmp_path / NODES_DIR / f"{node}.json"
        record = json.loads(path.read_text())
        del record["pairs"]  # as written before the all-reduces, and never again
        path.write_text(json.dumps(record))
    verdicts = preflight.judge(tmp_path, ["a", "b", "c"])
    for node in ("a", "b", "c"):
        (failed,) = [c for c in verdicts[node]["checks"] if c.verdict == "fail"]
        assert failed.name == "pair_busbw" and "did not finish" in failed.note and not verdicts[node]["ok"]


def test_a_check_that_hangs_fails_at_its_deadline_and_one_that_answers_is_read(monkeypatch):
    """The child-process runner of the NVML and CUDA checks: a child that never answers is killed at the deadline
    and its check fails `timed out after N s`; an answer or an error comes back as such. The hanging child is the
    test hook (HARNESS_PREFLIGHT_FAULT NODE:CHECK:hang), which hangs before the target is called."""
    import time

    from harness.health.isolate import Child, isolated

    monkeypatch.setenv("HARNESS_PREFLIGHT_FAULT", "b:slow_check:hang")
    started = time.monotonic()
    hung = Child("slow_check", "b", "harness.health.allreduce:pair_rounds", dict(nodes=4, rounds=1))
    answered = isolated("slow_check", "a", "harness.health.allreduce:pair_rounds", dict(nodes=4, rounds=1), 300)
    assert answered.failure is None and answered.value == [[[0, 3], [1, 2]]]
    outcome = hung.wait(2)
    assert outcome.value is None and outcome.failure.verdict == FAIL
    assert (outcome.failure.name, outcome.failure.measured) == ("slow_check", "timed out after 2 s")
    assert hung.process.wait(timeout=60) == -9  # killed, not left running
    assert time.monotonic() - started < 120  # a safety net only: the hang ended at its deadline, not never
    broken = isolated("slow_check", "a", "harness.health.allreduce:pair_rounds", dict(nodes="x"), 300)
    assert broken.failure.verdict == FAIL and broken.failure.note.startswith("TypeError: ")
    assert broken.value is None
    partly = isolated("slow_check", "a", "tests.test_preflight:measures_then_fails", {}, 300)
    assert partly.value == {"pairs": [1]} and partly.failure.note == "RuntimeError: the peer died"


def measures_then_fails():
    """A check's child that measured something, then failed: what it measured comes back with the failure."""
    yield {"pairs": [1]}
    raise RuntimeError("the peer died")


def test_each_local_rank_of_the_pair_phase_gets_its_own_link_verdict(tmp_path):
    """One verdict per GPU and its NIC: a slow one is named, and a rank that measured nothing fails with what it
    left (timed out), while the node's other GPUs pass."""
    import json

    from harness import preflight
    from harness.health import NODES_DIR

    _report(tmp_path, "a", 470, [{"peer": "b", "busbw_gbps": 45.0}])
    _report(tmp_path, "b", 470, [{"peer": "a", "busbw_gbps": 45.0}])
    path = tmp_path / NODES_DIR / "b.json"
    record = json.loads(path.read_text())
    record.update(pair_ranks=4, pair_failures={"3": "timed out after 300 s"},
                  pairs=[{"peer": "a", "gpu": 0, "busbw_gbps": 45.0}, {"peer": "a", "gpu": 1, "busbw_gbps": 12.0},
                         {"peer": "a", "gpu": 2, "busbw_gbps": 0.0, "error": "Connection closed by peer"}])
    path.write_text(json.dumps(record))
    verdicts = preflight.judge(tmp_path, ["a", "b"])
    assert verdicts["a"]["ok"] and not verdicts["b"]["ok"]
    links = {c.where.split(":")[0]: c for c in verdicts["b"]["checks"] if c.name == "pair_busbw"}
    assert {where: c.verdict for where, c in links.items()} == {"gpu 0": PASS, "gpu 1": FAIL, "gpu 2": FAIL,
                                                                "gpu 3": FAIL}
    assert preflight.reason(links["gpu 1"]) == "pair_busbw 12.0 GB/s < 40 (gpu 1: median with a)"
    assert links["gpu 2"].note == "a: Connection closed by peer"
    assert preflight.reason(links["gpu 3"]) == ("pair_busbw missing, expected measured with another node (gpu 3): "
                                                "timed out after 300 s")


def test_a_nodes_own_seconds_are_not_moved_by_its_clock_being_stepped(tmp_path, monkeypatch):
    """chrony steps a freshly booted node's clock (makestep) while its checks run: the report's seconds are its
    monotonic time, not an hour more."""
    import json
    import time

    from harness.health import NODES_DIR
    from harness.health import __main__ as health

    def checks_while_the_clock_is_stepped(*args):
        wall = time.time() + 3600
        monkeypatch.setattr(health.time, "time", lambda: wall)
        return [], {"deadline_s": 1200}, {"gpu": None}

    monkeypatch.setattr(health, "local_checks", checks_while_the_clock_is_stepped)
    monkeypatch.setenv("NODE_NAME", "a")
    monkeypatch.setenv("WORLD_SIZE", "1")
    assert health.main(["--out", str(tmp_path)]) == 0
    assert 0 <= json.loads((tmp_path / NODES_DIR / "a.json").read_text())["seconds"] < 3600


def _health_nodes(out: Path, nodes: list[str], settings: dict, fault: str, pair_ranks: int,
                  missing: tuple[int, ...] = ()) -> dict:
    """`python -m harness.health` on each of `nodes` at once, as a health job runs it (one process per node, the
    world in RANK/WORLD_SIZE/MASTER_*), on this machine: {node: its report}. The ranks in `missing` never start (and
    have no report). The timeout is a safety net."""
    import json
    import os
    import subprocess
    import sys

    from harness.health import NODES_DIR

    port = free_port()
    processes = [subprocess.Popen([sys.executable, "-m", "harness.health", "--out", str(out), "--settings",
                                   json.dumps(settings), "--cpu-pair-ranks", str(pair_ranks)],
                                  env={**os.environ, "NODE_NAME": node, "RANK": str(rank),
                                       "WORLD_SIZE": str(len(nodes)), "MASTER_ADDR": "127.0.0.1",
                                       "MASTER_PORT": str(port), "HARNESS_PREFLIGHT_FAULT": fault},
                                  stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
                 for rank, node in enumerate(nodes) if rank not in missing]
    try:
        logs = [p.communicate(timeout=600)[0] for p in processes]
    finally:
        for p in processes:
            p.kill()
    assert all(p.returncode == 0 for p in processes), logs
    return {node: json.loads((out / NODES_DIR / f"{node}.json").read_text()) for rank, node in enumerate(nodes)
            if rank not in missing}


@pytest.fixture(scope="module")
def hung_and_slow_nodes(tmp_path_factory):
    """Two CPU "nodes" x 2 pair ranks: node b's intra-node all-reduce hangs (as a CUDA call after Xid 79 does)
    and b's second pair rank measures a slow link. The 30 s check deadline is generous against the checks that do
    answer (a few seconds each, mostly importing torch), so only the hang reaches it."""
    out = tmp_path_factory.mktemp("hung")
    return out, _health_nodes(out, ["a", "b"], {"check_deadline_s": 30},
                              "b:allreduce_busbw:hang,b@1:pair_busbw:0.001", pair_ranks=2)


@pytest.mark.slow
def test_a_check_that_hangs_fails_its_node_at_the_deadline_and_the_others_finish(hung_and_slow_nodes):
    from harness import preflight

    out, reports = hung_and_slow_nodes
    checks = {node: {c["name"]: c for c in r["checks"]} for node, r in reports.items()}
    hung = checks["b"]["allreduce_busbw"]
    assert (hung["verdict"], hung["measured"]) == (FAIL, "timed out after 30 s")
    assert checks["b"]["shared_fs_rw"]["verdict"] == PASS  # the node's other checks still ran
    assert all(c["verdict"] != FAIL for c in checks["a"].values())
    assert reports["b"]["pairs"] and reports["a"]["pairs"]  # b joined the pairs after its check timed out
    verdicts = preflight.judge(out, ["a", "b"])
    assert verdicts["a"]["ok"] and not verdicts["b"]["ok"]


@pytest.mark.slow
def test_every_local_rank_meets_its_peer_and_a_slow_nic_is_named(hung_and_slow_nodes):
    """Between nodes local rank i meets local rank i of the partner (on GPUs: GPU i and its NIC): both of a
    node's links are measured, and only b's second one fails, by name."""
    from harness import preflight

    out, reports = hung_and_slow_nodes
    assert sorted((p["gpu"], p["peer"]) for p in reports["a"]["pairs"]) == [(0, "b"), (1, "b")]
    assert reports["a"]["pair_failures"] == reports["b"]["pair_failures"] == {}
    verdicts = preflight.judge(out, ["a", "b"])
    links = {node: {c.where.split(":")[0]: c.verdict for c in v["checks"] if c.name == "pair_busbw"}
             for node, v in verdicts.items()}
    assert links == {"a": {"rank 0": PASS, "rank 1": PASS}, "b": {"rank 0": PASS, "rank 1": FAIL}}


def test_the_shared_folder_must_hold_the_runs_checkpoints(tmp_path):
    """shared_fs_free asks for the run's checkpoints (the kept ones and the one being written), not a fixed
    100 GiB: one GPT-3 175B checkpoint is about 2.1 TB (fp32 weights and Adam's two moments)."""
    from harness import profiles
    from harness.health.storage import storage_checks
    from harness.launchers.base import health_command
    from harness.spec import JobSpec
    from workloads.registry import BENCHMARKS

    assert BENCHMARKS["gpt3"].checkpoint_bytes("full") == pytest.approx(2.1e12, rel=0.01)
    assert BENCHMARKS["resnet"].checkpoint_bytes("full") is None
    spec = JobSpec("gpt3", preset="full", nodes=4, keep_checkpoints=2, preflight=True,
                   profile=profiles.load("coreweave-h100")).resolved()
    command = health_command(spec, "python")
    need = float(command[command.index("--checkpoints-gib") + 1])
    assert need == pytest.approx(3 * 2.1e12 / 2**30, rel=0.01)
    _, room = storage_checks(tmp_path, "a", 100.0, need)
    assert (room.verdict, room.threshold, room.note) == (FAIL, f">= {need:g}", "room for the run's checkpoints")
    _, room = storage_checks(tmp_path, "a", 0.5, 1e-6)  # a tiny run: the model's floor stays
    assert (room.verdict, room.threshold, room.note) == (PASS, ">= 0.5", "")
    resnet = JobSpec("resnet", preset="full", nodes=4, preflight=True, profile=profiles.load("coreweave-h100"))
    assert "--checkpoints-gib" not in health_command(resnet.resolved(), "python")


def test_a_check_whose_process_exits_0_without_a_result_fails_its_node():
    """sys.exit() ends the child with code 0 before it writes anything: the check fails instead of the node's
    process failing on a missing result."""
    from harness.health.isolate import checks_of, isolated

    [check] = checks_of(isolated("nvml", "node-a", "sys:exit", {}, deadline=60))
    assert check.verdict == FAIL and "died without a result" in check.note


def _processes_carrying(marker: str) -> list[str]:
    """The command lines of the live processes whose environment holds `marker` (a zombie's reads empty)."""
    found = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                found.append((environ.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:  # it ended while we looked
            continue
    return found


def test_a_nodes_sigterm_kills_a_child_popen_has_not_yet_handed_back():
    """The health node's SIGTERM handler kills every child process of the node, registered or not: a cancel that
    lands while Popen is starting a check's child (the child exists, Popen has not returned) left that child
    running, as the suite once showed under load (a hung check outliving its node). Here the child is never
    registered at all; it runs in a session of its own, as a check's does."""
    import subprocess
    import sys
    import time

    from tests.conftest import REPO

    script = ("import os, signal, subprocess, sys, time\n"
              "from harness.health.isolate import stop_children\n"
              "signal.signal(signal.SIGTERM, stop_children)\n"
              "child = subprocess.Popen(['sleep', '600'], start_new_session=True)\n"
              "print(child.pid, flush=True)\n"
              "os.kill(os.getpid(), signal.SIGTERM)\n"
              "time.sleep(600)\n")
    node = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert node.returncode == 143, node.stderr
    stat = Path(f"/proc/{int(node.stdout)}/stat")
    deadline = time.monotonic() + 60  # killed: gone, or a zombie until init reaps it
    while time.monotonic() < deadline and stat.exists() and stat.read_text().rsplit(")", 1)[-1].split()[0] != "Z":
        time.sleep(0.1)
    assert not stat.exists() or stat.read_text().rsplit(")", 1)[-1].split()[0] == "Z"


@pytest.mark.slow
@pytest.mark.parametrize("command", [("preflight",), ("run", "resnet", "--preflight")])
def test_sigterm_during_preflight_stops_the_health_job_and_its_hung_check(tmp_path, command):
    """A CI timeout's SIGTERM (or Ctrl-C) while the health job runs: the job is cancelled, with the check child it
    started in a session of its own (here one hung, as an NVML call after Xid 79), and nothing trains. Before,
    `harness run` handled SIGTERM only once training was submitted, and `harness preflight` never: the health job
    kept its nodes. The hung check cannot end before its 600 s deadline, so the job is running when the signal
    comes, however fast the machine."""
    import json
    import time

    from tests.conftest import harness_stopped_by_sigterm

    out, marker = tmp_path / "run", f"HARNESS_TEST_MARKER={tmp_path}"  # unique to this session
    stopped = harness_stopped_by_sigterm(
        *command, "--out", str(out), "--env", marker, "--env", "NODE_NAME=n1",
        "--env", "HARNESS_PREFLIGHT_FAULT=n1:gpu_inventory:hang", "--set", "preflight.check_deadline_s=600",
        when=lambda: any("harness.health.isolate" in p for p in _processes_carrying(marker)))  # the hung check runs
    assert stopped.returncode == 143, stopped.stderr
    assert "(its job is cancelled)" in stopped.stderr and "Traceback" not in stopped.stderr
    assert json.loads((out / "job.json").read_text())["state"] == "CANCELLED"
    assert not list(out.glob("result_*.txt")) and not (out / "logs" / "rank_0.log").exists()  # nothing trained
    deadline = time.monotonic() + 60  # the health job's process and its check's child, killed, are gone
    while time.monotonic() < deadline and _processes_carrying(marker):
        time.sleep(0.2)
    assert _processes_carrying(marker) == []



# --- issue 36: a failure on one node is blamed on that node alone; remediation is capped and undone ----------------


def _pair_report(out: Path, node: str, rank: int, pairs: list | None = None, **fields) -> None:
    """A CPU node's report after the pair phase: its own checks passed, then `pairs` (None: no pair phase at all)."""
    import json

    from harness.health import NODES_DIR

    th = resolve({}, None)
    path = out / NODES_DIR / f"{node}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {"node": node, "rank": rank, "started": 1.0, "gpu": None, "thresholds": th, "checks": [],
              **({} if pairs is None else {"pair_ranks": 1, "pairs": [{"gpu": 0, **p} for p in pairs],
                                           "pair_failures": {}}), **fields}
    path.write_text(json.dumps(record))


def test_a_store_host_that_never_came_up_is_blamed_on_its_node_alone(tmp_path):
    """Rank 0's health process (which holds the pair phase's store) never started: the other nodes say they could
    not reach the store's host, and only the store's node is kept out. Before: every node failed pair_busbw."""
    from harness import preflight

    unreachable = "could not reach the pair phase's store at 10.0.0.1:29500 (rank 0's node): timed out"
    for rank, node in ((1, "b"), (2, "c"), (3, "d")):
        _pair_report(tmp_path, node, rank, [], store_unreachable=unreachable)
    verdicts = preflight.judge(tmp_path, ["a", "b", "c", "d"])
    assert {n: v["ok"] for n, v in verdicts.items()} == {"a": False, "b": True, "c": True, "d": True}
    assert [c.name for c in verdicts["a"]["checks"] if c.verdict == FAIL] == ["health_report"]
    [skip] = [c for c in verdicts["b"]["checks"] if c.name == "pair_busbw"]
    assert skip.verdict == SKIPPED and "store" in skip.note and "a" in skip.note
    # The store's node wrote its own checks but no other node reached its store: it is blamed, the others not.
    _pair_report(tmp_path, "a", 0, [{"peer": "node #1", "busbw_gbps": 0.0, "error": "timed out"}])
    verdicts = preflight.judge(tmp_path, ["a", "b", "c", "d"])
    assert {n: v["ok"] for n, v in verdicts.items()} == {"a": False, "b": True, "c": True, "d": True}
    assert any("no other node could reach" in c.note for c in verdicts["a"]["checks"] if c.verdict == FAIL)
    # One node that cannot reach a store the others reached: its own network, its own failure.
    _pair_report(tmp_path, "c", 2, [{"peer": "a", "busbw_gbps": 45.0}])
    _pair_report(tmp_path, "d", 3, [{"peer": "a", "busbw_gbps": 45.0}])
    _pair_report(tmp_path, "a", 0, [{"peer": "c", "busbw_gbps": 45.0}])
    verdicts = preflight.judge(tmp_path, ["a", "b", "c", "d"])
    assert {n: v["ok"] for n, v in verdicts.items()} == {"a": True, "b": False, "c": True, "d": True}


def test_a_node_that_cannot_reach_the_store_host_reports_it_rather_than_raising(monkeypatch):
    """No process listens at MASTER_ADDR:MASTER_PORT (rank 0's health process never started): the node's between-node
    phase ends at its deadline with a report that says so, instead of an exception that left no pairs at all."""
    from harness.health.allreduce import between_nodes

    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv("RANK", "2")
    monkeypatch.setenv("WORLD_SIZE", "3")
    links = between_nodes("c", 1, 1024, 3, False, op_timeout_s=1, deadline_s=1)
    assert links["pairs"] == [] and links["rank"] == 2
    assert "could not reach" in links["store_unreachable"] and "127.0.0.1" in links["store_unreachable"]


def test_nccl_pair_groups_are_made_eagerly_without_blocking_under_the_operation_timeout(monkeypatch):
    """On NCCL a missing partner must not hold its partner in ncclCommInitRank: the pair and world groups are
    initialised eagerly (device_id) and non-blocking (config.blocking = 0), with torch's non-blocking init timeout
    set to the operation timeout. CPU can only check this configuration; the GPU path itself is untested here."""
    import os

    import torch

    from harness.health.allreduce import group_arguments

    monkeypatch.delenv("TORCH_NCCL_NONBLOCKING_TIMEOUT", raising=False)
    nccl = group_arguments("cuda:3", 45)
    assert nccl["backend"] == "nccl" and nccl["device_id"] == torch.device("cuda", 3)
    assert nccl["pg_options"].config.blocking == 0 and nccl["timeout"].total_seconds() == 45
    assert os.environ["TORCH_NCCL_NONBLOCKING_TIMEOUT"] == "45"
    gloo = group_arguments("cpu", 45)
    assert gloo["backend"] == "gloo" and "device_id" not in gloo and "pg_options" not in gloo


def test_the_pairs_a_node_finished_reach_its_report_before_a_later_hang(tmp_path, monkeypatch):
    """The node is stopped (the scheduler's deadline) while a later pair hangs: the pair it finished is already in
    its report on disk, not lost with the process."""
    import json

    from harness.health import NODES_DIR
    from harness.health import __main__ as health

    def between_nodes(*args, progress, **kwargs):
        progress({"pair_ranks": 1, "pairs": [{"peer": "b", "gpu": 0, "busbw_gbps": 45.0}], "pair_failures": {}})
        raise SystemExit(143)  # stop_children at the scheduler's SIGTERM, while round 2 hangs

    monkeypatch.setattr(health, "local_checks", lambda *a: ([], resolve({}, None), {"gpu": None}))
    monkeypatch.setattr(health, "between_nodes", between_nodes)
    monkeypatch.setenv("NODE_NAME", "a")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(SystemExit):
        health.main(["--out", str(tmp_path)])
    report = json.loads((tmp_path / NODES_DIR / "a.json").read_text())
    assert report["pairs"] == [{"peer": "b", "gpu": 0, "busbw_gbps": 45.0}]


def test_a_partner_rank_that_ran_no_pair_fails_its_own_node_not_its_partners(tmp_path):
    """A GPU off the bus: its node joins the pair phase, but that GPU's pair rank fails before any pair (pair_failures,
    no pair of that rank), and each partner's pair with it ends after the operation timeout as a measured 0. With one
    or two partners the median cannot outvote it, and the healthy partner failed pair_busbw (found by the fault
    simulator: "slurm n=2 s=0 | gpu_offbus@0.a0.r0.s0"). That rank's node fails (pair_busbw missing); its partners'
    pairs with it are left out, as an absent partner's are."""
    from harness import preflight

    _pair_report(tmp_path, "a", 0, [], pair_failures={"0": "CUDA error: invalid device ordinal"})
    _pair_report(tmp_path, "b", 1, [{"peer": "a", "busbw_gbps": 0.0, "error": "NCCL communicator init timed out"}])
    verdicts = preflight.judge(tmp_path, ["a", "b"])
    assert {n: v["ok"] for n, v in verdicts.items()} == {"a": False, "b": True}
    [skip] = [c for c in verdicts["b"]["checks"] if c.name == "pair_busbw"]
    assert skip.verdict == SKIPPED and "a" in skip.note
    # A partner rank that measured a pair of its own before it failed is no such rank: its 0 stays in the median.
    _pair_report(tmp_path, "a", 0, [{"peer": "b", "busbw_gbps": 0.0, "error": "timed out"}],
                 pair_failures={"0": "died"})
    assert not preflight.judge(tmp_path, ["a", "b"])["b"]["ok"]


@pytest.mark.slow
def test_a_missing_pair_partner_is_named_and_its_partners_keep_the_pairs_they_finished(tmp_path):
    """Three CPU nodes on gloo, the third (rank 2) never starts. a meets c in round 1 and b meets c in round 0:
    each names the missing node's rank, marks the pair absent, and goes on to meet the other in round 2. Before, each
    waited for c's name for the whole phase and the a-b pair was never measured. (NCCL's set-up is not run here.)"""
    from harness import preflight

    reports = _health_nodes(tmp_path, ["a", "b", "c"], {"check_deadline_s": 10, "deadline_s": 100}, "", 1,
                            missing=(2,))
    for node, other in (("a", "b"), ("b", "a")):
        pairs = {p["peer"]: p for p in reports[node]["pairs"]}
        assert pairs["node #2"]["absent"] and "rank 2" in pairs["node #2"]["error"]
        assert pairs[other]["busbw_gbps"] > 0 and "error" not in pairs[other]
    verdicts = preflight.judge(tmp_path, ["a", "b", "c"])
    assert {n: v["ok"] for n, v in verdicts.items()} == {"a": True, "b": True, "c": False}


def test_a_nodes_deadline_is_its_own_start_capped_by_the_schedulers_kill():
    """A node's between-node phase ends by its own start + deadline_s, or earlier where the scheduler kills it
    earlier (Slurm tells the step's end: HARNESS_HEALTH_KILL_AT), always leaving the report's margin."""
    from harness.health.__main__ import REPORT_MARGIN_S, phase_seconds

    assert phase_seconds(1200, elapsed=100, now=1000.0, kill_at=None) == 1200 - 100 - REPORT_MARGIN_S
    # started 600 s after the scheduler's clock: its kill comes first
    assert phase_seconds(1200, elapsed=100, now=1000.0, kill_at=1000.0 + 500) == 500 - REPORT_MARGIN_S


def test_the_scheduler_deadline_leaves_room_for_the_image_pull_and_the_health_job_tolerates_the_harness_taint():
    from harness import profiles
    from harness.launchers import get_launcher
    from harness.launchers.kubernetes_nodes import TAINT
    from harness.spec import JobSpec

    spec = JobSpec("resnet", nodes=2, spare_nodes=1, preflight=True, profile=profiles.load("h100-ib")).resolved()
    th = spec.profile.preflight
    body = get_launcher("k8s").render_preflight(spec).payload["body"]
    assert body["spec"]["runPolicy"]["activeDeadlineSeconds"] == th.deadline_s + th.start_allowance_s
    for replica in body["spec"]["pytorchReplicaSpecs"].values():
        assert {"key": TAINT.key, "operator": "Equal", "value": TAINT.value, "effect": TAINT.effect} in \
            replica["template"]["spec"]["tolerations"]
    script = get_launcher("slurm").render_preflight(spec).text
    assert f"--time={-(-(th.deadline_s + th.start_allowance_s) // 60)}" in script
    assert "HARNESS_HEALTH_KILL_AT=" in script


def _marked_record(out: Path, failing: int, total: int, share: float = 0.1) -> dict:
    from harness import preflight

    for i in range(total):
        _report(out, f"n{i}", 120 if i < failing else 470)
    return preflight.decide(out, [f"n{i}" for i in range(total)], total - failing, max_marked_share=share)


def test_one_decision_marks_at_most_its_share_of_the_allocation_and_reports_more_as_systemic(tmp_path):
    from harness import preflight

    few = _marked_record(tmp_path / "few", 2, 20)
    assert few["marked"] == ["n0", "n1"] and few["systemic"] is None and few["passed"]
    many = _marked_record(tmp_path / "many", 5, 20)
    assert many["marked"] == [] and "systemic" in many["systemic"] and not many["passed"]
    assert "systemic" in many["message"] and "allreduce_busbw" in many["systemic"]
    assert preflight.marking(["x"], 3, 0.1) == (["x"], None)  # at least one node
    assert preflight.marking(["x", "y"], 3, 0.1)[0] == []


def test_remediation_marks_nothing_when_the_failure_is_systemic(tmp_path, monkeypatch):
    from harness import profiles
    from harness.launchers import get_launcher
    from harness.spec import JobSpec
    from tests.fake_kube_api import FakeKubeAPI

    record = _marked_record(tmp_path / "run", 5, 20)
    spec = JobSpec("resnet", nodes=15, spare_nodes=5, preflight=True, taint_bad_nodes=True, drain_bad_nodes=True,
                   out_dir=tmp_path / "run", profile=profiles.load("h100-ib")).resolved()
    with FakeKubeAPI() as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path)))
        for i in range(20):
            api.add_node(f"n{i}", taints=[])
        done = get_launcher("k8s").remediate(spec, record)
    assert not any(n["spec"]["taints"] for n in api.nodes.values()) and not api.events
    assert all(c["status"] != "True" for n in api.nodes.values() for c in n["status"].get("conditions", [])
               if c["type"] == "MLPerfPreflight")
    assert any("systemic" in line for line in done)


def test_a_node_the_harness_tainted_is_untainted_when_it_passes_again_and_no_one_elses_taint_is_touched(
        tmp_path, monkeypatch):
    from harness import preflight, profiles
    from harness.launchers import get_launcher
    from harness.launchers.kubernetes_nodes import CONDITION, TAINT
    from harness.spec import JobSpec
    from tests.fake_kube_api import FakeKubeAPI

    out = tmp_path / "run"
    _report(out, "gpu-a", 470)
    _report(out, "gpu-b", 470)
    record = preflight.decide(out, ["gpu-a", "gpu-b"], 2)
    spec = JobSpec("resnet", nodes=2, preflight=True, out_dir=out, profile=profiles.load("h100-ib")).resolved()
    ours = {"key": TAINT.key, "value": TAINT.value, "effect": TAINT.effect}
    admins = {"key": TAINT.key, "value": "maintenance", "effect": "NoSchedule"}
    with FakeKubeAPI() as api:
        monkeypatch.setenv("KUBECONFIG", str(api.kubeconfig(tmp_path)))
        api.add_node("gpu-a", taints=[{"key": "example.com/other", "effect": "NoExecute"}, ours])
        api.add_node("gpu-b", taints=[admins])
        done = get_launcher("k8s").remediate(spec, record)
    assert api.nodes["gpu-a"]["spec"]["taints"] == [{"key": "example.com/other", "effect": "NoExecute"}]
    assert api.nodes["gpu-b"]["spec"]["taints"] == [admins]
    assert f"gpu-a: untainted {TAINT.key}={TAINT.value}:{TAINT.effect} (passed again)" in done
    conditions = {n: {c["type"]: c for c in node["status"]["conditions"]} for n, node in api.nodes.items()}
    assert conditions["gpu-a"][CONDITION]["status"] == "False"


def test_a_node_the_harness_drained_is_resumed_when_it_passes_again_and_no_one_elses_drain_is(tmp_path,
                                                                                              monkeypatch):
    """A faked scontrol: node1 drained by the harness, node2 drained by an administrator, node3 fails now."""
    import os

    from harness import preflight, profiles
    from harness.launchers import get_launcher
    from harness.spec import JobSpec

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    log = tmp_path / "scontrol.log"
    (bin_dir / "scontrol").write_text(
        "#!/bin/bash\n"
        f'echo "$*" >> {log}\n'
        'case "$3" in\n'
        "  node1) echo 'NodeName=node1 State=IDLE+DRAIN Reason=harness preflight: pair_busbw 1 GB/s < 40 "
        "[root@2025-01-01T00:00:00]';;\n"
        "  node2) echo 'NodeName=node2 State=IDLE+DRAIN Reason=bad DIMM [admin@2025-01-01T00:00:00]';;\n"
        "  *) echo \"NodeName=$3 State=IDLE\";;\n"
        "esac\n")
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "run"
    for node in ("node1", "node2"):
        _report(out, node, 470)
    _report(out, "node3", 120)
    record = preflight.decide(out, ["node1", "node2", "node3"], 2, max_marked_share=0.5)
    spec = JobSpec("resnet", nodes=2, spare_nodes=1, preflight=True, drain_bad_nodes=True, out_dir=out,
                   profile=profiles.load("local-cpu")).resolved()
    done = get_launcher("slurm").remediate(spec, record)
    calls = log.read_text().splitlines()
    assert "update NodeName=node1 State=RESUME" in calls
    assert not any(c.startswith("update NodeName=node2") for c in calls)
    assert any(c.startswith("update NodeName=node3 State=DRAIN") for c in calls)
    assert "node1 resumed: it passed again (drained by harness preflight before)" in done
