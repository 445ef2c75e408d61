"""The vision towers over packed patches (Qwen2-VL / 2.5-VL, Qwen3-VL / 3.5, CLIP / SigLIP), the layers they share
(`layers`), their geometry and load-time fusions, and the `GraphTower` protocol the graph runner drives (`tower`).

No tower imports another tower (`tests/unit/test_architecture.py`)."""
