"""Clusters: uniform, from dicts and YAML files, validation; the device table."""

from __future__ import annotations

from pathlib import Path

import pytest

from raydit.planner import DEVICE_TYPES, ClusterSpec, NodeSpec, device_type

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", ["H100", "H200", "A100-40GB", "A100-80GB", "L40S", "L40", "A10G",
                                  "RTX4090", "T4", "cpu"])
def test_device_table_has_every_documented_field(name):
    d = DEVICE_TYPES[name]
    assert d.memory_gb > 0 and d.tflops > 0 and 0 < d.efficiency <= 1 and d.link_gb_s > 0
    assert d.link_kind in ("nvlink", "pcie", "shm")
    assert device_type(name.lower()) is d


def test_device_aliases_and_unknown():
    assert device_type("A100").name == "A100-80GB"  # what Ray reports as accelerator_type
    with pytest.raises(ValueError, match="unknown GPU type 'B300'; known: H100, H200"):
        device_type("B300")


@pytest.mark.parametrize("n,per_node,counts", [
    (1, None, [1]), (8, None, [8]), (20, None, [8, 8, 4]), (1024, None, [8] * 128), (6, 4, [4, 2]),
])
def test_uniform(n, per_node, counts):
    c = ClusterSpec.uniform(n, "H100", per_node)
    assert [x.count for x in c.nodes] == counts
    assert c.total == n
    assert len({x.name for x in c.nodes}) == len(c.nodes)


@pytest.mark.parametrize("n,message", [(0, "gpus must be a positive integer, got 0"),
                                       (-2, "gpus must be a positive integer, got -2")])
def test_uniform_bad(n, message):
    with pytest.raises(ValueError, match=message):
        ClusterSpec.uniform(n)


def test_from_dict_links_and_custom_types():
    c = ClusterSpec.from_dict({
        "network": {"gb_s": 50, "latency_us": 5},
        "gpu_types": [{"name": "MI300X", "memory_gb": 192, "tflops": 1307, "efficiency": 0.3,
                       "link_gb_s": 448, "link_kind": "nvlink"}],
        "nodes": [{"name": "a", "gpu_type": "mi300x", "count": 8},
                  {"name": "b", "gpu_type": "L40S", "count": 4, "link_gb_s": 20}],
    })
    assert c.network_gb_s == 50 and c.network_latency_us == 5
    assert c.nodes[0].device.memory_gb == 192
    assert c.nodes[1].intra_gb_s == 20 and c.nodes[1].intra_kind == "pcie"
    assert c.types == ["MI300X", "L40S"]


CUSTOM = {"name": "X", "memory_gb": 80, "tflops": 100, "efficiency": 0.3, "link_gb_s": 448, "link_kind": "nvlink"}

