"""The live cluster as the planner sees it, calibration, and where the ranks land.

One `ray.cluster_utils.Cluster` for the module: a head with 1 CPU and three fake-GPU nodes
of different types (A100 x4, L40S x2, T4 x1). Fake GPUs cannot run CUDA, so no RankWorker
is started on them: placement is checked on the placement groups themselves. Calibration
runs for real on CPU slots (gloo between two actors).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from raydit.planner import ClusterSpec, NodeSpec, device_type, plan
from raydit.runtime import topology
from raydit.runtime.topology import build_live_cluster, live_cluster_spec, read_live_cluster

MB = 1024 * 1024
MODEL = "cogvideox-2b"
# (Ray accelerator name, planner table name, GPUs, CPUs): every rank reserves 1 GPU + 1 CPU.
NODES = [("A100", "A100-80GB", 4, 4), ("L40S", "L40S", 2, 2), ("T4", "T4", 1, 1)]

# A calibration's own limit (120 s by default, "no free device?") has whole minutes of margin
# here: on a loaded 2-core machine the CPU slot's measurements alone took over 120 s.
CALIBRATE_TIMEOUT_S = 900.0


@pytest.fixture(scope="module")
def fake_cluster():
    import ray
    from ray.cluster_utils import Cluster

    if ray.is_initialized():
        ray.shutdown()
    cluster = Cluster(initialize_head=True,
                      head_node_args={"num_cpus": 1, "object_store_memory": 100 * MB,
                                      "include_dashboard": False})
    ids = {}
    for ray_type, _, gpus, cpus in NODES:
        node = cluster.add_node(num_cpus=cpus, num_gpus=gpus, object_store_memory=100 * MB,
                                resources={f"accelerator_type:{ray_type}": 1},
                                labels={"ray.io/accelerator-type": ray_type})
        ids[ray_type] = node.node_id
    ray.init(address=cluster.address, logging_level="ERROR", log_to_driver=False)
    cluster.wait_for_nodes()
    try:
        yield cluster, ids
    finally:
        ray.shutdown()
        cluster.shutdown()


# -- pure: node records -> ClusterSpec ---------------------------------------------------------


def _rec(node_id, gpus=0, cpus=2, label=None, resource=None, alive=True):
    res = {"CPU": cpus}
    if gpus:
        res["GPU"] = gpus
    if resource:
        res[f"accelerator_type:{resource}"] = 1
    labels = {"ray.io/node-id": node_id}
    if label:
        labels["ray.io/accelerator-type"] = label
    return {"NodeID": node_id, "Alive": alive, "Resources": res, "Labels": labels,
            "NodeManagerAddress": "10.0.0.1"}


def test_accelerator_type_label_then_resource_then_none():
    assert topology.accelerator_type(_rec("a", 8, label="H100", resource="A100")) == "H100"
    assert topology.accelerator_type(_rec("a", 8, resource="L40S")) == "L40S"
    assert topology.accelerator_type(_rec("a", 8)) == ""


@pytest.mark.parametrize("ray_name,table", [("A100", "A100-80GB"), ("A100-40G", "A100-40GB"),
                                            ("A100-80G", "A100-80GB"), ("H100", "H100"),
                                            ("L40S", "L40S"), ("T4", "T4"), ("A10G", "A10G")])
def test_ray_accelerator_names_map_to_the_table(ray_name, table):
    dev, note = topology.table_device(ray_name)
    assert dev.name == table and note is None


def test_unknown_or_missing_type_is_conservative_with_a_note():
    # B300: not in the device table (B200 joined it with issue 40).
    nodes = [_rec("b2", 8, label="B300"), _rec("x", 2), _rec("h", 8, label="H100")]
    live = build_live_cluster(nodes, "cuda")
    devs = {n.node_id: n.device for n in live.nodes}
    assert devs["b2"].name == "B300" and devs["b2"].tflops == topology.CONSERVATIVE.tflops
    assert devs["b2"].memory_gb == topology.CONSERVATIVE.memory_gb
    assert devs["x"].name == "unknown-gpu"
    assert any("'B300' is not in the device table" in n for n in live.notes)
    assert any("no accelerator type" in n for n in live.notes)
    assert [n.name for n in live.spec.nodes] == ["b2", "x", "h"]
    # The conservative node is the slowest: the planner puts the H100 node first.
    assert plan(MODEL, cluster=live.spec).best.placement[0].node == "h"


def test_counts_cpu_slots_dead_nodes_probe_and_calibration():
    from dataclasses import replace

    from raydit.planner import device_type

    nodes = [_rec("a", 4, cpus=8, label="A100"), _rec("b", 2, cpus=4, label="L40S"),
             _rec("dead", 8, label="H100", alive=False), _rec("head", 0, cpus=1)]
    live = build_live_cluster(nodes, "cuda")
    assert [(n.name, n.count, n.device.name) for n in live.spec.nodes] == \
        [("a", 4, "A100-80GB"), ("b", 2, "L40S")]
    after = build_live_cluster(nodes, "cuda", counts={"a": 3})
    assert [(n.name, n.count) for n in after.spec.nodes] == [("a", 3)]
    cpu = build_live_cluster(nodes, "cpu")
    assert [(n.name, n.count, n.device.name) for n in cpu.spec.nodes] == \
        [("a", 8, "cpu"), ("b", 4, "cpu"), ("head", 1, "cpu")]
    assert build_live_cluster(nodes, "auto").spec.total == 6
    probed = build_live_cluster(nodes, "cuda", probed_memory_gb={"A100": 42.5})
    assert probed.spec.nodes[0].device.memory_gb == 42.5
    assert probed.nodes[0].source == "table+memory probe"
    fast = replace(device_type("L40S"), tflops=1000.0)
    cal = build_live_cluster(nodes, "cuda", calibrated={"L40S": fast})
    assert cal.spec.nodes[1].device.tflops == 1000.0 and cal.nodes[1].source == "calibrated"
    ib = build_live_cluster(nodes, "cuda", network_gb_s=50.0, network_latency_us=5.0).spec
    assert (ib.network_gb_s, ib.network_latency_us) == (50.0, 5.0)
    with pytest.raises(ValueError, match="has no GPUs to run on"):
        build_live_cluster(nodes, "cuda", counts={"zzz": 2})
    with pytest.raises(ValueError, match="device 'cuda' asked for, but the Ray cluster has no GPUs"):
        build_live_cluster([_rec("c", 0)], "cuda")


def test_unreachable_or_malformed_address_is_one_line(capsys):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from raydit.cli import main

    for address, message in ((f"127.0.0.1:{port}", "cannot reach a Ray cluster at 127.0.0.1"),
                             ("nonsense", "is not HOST:PORT")):
        with pytest.raises(ValueError, match=message):
            topology.check_reachable(address, timeout_s=2)
    # The CLI in a fresh process (no Ray connection to reuse): exit 2, one line, no hang.
    out = subprocess.run([sys.executable, "-m", "raydit.cli", "plan", "--model", MODEL,
                          "--address", f"127.0.0.1:{port}"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stdout == ""
    assert out.stderr.startswith("raydit: error: cannot reach a Ray cluster") and \
        out.stderr.count("\n") == 1, out.stderr
    assert main(["plan", "--model", MODEL, "--address", "auto", "--gpus", "8"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err
    with pytest.raises(ValueError, match="is not HOST:PORT .*port 1-65535"):
        topology.check_reachable("127.0.0.1:99999", timeout_s=2)


def test_a_port_that_answers_but_is_not_ray_is_one_line():
    """ray.init on a listener that is not a GCS (the dashboard's 8265, a web server) retried
    for minutes; an HTTP/1 server and a silent one are refused in one line (a live GCS passes:
    test_plan_cli_on_the_live_cluster_via_ray_address)."""
    import threading

    def serve(listener, reply):
        conn, _ = listener.accept()
        with conn:
            conn.recv(64)
            if reply:
                conn.sendall(reply)
            threading.Event().wait(3)

    for reply in (b"HTTP/1.0 400 Bad Request\r\n\r\n", None):
        with socket.socket() as listener:
            listener.bind(("127.0.0.1", 0))
            listener.listen(1)
            address = f"127.0.0.1:{listener.getsockname()[1]}"
            threading.Thread(target=serve, args=(listener, reply), daemon=True).start()
            with pytest.raises(ValueError, match=f"{address} answers, but not as a Ray cluster .*not the dashboard"):
                topology.check_reachable(address, timeout_s=1)
    # The CLI: exit 2 and one line, where it hung.
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        threading.Thread(target=serve, args=(listener, b"HTTP/1.0 400 Bad Request\r\n\r\n"), daemon=True).start()
        out = subprocess.run([sys.executable, "-m", "raydit.cli", "plan", "--model", MODEL, "--address",
                              f"127.0.0.1:{listener.getsockname()[1]}"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and out.stderr.count("\n") == 1 and "answers, but not as a Ray cluster" in out.stderr, \
        out.stderr


# -- the live cluster ---------------------------------------------------------------------------


def test_live_spec_reads_types_counts_and_node_ids(fake_cluster):
    _, ids = fake_cluster
    live = read_live_cluster("cuda", probe_timeout_s=60)
    got = {n.name: (n.device.name, n.count) for n in live.spec.nodes}
    assert got == {ids[t]: (name, gpus) for t, name, gpus, _ in NODES}
    # Fake GPUs: the probe ran and said CUDA is not usable there; table memory is kept.
    assert any("CUDA is not usable" in n for n in live.notes), live.notes
    assert {n.device.memory_gb for n in live.spec.nodes} == {80, 48, 16}
    cpu = live_cluster_spec("cpu", calibration=False)
    assert cpu.total == 1 + sum(c for *_, c in NODES) and cpu.types == ["cpu"]
    survivors = live_cluster_spec("cuda", counts={ids["A100"]: 2, ids["T4"]: 1}, probe=False)
    assert sorted(n.count for n in survivors.nodes) == [1, 2]
    rows = topology.describe_live_cluster()
    assert sorted((r["ray_type"], r["device_type"], r["count"]) for r in rows) == \
        sorted((t, name, gpus) for t, name, gpus, _ in NODES)


def _without_node_names(d, names: dict):
    """Replace node names (Ray node ids or YAML names) by their position in the cluster."""
    text = json.dumps(d, sort_keys=True)
    for name, pos in names.items():
        text = text.replace(json.dumps(name), json.dumps(f"node#{pos}"))
    return json.loads(text)


def test_live_plan_equals_the_offline_plan_of_the_same_cluster_as_yaml(fake_cluster, tmp_path):
    import yaml

    _, ids = fake_cluster
    spec = live_cluster_spec("cuda", probe=False)
    # The same numbers written by hand, in the order Ray lists the nodes.
    by_id = {ids[t]: (t, name, gpus) for t, name, gpus, _ in NODES}
    listed = [by_id[n.name] for n in spec.nodes]
    assert sorted(listed) == sorted((t, name, gpus) for t, name, gpus, _ in NODES)
    yaml_path = tmp_path / "same.yaml"
    yaml_path.write_text(yaml.safe_dump({"nodes": [
        {"name": f"yaml-{t}", "gpu_type": name, "count": gpus} for t, name, gpus in listed]}))
    offline = plan(MODEL, cluster=str(yaml_path))
    live = plan(MODEL, cluster=spec)
    a = _without_node_names(live.to_dict(), {ids[t]: t for t, *_ in listed})
    b = _without_node_names(offline.to_dict(), {f"yaml-{t}": t for t, *_ in listed})
    assert a == b
    best = live.best
    per_node = {}
    for r in best.placement:
        per_node[r.node] = per_node.get(r.node, 0) + 1
    assert best.world_size == sum(per_node.values()) and best.world_size >= 2
    assert a["best"]["world_size"] == best.world_size


def test_ulysses_groups_land_on_one_node_each(fake_cluster):
    """Reserve what the plan asks for and read back where Ray put every bundle."""
    import ray
    from ray.util.placement_group import placement_group_table, remove_placement_group

    from raydit.runtime.pool import reserve_devices

    result = plan(MODEL, cluster=live_cluster_spec("cuda", probe=False), cfg=1)
    # Show every shape the planner ranks on this cluster that has a Ulysses group > 1.
    plans = [p for p in result.candidates if p.ulysses > 1][:3]
    assert plans, [p.explanation for p in result.candidates]
    for p in plans:
        ranks = p.placement
        pgs = reserve_devices(len(ranks), [r.node for r in ranks], "cuda", 60)
        try:
            landed = []
            for pg in pgs:
                table = placement_group_table(pg)
                assert table["state"] == "CREATED" and len(table["bundles_to_node_id"]) == 1
                landed.append(table["bundles_to_node_id"][0])
            assert landed == [r.node for r in ranks]
            groups: dict = {}
            for r, node in zip(ranks, landed):
                groups.setdefault((r.replica, r.cfg_rank, r.ring_rank), set()).add(node)
            assert all(len(nodes) == 1 for nodes in groups.values()), groups
            assert len(groups) == p.world_size // p.ulysses
        finally:
            for pg in pgs:
                remove_placement_group(pg)
    # Removal is asynchronous: every GPU comes back free (poll, with a generous limit).
    for _ in range(100):
        if ray.available_resources().get("GPU", 0) == sum(g for *_, g, _ in NODES):
            break
        time.sleep(0.2)
    assert ray.available_resources().get("GPU", 0) == sum(g for *_, g, _ in NODES)


def test_plan_cli_on_the_live_cluster_via_ray_address(fake_cluster):
    cluster, ids = fake_cluster
    env = dict(os.environ, RAY_ADDRESS=cluster.address)
    out = subprocess.run([sys.executable, "-m", "raydit.cli", "plan", "--model", MODEL,
                          "--address", "auto", "--json", "--top", "1"],
                         capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert out.stdout.lstrip().startswith("{"), (out.stdout, out.stderr)
    got = json.loads(out.stdout)
    expected = plan(MODEL, cluster=live_cluster_spec("cuda", probe=False)).to_dict(top=1)
    assert got["cluster"] == expected["cluster"]
    assert got["best"] == expected["best"]
    # Fake GPUs: the memory probe says why it could not read them (or that it timed out).
    assert "raydit: note: GPU memory" in out.stderr, out.stderr


def test_plan_json_is_alone_on_stdout_when_ray_prints_to_the_driver(fake_cluster, capsys, monkeypatch):
    """Ray's driver prints the messages the raylet pushes to a job (a worker slow to start on a
    busy node) to stdout, log_to_driver or not (ray._private.worker.listen_error_messages). Under
    load one landed in `raydit plan --json`'s stdout. Here Ray's own printer fires while the live
    cluster is read, as its listener thread does: the JSON stays alone on stdout."""
    from ray._private.worker import print_to_stdstream

    from raydit import cli
    from raydit.runtime import topology

    read = topology.read_live_cluster

    def read_while_ray_prints(*a, **k):
        print_to_stdstream({"lines": ["WARNING: worker slow to start"], "pid": "raylet", "is_err": False},
                           ignore_prefix=False)
        return read(*a, **k)

    monkeypatch.setattr(topology, "read_live_cluster", read_while_ray_prints)
    assert cli.main(["plan", "--model", MODEL, "--address", "auto", "--json", "--top", "1"]) == 0
    out, err = capsys.readouterr()
    got = json.loads(out)
    assert got["best"] == plan(MODEL, cluster=live_cluster_spec("cuda", probe=False)).to_dict(top=1)["best"]
    assert "WARNING: worker slow to start" in err


# -- calibration ------------------------------------------------------------------------------


@pytest.mark.long  # the second stage: stage one ran 29:11 under load at 26e0658 (this one 72 s)
def test_cpu_calibration_measures_caches_and_changes_the_plan(fake_cluster, tmp_path, monkeypatch):
    from raydit.doctor import format_report
    from raydit.runtime import calibrate, calibration_cache

    _, ids = fake_cluster
    monkeypatch.setenv("RAYDIT_CACHE", str(tmp_path))
    assert calibration_cache.calibrated_device_type("cpu") == device_type("cpu")  # nothing cached yet
    assert calibrate.calibrate_cluster("cpu", timeout_s=CALIBRATE_TIMEOUT_S) == []
    entries = json.loads((tmp_path / "calibration.json").read_text())["devices"]
    m = entries["cpu"]["measured"]
    for key in ("matmul_tflops", "dit_linear_tflops", "all_to_all_gb_s", "p2p_gb_s", "latency_us"):
        assert math.isfinite(m[key]) and m[key] > 0, (key, m)
    assert m["matmul_dtype"] == "float32" and len(m["matmul_tflops_by_size"]) == 3
    assert m["dit_dtype"] == "float32" and m["attention_kernel"] == "torch-cpu"
    assert set(m["attention_tflops_by_head_dim"]) == {"64", "128"}
    assert all(math.isfinite(r) and r > 0 for r in m["attention_tflops_by_head_dim"].values())
    assert entries["cpu"]["node_id"] == ids["A100"]  # the node with the most CPU slots
    # Cached: a second call measures nothing (the entry is the same, time stamp included).
    assert calibrate.calibrate_cluster("cpu", timeout_s=CALIBRATE_TIMEOUT_S) == []
    assert calibration_cache.load_calibration() == entries

    cal = calibration_cache.calibrated_device_type("cpu")
    table = device_type("cpu")
    # Each part of the step at its measured rate: the linear part, the attention kernel.
    top = max(m["matmul_tflops"], m["dit_linear_tflops"], *m["attention_tflops_by_head_dim"].values(),
              *m["attention_plain_tflops_by_head_dim"].values())
    assert cal.tflops == top and cal.flops_per_second == pytest.approx(m["dit_linear_tflops"] * 1e12)
    for head_dim, rate in m["attention_tflops_by_head_dim"].items():
        assert cal.attention_flops_per_second(int(head_dim)) == pytest.approx(rate * 1e12)
    assert cal.link_gb_s == m["all_to_all_gb_s"] and cal.link_latency_us == m["latency_us"]
    # The live spec picks the cache up by itself.
    live = read_live_cluster("cpu")
    assert all(n.source == "calibrated" and n.device == cal for n in live.nodes)
    # "measure" measures only what the cache lacks (nothing here); False ignores the cache.
    assert read_live_cluster("cpu", calibration="measure").spec == live.spec
    assert calibration_cache.load_calibration() == entries
    assert live_cluster_spec("cpu", calibration=False).nodes[0].device == table
    with pytest.raises(ValueError, match="calibration 'yes' must be None"):
        read_live_cluster("cpu", calibration="yes")

    # The planner uses the measured rate: compute time scales with 1 / FLOP/s exactly (with
    # attention at the same rate), and the Ulysses all-to-all follows the measured link, its
    # bandwidth and its latency both (the table's figures with the measured link's put in give
    # the same all-to-all; whether it is faster than the table's depends on both, and on a
    # loaded machine the latency can be the larger part: no order between them is asserted).
    def best(dev):
        return plan(MODEL, cluster=ClusterSpec((NodeSpec("n", dev, 2),)), ulysses=2, cfg=1).best

    p_cal, p_table = best(dataclasses.replace(cal, attention_efficiency=(), plain_attention_efficiency=())), best(table)
    assert p_cal.cost.compute * cal.flops_per_second == pytest.approx(
        p_table.cost.compute * table.flops_per_second, rel=1e-9)
    assert best(cal).cost.compute != pytest.approx(p_cal.cost.compute, rel=1e-6)  # attention apart
    table_on_measured_link = dataclasses.replace(table, link_gb_s=cal.link_gb_s, link_latency_us=cal.link_latency_us)
    assert p_cal.cost.all_to_all == pytest.approx(best(table_on_measured_link).cost.all_to_all, rel=1e-12)
    assert (p_cal.cost.all_to_all == p_table.cost.all_to_all) == \
        ((cal.link_gb_s, cal.link_latency_us) == (table.link_gb_s, table.link_latency_us))
    assert (p_cal.predicted_step_seconds < p_table.predicted_step_seconds) == \
        (p_cal.cost.total < p_table.cost.total)

    report = format_report(_doctor_info())
    assert f"calibration   {tmp_path / 'calibration.json'}" in report
    assert "cpu: matmul" in report and "all-to-all" in report
    assert "DiT block linear part" in report and "attention d64 torch-cpu " in report


@pytest.mark.long  # the second stage (suite time: stage one ran 21:42 at f797430)
def test_model_calibration_files_the_models_own_rates_and_the_planner_uses_them(fake_cluster, tmp_path, monkeypatch):
    """`raydit doctor --calibrate --model`: one actor loads the saved pipeline, times its own
    step at the request given and its attention at its shape; the entry is filed under the
    model's calibration key on the device type, survives the device being measured again,
    and the planner then gives the timed step back for that model (and only for it)."""
    from raydit.doctor import format_report
    from raydit.models.loading import resolve_model_dir
    from raydit.planner import model_spec
    from raydit.runtime import calibrate, calibration_cache, measure

    _, ids = fake_cluster
    monkeypatch.setenv("RAYDIT_CACHE", str(tmp_path))
    model = str(resolve_model_dir("tiny"))
    spec = model_spec(model)
    entry = calibrate.calibrate_type("cpu", ids["A100"], "cpu", pair=False, sizes=(64,), model=model,
                                     geometry={"frames": 5, "height": 48, "width": 64}, timeout_s=CALIBRATE_TIMEOUT_S)
    got = entry["models"][spec.calibration_key]
    assert got["request"] == {"frames": 5, "height": 48, "width": 64, "guidance_scale": 5.0,
                              "batch": spec.cfg_branches, "tokens": spec.geometry(5, 48, 64).sequence_tokens}
    assert len(got["step_seconds_all"]) == measure.MODEL_STEPS and got["dtype"] == "float32"
    for key in ("step_seconds", "linear_tflops", "lse_attention_tflops", "plain_attention_tflops"):
        assert math.isfinite(got[key]) and got[key] > 0, (key, got)
    calibration_cache.save_calibration({"cpu": entry})
    # Measuring the device again (without --model) keeps the model's figures.
    calibration_cache.save_calibration({"cpu": dict(entry, models={}, when="later")})
    assert calibration_cache.load_calibration()["cpu"]["models"] == entry["models"]

    cal = calibration_cache.calibrated_device_type("cpu")
    assert cal.model_rates == ((spec.calibration_key, got["linear_tflops"], got["lse_attention_tflops"],
                                got["plain_attention_tflops"]),)
    one = ClusterSpec((NodeSpec("n", cal, 1),))
    best = plan(spec, 5, 48, 64, cluster=one, world_size=1).best
    assert best.predicted_step_seconds == pytest.approx(got["step_seconds"], rel=1e-9)
    bare = ClusterSpec((NodeSpec("n", dataclasses.replace(cal, model_rates=()), 1),))
    assert plan(spec, 5, 48, 64, cluster=bare, world_size=1).best.predicted_step_seconds != \
        pytest.approx(got["step_seconds"], rel=1e-3)
    report = format_report(_doctor_info())
    assert f"cpu: model {model} ({spec.calibration_key}): step " in report and "at 5x48x64, batch 2" in report


def _doctor_info():
    from raydit.doctor import _calibration

    return {"python": "", "torch": "", "cuda_version": None, "diffusers": "", "transformers": "",
            "ray": "", "gpus": [], "nccl_available": False, "gloo_available": True,
            "flash_attn_installed": False, "kernels": {}, "cluster": {"status": "-"},
            "calibration": _calibration()}


def test_gpu_calibration_on_fake_gpus_says_why_and_caches_nothing(fake_cluster, tmp_path, monkeypatch):
    from raydit.runtime import calibrate

    _, ids = fake_cluster
    monkeypatch.setenv("RAYDIT_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="cannot calibrate T4 .*CUDA is not usable"):
        calibrate.calibrate_type("T4", ids["T4"], "cuda", pair=False, timeout_s=60)
    assert not Path(tmp_path / "calibration.json").exists()


def test_dit_block_measure_times_its_two_parts_apart():
    """measure_dit: the linear part and the runtime's attention kernel at head dims 64 and 128
    of a small block, in one thread, the block's shape recorded. Timed by a clock that says
    each call took one second (the machine's speed is bench/'s business): every rate is the
    part's FLOP count, as the cost model counts it, over one second."""
    import torch

    from raydit.runtime.measure import measure_dit

    now = [0.0]

    def one_second_a_call():  # each read a second on: one second between a call's two reads
        now[0] += 1.0
        return now[0]

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        m = measure_dit("cpu", block=(128, 256, 1024), repeats=1, timer=one_second_a_call)
    finally:
        torch.set_num_threads(threads)
    assert m["dit_block"] == {"tokens": 128, "hidden": 256, "ffn": 1024} and m["dit_dtype"] == "float32"
    assert m["attention_kernel"] == "torch-cpu" and set(m["attention_tflops_by_head_dim"]) == {"64", "128"}
    # The one CPU candidate, chosen at each head dim, its rate the planner's; SDPA timed apart.
    assert m["attention_kernel_by_head_dim"] == {"64": "torch-cpu", "128": "torch-cpu"}
    assert m["attention_rates_by_head_dim"] == {d: {"torch-cpu": r} for d, r in m["attention_tflops_by_head_dim"].items()}
    assert m["attention_dropped_by_head_dim"] == {}
    # 2 T (4 h^2 + 2 h f) for the linear part, 4 T^2 h for attention at every head dim.
    assert m["dit_linear_tflops"] == pytest.approx(2 * 128 * (4 * 256**2 + 2 * 256 * 1024) / 1e12)
    attention = {"64": pytest.approx(4 * 128**2 * 256 / 1e12), "128": pytest.approx(4 * 128**2 * 256 / 1e12)}
    assert m["attention_tflops_by_head_dim"] == attention and m["attention_plain_tflops_by_head_dim"] == attention


