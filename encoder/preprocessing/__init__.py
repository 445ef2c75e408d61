"""Image preprocessing without torch: decoding (`images`), structural limits (`image_guard`), and one config type
per family with its resize equal to Hugging Face's processor (`qwen.PreprocessConfig`, `vit.VitPreprocessConfig`;
what both offer is `config.ProcessorConfig`: `resize`, `num_patches`, `kind`; `families` reads either back from its
dump). The ingress and the batch job's decode tasks use it in processes that never import torch; nothing below this
folder imports torch (`tests/unit/test_architecture.py`)."""
