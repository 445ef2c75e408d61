"""Where the test suite's time goes on a small CPU box (issue 18: the full suite in 8 minutes on 2 cores).

A pytest plugin: at each change of test module it reads the machine's CPU counters (`/proc/stat`, every
process on the box, Ray's and the subprocesses' included, which pytest's own timings do not see) and writes one
line per module: wall seconds, busy CPU-seconds of the whole machine, and how busy it was. A module near 100%
is bound by CPU work (processes started, imports, encoding): running it beside others gains nothing; one well
under is waiting (timeouts, health-check periods, start-up sequences) and could overlap with other work.

    python -m pytest -q -m slow -p benchmarks.experiments.suite_cpu   # lines go to suite_cpu.txt (SUITE_CPU_OUT)

Linux only (`/proc/stat`). A module's fixture teardown is counted in the module, its first setup too.

Answer (2-core CPU box, issue 18, 2026-12-02): the slow modules are mostly CPU-bound, not waiting (test_shutdown 98%
busy, multi-node 79%, batch 83%, most Serve modules 69–96%), so running them side by side gains little on 2 cores;
their time is process start-ups and imports (see `suite_procs`).
"""

from __future__ import annotations

import os
import time

_OUT = os.environ.get("SUITE_CPU_OUT", "suite_cpu.txt")
_current: dict[str, object] = {}


def _cpu_seconds() -> tuple[float, float]:
    """(busy, total) CPU-seconds of the machine since boot: user, nice, system, irq, softirq, steal are busy."""
    with open("/proc/stat") as fh:
        user, nice, system, idle, iowait, irq, softirq, steal = (int(v) for v in fh.readline().split()[1:9])
    tick = os.sysconf("SC_CLK_TCK")
    busy = user + nice + system + irq + softirq + steal
    return busy / tick, (busy + idle + iowait) / tick


def _switch(module: str | None) -> None:
    now, (busy, total) = time.monotonic(), _cpu_seconds()
    if "module" in _current:
        wall0, busy0, total0 = _current["start"]
        share = 100 * (busy - busy0) / max(total - total0, 1e-9)
        with open(_OUT, "a") as fh:
            fh.write(f"{now - wall0:7.1f} s wall {busy - busy0:7.1f} cpu-s {share:4.0f}% {_current['module']}\n")
    if module is not None:
        _current.update(module=module, start=(now, busy, total))


def pytest_runtest_setup(item) -> None:
    module = item.nodeid.split("::")[0]
    if module != _current.get("module"):
        _switch(module)


def pytest_sessionfinish(session) -> None:
    _switch(None)
