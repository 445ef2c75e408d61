"""Ray processes of a batch job whose driver was SIGKILLed are ended (Linux).

Why: `ray.init()` in the driver starts a local cluster (GCS, raylet, dashboard and runtime-env agents,
workers). A normal exit, an exception or Ctrl-C runs Ray's own shutdown; a SIGKILL runs nothing, and the
agents were left running (issue 17). So after starting a local cluster the driver starts a small watcher in
its own session: it notes the driver's descendant processes every `POLL_S` (pid and start time, read from
/proc), and when the driver's end of a pipe closes (the driver is gone, however it ended) it sends SIGTERM to
those still running, then SIGKILL after `GRACE_S`. A pid is only signalled if its start time is the one
noted, so a reused pid is never hit. Nothing happens on a cluster the job joined (`--address`) or without
/proc.
"""

from __future__ import annotations

import os
import subprocess
import sys

POLL_S = 1.0
GRACE_S = 5.0

# The watcher's code (run with `python -c`, so it imports nothing of ours and starts fast).
_WATCHER = r"""
import os, select, signal, sys, time
driver, poll_s, grace_s = int(sys.argv[1]), float(sys.argv[2]), float(sys.argv[3])

def stat(pid):
    try:
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        return int(fields[1]), fields[19]  # ppid, start time
    except (OSError, IndexError, ValueError):
        return None

def descendants():
    parents = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            s = stat(int(name))
            if s is not None:
                parents[int(name)] = s
    found, todo = {}, [driver]
    while todo:
        p = todo.pop()
        for pid, (ppid, start) in parents.items():
            if ppid == p and pid not in found and pid != os.getpid():
                found[pid] = start
                todo.append(pid)
    return found

noted = {}
while True:
    ready, _, _ = select.select([sys.stdin], [], [], poll_s)
    if ready and not os.read(sys.stdin.fileno(), 1):
        break  # the driver's end closed: it is gone
    noted.update(descendants())

def alive(pid, start):
    s = stat(pid)
    return s is not None and s[1] == start

for sig, wait in ((signal.SIGTERM, grace_s), (signal.SIGKILL, 0.0)):
    left = {pid: start for pid, start in noted.items() if alive(pid, start)}
    for pid in left:
        try:
            os.kill(pid, sig)
        except OSError:
            pass
    deadline = time.monotonic() + wait
    while left and time.monotonic() < deadline:
        time.sleep(0.1)
        left = {pid: start for pid, start in left.items() if alive(pid, start)}
    if not left:
        break
"""

_pipe_end: int | None = None  # the driver's end of the pipe; open for the driver's life


def start_reaper() -> bool:
    """Start the watcher for this process's descendants (once); False where /proc is missing."""
    global _pipe_end
    if _pipe_end is not None:
        return True
    if not os.path.isdir("/proc/self"):
        return False
    read_end, write_end = os.pipe()
    subprocess.Popen(
        [sys.executable, "-c", _WATCHER, str(os.getpid()), str(POLL_S), str(GRACE_S)],
        stdin=read_end,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # not in the driver's process group: a group signal to the job spares it
        close_fds=True,
    )
    os.close(read_end)
    _pipe_end = write_end  # not inherited by Ray's processes (pipes are created non-inheritable)
    return True
