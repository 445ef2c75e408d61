"""Scale-out configs: `cluster.yaml` through Ray's own cluster-config validator, `deployments/serve_production.yaml`
through Serve's schema and `AppArgs`, the two against each other, and README "Scale out" against both.

Ray's validator is what `ray up` runs before it talks to a cloud: `prepare_config` (merge with the provider's
defaults, per-node-type worker bounds, merged setup commands) then `validate_config` (the JSON schema
`ray/autoscaler/ray-schema.json` plus cross-field checks). No cloud SDK or credentials are needed.
"""

from __future__ import annotations

import copy
import os
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

from deployments.config import DEFAULT_APP_NAME, ENCODER_NAME, INGRESS_NAME, AppArgs

ROOT = Path(__file__).resolve().parents[3]
CLUSTER = ROOT / "cluster.yaml"
PRODUCTION = ROOT / "deployments" / "serve_production.yaml"
README = ROOT / "README.md"
CPU_NODE = "cpu_node"  # the custom resource that marks nodes for ingress replicas


def cluster_config() -> dict:
    return yaml.safe_load(CLUSTER.read_text())


def production_config() -> dict:
    return yaml.safe_load(PRODUCTION.read_text())


def ray_validate(config: dict) -> dict:
    """What `ray up` checks before launching anything; returns the prepared (defaults merged) config."""
    from ray.autoscaler._private.util import prepare_config, validate_config

    prepared = prepare_config(copy.deepcopy(config))
    validate_config(prepared)
    return prepared


def app_section(config: dict) -> dict:
    (app,) = config["applications"]
    return app


def overrides(config: dict) -> dict[str, dict]:
    return {d["name"]: d for d in app_section(config).get("deployments", [])}


# ------------------------------------------------------------------------------------- cluster.yaml


def test_cluster_yaml_passes_rays_validator():
    prepared = ray_validate(cluster_config())
    types = prepared["available_node_types"]
    head = types[prepared["head_node_type"]]
    assert head["resources"].get("GPU", 0) == 0 and head["max_workers"] == 0  # a CPU head, never scaled
    gpu_counts = sorted(t["resources"]["GPU"] for t in types.values() if t["resources"].get("GPU"))
    assert gpu_counts == [1, 8]  # the 1-GPU and 8-GPU worker types
    for name, node_type in types.items():
        if name != prepared["head_node_type"]:
            assert 0 <= node_type["min_workers"] <= node_type["max_workers"], name
    assert sum(t["min_workers"] for t in types.values()) <= prepared["max_workers"]
    # Setup reaches every node: merged into the head's and the workers' command lists.
    for commands in (prepared["head_setup_commands"], prepared["worker_setup_commands"]):
        text = "\n".join(commands)
        assert "download.pytorch.org/whl/cu" in text and "pip install" in text
    assert any("ray start --head" in c for c in prepared["head_start_ray_commands"])
    assert any("ray start --address=$RAY_HEAD_IP:6379" in c for c in prepared["worker_start_ray_commands"])
    for commands in (prepared["head_start_ray_commands"], prepared["worker_start_ray_commands"]):
        assert any("RAY_AUTH_MODE=token" in c for c in commands)  # token authentication stays on
    # The autoscaler on the head needs the cloud's SDK in the environment `ray start` runs in.
    assert any("boto3" in c for c in prepared["head_setup_commands"])


def test_cluster_yaml_installs_the_mounted_checkout_and_the_served_model():
    config = cluster_config()
    mounts = config["file_mounts"]
    (project,) = [remote for remote, local in mounts.items() if local == "."]
    assert "~/.ray/auth_token" in mounts  # the shared token of token authentication
    setup = "\n".join(config["setup_commands"])
    assert f"-e {project} " in setup  # the checkout file_mounts copies is what gets installed
    pin = re.search(r'"ray\[serve,data\]==([\d.]+)"', setup)
    assert pin, "setup_commands pin the Ray version (it must match the one `ray up` runs with)"
    model = app_section(production_config())["args"]["model"]
    assert f"--local-dir {model}" in setup  # the checkpoint serve_production.yaml serves is downloaded


def test_cluster_yaml_starts_every_node_on_the_launchers_fast_path():
    from deployments.ray_compat import FAST_PATH_ENV

    config = cluster_config()
    for key in ("head_start_ray_commands", "worker_start_ray_commands"):
        (start,) = [c for c in config[key] if "ray start" in c]
        assigned = dict(w.split("=", 1) for w in shlex.split(start.split("ray start")[0]) if "=" in w)
        assert {k: assigned.get(k) for k in FAST_PATH_ENV} == FAST_PATH_ENV, (key, start)


