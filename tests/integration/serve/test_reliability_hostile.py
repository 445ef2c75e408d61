"""Cheap hostile requests and abandoned work on CPU Ray (issue 17, cases 1 and 2).

One encoder replica behind one ingress, scaled down so the mechanisms show on a 2-core box: a 1 s decode
deadline with two decode processes (a progressive JPEG under the 100-scan limit takes 3.7 s at 7000x7000), a
6 s request deadline, and packs of one 448x448 image (1,024 patches, ~0.5-1 s of CPU each) so that a
request of 160 such images is 19 s of encoder work at the very least. The inputs are generated
(`tests.jpeg_bombs`, uniform PNGs); nothing sleeps to synchronise: the tests poll the service's counters.
"""

from __future__ import annotations

import base64
import io
import threading
import time

import httpx
import pytest
from PIL import Image
from ray import serve

from deployments.config import ENCODER_NAME
from tests.jpeg_bombs import scan_bomb
from tests.serve_fixtures import app_fixture, wait_for

pytestmark = pytest.mark.slow

APP = "hostile"
DEADLINE_S = 6.0
ARGS = {
    "model": "tiny",
    "num_replicas": 1,
    "decode_processes": 2,
    "decode_timeout_s": 1.0,
    "request_timeout_s": DEADLINE_S,
    "max_batch_patches": 1024,
    "ingress_packs_in_flight": 2,
}
HEAVY_IMAGES = 160  # 0.12-0.8 s each on this CPU: 19 s at the very least, against the 6 s deadline

app = app_fixture(ARGS, APP)


def data_url(data: bytes, media: str = "image/png") -> str:
    return f"data:{media};base64," + base64.b64encode(data).decode()


