"""Image preprocessing without torch: decoding, structural limits (`image_guard`), resizing equal to Hugging Face's
processors (`qwen`, `vit`) and their settings (`config`). The ingress and the batch job's decode tasks use it in
processes that never import torch; nothing below this folder imports torch (`tests/unit/test_architecture.py`)."""
