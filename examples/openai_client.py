"""Embed an image with the official `openai` client pointed at the local service.

    python -m deployments --port 8000    # in another terminal (or: serve run deployments:app)
    python examples/openai_client.py --url http://127.0.0.1:8000

The client sends `encoding_format="base64"` unless told otherwise and decodes it; both work.
Extension fields (`pooling`) go through `extra_body`.
"""

from __future__ import annotations

import argparse
import base64
from pathlib import Path

from openai import OpenAI

DEFAULT_IMAGE = Path(__file__).parent / "images" / "gradient.jpg"


def main(base_url: str = "http://127.0.0.1:8000", image: str | Path = DEFAULT_IMAGE) -> list[float]:
    """One mean-pooled embedding of `image`, as a list of floats."""
    client = OpenAI(base_url=f"{base_url}/v1", api_key="not-checked")
    model = client.models.list().data[0].id
    url = "data:image/jpeg;base64," + base64.b64encode(Path(image).read_bytes()).decode()
    response = client.embeddings.create(model=model, input=[url])
    vector = response.data[0].embedding
    tokens = client.embeddings.create(model=model, input=[url], encoding_format="float", extra_body={"pooling": "none"})
    print(f"{model}: {len(vector)}-dim embedding, {response.usage.prompt_tokens} patches; "
          f"pooling=none gives {len(tokens.data[0].embedding)} token vectors")  # fmt: skip
    return vector


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--image", default=str(DEFAULT_IMAGE))
    args = parser.parse_args()
    main(args.url, args.image)
