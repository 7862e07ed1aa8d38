"""A private, real Slurm cluster on loopback for the tests: munged, one slurmctld, N slurmd.

Each slurmd is started with `-N nodeK` on its own port, so one machine hosts a
genuine multi-node cluster. State, logs and config live in the given folder;
the folders that hold Unix sockets (munge's, slurmd's spools) live in a short
private folder under /tmp, removed at the end, because a socket's path may be at
most 107 bytes and pytest's own temporary folders are deep (on CI slurmstepd's
`<root>/spool-node1/node1_1.4294967291` came to 109 and every job failed).
Nothing in /etc is read or written, and the daemons are stopped at the end. Client commands find the cluster through
SLURM_CONF, which `env` carries.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.conftest import free_port

DAEMONS = ("munged", "slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "scancel", "sinfo")


def missing_programs() -> list[str]:
    return [name for name in DAEMONS if shutil.which(name) is None and not Path(f"/usr/sbin/{name}").exists()]


def unavailable() -> str | None:
    """Why no test cluster can start here, or None."""
    missing = missing_programs()
    if missing:
        return (f"Slurm is not installed here (missing {', '.join(missing)}); the README's test command installs "
                "Debian's slurm-wlm and munge when run as root")
    if os.geteuid() != 0:
        return "the private Slurm cluster runs its daemons as root; run the tests as root"
    return None


def _program(name: str) -> str:
    return shutil.which(name) or f"/usr/sbin/{name}"


def _free_ports(count: int) -> list[int]:
    ports: list[int] = []
    for _ in range(count):
        ports.append(free_port(taken=tuple(ports)))
    return ports


def _free_pair(taken: tuple[int, ...]) -> int:
    """A free port whose next one is free too (a job's rendezvous, and preflight's one above it)."""
    while True:
        port = free_port(taken)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
        if port + 1 not in taken:
            return port


class SlurmCluster:
    def __init__(self, root: Path, nodes: int = 2, cpus_per_node: int = 2):
        self.root, self.nodes, self.cpus = Path(root), nodes, cpus_per_node
        self.node_names = [f"node{i + 1}" for i in range(nodes)]
        self.conf = self.root / "slurm.conf"
        self.sockets: Path | None = None  # made when the cluster starts
        self.rendezvous_port = 0  # drawn when the cluster starts (run_args)
        self._pids: list[Path] = []

    @property
    def env(self) -> dict[str, str]:
        return {"SLURM_CONF": str(self.conf)}

    @property
    def overrides(self) -> list[str]:
        """The profile's settings for jobs on this cluster: their rendezvous on ports of its own. The profile's
        (torchrun's 29500) would be every other test run's on this host too, and all its nodes are this host."""
        return [f"slurm.rendezvous_port={self.rendezvous_port}"]

    @property
    def run_args(self) -> tuple[str, ...]:
        """The overrides as `harness run` and `harness preflight` options."""
        return tuple(arg for override in self.overrides for arg in ("--set", override))

    @property
    def munge_socket(self) -> Path:
        assert self.sockets is not None, "the cluster has not started"
        return self.sockets / "munge" / "munge.socket"

    def start(self) -> "SlurmCluster":
        self.root.mkdir(parents=True, exist_ok=True)
        self.sockets = Path(tempfile.mkdtemp(prefix="slurm-", dir="/tmp"))
        self._start_munge()
        self._write_conf()
        env = {**os.environ, **self.env}
        subprocess.run([_program("slurmctld"), "-f", str(self.conf)], env=env, check=True, timeout=60)
        self._pids.append(self.root / "slurmctld.pid")
        for name in self.node_names:
            subprocess.run([_program("slurmd"), "-N", name, "-f", str(self.conf)], env=env, check=True, timeout=60)
            self._pids.append(self.root / f"slurmd-{name}.pid")
        self._wait_idle()
        return self

    def _start_munge(self) -> None:
        folder = self.munge_socket.parent
        folder.mkdir(parents=True, mode=0o700)
        key = folder / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        subprocess.run([_program("munged"), "--force", f"--socket={self.munge_socket}", f"--key-file={key}",
                        f"--pid-file={folder / 'munged.pid'}", f"--log-file={self.root / 'munged.log'}",
                        f"--seed-file={folder / 'munged.seed'}"], check=True, timeout=30)
        self._pids.append(folder / "munged.pid")

    def _write_conf(self) -> None:
        ports = _free_ports(1 + self.nodes)
        ctld_port, *node_ports = ports
        self.rendezvous_port = _free_pair(tuple(ports))
        (self.root / "state").mkdir()
        nodes = "\n".join(
            f"NodeName={name} NodeHostname=localhost NodeAddr=127.0.0.1 Port={port} CPUs={self.cpus} State=UNKNOWN"
            for name, port in zip(self.node_names, node_ports))
        self.conf.write_text(f"""\
ClusterName=harness-test
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket},cred_expire=10
StateSaveLocation={self.root / 'state'}
SlurmdSpoolDir={self.sockets}/spool-%n
SlurmctldPidFile={self.root}/slurmctld.pid
SlurmdPidFile={self.root}/slurmd-%n.pid
SlurmctldLogFile={self.root}/slurmctld.log
SlurmdLogFile={self.root}/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=none
ReturnToService=1
SchedulerType=sched/backfill
# A requeued job waits for the periodic full scheduling pass (every 60 s by default) to be judged
SchedulerParameters=sched_interval=2
InactiveLimit=0
KillWait=5
MinJobAge=300
{nodes}
PartitionName=debug Nodes={','.join(self.node_names)} Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
""")

    def _wait_idle(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        out = ""
        while time.monotonic() < deadline:
            proc = subprocess.run([_program("sinfo"), "-h", "-N", "-o", "%N %t"], env={**os.environ, **self.env},
                                  capture_output=True, text=True)
            out = proc.stdout + proc.stderr
            states = dict(line.split() for line in proc.stdout.splitlines() if len(line.split()) == 2)
            if len(states) == self.nodes and all(s == "idle" for s in states.values()):
                return
            time.sleep(0.5)
        raise RuntimeError(f"the test Slurm cluster did not come up: {out}\n{self.logs()}")

    def logs(self) -> str:
        return "\n".join(f"==> {p.name} <==\n{p.read_text(errors='replace')[-3000:]}"
                         for p in sorted(self.root.rglob("*.log")))

    def stop(self) -> None:
        """Cancel the jobs still there (a failed test's), then stop the daemons. slurmd leaves its jobs' steps
        running when it stops, as across a restart of its own: they would outlive the session, holding their
        ports (a rendezvous left hung here waited on for 10 minutes after its test had failed)."""
        env = {**os.environ, **self.env}
        try:
            subprocess.run([_program("scancel"), "--partition=debug"], env=env, capture_output=True, timeout=60)
            deadline = time.monotonic() + 120
            while time.monotonic() < deadline and subprocess.run(
                    [_program("squeue"), "-h"], env=env, capture_output=True, text=True, timeout=60).stdout.strip():
                time.sleep(0.5)
        except subprocess.TimeoutExpired:
            pass  # a controller that does not answer: stop it anyway
        for pid_file in reversed(self._pids):
            try:
                pid = int(pid_file.read_text().split()[0])
                os.kill(pid, signal.SIGTERM)
            except (OSError, ValueError, IndexError):
                continue
            deadline = time.monotonic() + 15
            while time.monotonic() < deadline and Path(f"/proc/{pid}").exists():
                time.sleep(0.1)
        if self.sockets is not None:
            shutil.rmtree(self.sockets, ignore_errors=True)