def broken(mutate) -> dict:
    config = cluster_config()
    mutate(config)
    return config


BROKEN = {
    "misspelled top-level key": lambda c: c.update(max_worker=c.pop("max_workers")),
    "node type without resources": lambda c: c["available_node_types"]["gpu_1x"].pop("resources"),
    "fractional GPU count": lambda c: c["available_node_types"]["gpu_1x"]["resources"].update(GPU=0.5),
    "unknown node type field": lambda c: c["available_node_types"]["gpu_8x"].update(min_replicas=1),
    "head_node_type not a node type": lambda c: c.update(head_node_type="gpu_head"),
    "min_workers above max_workers": lambda c: c.update(max_workers=0),
    "commands not a list of strings": lambda c: c.update(head_start_ray_commands="ray start --head"),
}


@pytest.mark.parametrize("what", list(BROKEN))
def test_a_broken_cluster_yaml_fails_rays_validator(what):
    with pytest.raises((jsonschema.ValidationError, ValueError)):
        ray_validate(broken(BROKEN[what]))


def test_the_documented_switch_to_own_machines_validates():
    """cluster.yaml's header: provider `local` with the machines' IPs, no node types; everything else kept."""
    config = cluster_config()
    config["provider"] = {"type": "local", "head_ip": "10.0.0.1", "worker_ips": ["10.0.0.2", "10.0.0.3"]}
    config["auth"] = {"ssh_user": "me", "ssh_private_key": "~/.ssh/id_rsa"}
    for key in ("available_node_types", "head_node_type"):
        del config[key]
    config["head_setup_commands"] = []
    prepared = ray_validate(config)
    assert prepared["setup_commands"] == cluster_config()["setup_commands"]


# ------------------------------------------------------------------------------------- serve_production.yaml


def test_production_serve_config_validates():
    from ray.serve.schema import ServeDeploySchema

    config = production_config()
    schema = ServeDeploySchema.model_validate(config)
    (app,) = schema.applications
    assert app.name == DEFAULT_APP_NAME and app.import_path == "deployments:build_app"
    args = AppArgs.model_validate(app.args)  # only fields AppArgs has (it forbids others)
    assert args.request_router_class == "deployments.routing.router:BucketRouter"
    assert args.num_gpus and args.num_gpus > 0  # pinned: the CPU head builds the app
    by_name = {d.name: d for d in app.deployments}
    assert set(by_name) == {ENCODER_NAME, INGRESS_NAME}  # the names build_app gives its deployments
    for name in (ENCODER_NAME, INGRESS_NAME):
        auto = by_name[name].autoscaling_config
        assert by_name[name].num_replicas == "auto"
        assert 1 <= auto["min_replicas"] <= auto["max_replicas"], name
        assert auto["target_ongoing_requests"] > 0 and "upscale_delay_s" in auto and "downscale_delay_s" in auto
    assert by_name[ENCODER_NAME].autoscaling_config["target_ongoing_requests"] <= args.max_ongoing_requests


def test_production_serve_config_builds_the_application():
    """build_app accepts the file's args as `serve deploy` passes them, without a cluster (num_gpus is pinned,
    so nothing asks Ray how many GPUs there are). Its model directory exists only on the cluster's nodes, and
    build_app checks the model first: here it is refused in one line naming it, and a preset in its place builds."""
    from ray import serve

    from deployments import build_app
    from deployments.preflight import AppConfigError

    args = app_section(production_config())["args"]
    if not os.path.exists(args["model"]):  # as on the test machines
        with pytest.raises(AppConfigError, match=f"model '{args['model']}': no such directory"):
            build_app(args)
    app = build_app({**args, "model": "tiny"})
    assert isinstance(app, serve.Application)


