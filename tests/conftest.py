"""Shared fixtures: one real tiny campaign per test session, and the official compliance checker."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from filelock import FileLock

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
TINY_RUNS = 5  # a whole MLPerf ResNet campaign: enough runs for a score and a submission package


@dataclass
class Completed:
    returncode: int
    stdout: str
    stderr: str


def training_job(text: str) -> dict:
    """The (first) training job among the documents a Kubernetes dry run prints: after the health job with
    --preflight, before its watcher pod; a closed campaign that flushes has one a run, the first run's first."""
    import yaml

    return next(doc for doc in yaml.safe_load_all(text) if doc and doc["kind"] in ("PyTorchJob", "TrainJob")
                and not doc["metadata"]["name"].endswith("-preflight"))


def harness(*args: str, cwd: Path | None = None, env: dict | None = None, timeout: float = 600) -> Completed:
    """Run the real CLI in a fresh interpreter, as a user would."""
    proc = subprocess.run([sys.executable, "-m", "harness", *args], cwd=cwd or REPO, capture_output=True,
                          text=True, timeout=timeout, env={**os.environ, **(env or {})})
    return Completed(proc.returncode, proc.stdout, proc.stderr)


def harness_stopped_by_sigterm(*args: str, when: Callable[[], bool]) -> Completed:
    """`harness ARGS` in a session of its own, sent SIGTERM (a CI job's timeout) once `when()` holds: an event
    waited for with a generous deadline, never a pace. Killed whole if it outlives the test."""
    proc = subprocess.Popen([sys.executable, "-m", "harness", *args], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not when():
            time.sleep(0.2)
        assert when(), "the job never got where the test signals it"
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    return Completed(proc.returncode, stdout, stderr)


def compliance(path: Path, ruleset: str, cwd: Path) -> Completed:
    """MLCommons' checker, exactly as a submitter runs it."""
    proc = subprocess.run([sys.executable, "-m", "mlperf_logging.compliance_checker", "--usage", "training",
                           "--ruleset", ruleset, str(path)], cwd=cwd, capture_output=True, text=True, timeout=300)
    return Completed(proc.returncode, proc.stdout, proc.stderr)


def failed_checks(result: Completed) -> list[str]:
    text = result.stdout + result.stderr
    return [line for line in text.splitlines() if "Failed" in line or ("ERROR" in line and "FAILED" not in line)]


# Fixtures that start real end-to-end runs: a test that uses one is in the slow tier too.
SLOW_FIXTURES = {"tiny_campaign", "slurm_cluster", "scraped_campaign"}


# The files with the longest real runs, started first and longest first (as measured in a full run on 2 cores): the two
# workers take whole files in this order (`--no-loadscope-reorder` in pyproject.toml; xdist would otherwise sort
# files by their number of tests), and one of these left to the end would leave the other worker idle. The shared
# campaign's first user leads, so that its later users (test_api, test_compare, test_export, test_notebook) find it
# built rather than wait on its lock.
LONG_FILES = ("test_resnet_campaign.py", "test_gpt3.py", "test_bert.py", "test_slurm.py", "test_resilience.py",
              "test_gpt_oss.py", "test_api.py", "test_kubernetes.py", "test_compare.py", "test_llama.py", "test_flux.py",
              "test_preflight.py", "test_fault_simulator.py", "test_notebook.py", "test_deepseek.py",
              "test_container.py", "test_llama_parallel.py", "test_gpu_throughput_bench.py")


def pytest_collection_modifyitems(config, items):
    """The slow tier: tests marked slow, every Slurm and container test, and every test of a slow fixture. Then the
    long files first (LONG_FILES), the rest in their order."""
    rank = {name: i for i, name in enumerate(LONG_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(LONG_FILES)))
    for item in items:
        if (item.get_closest_marker("slurm") or item.get_closest_marker("container")
                or SLOW_FIXTURES & set(item.fixturenames)):
            item.add_marker(pytest.mark.slow)


@pytest.fixture(scope="session", autouse=True)
def this_checkout_first():
    """Every process a test starts imports this checkout's code, not whichever checkout pip installed in
    editable mode (a git worktree, or a clone beside it): torch.distributed.run puts only the script's folder
    on sys.path."""
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))


