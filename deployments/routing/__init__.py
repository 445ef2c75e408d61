"""Request routing: the bucket-aware router Serve runs in each caller, the stable bucket -> replica assignment, and
the routing stats the replicas publish. Imports neither wing (`tests/unit/test_architecture.py`)."""
