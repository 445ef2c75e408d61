"""The ingress wing (CPU): the `VisionIngress` deployment, its HTTP routes and handle methods, the OpenAI schema,
admission and limits, security, image decoding (in the decode pool's processes) and the calls to the encoder replicas.

Imports no torch and nothing of the replica wing (`tests/unit/test_architecture.py`)."""