def session_root(tmp_path_factory) -> Path:
    """A folder that every process of this test session shares: the base temp folder, or under pytest-xdist
    (the README's command runs two workers) the folder that holds each worker's own."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if "PYTEST_XDIST_WORKER" in os.environ else base


@pytest.fixture(scope="session", autouse=True)
def worker_threads():
    """Each pytest-xdist worker's share of the cores for torch in the worker and in the processes it starts itself
    (closed proxies, benches, torchrun jobs), so that two workers do not oversubscribe the machine. A `harness run`
    it starts divides the machine's cores among its ranks as it does for a user (local launcher: one thread a rank
    here), and the two workers' runs then share the cores. A rank that builds a cached input for the others (the
    tiny BERT warm start) takes the worker's share too, not every core."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if workers > 1:
        import torch

        from harness.launchers.local import cpu_count

        share = max(1, cpu_count() // workers)
        os.environ["OMP_NUM_THREADS"] = str(share)
        os.environ["HARNESS_BUILD_THREADS"] = str(share)  # a node's one-off builds too (workloads.common.cache)
        torch.set_num_threads(share)


@pytest.fixture(scope="session", autouse=True)
def tiny_data_dir(tmp_path_factory) -> Path:
    """Generate the tiny datasets and warm starts privately for this session instead of in the user's cache, once
    for all workers (the cache builds each entry once even when processes race: workloads/common/cache.py)."""
    path = session_root(tmp_path_factory) / "data"
    path.mkdir(exist_ok=True)
    os.environ["HARNESS_DATA_DIR"] = str(path)
    return path


@pytest.fixture(scope="session")
def tiny_campaign(tmp_path_factory) -> tuple[Path, Completed]:
    """`harness run resnet --runs 5` on the local default: two processes, gloo, the tiny preset. Run once per
    session: the first worker to ask runs it while the others wait on the lock, then all read its folder."""
    root = session_root(tmp_path_factory) / "campaign"
    root.mkdir(exist_ok=True)
    out, record = root / "run", root / "completed.json"
    with FileLock(str(root / "lock")):
        if not record.exists():
            shutil.rmtree(out, ignore_errors=True)  # what a worker that failed here left
            result = harness("run", "resnet", "--runs", str(TINY_RUNS), "--out", str(out))
            record.write_text(json.dumps(vars(result)))
    result = Completed(**json.loads(record.read_text()))
    assert result.returncode == 0, result.stdout + result.stderr
    return out, result


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A real two-node Slurm cluster on loopback (see tests/slurm_cluster.py), when Slurm is installed."""
    from tests.slurm_cluster import SlurmCluster, unavailable

    if why := unavailable():
        pytest.skip(why)
    cluster = SlurmCluster(tmp_path_factory.mktemp("slurm"))
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def closed_proxy_run(benchmark: str, *args: str, procs: int = 1, timeout: float = 600) -> Completed:
    """A shortened closed run of bert or gpt3 in `procs` processes, with the small model of tests/closed_proxy.py.
    It goes ahead where the machine cannot flush the page cache (tests/test_shared_checkpoints.py tests that stop)."""
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs),
                           str(REPO / "tests" / "closed_proxy.py"), benchmark, "--preset", "full", *args,
                           "--allow-unflushed-cache"],
                          cwd=REPO, capture_output=True, text=True, timeout=timeout)
    return Completed(proc.returncode, proc.stdout, proc.stderr)


def ephemeral_ports() -> range:
    """The ports the kernel hands out for bind(0) and outgoing connections (Linux's default where unreadable)."""
    try:
        low, high = map(int, Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split())
    except (OSError, ValueError):
        low, high = 32768, 60999
    return range(low, high + 1)


def free_port(taken: tuple[int, ...] = ()) -> int:
    """A TCP port free now, for a process started later to listen on (a store, a daemon, an exporter). Drawn at
    random below the kernel's ephemeral range: a port that bind(0) gave out and this closed is free for the next
    bind(0) of any process, and in the seconds before ours listens the other worker's gloo pairs, torchrun
    --standalone stores and exporters, all listening on port 0, can take it. Random (from the OS, not the
    `random` module that tests seed), so two workers, or two CI runs on one host, rarely draw the same."""
    draw = random.SystemRandom()
    below = ephemeral_ports().start
    low = 15000 if below > 20000 else 1024
    for _ in range(1000):
        port = draw.randrange(low, below)
        if port in taken:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue  # someone listens there
        return port
    raise RuntimeError(f"no free TCP port found in {low}-{below - 1}")


@pytest.fixture
def one_rank_world():
    """A one-process gloo group on CPU, and its DistContext."""
    import torch
    import torch.distributed as dist

    from workloads.common.distributed import DistContext, shutdown_distributed

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield DistContext(rank=0, world_size=1, local_rank=0, local_world_size=1, device=torch.device("cpu"))
    shutdown_distributed()


@pytest.fixture
def one_process_world(monkeypatch):
    """The environment torchrun gives a lone rank, for a campaign run in this process (run_campaign). The page
    cache is left alone (the machine is shared): the flush is faked as done, so that closed runs go ahead."""
    import torch

    from workloads.common import campaign

    for key, value in {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(free_port()), "RANK": "0", "WORLD_SIZE": "1",
                       "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setattr(campaign, "clear_page_caches", lambda *args: [])  # no node failed to flush
    yield
    if torch.distributed.is_initialized():  # a campaign that raised left its group behind
        torch.distributed.destroy_process_group()
