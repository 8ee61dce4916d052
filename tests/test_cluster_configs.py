"""Every YAML in cluster/ is checked for what raydit and Ray read from it.

Three kinds, told apart by their top-level keys:
  - planner cluster files (`nodes:`): `ClusterSpec.from_yaml` builds them;
  - `ray up` files (`cluster_name:` + `provider:`): Ray's own `prepare_config` and
    `validate_config` accept them; a head type exists; every GPU worker type declares GPUs,
    one `accelerator_type:<T>` resource the planner knows and the matching
    `ray.io/accelerator-type` label; min/max workers are sane; /dev/shm is sized;
  - KubeRay (`apiVersion: ray.io/...`): RayCluster / RayJob; every GPU worker group's
    `nvidia.com/gpu` limit equals its `num-gpus`, it carries the accelerator resource and a
    label Ray parses, a GPU-product nodeSelector, and a memory-backed /dev/shm emptyDir
    mounted in its container; a RayJob's entrypoint is `raydit generate` with arguments
    that raydit's own parser accepts; a RayService runs `raydit serve`'s builder with
    options it accepts (see check_rayservice).
A checker raises CheckError naming the file and the problem; the negative tests corrupt a
copy of each kind and expect it to raise.
"""

from __future__ import annotations

import argparse
import copy
import json
import shlex
from pathlib import Path

import pytest
import yaml

from raydit.planner import ClusterSpec, device_type

REPO = Path(__file__).resolve().parents[1]
CLUSTER_DIR = REPO / "cluster"
YAMLS = sorted(CLUSTER_DIR.glob("*.yaml"))
ACCEL_LABEL = "ray.io/accelerator-type"


class CheckError(Exception):
    pass


def _fail(path, msg):
    raise CheckError(f"{path.name}: {msg}")


def kind_of(data: dict) -> str:
    if "apiVersion" in data:
        return "kuberay"
    if "cluster_name" in data and "provider" in data:
        return "ray-up"
    if "nodes" in data:
        return "planner"
    return "unknown"


def _accel_type(path, where, name: str) -> str:
    try:
        return device_type(name).name
    except ValueError:
        _fail(path, f"{where}: accelerator type {name!r} is not in the planner's device table")


def _accel_resources(path, where, resources: dict) -> list[str]:
    types = [k.split(":", 1)[1] for k in resources if k.startswith("accelerator_type:")]
    if len(types) != 1:
        _fail(path, f"{where}: needs exactly one accelerator_type:<T> resource, has {types}")
    return types


# -- planner files ----------------------------------------------------------------------------


def check_planner(path: Path, data: dict) -> None:
    try:
        spec = ClusterSpec.from_yaml(path)
    except ValueError as exc:
        _fail(path, str(exc))
    if spec.total < 1:
        _fail(path, "no devices")


# -- ray up -----------------------------------------------------------------------------------


