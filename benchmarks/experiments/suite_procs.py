"""Which processes the test suite's CPU time goes to (issue 18: the full suite in 8 minutes on 2 cores).

`suite_cpu.py` says how busy the machine is per test module; this says who is busy. A pytest plugin that starts
a sampler process: every 0.2 s it reads every process's CPU time from `/proc` and keeps, per process (pid and
start time), its command line (Ray workers rename themselves `ray::SERVE_REPLICA::app#Deployment#id...` once
they are actors) and the last CPU time seen. At the end it writes the CPU-seconds per kind of process (encoder
replicas, ingress replicas, the Serve controller and proxy, Ray Data workers, Ray's own daemons, decode
processes, pytest, the subprocesses tests start) and how many processes of each kind there were.

    python -m pytest -q -m slow -p benchmarks.experiments.suite_procs   # table in suite_procs.txt (SUITE_PROCS_OUT)

Linux only. Processes shorter than one sample are missed, and a process's last 0.2 s may be; kernel threads
and processes that existed before the session (but pytest's own) are left out. The raw samples stay in
`suite_procs.txt.json`.

Answer (2-core CPU box, issue 18, 2026-12-02): of ≈ 1,185 CPU-s in the slow suite, encoder replicas took 277, Ray
Data workers 166, Ray's daemons 162, pytest 158 and ingress replicas 125; a replica is ≥ 5.5 CPU-s of imports before
any work (torch ≈ 3, Serve ≈ 3), so process start-ups, not encoding, dominate.
"""

from __future__ import annotations

import collections
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

_OUT = os.environ.get("SUITE_PROCS_OUT", "suite_procs.txt")
_STOP = Path(_OUT + ".stop")  # its existence tells the sampler to write what it saw and exit
_INTERVAL_S = 0.2
_sampler: subprocess.Popen | None = None

# (pattern in the command line, kind); the first that matches names the process
KINDS = [
    (r"VisionEncoder", "encoder replicas"),
    (r"VisionIngress", "ingress replicas"),
    (r"ServeController", "Serve controller"),
    (r"ProxyActor|HAProxy", "Serve proxies"),
    (r"MapBatches|MapWorker|Repartition|_StatsActor|Autoscaling|ActorLocation|Read|Write", "Ray Data workers"),
    (r"gcs_server|raylet|dashboard|log_monitor|monitor\.py|RuntimeEnvAgent|DashboardAgent", "Ray daemons"),
    (r"multiprocessing\.(forkserver|resource_tracker|spawn)", "decode processes"),
    (r"pytest", "pytest"),
    (r"^ray::|default_worker\.py", "other Ray workers and actors"),
    (r"python", "subprocesses started by tests"),
]


def _read(pid: str) -> tuple[str, float, str] | None:
    """(start time, CPU-seconds, command line) of a process, or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            stat = fh.read()
        with open(f"/proc/{pid}/cmdline") as fh:
            cmd = fh.read().replace("\0", " ").strip()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()
    return fields[19], (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK"), cmd


def sample(out: str, stop: str) -> None:
    """The sampler process: until the file `stop` exists, then write the processes seen to `out` (JSON)."""
    before = {pid for pid in os.listdir("/proc") if pid.isdigit()} - {str(os.getppid())}  # pytest itself counts
    seen: dict[str, dict] = {}
    while not os.path.exists(stop):
        for pid in os.listdir("/proc"):
            if not pid.isdigit() or pid in before or int(pid) == os.getpid():
                continue
            got = _read(pid)
            if got is None or not got[2]:  # gone, or a kernel thread
                continue
            start, cpu, cmd = got
            entry = seen.setdefault(f"{pid}:{start}", {"cmd": cmd, "cpu": cpu})
            entry["cpu"] = cpu
            if cmd.startswith("ray::") and not cmd.startswith("ray::IDLE"):  # an actor's name, once it has one
                entry["cmd"] = cmd
        time.sleep(_INTERVAL_S)
    Path(out).write_text(json.dumps(seen))


def table(seen: dict[str, dict]) -> str:
    cpu: collections.Counter = collections.Counter()
    count: collections.Counter = collections.Counter()
    for entry in seen.values():
        kind = next((k for pattern, k in KINDS if re.search(pattern, entry["cmd"])), None)
        if kind is not None:
            cpu[kind] += entry["cpu"]
            count[kind] += 1
    lines = ["| processes | how many | CPU-s |", "| --- | ---: | ---: |"]
    lines += [f"| {kind} | {count[kind]} | {seconds:.1f} |" for kind, seconds in cpu.most_common()]
    lines.append(f"| all | {sum(count.values())} | {sum(cpu.values()):.1f} |")
    return "\n".join(lines) + "\n"


def pytest_sessionstart(session) -> None:
    global _sampler
    if os.environ.get("PYTEST_XDIST_WORKER"):  # under `-n`: one sampler, the controller's, sees every process
        return
    _STOP.unlink(missing_ok=True)
    _sampler = subprocess.Popen([sys.executable, __file__, _OUT + ".json", str(_STOP)])


def pytest_sessionfinish(session) -> None:
    if _sampler is None:
        return
    _STOP.write_text("")
    _sampler.wait(timeout=60)
    _STOP.unlink(missing_ok=True)
    Path(_OUT).write_text(table(json.loads(Path(_OUT + ".json").read_text())))


if __name__ == "__main__":
    sample(sys.argv[1], sys.argv[2])
