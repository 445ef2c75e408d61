"""The encoder replica wing (GPU): the `EncoderReplica` deployment, its device pipeline and its health probe.

Imports nothing of the ingress wing (`tests/unit/test_architecture.py`)."""