def test_cache_round_trip_and_bad_cache(tmp_path):
    from raydit.runtime import calibration_cache

    path = tmp_path / "c.json"
    entry = {"name": "L40S", "measured": {"matmul_tflops": 200.0, "all_to_all_gb_s": 20.0,
                                          "latency_us": 12.0, "memory_gb": 47.7}}
    calibration_cache.save_calibration({"L40S": entry}, path)
    calibration_cache.save_calibration({"T4": {"name": "T4", "measured": {"matmul_tflops": 40.0}}}, path)
    assert set(calibration_cache.load_calibration(path)) == {"L40S", "T4"}
    dev = calibration_cache.calibrated_device_type("L40S", path)
    assert (dev.tflops, dev.link_gb_s, dev.link_latency_us, dev.memory_gb) == (200.0, 20.0, 12.0, 47.7)
    t4 = calibration_cache.calibrated_device_type("t4", path)
    assert t4.tflops == 40.0 and t4.link_gb_s == 8  # only what was measured is replaced
    assert t4.efficiency == device_type("T4").efficiency and t4.attention_efficiency == ()
    # With the DiT block's figures: each part's rate is the measured one, over the fastest.
    dit = {"matmul_tflops": 40.0, "dit_linear_tflops": 30.0,
           "attention_tflops_by_head_dim": {"64": 20.0, "128": 50.0}}
    calibration_cache.save_calibration({"T4": {"name": "T4", "measured": dit}}, path)
    t4 = calibration_cache.calibrated_device_type("T4", path)
    assert t4.tflops == 50.0 and t4.flops_per_second == pytest.approx(30e12)
    assert t4.attention_efficiency == ((64, 0.4), (128, 1.0))
    assert t4.attention_flops_per_second(64) == pytest.approx(20e12)
    path.write_text("{not json")
    with pytest.raises(ValueError, match="calibration cache .* is unreadable.*delete it"):
        calibration_cache.load_calibration(path)
    assert calibration_cache.describe_calibration(path)[0].startswith("calibration cache")
