"""`python -m tests.serve_run_port PORT ARGS...`: Serve's `serve run ARGS...` with its HTTP proxy on
127.0.0.1:PORT. The CLI takes no port for an import path (only a YAML config sets one, and `serve run` of a
YAML never imports the application in its own process, so it could not drain on a signal); tests need a free
port because other runs share the machine. Everything else is the real CLI, signals included."""

from __future__ import annotations

import sys

from ray.serve import scripts

PORT = int(sys.argv[1])
_start = scripts._private_api.serve_start


def _serve_start(http_options=None, **kwargs):
    return _start(http_options={**(http_options or {}), "host": "127.0.0.1", "port": PORT}, **kwargs)


scripts._private_api.serve_start = _serve_start

if __name__ == "__main__":
    scripts.cli(["run", *sys.argv[2:]], prog_name="serve")