def png(side: int, color=(90, 120, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (side, side), color).save(buf, format="PNG")
    return buf.getvalue()


SMALL = data_url(png(64, (10, 200, 90)))
HEAVY = {"input": [data_url(png(448, (i, 255 - i, 7))) for i in range(HEAVY_IMAGES)]}
# under the scan limit and the 50 M pixel limit, so only the decode deadline stops it: 3.7 s of libjpeg at
# 7000x7000 on an idle 2-core box (2026-12-02), against the 1 s deadline. At 4096x4096 it took 1.26-1.8 s, and a
# fast hour decoded it inside the deadline (200 instead of 413): the margin has to be wide
POOL_BOMB = data_url(scan_bomb(98, 7000, 7000), "image/jpeg")


@pytest.fixture(scope="module")
def client(app):
    with httpx.Client(base_url=app.base_url, timeout=60) as c:
        assert c.post("/v1/embeddings", json={"input": [SMALL]}).status_code == 200  # starts the decode processes
        wait_for(lambda: len(decode_pids(app)) == 2, timeout_s=120, what="the decode processes")
        yield c


@pytest.fixture(scope="module")
def encoder_handle(app):
    return serve.get_deployment_handle(ENCODER_NAME, app_name=APP)


def decode_pids(app) -> list[int]:
    return app.handle.ingress_stats.remote().result(timeout_s=30)["decode_pids"]


def timed_post(client: httpx.Client, body: dict) -> tuple[httpx.Response, float]:
    started = time.monotonic()
    r = client.post("/v1/embeddings", json=body)
    return r, time.monotonic() - started


def in_thread(fn, *args) -> tuple[threading.Thread, list]:
    out: list = []
    t = threading.Thread(target=lambda: out.append(fn(*args)), daemon=True)
    t.start()
    return t, out


def replica_stats(encoder_handle) -> dict:
    return encoder_handle.stats.remote().result(timeout_s=30)


@pytest.mark.parametrize(
    "bomb, code",
    [(data_url(scan_bomb(24_000), "image/jpeg"), "image_too_complex"), (POOL_BOMB, "image_decode_timeout")],
    ids=["scan-limit", "decode-deadline"],
)
def test_a_scan_bomb_is_refused_and_health_answers_meanwhile(app, client, bomb, code):
    """The issue's 288 KB bomb (24,000 scans) is refused by its structure; one under the scan limit is
    stopped by the decode deadline in a decode process; /health answers within 1.5 s all along."""
    thread, out = in_thread(timed_post, httpx.Client(base_url=app.base_url, timeout=60), {"input": [bomb]})
    health = []
    with httpx.Client(base_url=app.base_url, timeout=10) as probe:
        while thread.is_alive() or not health:
            started = time.monotonic()
            health.append((probe.get("/health").status_code, time.monotonic() - started))
            time.sleep(0.1)  # pacing the probes, as a load balancer does
    thread.join()
    r, seconds = out[0]
    assert r.status_code == 413 and r.json()["error"]["code"] == code, r.text
    assert r.json()["error"]["message"].startswith("input[0]: "), r.text
    # working: 0.04 s (scan limit), 1.07 s (the 1 s deadline); broken, the bomb decodes for 3.7 s and is answered
    # 200 (the status above). The bound only says "promptly", 5x what the deadline case takes
    assert seconds < 6.0, seconds
    assert all(status == 200 and s < 1.5 for status, s in health), health
    print(f"{code}: 413 in {seconds:.2f}s; /health x{len(health)}, slowest {max(s for _, s in health):.3f}s")


def test_pool_bombs_cost_their_senders_a_worker_for_the_deadline(app, client):
    """Four bombs at once get 413 (their workers are killed at the 1 s deadline and replaced: 1.05-2.06 s on this
    box; bounded at 11 s, 5x that); a two-image request sent 2 s after them succeeds within 5 s (0.14 s)."""
    pids = decode_pids(app)
    bombs = [
        in_thread(timed_post, httpx.Client(base_url=app.base_url, timeout=60), {"input": [POOL_BOMB]}) for _ in range(4)
    ]
    sent = time.monotonic()
    # the scenario's gap, not a synchronisation: the good request goes while the bombs hold the workers
    time.sleep(max(0.0, sent + 2.0 - time.monotonic()))
    r, seconds = timed_post(client, {"input": [data_url(png(300)), data_url(png(200, (1, 2, 3)))]})
    assert r.status_code == 200 and len(r.json()["data"]) == 2, r.text
    assert seconds < 5.0, seconds
    bomb_times = []
    for thread, out in bombs:
        thread.join()
        bomb, bomb_s = out[0]
        assert bomb.status_code == 413 and bomb.json()["error"]["code"] == "image_decode_timeout", bomb.text
        assert bomb_s < 11.0, bomb_s
        bomb_times.append(round(bomb_s, 2))
    print(f"four pool bombs: 413 after {sorted(bomb_times)} s; the two-image request 2 s later: {seconds:.2f}s")
    wait_for(lambda: len(decode_pids(app)) == 2, timeout_s=30, what="the replaced decode processes")
    assert not set(decode_pids(app)) & set(pids)  # every worker was bombed, killed and replaced


def good_requests_after(client: httpx.Client, t0: float, grace_s: float = 2.0, span_s: float = 3.0) -> list:
    """One-image requests in a closed loop from `t0` until `t0 + grace + span`; those sent after the grace.

    The check after it must come well before the heavy request's work could have ended on its own (19 s at
    the very least from its start): work not dropped is then still queued or running, and seen."""
    results = []
    while time.monotonic() < t0 + grace_s + span_s:
        sent = time.monotonic()
        r, seconds = timed_post(client, {"input": [SMALL]})
        if sent >= t0 + grace_s:
            results.append((r.status_code, seconds))
    return results


def heavy_images_encoded(stats: dict) -> int:
    """Images replayed in the 1024-patch bucket: the heavy request's (the small ones fit the 256 bucket)."""
    return sum(n for budget, n in stats["replays"].items() if int(budget) == 1024)


def assert_others_served_then_heavy_work_dropped(client, t0: float, encoder_handle, before: dict, what: str):
    """After the heavy request ended at `t0` (answered or abandoned), other one-image requests are answered 200
    within 5 s each, and the heavy request's remaining work was dropped."""
    results = good_requests_after(client, t0)
    assert results and all(status == 200 and s < 5.0 for status, s in results), results
    print(f"{what}; then {len(results)} good requests, slowest {max(s for _, s in results):.2f}s")
    stats = replica_stats(encoder_handle)
    assert stats["queued_requests"] == 0, stats  # nothing of it is queued or running
    encoded = heavy_images_encoded(stats) - heavy_images_encoded(before)
    assert encoded < HEAVY_IMAGES, encoded  # its packs after the deadline were never run
    print(f"heavy request: {encoded} of its {HEAVY_IMAGES} images were encoded before it was dropped")


def test_a_request_past_the_deadline_is_answered_504_and_its_work_dropped(client, encoder_handle):
    before = replica_stats(encoder_handle)
    r, seconds = timed_post(client, HEAVY)
    assert r.status_code == 504 and r.json()["error"]["code"] == "timeout", r.text
    assert_others_served_then_heavy_work_dropped(
        client, time.monotonic(), encoder_handle, before, f"504 after {seconds:.1f}s"
    )


def test_a_request_abandoned_by_its_client_is_dropped(app, client, encoder_handle):
    before = replica_stats(encoder_handle)
    gone = app.handle.ingress_stats.remote().result(timeout_s=30)["disconnected"]
    with httpx.Client(base_url=app.base_url, timeout=2.0) as impatient:
        with pytest.raises(httpx.TimeoutException):
            impatient.post("/v1/embeddings", json=HEAVY)
    assert_others_served_then_heavy_work_dropped(client, time.monotonic(), encoder_handle, before, "abandoned")
    # counted as a disconnect (broken: counted nowhere)
    assert app.handle.ingress_stats.remote().result(timeout_s=30)["disconnected"] == gone + 1


def test_other_callers_interleave_with_a_heavy_request(app, client, encoder_handle):
    """While a 160-pack request runs, a one-image request from another caller is answered within 5 s."""
    before = replica_stats(encoder_handle)["batches"]
    heavy, out = in_thread(timed_post, httpx.Client(base_url=app.base_url, timeout=60), HEAVY)
    wait_for(lambda: replica_stats(encoder_handle)["batches"] >= before + 1, timeout_s=30, what="the heavy request")
    r, seconds = timed_post(client, {"input": [SMALL]})
    assert r.status_code == 200 and seconds < 5.0, (r.status_code, seconds)
    assert heavy.is_alive()  # it was still running
    print(f"one-image request beside the heavy one: {seconds:.2f}s")
    heavy.join()