def test_production_serve_config_fits_the_cluster():
    """Every replica fits a node type of cluster.yaml: encoders only on GPU nodes, ingress only on `cpu_node`
    nodes; the minimum replicas fit the minimum cluster and the maximum fits the largest one."""
    types = ray_validate(cluster_config())["available_node_types"]
    head_type = cluster_config()["head_node_type"]
    app = app_section(production_config())
    args = AppArgs.model_validate(app["args"])
    by_name = overrides(production_config())

    encoder = {"CPU": args.num_cpus, "GPU": args.num_gpus}
    ingress_options = by_name[INGRESS_NAME]["ray_actor_options"]
    ingress = {"CPU": ingress_options["num_cpus"], **ingress_options["resources"]}
    assert CPU_NODE in ingress

    def fits(request: dict, node_type: dict) -> bool:
        return all(node_type["resources"].get(k, 0) >= v for k, v in request.items() if v)

    encoder_types = {n for n, t in types.items() if fits(encoder, t)}
    ingress_types = {n for n, t in types.items() if fits(ingress, t)}
    assert encoder_types and all(types[n]["resources"].get("GPU", 0) > 0 for n in encoder_types)
    assert head_type in ingress_types and all(types[n]["resources"].get("GPU", 0) == 0 for n in ingress_types)

    enc_auto, ing_auto = by_name[ENCODER_NAME]["autoscaling_config"], by_name[INGRESS_NAME]["autoscaling_config"]
    max_gpus = sum(t["max_workers"] * t["resources"].get("GPU", 0) for t in types.values())
    min_gpus = sum(t["min_workers"] * t["resources"].get("GPU", 0) for t in types.values())
    assert enc_auto["max_replicas"] * args.num_gpus <= max_gpus
    assert enc_auto["min_replicas"] * args.num_gpus <= min_gpus  # serving starts without waiting for nodes
    assert ing_auto["min_replicas"] * ingress["CPU"] <= types[head_type]["resources"]["CPU"]


# ------------------------------------------------------------------------------------- README


def scale_out_section() -> str:
    text = README.read_text()
    match = re.search(r"^## Scale out\n(.*?)(?=^## |\Z)", text, flags=re.S | re.M)
    assert match, 'README.md has no "## Scale out" section'
    return match.group(1)


def yaml_keys(node) -> set[str]:
    if isinstance(node, dict):
        return {str(k) for k in node} | {k for v in node.values() for k in yaml_keys(v)}
    if isinstance(node, list):
        return {k for v in node for k in yaml_keys(v)}
    return set()


def test_readme_scale_out_names_files_that_exist():
    section = scale_out_section()
    (project,) = [remote for remote, local in cluster_config()["file_mounts"].items() if local == "."]
    named = set(re.findall(r"(?<![\w.~/-])((?:[\w.-]+/)*[\w-]+\.(?:yaml|py|md|toml))\b", section))
    assert {"cluster.yaml", "deployments/serve_production.yaml"} <= named
    for path in named:
        assert (ROOT / path).is_file(), f"README Scale out names {path}, which does not exist"
    for path in re.findall(re.escape(project) + r"/([\w./-]+)", section):  # the checkout on the nodes
        assert (ROOT / path).exists(), f"README Scale out names {project}/{path}, which is not in the checkout"


def test_readme_scale_out_keys_exist_in_the_files():
    """Every `snake_case` name the section quotes is a key of cluster.yaml or serve_production.yaml, an
    AppArgs field, or a value of those files (a node type, a resource)."""
    cluster, production = cluster_config(), production_config()
    known = yaml_keys(cluster) | yaml_keys(production) | set(AppArgs.model_fields)
    known |= set(cluster["available_node_types"]) | {CPU_NODE}
    quoted = set(re.findall(r"`([a-z][a-z0-9]*(?:_[a-z0-9]+)+)`", scale_out_section()))
    assert quoted, "the section quotes no config keys"
    assert quoted <= known, f"README Scale out quotes names absent from the configs: {sorted(quoted - known)}"


def test_readme_scale_out_commands_match_the_files():
    section = scale_out_section()
    assert "ray up" in section and "cluster.yaml" in section
    assert "serve deploy" in section and "ray job submit" in section
    # The Ray pin people install locally is the one the cluster installs.
    cluster_pin = re.search(r"ray\[serve,data\]==([\d.]+)", "\n".join(cluster_config()["setup_commands"]))
    for pin in re.findall(r"ray\[serve,data\]==([\d.]+)", section):
        assert pin == cluster_pin.group(1)
    # Every batch command parses with the batch CLI's own parser.
    from deployments.batch.__main__ import parse_args

    blocks = "\n".join(re.findall(r"```[a-z]*\n(.*?)```", section, flags=re.S))
    commands = re.findall(r"python -m deployments\.batch((?:[^\n]*\\\n)*[^\n]*)", blocks)
    assert commands, "no `python -m deployments.batch` command in the section"
    for command in commands:
        argv = shlex.split(command.replace("\\\n", " "), comments=True)
        parse_args(argv)