def check_ray_up(path: Path, data: dict) -> None:
    from ray.autoscaler._private.util import prepare_config, validate_config

    try:
        config = prepare_config(copy.deepcopy(data))
        validate_config(config)
    except Exception as exc:  # jsonschema.ValidationError, ValueError, ...
        _fail(path, f"Ray rejects it: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    types = config["available_node_types"]
    head = config["head_node_type"]
    if head not in types:
        _fail(path, f"head_node_type {head!r} is not a node type")
    run_options = " ".join(config.get("docker", {}).get("run_options", []))
    if config.get("docker") and "--shm-size" not in run_options:
        _fail(path, "docker run_options need --shm-size (Ray's object store and NCCL use /dev/shm)")
    if data["provider"]["type"] == "local":
        # One node type; Ray detects each machine's GPUs and accelerator type itself.
        ips = data["provider"].get("worker_ips") or []
        if not data["provider"].get("head_ip") or not ips:
            _fail(path, "local provider needs head_ip and worker_ips")
        if data.get("max_workers", len(ips)) > len(ips):
            _fail(path, f"max_workers {data['max_workers']} exceeds the {len(ips)} worker_ips")
        starts = " ".join(config.get("worker_start_ray_commands", []))
        if "ray start --address=$RAY_HEAD_IP:6379" not in starts:
            _fail(path, "worker_start_ray_commands must join the head: ray start --address=$RAY_HEAD_IP:6379")
        return
    gpu_types = [t for t in types if t != head]
    if not gpu_types:
        _fail(path, "no worker node types")
    if sum(types[t].get("min_workers", 0) for t in gpu_types) > config["max_workers"]:
        _fail(path, "the min_workers of the types add up to more than max_workers")
    for name in gpu_types:
        t = types[name]
        res = t.get("resources", {})
        lo, hi = t.get("min_workers", 0), t.get("max_workers", 0)
        if not 0 <= lo <= hi or hi < 1 or hi > config["max_workers"]:
            _fail(path, f"{name}: min_workers {lo} / max_workers {hi} must be 0 <= min <= max, "
                  f"1 <= max <= max_workers {config['max_workers']}")
        if not res.get("GPU", 0) >= 1:
            _fail(path, f"{name}: a GPU worker type must declare resources GPU >= 1")
        (accel,) = _accel_resources(path, name, res)
        _accel_type(path, name, accel)
        if t.get("labels", {}).get(ACCEL_LABEL) != accel:
            _fail(path, f"{name}: labels.{ACCEL_LABEL} must be {accel!r} like its resource")


# -- KubeRay -----------------------------------------------------------------------------------


def _int(path, where, value) -> int:
    try:
        return int(str(value).strip('"'))
    except ValueError:
        _fail(path, f"{where}: {value!r} is not an integer")


def _resources_param(path, where, text: str) -> dict:
    """KubeRay passes rayStartParams.resources to `ray start --resources` as a quoted JSON string."""
    raw = text.strip()
    if len(raw) > 1 and raw[0] == raw[-1] == '"':
        raw = raw[1:-1]
    try:
        res = json.loads(raw.replace('\\"', '"'))
    except json.JSONDecodeError as exc:
        _fail(path, f"{where}: rayStartParams.resources is not JSON ({exc})")
    if not isinstance(res, dict):
        _fail(path, f"{where}: rayStartParams.resources must be a JSON object")
    return res


def _check_shm(path, where, pod: dict, container: dict) -> None:
    shm = [v["name"] for v in pod.get("volumes", []) if (v.get("emptyDir") or {}).get("medium") == "Memory"]
    mounted = [m["name"] for m in container.get("volumeMounts", []) if m.get("mountPath") == "/dev/shm"]
    if not set(shm) & set(mounted):
        _fail(path, f"{where}: needs a memory-backed emptyDir (medium: Memory) mounted at /dev/shm")


def check_cluster_spec(path: Path, spec: dict, where: str) -> None:
    from ray._private.label_utils import parse_node_labels_string

    head = spec.get("headGroupSpec")
    if not head or not head.get("template", {}).get("spec", {}).get("containers"):
        _fail(path, f"{where}: headGroupSpec with a container is required")
    groups = spec.get("workerGroupSpecs") or []
    if not groups:
        _fail(path, f"{where}: no workerGroupSpecs")
    for g in groups:
        name = f"{where}.workerGroupSpecs[{g.get('groupName')}]"
        lo, hi, n = g.get("minReplicas", 0), g.get("maxReplicas", 0), g.get("replicas", 0)
        if not 0 <= lo <= n <= hi or hi < 1:
            _fail(path, f"{name}: need 0 <= minReplicas {lo} <= replicas {n} <= maxReplicas {hi}, max >= 1")
        params = g.get("rayStartParams") or {}
        pod = g.get("template", {}).get("spec", {})
        containers = pod.get("containers") or []
        if len(containers) != 1:
            _fail(path, f"{name}: expected one container, has {len(containers)}")
        c = containers[0]
        limits = (c.get("resources") or {}).get("limits") or {}
        gpus = _int(path, name, limits.get("nvidia.com/gpu", 0))
        if gpus < 1:
            _fail(path, f"{name}: a GPU worker group needs resources.limits nvidia.com/gpu >= 1")
        if _int(path, name, params.get("num-gpus", -1)) != gpus:
            _fail(path, f"{name}: rayStartParams num-gpus {params.get('num-gpus')!r} != "
                  f"nvidia.com/gpu limit {gpus}")
        (accel,) = _accel_resources(path, name, _resources_param(path, name, params.get("resources", "{}")))
        _accel_type(path, name, accel)
        try:
            labels = parse_node_labels_string(params.get("labels", ""))
        except ValueError as exc:
            _fail(path, f"{name}: rayStartParams.labels does not parse: {exc}")
        if labels.get(ACCEL_LABEL) != accel:
            _fail(path, f"{name}: rayStartParams.labels needs {ACCEL_LABEL}={accel}")
        if not any("gpu" in k for k in (pod.get("nodeSelector") or {})):
            _fail(path, f"{name}: needs a nodeSelector on a GPU product label (e.g. nvidia.com/gpu.product)")
        if not c.get("image"):
            _fail(path, f"{name}: container image missing")
        _check_shm(path, name, pod, c)


def generate_argv(path: Path, entrypoint: str) -> argparse.Namespace:
    """Parse a RayJob entrypoint with raydit's own `generate` parser."""
    from raydit.cli import UsageError, _Parser
    from raydit.commands import add_generate_arguments, resolve_generate_options

    argv = shlex.split(entrypoint)
    if argv[:2] != ["raydit", "generate"]:
        _fail(path, f"entrypoint must run `raydit generate ...`, got {' '.join(argv[:2])!r}")
    parser = _Parser(prog="raydit generate")
    add_generate_arguments(parser)
    try:
        args = parser.parse_args(argv[2:])
        resolve_generate_options(args)
    except (UsageError, ValueError) as exc:
        _fail(path, f"entrypoint arguments: {exc}")
    return args


def check_kuberay(path: Path, data: dict) -> None:
    if not str(data.get("apiVersion", "")).startswith("ray.io/"):
        _fail(path, f"apiVersion {data.get('apiVersion')!r} is not ray.io/v1")
    kind = data.get("kind")
    if kind == "RayCluster":
        check_cluster_spec(path, data.get("spec") or {}, "spec")
    elif kind == "RayJob":
        spec = data.get("spec") or {}
        check_cluster_spec(path, spec.get("rayClusterSpec") or {}, "spec.rayClusterSpec")
        generate_argv(path, spec.get("entrypoint", ""))
        if spec.get("runtimeEnvYAML"):
            yaml.safe_load(spec["runtimeEnvYAML"])
    elif kind == "RayService":
        check_rayservice(path, data.get("spec") or {})
    else:
        _fail(path, f"kind {kind!r} is not RayCluster, RayJob or RayService")


def check_rayservice(path: Path, spec: dict) -> None:
    """`raydit serve` on KubeRay: Ray Serve accepts serveConfigV2; every application is
    raydit's builder with `raydit serve` options it accepts; the front is pinned to the
    head by a resource the head declares, its output_dir is on a volume mounted there; the
    head exposes the HTTP port; the API token comes from a Secret, never a literal."""
    from ray.serve.schema import ServeDeploySchema

    from raydit.serve.config import resolve_serve_options

    cluster = spec.get("rayClusterConfig") or {}
    check_cluster_spec(path, cluster, "spec.rayClusterConfig")
    try:
        config = yaml.safe_load(spec.get("serveConfigV2") or "")
        ServeDeploySchema.model_validate(config)
    except Exception as exc:  # yaml.YAMLError, pydantic.ValidationError
        _fail(path, f"serveConfigV2: Ray Serve rejects it: {type(exc).__name__}: {str(exc).splitlines()[0]}")
    head = cluster["headGroupSpec"]
    container = head["template"]["spec"]["containers"][0]
    head_resources = _resources_param(path, "headGroupSpec", (head.get("rayStartParams") or {}).get("resources", "{}"))
    token = next((e for e in container.get("env", []) if e.get("name") == "RAYDIT_API_TOKEN"), None)
    if token is None or "value" in token or "secretKeyRef" not in (token.get("valueFrom") or {}):
        _fail(path, "head container needs RAYDIT_API_TOKEN from a secretKeyRef (never a literal value)")
    port = (config.get("http_options") or {}).get("port", 8000)
    if port not in [p.get("containerPort") for p in container.get("ports", [])]:
        _fail(path, f"head container does not expose Serve's HTTP port {port}")
    mounts = [m["mountPath"].rstrip("/") for m in container.get("volumeMounts", [])]
    for app in config["applications"]:
        name = app.get("name")
        if app.get("import_path") != "raydit.serve.app:build":
            _fail(path, f"application {name}: import_path must be raydit.serve.app:build")
        try:
            opts = resolve_serve_options(app.get("args") or {})
        except ValueError as exc:
            _fail(path, f"application {name} args: {exc}")
        if not any(opts["output_dir"].startswith(m + "/") for m in mounts):
            _fail(path, f"application {name}: output_dir {opts['output_dir']!r} is not on a volume mounted in the head")
        front = next((d for d in app.get("deployments", []) if d.get("name") == "VideoAPI"), {})
        pinned = (front.get("ray_actor_options") or {}).get("resources") or {}
        if not pinned or any(k not in head_resources for k in pinned):
            _fail(path, f"application {name}: VideoAPI must be pinned to the head by a resource the head "
                  f"declares (head has {sorted(head_resources)}, VideoAPI asks for {sorted(pinned)})")


CHECKERS = {"planner": check_planner, "ray-up": check_ray_up, "kuberay": check_kuberay}


def check_file(path: Path) -> str:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        _fail(path, f"invalid YAML: {exc}")
    if not isinstance(data, dict):
        _fail(path, "not a YAML mapping")
    kind = kind_of(data)
    if kind not in CHECKERS:
        _fail(path, "neither a planner cluster file, a `ray up` file nor a KubeRay manifest")
    CHECKERS[kind](path, data)
    return kind


# -- tests --------------------------------------------------------------------------------------


@pytest.mark.parametrize("path", YAMLS, ids=[p.name for p in YAMLS])
def test_every_cluster_file_checks(path):
    check_file(path)


def test_every_kind_is_present_and_documented():
    kinds = {p.name: check_file(p) for p in YAMLS}
    assert set(kinds.values()) == {"planner", "ray-up", "kuberay"}
    kube = {yaml.safe_load(p.read_text())["kind"] for p in YAMLS if kinds[p.name] == "kuberay"}
    assert kube == {"RayCluster", "RayJob", "RayService"}
    providers = {yaml.safe_load(p.read_text())["provider"]["type"]
                 for p in YAMLS if kinds[p.name] == "ray-up"}
    assert {"aws", "local"} <= providers
    readme = (CLUSTER_DIR / "README.md").read_text()
    for p in YAMLS + [CLUSTER_DIR / "Dockerfile"]:
        assert p.name in readme, f"{p.name} is not described in cluster/README.md"


def test_rayjob_entrypoint_is_a_real_generate_command():
    path = CLUSTER_DIR / "kuberay-rayjob.yaml"
    args = generate_argv(path, yaml.safe_load(path.read_text())["spec"]["entrypoint"])
    assert args.device == "cuda" and args.model.startswith("/models/") and args.prompt
    assert args.out.startswith("/outputs/")


def test_aws_gpu_types_are_distinct_and_plan_together():
    """The AWS node types, at their max counts, are a mixed cluster the planner can plan."""
    from raydit.planner import plan

    data = yaml.safe_load((CLUSTER_DIR / "ray-aws.yaml").read_text())
    nodes = []
    for name, t in data["available_node_types"].items():
        if name == data["head_node_type"]:
            continue
        accel = next(k.split(":", 1)[1] for k in t["resources"] if k.startswith("accelerator_type:"))
        for i in range(t["max_workers"]):
            nodes.append({"name": f"{name}-{i}", "gpu_type": accel, "count": t["resources"]["GPU"]})
    spec = ClusterSpec.from_dict({"nodes": nodes})
    assert len(spec.types) == 3
    assert plan("cogvideox-2b", cluster=spec).best.world_size >= 8


def _corrupt(tmp_path, name, edit) -> Path:
    data = yaml.safe_load((CLUSTER_DIR / name).read_text())
    edit(data)
    out = tmp_path / name
    out.write_text(yaml.safe_dump(data, sort_keys=False))
    return out


def _h100_group(spec):
    return next(g for g in spec["workerGroupSpecs"] if g["groupName"] == "h100x8")


def _drop_shm_mount(d):
    c = _h100_group(d["spec"])["template"]["spec"]["containers"][0]
    c["volumeMounts"] = [m for m in c["volumeMounts"] if m["mountPath"] != "/dev/shm"]


def _disk_shm(d):
    vols = _h100_group(d["spec"]["rayClusterSpec"])["template"]["spec"]["volumes"]
    next(v for v in vols if v["name"] == "dshm")["emptyDir"] = {}


def _serve_config(d, edit):
    config = yaml.safe_load(d["spec"]["serveConfigV2"])
    edit(config)
    d["spec"]["serveConfigV2"] = yaml.safe_dump(config)


def _head_env(d, value):
    env = d["spec"]["rayClusterConfig"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"]
    next(e for e in env if e["name"] == "RAYDIT_API_TOKEN").update(value)


BROKEN = [
    ("kuberay-rayservice.yaml", lambda d: _head_env(d, {"value": "s3cret", "valueFrom": None}),
     "RAYDIT_API_TOKEN from a secretKeyRef"),
    ("kuberay-rayservice.yaml", lambda d: _serve_config(d, lambda c: c["applications"][0]["args"].update(
        worker=8)), "unknown option 'worker'"),
    ("kuberay-rayservice.yaml", lambda d: _serve_config(d, lambda c: c["applications"][0]["args"].update(
        output_dir="/data/videos")), "not on a volume mounted in the head"),
    ("kuberay-rayservice.yaml", lambda d: _serve_config(
        d, lambda c: c["applications"][0]["deployments"][0]["ray_actor_options"].pop("resources")),
     "VideoAPI must be pinned to the head"),
    ("kuberay-rayservice.yaml", lambda d: _serve_config(d, lambda c: c.update(applications="raydit")),
     "Ray Serve rejects it"),
    ("mixed.yaml", lambda d: d["nodes"][0].update(gpu_type="Z80"), "unknown GPU type 'Z80'"),
    ("8xH100.yaml", lambda d: d["nodes"][0].update(count=0), "count must be a positive integer"),
    ("ray-aws.yaml", lambda d: d["available_node_types"]["gpu-l40sx4"]["resources"].pop("GPU"),
     "must declare resources GPU"),
    ("ray-aws.yaml", lambda d: d["available_node_types"]["gpu-t4x4"]["resources"].pop("accelerator_type:T4"),
     "exactly one accelerator_type"),
    ("ray-aws.yaml", lambda d: d["available_node_types"]["gpu-t4x4"]["labels"].update(
        {ACCEL_LABEL: "A10G"}), "labels.ray.io/accelerator-type must be 'T4'"),
    ("ray-aws.yaml", lambda d: d["available_node_types"]["gpu-h100x8"].update(min_workers=3),
     "min_workers 3 / max_workers 2"),
    ("ray-aws.yaml", lambda d: d.pop("head_node_type"), "Ray rejects it"),
    ("ray-aws.yaml", lambda d: d["available_node_types"]["gpu-h100x8"].update(typo=1), "Ray rejects it"),
    ("ray-aws.yaml", lambda d: d["docker"].update(run_options=[]), "--shm-size"),
    ("ray-local.yaml", lambda d: d.update(max_workers=5), "exceeds the 2 worker_ips"),
    ("kuberay-raycluster.yaml",
     lambda d: _h100_group(d["spec"])["rayStartParams"].update({"num-gpus": "4"}),
     "num-gpus '4' != nvidia.com/gpu limit 8"),
    ("kuberay-raycluster.yaml", _drop_shm_mount, "mounted at /dev/shm"),
    ("kuberay-raycluster.yaml",
     lambda d: _h100_group(d["spec"])["rayStartParams"].update(labels="ray.io/accelerator-type"),
     "labels does not parse"),
    ("kuberay-raycluster.yaml", lambda d: d.update(apiVersion="v1"), "is not ray.io/v1"),
    ("kuberay-rayjob.yaml", _disk_shm, "memory-backed emptyDir"),
    ("kuberay-rayjob.yaml", lambda d: d["spec"].update(entrypoint="python generate.py"),
     "must run `raydit generate"),
    ("kuberay-rayjob.yaml", lambda d: d["spec"].update(
        entrypoint=d["spec"]["entrypoint"].replace("--steps 50", "--steps fifty")),
     "invalid int value: 'fifty'"),
    ("kuberay-rayjob.yaml", lambda d: d["spec"].update(
        entrypoint=d["spec"]["entrypoint"].replace("--guidance-scale", "--cfg-scale")),
     "unrecognized arguments"),
]


@pytest.mark.parametrize("name,edit,message", BROKEN, ids=[f"{n}:{m[:24]}" for n, _, m in BROKEN])
def test_a_broken_copy_fails_the_check(tmp_path, name, edit, message):
    check_file(CLUSTER_DIR / name)  # the original passes
    with pytest.raises(CheckError, match=None) as info:
        check_file(_corrupt(tmp_path, name, edit))
    assert message in str(info.value), info.value


def test_unknown_kind_and_bad_yaml_fail(tmp_path):
    odd = tmp_path / "odd.yaml"
    odd.write_text("just: a mapping\n")
    with pytest.raises(CheckError, match="neither a planner cluster file"):
        check_file(odd)
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes: [ {gpu_type: H100\n")
    with pytest.raises(CheckError, match="invalid YAML"):
        check_file(bad)
