"""Embed an image over HTTP with httpx: `POST /v1/embeddings` with a data URL.

python -m deployments --port 8000     # in another terminal (or: serve run deployments:app)
python examples/http_client.py --url http://127.0.0.1:8000 --image examples/images/gradient.jpg
"""

from __future__ import annotations

import argparse
import base64
import mimetypes
from pathlib import Path

import httpx

DEFAULT_IMAGE = Path(__file__).parent / "images" / "gradient.jpg"


def data_url(path: str | Path) -> str:
    """`data:image/jpeg;base64,...` for an image file."""
    media = mimetypes.guess_type(str(path))[0] or "image/png"
    return f"data:{media};base64,{base64.b64encode(Path(path).read_bytes()).decode()}"


def main(base_url: str = "http://127.0.0.1:8000", image: str | Path = DEFAULT_IMAGE) -> dict:
    """Post one image, mean-pooled and per-token; return the two responses' JSON."""
    with httpx.Client(base_url=base_url, timeout=60) as client:
        model = client.get("/v1/models").raise_for_status().json()["data"][0]["id"]
        mean = client.post("/v1/embeddings", json={"model": model, "input": [data_url(image)]}).raise_for_status()
        tokens = client.post(
            "/v1/embeddings", json={"model": model, "input": data_url(image), "pooling": "none"}
        ).raise_for_status()
    mean, tokens = mean.json(), tokens.json()
    vector = mean["data"][0]["embedding"]
    print(f"model {model}: {len(vector)}-dim embedding, {mean['usage']['prompt_tokens']} patches")
    print(f"pooling=none: {tokens['data'][0]['shape']} token matrix")
    return {"mean": mean, "none": tokens}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--image", default=str(DEFAULT_IMAGE))
    args = parser.parse_args()
    main(args.url, args.image)
