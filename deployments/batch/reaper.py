"""Ray processes of a batch job whose driver was SIGKILLed are ended (Linux).

Why: `ray.init()` in the driver starts a local cluster (GCS, raylet, dashboard and runtime-env agents,
workers). A normal exit, an exception or Ctrl-C runs Ray's own shutdown; a SIGKILL runs nothing, and the
agents were left running (issue 17). So before starting a local cluster the driver starts a small watcher in
its own session: it notes the processes below the driver at once and every `POLL_S` (pid and start time,
read from /proc), and when the driver's end of a pipe closes (the driver is gone, however it ended) it sends
SIGTERM to those still running, then SIGKILL after `GRACE_S`. A pid is only signalled if its start time is the
one noted, so a reused pid is never hit. Nothing happens on a cluster the job joined (`--address`) or without
/proc.

Processes started since the last poll: once the driver is gone, no /proc walk from it reaches its children,
so the watcher also looks below the processes it noted (a worker the raylet started a moment before, or
while it goes down), and for Ray workers whose raylet is already gone (the raylet dies with the driver:
its newest workers are then orphans). Such a worker is taken only if it is in the driver's session, started
after the driver, and its parent is no raylet: another job's workers keep their live raylet as parent.
Without these, a worker the raylet had just started lived on for ~20 s until it gave up on its raylet
(half the runs of `test_batch_reaper.py`, 2026-12-03).
"""

from __future__ import annotations

import os
import select
import subprocess
import sys

POLL_S = 1.0
GRACE_S = 5.0
STARTED_WITHIN_S = 30.0  # the watcher's first note; it imports only the standard library and starts in ~50 ms

# The watcher's code (run with `python -c`, so it imports nothing of ours and starts fast).
_WATCHER = r"""
import os, select, signal, sys, time
driver, poll_s, grace_s = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])

def stat(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return int(fields[1]), fields[19], int(fields[3])  # ppid, start time, session id
    except (OSError, IndexError, ValueError):
        return None

def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as fh:
            return fh.read(4096).replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""

def is_ray_worker(pid):
    line = cmdline(pid)  # a worker's title once it runs, its command line while it starts
    return line.startswith("ray::") or "ray/_private/workers/default_worker.py" in line

def processes():
    # every process now: pid -> (ppid, start time, session id), from one pass over /proc
    procs = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            s = stat(int(name))
            if s is not None:
                procs[int(name)] = s
    return procs

def below(roots, procs):
    # every process below the live ones of `roots` ({pid: start time, or None for the driver}), by pid
    children = {}
    for pid, (ppid, start, sid) in procs.items():
        children.setdefault(ppid, []).append(pid)
    todo = [p for p, start in roots.items() if p in procs and start in (None, procs[p][1])]
    found = {}
    while todo:
        for pid in children.get(todo.pop(), ()):
            if pid not in found and pid not in roots and pid != os.getpid():
                found[pid] = procs[pid][1]
                todo.append(pid)
    return found

def orphaned_workers(procs):
    # Ray workers of the driver's session started after it whose parent is no raylet (theirs died with the driver)
    found = {}
    for pid, (ppid, start, sid) in procs.items():
        if pid not in noted and sid == driver_sid and int(start) > int(driver_start) and is_ray_worker(pid):
            if "raylet" not in cmdline(ppid):
                found[pid] = start
    return found

def late(roots):
    # started since the last look: below `roots`, or Ray workers orphaned by their raylet
    procs = processes()
    return below(roots, procs) | orphaned_workers(procs)

first = stat(driver)
if first is None:
    sys.exit()  # gone before anything was started
_, driver_start, driver_sid = first
noted = below({driver: None}, processes())
os.write(1, b"1")  # the driver's start_reaper returns: what runs below it now is noted
os.close(1)
while True:
    ready, _, _ = select.select([sys.stdin], [], [], poll_s)
    if ready and not os.read(sys.stdin.fileno(), 1):
        break  # the driver's end closed: it is gone
    noted.update(below({driver: None, **noted}, processes()))
noted.update(late(noted))

def alive(pid, start):
    s = stat(pid)
    return s is not None and s[1] == start

def signal_all(pids, sig):
    for pid in pids:
        try:
            os.kill(pid, sig)
        except OSError:
            pass

for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
    left = {pid: start for pid, start in noted.items() if alive(pid, start)}
    signal_all(left, sig)
    deadline = time.monotonic() + wait
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        new = late(left)  # started while they go down
        signal_all(new, sig)
        noted.update(new)
        left = {pid: start for pid, start in {**left, **new}.items() if alive(pid, start)}
    if not left:
        break
"""

_pipe_end: int | None = None  # the driver's end of the pipe; open for the driver's life


def start_reaper(poll_s: float = POLL_S, grace_s: float = GRACE_S) -> bool:
    """Start the watcher for this process's descendants (once); False where /proc is missing. Returns once
    the watcher has noted the processes already running below this one."""
    global _pipe_end
    if _pipe_end is not None:
        return True
    if not os.path.isdir("/proc/self"):
        return False
    read_end, write_end = os.pipe()
    watcher = subprocess.Popen(
        [sys.executable, "-c", _WATCHER, str(os.getpid()), str(poll_s), str(grace_s)],
        stdin=read_end,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # not in the driver's process group: a group signal to the job spares it
        close_fds=True,
    )
    os.close(read_end)
    _pipe_end = write_end  # not inherited by Ray's processes (pipes are created non-inheritable)
    # its first note; without it (a watcher that cannot start) the job runs as it would without /proc
    select.select([watcher.stdout], [], [], STARTED_WITHIN_S)
    watcher.stdout.close()
    return True
