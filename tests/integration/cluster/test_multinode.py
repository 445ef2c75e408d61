"""Scale-out on one machine: the production Serve config and a batch job on a local multi-node Ray cluster.

`ray.cluster_utils.Cluster` starts a head node that advertises `cpu_node` (as cluster.yaml's head does) and
two worker "nodes" with two logical GPUs each (no CUDA here, so the encoder runs its eager CPU path). Then,
through the same CLIs the README's "Scale out" section uses:

* `serve deploy` of deployments/serve_production.yaml with CPU-sized overrides (tiny preset, CPU device,
  fractional CPUs, exactly two encoder replicas): requests over HTTP and the handle succeed, the ingress
  runs on the head, one encoder replica runs on each GPU node, and the bucket router sends the small
  bucket to one of them and the large bucket to the other;
* `ray job submit -- python -m deployments.batch ...` while the service keeps one GPU per node: the job's
  two GPU encoder actors run one on each node.

This module needs its own Ray: it shuts down the session's shared instance (tests/serve_fixtures.py) if one
runs and leaves it down; it is marked `own_ray`, so it runs before every other module (tests/conftest.py),
before anything has started the shared one, and what needs that one after it starts it (`serve_fixtures.ensure_ray`).
The nodes get the repository on PYTHONPATH (what `pip install -e .` does on a real cluster).
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import ray
import yaml
from ray import serve

from deployments.config import DEFAULT_APP_NAME, ENCODER_NAME, INGRESS_NAME
from tests.images_util import encode, random_image
from tests.serve_fixtures import free_port, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.own_ray]

ROOT = Path(__file__).resolve().parents[3]
PRODUCTION = ROOT / "deployments" / "serve_production.yaml"
BIN = Path(sys.executable).parent  # the `ray` and `serve` CLIs of this environment
GPUS_PER_WORKER = 2
# Buckets of the CPU config (one image each). Two replicas split them by the router's "ranges" rule: the lower
# replica id owns 256 and 512, the higher 1024. Sizes of the tiny preset: 400 patches (bucket 512) and 784
# patches (bucket 1024). Bucket 256 is left out of the checks: each replica's health probe replays it.
BUCKETS = "256,512,1024"
SMALL, LARGE = (280, 280), (400, 400)


@dataclass
class LocalCluster:
    cluster: object  # ray.cluster_utils.Cluster
    dashboard: str  # http://host:port, what `serve deploy` / `ray job submit` take as --address
    head: str  # node ids
    workers: tuple[str, str]
    env: dict  # environment for the CLIs

    def actors(self, class_name: str) -> list[dict]:
        """GCS actor-table entries whose class name contains `class_name`, alive or finished (the node they
        ran on is `["Address"]["NodeID"]`)."""
        table = self.cluster.global_state.actor_table(None)
        return [a for a in table.values() if class_name in a.get("ActorClassName", "")]

    def cli(self, *args: str, timeout: float = 240) -> subprocess.CompletedProcess:
        proc = subprocess.run(
            [str(BIN / args[0]), *args[1:]], env=self.env, cwd=ROOT, capture_output=True, text=True, timeout=timeout
        )
        assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        return proc


def _own_address_file(address: str, temp_dir: str) -> None:
    """Keep the cluster's address in its own temp dir only.

    `Cluster` records the head's address in Ray's default temp dir, where any `ray.init()` on this machine
    would find it and join this cluster (other test runs share the machine). Jobs need the record in the
    cluster's temp dir (the job supervisor finds its cluster there), so it moves there.
    """
    from ray._private.utils import get_ray_address_file, write_ray_address

    write_ray_address(address, temp_dir)
    default = Path(get_ray_address_file(None))
    if default.exists() and default.read_text().strip() == address:
        default.unlink()


@pytest.fixture(scope="module")
def local_cluster() -> Iterator[LocalCluster]:
    from ray.cluster_utils import Cluster

    had_ray = ray.is_initialized()
    if had_ray:  # the session's shared instance (tests/serve_fixtures.py)
        serve.shutdown()
        ray.shutdown()
    # Token authentication on, as cluster.yaml has it: what `ray.init()` does for a local cluster (sets
    # RAY_AUTH_MODE=token for this process and its children, refreshes Ray's config, makes the token).
    # A no-op when the session's instance already did it.
    from ray._private.authentication.authentication_token_setup import enable_token_auth_by_default

    enable_token_auth_by_default()
    token = subprocess.run([str(BIN / "ray"), "get-auth-token", "--generate"], capture_output=True, text=True)
    assert token.returncode == 0, token.stderr
    # The nodes inherit this process's environment: the repository importable everywhere (the controller
    # builds the app, the job driver runs the CLI), as `pip install -e .` makes it on a real cluster.
    saved_pythonpath = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), saved_pythonpath) if p)
    temp_dir = tempfile.mkdtemp(prefix="raymn")  # short: Ray's socket paths live under it
    # `Cluster` first records the head's address in Ray's default temp dir (moved out by `_own_address_file`),
    # and on a machine where Ray never ran that directory does not exist yet: the record fails with
    # FileNotFoundError (a fresh CI machine, where this module is the first to start Ray)
    from ray._private.utils import get_ray_address_file

    Path(get_ray_address_file(None)).parent.mkdir(parents=True, exist_ok=True)
    cluster = None
    try:
        cluster = Cluster(
            initialize_head=True,
            head_node_args={
                "num_cpus": 2,
                "resources": {"cpu_node": 1},
                "include_dashboard": True,
                "dashboard_port": free_port(),  # fixed default ports may be taken by other Ray instances here
                "dashboard_agent_listen_port": free_port(),
                "temp_dir": temp_dir,
            },
        )
        _own_address_file(cluster.address, temp_dir)
        workers = [cluster.add_node(num_cpus=4, num_gpus=GPUS_PER_WORKER, temp_dir=temp_dir) for _ in range(2)]
        cluster.wait_for_nodes()
        ray.init(address=cluster.address)
        yield LocalCluster(
            cluster=cluster,
            dashboard=f"http://{cluster.webui_url}",
            head=cluster.head_node.node_id,
            workers=tuple(w.node_id for w in workers),
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    finally:
        if ray.is_initialized():
            serve.shutdown()
            ray.shutdown()
        if cluster is not None:
            cluster.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
        if saved_pythonpath is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = saved_pythonpath


def cpu_config(http_port: int) -> dict:
    """serve_production.yaml, resized for CPU: the tiny preset on the CPU eager path, fractional CPUs,
    exactly two encoder replicas (one GPU each, at most one per node: each GPU node keeps one GPU free
    for the batch job) and one ingress replica. Everything else (router, limits, autoscaling delays,
    the ingress's `cpu_node` placement) is the production file's."""
    config = yaml.safe_load(PRODUCTION.read_text())
    config["http_options"].update(host="127.0.0.1", port=http_port)
    (app,) = config["applications"]
    args = app["args"]
    args.pop("served_model_name")  # the model's own name
    args.update(model="tiny", device="cpu", buckets=BUCKETS, bucket_max_images=1, num_cpus=0.25, decode_threads=2)
    assert args["num_gpus"] == 1 and args["request_router_class"] == "deployments.routing.router:BucketRouter"
    by_name = {d["name"]: d for d in app["deployments"]}
    encoder = by_name[ENCODER_NAME]
    encoder["autoscaling_config"].update(min_replicas=2, max_replicas=2)
    encoder["max_replicas_per_node"] = 1
    ingress = by_name[INGRESS_NAME]
    ingress["autoscaling_config"].update(min_replicas=1, max_replicas=1)
    ingress["ray_actor_options"]["num_cpus"] = 0.25
    assert "cpu_node" in ingress["ray_actor_options"]["resources"]
    return config


@dataclass
class Deployed:
    base_url: str
    config: dict


@pytest.fixture(scope="module")
def service(local_cluster: LocalCluster, tmp_path_factory) -> Iterator[Deployed]:
    port = free_port()
    config = cpu_config(port)
    path = tmp_path_factory.mktemp("serve") / "serve_cpu.yaml"
    path.write_text(yaml.safe_dump(config))
    local_cluster.cli("serve", "deploy", "--address", local_cluster.dashboard, str(path))
    base_url = f"http://127.0.0.1:{port}"

    def healthy() -> bool:
        return httpx.get(f"{base_url}/health", timeout=10).status_code == 200

    wait_for(healthy, timeout_s=180, interval_s=0.5, what="/health of the production config")
    # /health is 200 once one encoder replica serves; the checks below need both, and the application RUNNING
    # (the controller marks it on a later pass)
    wait_for(
        lambda: serve.status().applications[DEFAULT_APP_NAME].status == "RUNNING",
        timeout_s=120,
        interval_s=0.5,
        what="the production config's application RUNNING",
    )
    yield Deployed(base_url, config)


def data_url(size: tuple[int, int], seed: int) -> str:
    png = encode(random_image("RGB", size[0], size[1], seed=seed), "PNG")
    return "data:image/png;base64," + base64.b64encode(png).decode()


def test_production_config_spreads_replicas_and_buckets_over_nodes(local_cluster: LocalCluster, service: Deployed):
    status = serve.status().applications[DEFAULT_APP_NAME]
    assert status.status == "RUNNING"
    assert status.deployments[ENCODER_NAME].replica_states.get("RUNNING") == 2

    # Placement: the ingress where `cpu_node` is (the head), one encoder replica on each GPU node.
    def nodes_of(deployment: str) -> list[str]:
        actors = local_cluster.actors(f"ServeReplica:{DEFAULT_APP_NAME}:{deployment}")
        return sorted(a["Address"]["NodeID"] for a in actors if a["State"] == "ALIVE")

    assert nodes_of(INGRESS_NAME) == [local_cluster.head]
    assert nodes_of(ENCODER_NAME) == sorted(local_cluster.workers)

    # Requests over HTTP (OpenAI shape) and through the handle, small and large images, one at a time so
    # the ingress does not merge them: each request keeps its own bucket.
    sizes = [SMALL, LARGE, SMALL, LARGE, SMALL]
    for i, size in enumerate(sizes):
        r = httpx.post(f"{service.base_url}/v1/embeddings", json={"input": [data_url(size, i)]}, timeout=60)
        assert r.status_code == 200, r.text
        assert len(r.json()["data"][0]["embedding"]) == 128
    handle = serve.get_app_handle(DEFAULT_APP_NAME)
    png = encode(random_image("RGB", *LARGE, seed=99), "PNG")
    (vector,) = handle.embed.remote([png]).result(timeout_s=60)
    assert vector.shape == (128,)

    # The bucket router: requests of bucket 512 stay on its owner replica, those of bucket 1024 on the other,
    # and the two replicas are on the two GPU nodes. `stats` carries no routing kwarg, so it reaches a random
    # replica: poll until both have answered.
    encoder = serve.get_deployment_handle(ENCODER_NAME, app_name=DEFAULT_APP_NAME)
    owners: dict[int, dict] = {}
    deadline = time.monotonic() + 60
    while len(owners) < 2 and time.monotonic() < deadline:
        replays = encoder.stats.remote().result(timeout_s=30)["replays"]
        for bucket in (512, 1024):
            if bucket in replays:
                owners[bucket] = replays
    assert owners.keys() == {512, 1024}, f"replays by bucket of the replicas that answered: {owners}"
    assert owners[512] is not owners[1024] and 1024 not in owners[512] and 512 not in owners[1024], owners
    assert owners[512][512] == sum(s == SMALL for s in sizes)
    assert owners[1024][1024] == sum(s == LARGE for s in sizes) + 1  # + the handle call


def test_batch_job_runs_on_both_gpu_nodes(local_cluster: LocalCluster, service: Deployed, tmp_path):
    # The service holds one GPU of each worker node, so the job's two one-GPU actors must use both nodes (two
    # encoder batches of 12 rows: the job starts no more actors than batches).
    ids = list(range(24))
    images = [encode(random_image("RGB", 40 + 8 * (i % 5), 56, seed=i), "PNG") for i in ids]
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"id": ids, "image": pa.array(images, pa.binary())}), src)
    out = tmp_path / "out"
    before = {a["ActorID"] for a in local_cluster.actors("MapBatches(EncoderActor)")}
    job = local_cluster.cli(
        "ray", "job", "submit", "--address", local_cluster.dashboard, "--",
        sys.executable, "-m", "deployments.batch", "--input", str(src), "--output", str(out),
        "--num-gpus", "2", "--buckets", "256,512", "--part-rows", "12", "--batch-size", "12", "--no-progress",
        timeout=300,
    )  # fmt: skip
    assert "batch job complete" in job.stdout, job.stdout[-3000:]
    assert "12 rows per encoder batch, 2 GPU actor(s)" in job.stdout, job.stdout[-3000:]
    assert "minimum number of concurrent actors" not in job.stdout, job.stdout[-3000:]  # no more actors than inputs
    # the GPU actors keep Ray Data's default CPU reservation: no warning that num_cpus with num_gpus is "experimental"
    assert "is experimental" not in job.stdout, job.stdout[-3000:]

    result = pq.read_table(out)
    assert sorted(result.column("id").to_pylist()) == ids
    assert result.column("error").null_count == len(ids)
    assert json.loads((out / "_manifest.json").read_text())["complete"] is True
    actors = [a for a in local_cluster.actors("MapBatches(EncoderActor)") if a["ActorID"] not in before]
    assert sorted(a["Address"]["NodeID"] for a in actors) == sorted(local_cluster.workers)
    # each held one GPU and Ray Data's default of one CPU (the job names no num_cpus for them)
    from ray.util.state import get_actor

    for a in actors:
        required = get_actor(a["ActorID"], address=local_cluster.dashboard).required_resources
        assert required == {"CPU": 1.0, "GPU": 1.0}, required
