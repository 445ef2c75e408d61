"""Processes by session id, from /proc (Linux): what a test started with `start_new_session=True` left running."""

from __future__ import annotations

import os


def session_processes(sid: int) -> dict[int, str]:
    """The live (not zombie: a zombie has exited, waiting to be reaped) processes whose session id is `sid`, as
    pid -> the first 120 characters of the command line."""
    found = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as fh:
                fields = fh.read().rsplit(")", 1)[1].split()
            if fields[0] == "Z" or int(fields[3]) != sid:
                continue
            with open(f"/proc/{name}/cmdline", "rb") as fh:
                found[int(name)] = fh.read().replace(b"\0", b" ").decode(errors="replace")[:120]
        except (OSError, IndexError, ValueError):  # gone meanwhile
            continue
    return found
