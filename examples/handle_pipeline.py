"""Embed images from a Python pipeline through a Ray Serve `DeploymentHandle` (no HTTP).

    # start the tiny service inside this process (its own Ray instance):
    python examples/handle_pipeline.py --local
    # or against a service on a cluster you started (`ray start` prints its address; a Ray instance that
    # `serve run` or `python -m deployments` starts by itself cannot be joined by other processes):
    ray start --head --port 6380 && python -m deployments --address 127.0.0.1:6380    # another terminal
    RAY_AUTH_MODE=token python examples/handle_pipeline.py --address 127.0.0.1:6380 --app default

Ray 2.60 clusters use token authentication: RAY_AUTH_MODE=token makes this process send the cluster's
token (~/.ray/auth_token, written by `ray start`; `ray get-auth-token` prints it); without it every
connection attempt fails with InvalidAuthToken. There is no default address: `auto` would join whichever
cluster runs on this machine, maybe another user's.

`embed(images, pooling="mean")` takes encoded bytes, PIL images, uint8 arrays (and data URLs) and
returns one float32 numpy array per image. Many concurrent calls are merged by the ingress.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

import numpy as np
from PIL import Image

DEFAULT_IMAGE = Path(__file__).parent / "images" / "gradient.jpg"


async def embed_stream(handle, batches: list[list], pooling: str = "mean") -> list[list[np.ndarray]]:
    """Many calls in flight at once (how a pipeline keeps the GPU busy): one call per batch."""
    return list(await asyncio.gather(*(handle.embed.remote(b, pooling=pooling) for b in batches)))


def main(handle, image: str | Path = DEFAULT_IMAGE) -> list[np.ndarray]:
    """Embed one image given three ways (bytes, PIL, array), then a stream of small batches."""
    data = Path(image).read_bytes()
    pil = Image.open(image).convert("RGB")
    pixels = np.asarray(pil)[::2, ::2].copy()  # any uint8 HxWx3 array
    vectors = handle.embed.remote([data, pil, pixels]).result()
    print("embed([bytes, PIL, array]) ->", [v.shape for v in vectors])
    tokens = handle.embed.remote([data], pooling="none").result()[0]
    print("pooling='none' ->", tokens.shape)
    batches = [[pixels[: 56 + 28 * i]] for i in range(8)]
    results = asyncio.run(embed_stream(handle, batches))
    print(f"{len(results)} concurrent calls ->", [r[0].shape for r in results])
    return vectors


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--app", default="default", help="name of a running Serve application (`serve run` names it default)"
    )
    parser.add_argument("--address", default=None, help="Ray cluster address (GCS host:port) of the service")
    parser.add_argument("--local", action="store_true", help="start the tiny service in this process")
    parser.add_argument("--image", default=str(DEFAULT_IMAGE))
    args = parser.parse_args()
    if not args.local and not args.address:
        parser.error("give --local (start the service here) or --address HOST:PORT of the cluster running it")

    import ray
    from ray import serve

    if args.local:
        import sys

        sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo, if not pip-installed
        import deployments
        from deployments.ray_compat import quiet_serve_noise, quiet_serve_shutdown_notice, quiet_token_auth_notice

        # quiet, as the launcher: no token-authentication notice (authentication stays on), Ray and Serve at
        # WARNING and above, none of the two Serve INFO lines quiet_serve_noise drops
        quiet_token_auth_notice()
        quiet_serve_shutdown_notice()
        quiet_serve_noise()
        logging.getLogger("ray.serve").setLevel(logging.WARNING)  # this driver's Serve lines (start, app ready)
        ray.init(address="local", num_cpus=4, logging_level=logging.WARNING)  # a Ray instance of our own
        # handles only: no HTTP proxy, so no port is opened
        serve.start(proxy_location="Disabled", logging_config={"log_level": "WARNING"})
        app = deployments.build_app({})
        handle = serve.run(app, name=args.app, route_prefix=None, logging_config={"log_level": "WARNING"})
    else:
        ray.init(address=args.address)
        handle = serve.get_app_handle(args.app)
    main(handle, args.image)
