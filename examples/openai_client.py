"""Embed an image with the official `openai` client pointed at the local service.

    python -m deployments --port 8000    # in another terminal (or: serve run deployments:app)
    python examples/openai_client.py --url http://127.0.0.1:8000

The client sends `encoding_format="base64"` unless told otherwise and decodes it as float32; both work.
Extension fields (`pooling`, `embedding_dtype`) go through `extra_body`. With `embedding_dtype` pass
`encoding_format="base64"` yourself: the client then hands over the base64 text, to decode in that dtype
(left to the client, it would read the float16 bytes as float32: half as many values, all wrong).
"""

from __future__ import annotations

import argparse
import base64
from pathlib import Path

import numpy as np
from openai import OpenAI

DEFAULT_IMAGE = Path(__file__).parent / "images" / "gradient.jpg"


def main(base_url: str = "http://127.0.0.1:8000", image: str | Path = DEFAULT_IMAGE) -> tuple[list[float], np.ndarray]:
    """One mean-pooled embedding of `image`, as a list of floats, and the same in float16."""
    client = OpenAI(base_url=f"{base_url}/v1", api_key="not-checked")
    model = client.models.list().data[0].id
    url = "data:image/jpeg;base64," + base64.b64encode(Path(image).read_bytes()).decode()
    response = client.embeddings.create(model=model, input=[url])
    vector = response.data[0].embedding
    tokens = client.embeddings.create(model=model, input=[url], encoding_format="float", extra_body={"pooling": "none"})
    half = client.embeddings.create(
        model=model, input=[url], encoding_format="base64", extra_body={"embedding_dtype": "float16"}
    )
    half_vector = np.frombuffer(base64.b64decode(half.data[0].embedding), dtype="<f2")  # half the bytes
    print(f"{model}: {len(vector)}-dim embedding, {response.usage.prompt_tokens} patches; "
          f"pooling=none gives {len(tokens.data[0].embedding)} token vectors; "
          f"float16 differs by {np.abs(half_vector - np.asarray(vector)).max():.1e} at most")  # fmt: skip
    return vector, half_vector


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--image", default=str(DEFAULT_IMAGE))
    args = parser.parse_args()
    main(args.url, args.image)
