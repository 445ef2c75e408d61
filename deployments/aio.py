"""asyncio helpers of the request path: awaiting several things as one, and awaiting a handle call so that
giving up on it also cancels it where it runs."""

from __future__ import annotations

import asyncio


async def gather_or_cancel(aws) -> list:
    """`asyncio.gather` that cancels the other awaitables when one fails (gather alone lets them run on: a
    request refused for one image would keep its other images decoding, or its other packs encoding)."""
    tasks = [asyncio.ensure_future(a) for a in aws]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for t in tasks:
            t.cancel()
        raise


async def await_cancelling(response):
    """`await response` (a Serve `DeploymentResponse`), cancelling the call when this await is cancelled.

    Serve cancels a replica's child calls when the replica's own request is cancelled (its client
    disconnected), but an await that is cancelled for any other reason (the request's deadline, a sibling
    pack that failed) only stops waiting: without `cancel()` the encoder would still run the work."""
    try:
        return await response
    except asyncio.CancelledError:
        response.cancel()
        raise
