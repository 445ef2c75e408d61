"""A decode function for DecodePool tests that misbehaves on request (it runs in the worker processes,
so it lives in an importable module, not in the test file)."""

from __future__ import annotations

import os
import signal
import time

from deployments.ingress.decode_pool import decode_rgb


def misbehaving_decode(data: bytes, cfg):
    if data == b"sleep":
        time.sleep(600)  # far past any deadline a test uses: the pool must kill this worker
    if data == b"exit":
        os._exit(3)
    if data == b"segfault":
        os.kill(os.getpid(), signal.SIGSEGV)
    if data == b"bug":
        raise KeyError("a bug in the decode function")
    if data == b"pid":
        return [[[os.getpid() % 256]]]  # tells the test which worker answered (as a 1x1x1 array)
    return decode_rgb(data, cfg)