BAD_DICTS = [
    ({}, "'nodes' must be a non-empty list"),
    ({"nodes": []}, "'nodes' must be a non-empty list"),
    ({"nodes": [{"gpu_type": "H100"}]}, "nodes[0] needs gpu_type and count"),
    ({"nodes": [{"gpu_type": "H100", "count": 0}]}, "count must be a positive integer, got 0"),
    ({"nodes": [{"gpu_type": "Z9", "count": 2}]}, "unknown GPU type 'Z9'"),
    ({"nodes": [{"gpu_type": "H100", "count": 2, "gpus": 3}]}, "nodes[0]: unknown keys gpus"),
    ({"nodes": [{"name": "a", "gpu_type": "H100", "count": 2}, {"name": "a", "gpu_type": "H100", "count": 2}]},
     "node names must be unique; repeated: a"),
    ({"nodes": [{"gpu_type": "H100", "count": 2}], "network": {"gb_s": 0}}, "network gb_s 0 must be a number > 0"),
    ({"nodes": [{"gpu_type": "H100", "count": 2}], "links": {}}, "unknown keys links"),
    ([1, 2], "expected a mapping"),
    # Wrong types and non-finite numbers name the entry (were TypeError / AttributeError
    # tracebacks, or NaN plans printed as invalid JSON).
    ({"nodes": [{"gpu_type": "H100", "count": 2, "link_gb_s": "fast"}]},
     "nodes[0]: node 'node0': link_gb_s must be a number > 0, got 'fast'"),
    ({"nodes": [{"gpu_type": "H100", "count": 2}], "network": {"gb_s": None}}, "network gb_s None must be a number"),
    ({"nodes": [{"gpu_type": "H100", "count": 2}], "network": {"gb_s": "x"}}, "network gb_s 'x' must be a number"),
    ({"nodes": [{"gpu_type": "H100", "count": 2}], "network": {"latency_us": -1}},
     "network latency_us -1 must be a number >= 0"),
    ({"gpu_types": [dict(CUSTOM, name=5)], "nodes": [{"gpu_type": "H100", "count": 2}]},
     "gpu_types[0]: device type name 5 must be a non-empty string"),
    ({"gpu_types": [dict(CUSTOM, tflops=float("inf"))], "nodes": [{"gpu_type": "X", "count": 2}]},
     "gpu_types[0]: device type 'X': tflops inf must be a finite number"),
    ({"gpu_types": [dict(CUSTOM, tflops=float("nan"))], "nodes": [{"gpu_type": "X", "count": 2}]},
     "tflops nan must be a finite number"),
    ({"gpu_types": [dict(CUSTOM, link_gb_s=float("nan"))], "nodes": [{"gpu_type": "X", "count": 2}]},
     "link_gb_s nan must be a finite number"),
    ({"gpu_types": [dict(CUSTOM, memory_gb="192")], "nodes": [{"gpu_type": "X", "count": 2}]},
     "memory_gb '192' must be a finite number"),
    ({"gpu_types": [dict(CUSTOM, link_latency_us=-50)], "nodes": [{"gpu_type": "X", "count": 2}]},
     "link_latency_us -50 must be >= 0"),
    ({"gpu_types": [dict(CUSTOM, per_node=0)], "nodes": [{"gpu_type": "X", "count": 2}]},
     "per_node 0 must be a positive integer"),
    ({"gpu_types": [CUSTOM, dict(CUSTOM, name="x")], "nodes": [{"gpu_type": "X", "count": 2}]},
     "gpu_types[1]: 'x' is given twice"),
    ({"gpu_types": {"name": "X"}, "nodes": [{"gpu_type": "H100", "count": 2}]}, "'gpu_types' must be a list"),
    # A count the planner would walk for minutes (or run out of memory on) is refused at once.
    ({"nodes": [{"gpu_type": "H100", "count": 10 ** 9}]},
     "the cluster has 1000000000 devices, more than the 16384 devices raydit plans for at once"),
]


@pytest.mark.parametrize("data,message", BAD_DICTS)
def test_from_dict_bad(data, message):
    with pytest.raises(ValueError) as info:
        ClusterSpec.from_dict(data)
    assert message in str(info.value)


def _planner_files():
    """cluster/ also holds `ray up` and KubeRay files (checked in test_cluster_configs.py);
    the planner's own files are the ones with a top-level `nodes:` list."""
    import yaml

    return [p for p in sorted((REPO / "cluster").glob("*.yaml"))
            if "nodes" in (yaml.safe_load(p.read_text()) or {})]


def test_cluster_dir_has_planner_files():
    assert len(_planner_files()) >= 3


@pytest.mark.parametrize("path", _planner_files(), ids=lambda p: p.name)
def test_example_cluster_files_load(path):
    c = ClusterSpec.from_yaml(path)
    assert c.total >= 1


def test_from_yaml_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        ClusterSpec.from_yaml(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("nodes:\n  - {name: a, gpu_type: H100, count: 8\n")
    with pytest.raises(ValueError, match=r"cluster file .*bad.yaml.* at line \d"):
        ClusterSpec.from_yaml(bad)


def test_node_spec_direct_for_the_runtime():
    c = ClusterSpec(nodes=[NodeSpec("n0", "cpu", 2), NodeSpec("n1", "cpu", 2)])
    assert c.total == 4 and c.types == ["cpu"]
    with pytest.raises(ValueError, match="at least one node"):
        ClusterSpec(nodes=[])
