"""The device model (issue 40): the roofline per op class, the tables' provenance, the decode
pricing of Kandinsky 5 / LTX-2, and what `plan` says about its rates. Exact formulas: each
expected value is computed here from the formula, not copied from a run."""

import dataclasses
import json
import re

import pytest

from raydit.planner import ClusterSpec, NodeSpec, device_type, model_spec, plan
from raydit.planner import cost as costmod
from raydit.planner import devicemodel as dm
from raydit.planner.decode import VAE_EFFICIENCY, decode_cost, decode_ranks


def test_roofline_is_the_slower_of_compute_and_memory_plus_launches():
    r = dm.Roofline(tflops=100, gb_s=1000, launch_us=5)
    assert r.seconds(2e12, 1e9) == pytest.approx(0.02 + 5e-6)  # compute-bound: 2e12 / 1e14
    assert r.seconds(1e9, 1e11, launches=3) == pytest.approx(0.1 + 15e-6)  # memory-bound: 1e11 / 1e12


def test_every_table_says_where_its_figures_come_from():
    tables = dm.builtin_tables()
    assert {"H100", "H200", "A100-80GB", "A100-40GB", "L40S", "L4", "H20", "B200"} <= set(tables)
    for name, t in tables.items():
        for key in ("device_type", "gpu", "date", "torch", "provenance"):
            assert t.data[key], (name, key)
        rows = [r for rows in t.data["gemm"].values() for r in rows]
        rows += [r for rows in t.data["attention"].values() for r in rows]
        assert rows and all(r["source"] for r in rows), name
        for key in ("hbm_gb_s", "elementwise_gb_s", "launch_us", "compiled_fraction"):
            assert t.data[key]["source"], (name, key)
        if not t.provenance.startswith("measured"):  # the rest are scaled from the measured H200 one, and say so
            assert t.provenance == "scaled from H200" and "by published specs" in t.data["note"], name
    assert tables["H200"].provenance.startswith("measured") and tables["H200"].priced
    # A scaled table prices only a type without fit figures of its own.
    assert tables["H20"].priced and tables["B200"].priced
    assert not tables["A100-80GB"].priced and not tables["L40S"].priced
    assert tables["H100"].priced == tables["H100"].provenance.startswith("measured")  # once bench_opsweep ran there
    # No FP8 tensor cores on an A100: no fp8 rows, and an fp8 GEMM is priced at the bf16 rate.
    a100 = tables["A100-80GB"]
    assert not a100.gemm_rows("fp8") and a100.gemm(32760, 1536, 1536, "fp8") == a100.gemm(32760, 1536, 1536)
    # Scaling: rates by the bf16 peak ratio, bandwidth by the memory ratio.
    h200 = tables["H200"]
    assert a100.gemm(8192, 8192, 8192).tflops == pytest.approx(h200.gemm(8192, 8192, 8192).tflops * 312 / 989.4,
                                                               abs=0.01)
    assert a100.data["hbm_gb_s"]["value"] == pytest.approx(4800 * 2039 / 4800, abs=0.1)


def test_a_table_without_provenance_is_refused(tmp_path):
    data = json.loads((dm.TABLE_DIR / "h200.json").read_text())
    del data["date"]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(data))
    with pytest.raises(ValueError, match="bad.json: device table: 'date' must be a non-empty string"):
        dm.load_table(bad)


def test_rates_are_looked_up_at_the_nearest_measured_shape():
    t = dm.table_for("H200")
    assert t.gemm(32000, 1536, 1536).tflops == 700.0 and t.gemm(30000, 5000, 5100).tflops == 775.0
    assert t.gemm(32760, 1536, 1536, "fp8").tflops == 961.0
    assert t.attention(128, 30000).tflops == 603.2  # SDPA at 32760 tokens, head dim 128
    assert t.attention(128, 100000, "bf16-lse").tflops == 553.0
    assert t.attention(64, 17000).tflops == 440.8 or t.attention(64, 17000).tflops == 432.0
    # No 8-bit kernel measured on the H200 yet: its bf16 kernel's rate stands in.
    assert t.attention(128, 32760, "int8") == t.attention(128, 32760)


def test_attention_rows_of_equal_length_are_told_apart_by_heads_times_batch():
    t = dm.table_for("H100")  # (1, 12) and (1, 40) heads measured at 32760 tokens, head dim 128
    assert t.attention(128, 32760, lanes=40).tflops == 572.0
    assert t.attention(128, 32760, lanes=12).tflops == 632.3
    assert t.attention(128, 32760, lanes=2 * 40).tflops == 572.0  # Wan 14B's two samples: nearer 40
    spec = model_spec("wan2.1-i2v-14b-480p")
    geo = spec.geometry(81, 480, 832)
    ops = dm.step_ops(t, spec, geo, 1)
    assert ops.attention_per_layer == pytest.approx(4 * geo.sequence_tokens ** 2 * spec.hidden / 572.0e12)


def test_a_gated_ffn_projects_to_twice_its_width():
    t = dm.table_for("H200")
    mochi = model_spec("mochi-1")
    assert mochi.gated_ffn and not model_spec("wan2.1-t2v-1.3b").gated_ffn
    geo = mochi.geometry()
    m, h, f = 2 * geo.sequence_tokens, mochi.hidden, mochi.ffn_hidden

    def g(rows, n, k):
        return t.gemm(rows, n, k).seconds(2 * rows * n * k, (rows * k + k * n) * 2 + rows * n * 2, 0)

    gated, plain = (dm.step_ops(t, s, geo, 2) for s in (mochi, dataclasses.replace(mochi, gated_ffn=False)))
    assert gated.gemm - plain.gemm == pytest.approx(mochi.layers * (g(m, 2 * f, h) - g(m, f, h)))
    with pytest.raises(ValueError, match="gated_ffn must be True or False"):
        dataclasses.replace(mochi, gated_ffn="yes")


def test_a_masked_attention_is_priced_at_the_masked_rows_or_the_stand_in():
    t = dm.table_for("H200")
    hv = model_spec("hunyuanvideo")
    assert hv.masked_attention and not model_spec("wan2.1-t2v-1.3b").masked_attention
    geo = hv.geometry(33, 480, 848)
    S, h = geo.sequence_tokens, hv.hidden
    ops = dm.step_ops(t, hv, geo, 1)
    # No masked call measured on the H200: its FlashAttention-2 rows stand in.
    stand_in = t.attention(128, S, dm.MASKED_STAND_IN, hv.heads).tflops
    assert stand_in == 351.8 and t.attention(128, S, "bf16-masked", hv.heads).tflops == stand_in
    assert "masked attention at its fa2 rows (no masked call measured)" in t.describe()
    assert ops.attention_per_layer == pytest.approx(4 * S * S * h / (stand_in * 1e12))
    # Sharded, raydit's processor attends to the valid text unmasked: the LSE kernel's own rate.
    assert ops.attention_lse_per_layer == pytest.approx(4 * S * S * h / (t.attention(128, S, "bf16-lse", 24).tflops * 1e12))
    assert dm.step_ops(t, dataclasses.replace(hv, masked_attention=False), geo, 1).attention < ops.attention
    # A table that measured the masked call prices it at its own rows.
    data = json.loads(json.dumps(t.data))
    data["attention"]["bf16-masked"] = [dict(head_dim=128, tokens=S, heads=24, batch=1, tflops=500.0, source="test")]
    measured = dm.step_ops(dm.DeviceTable(data), hv, geo, 1)
    assert measured.attention_per_layer == pytest.approx(4 * S * S * h / 500e12)
    # The plan pays the masked rate on one device only: sharded (Ulysses 2), raydit's processor
    # attends unmasked, at the LSE kernel's rate (within 1.3% of the plain one on the H200).
    unmasked = dataclasses.replace(hv, masked_attention=False)

    def step(spec, gpus):
        return plan(spec, 33, 480, 848, gpus=gpus, gpu_type="H200", ulysses=gpus, ring=1,
                    world_size=gpus).best.predicted_step_seconds

    assert step(hv, 1) > 1.2 * step(unmasked, 1)
    assert step(hv, 2) == pytest.approx(step(unmasked, 2), rel=0.01)
    # An 8-bit attention mode is priced at its own kernel, masked or not.
    int8 = dm.step_ops(t, hv, geo, 1, dm.Mode(attention="int8"))
    assert int8.attention_per_layer == pytest.approx(4 * S * S * h / (t.attention(128, S, "int8", 24).tflops * 1e12))


def test_a_step_is_the_sum_of_its_ops():
    t = dm.table_for("H200")
    spec = model_spec("wan2.1-t2v-1.3b")
    geo = spec.geometry(81, 480, 832)
    b, L, h, f, S, X = 2, spec.layers, spec.hidden, spec.ffn_hidden, geo.sequence_tokens, geo.cross_text_tokens
    m = b * S
    ops = dm.step_ops(t, spec, geo, b)

    def g(rows, n, k):
        return t.gemm(rows, n, k).seconds(2 * rows * n * k, (rows * k + k * n) * 2 + rows * n * 2, 0)

    assert ops.gemm == pytest.approx(L * (6 * g(m, h, h) + g(m, f, h) + g(m, h, f) + 2 * g(b * X, h, h)))
    assert ops.attention == pytest.approx(L * 4 * b * S * S * h / (t.attention(128, S).tflops * 1e12))
    # Elementwise: the counted bytes of Wan's block at the elementwise bandwidth.
    assert spec.elementwise_bytes == 419.0
    assert ops.elementwise == pytest.approx(419.0 * m * h * L / (t.data["elementwise_gb_s"]["value"] * 1e9))
    # Compile keeps `compiled_fraction` of the elementwise work; fp8 runs the GEMMs at the fp8 rates
    # and, eager, pays the activations' quantization.
    compiled = dm.step_ops(t, spec, geo, b, dm.Mode(compile=True))
    assert compiled.elementwise == pytest.approx(ops.elementwise * t.compiled_fraction)
    assert compiled.gemm == ops.gemm and compiled.attention == ops.attention
    # Launches: every kernel of a layer once per transformer call; Wan calls once per branch
    # (b calls), CogVideoX runs its branches as one batch (one call).
    per_call = dm.GEMM_LAUNCHES + dm.ATTENTION_LAUNCHES + dm.CROSS_LAUNCHES + spec.elementwise_launches
    assert spec.elementwise_launches == 78 and not spec.batched_branches
    assert ops.launches == pytest.approx(b * L * per_call * t.launch_us * 1e-6)
    assert compiled.launches == pytest.approx(b * L * (per_call - (1 - t.compiled_fraction) * 78) * t.launch_us * 1e-6)
    cog = model_spec("cogvideox-2b")
    assert cog.batched_branches
    cog_ops = dm.step_ops(t, cog, cog.geometry(), 2)
    assert cog_ops.launches == pytest.approx(
        cog.layers * (dm.GEMM_LAUNCHES + dm.ATTENTION_LAUNCHES + cog.elementwise_launches) * t.launch_us * 1e-6)
    fp8 = dm.step_ops(t, spec, geo, b, dm.Mode(quantize="fp8"))
    assert fp8.gemm < ops.gemm and fp8.quantize > 0
    assert dm.step_ops(t, spec, geo, b, dm.Mode(quantize="fp8", compile=True)).quantize == 0


def test_model_rates_give_the_op_step_back_through_the_cost_model():
    t = dm.table_for("H200")
    spec = model_spec("wan2.1-t2v-1.3b")
    geo = spec.geometry()
    ops = dm.step_ops(t, spec, geo, 2)
    linear, lse, plain = dm.model_rates(t, spec)
    link = costmod.Link(450, 8)
    got = costmod.step_cost(spec, geo, 1, 1, 1, 2, linear, link, link, link, attn_flops_per_s=plain)
    assert got.total == pytest.approx(ops.total, rel=1e-9)
    # The H200 plans with them, and says so.
    h200 = device_type("H200")
    assert h200.rates_for(spec) == (linear, lse, plain)
    one = plan(spec, gpus=1, gpu_type="H200")
    assert one.best.predicted_step_seconds == pytest.approx(ops.total, rel=1e-9)
    assert one.rates_sources == (f"H200: {t.describe()}",) and one.mode == dm.Mode()


def test_plan_prices_the_mode_and_names_it():
    base = plan("wan2.1-t2v-1.3b", gpus=1, gpu_type="H200")
    fast = plan("wan2.1-t2v-1.3b", gpus=1, gpu_type="H200", mode=dm.Mode("fp8", "bf16", True))
    assert fast.best.predicted_step_seconds < base.best.predicted_step_seconds
    assert fast.to_dict()["mode"] == {"quantize": "fp8", "attention": "bf16", "compile": True, "keep_bf16": False,
                                      "full_precision_steps": 0, "steps": 50, "label": "fp8 GEMMs, compiled"}
    # A type without a priced table keeps its figures whatever the mode, and says which.
    a100 = plan("wan2.1-t2v-1.3b", gpus=1, gpu_type="A100-80GB", mode=dm.Mode(compile=True))
    assert a100.best.predicted_step_seconds == plan("wan2.1-t2v-1.3b", gpus=1,
                                                    gpu_type="A100-80GB").best.predicted_step_seconds
    assert "A100-80GB device figures" in a100.rates_sources[0] and "scaled from H200" in a100.rates_sources[0]
    assert "mode bf16, compiled not priced here" in a100.rates_sources[0]
    with pytest.raises(ValueError, match="quantize 'int4' is not one of none, fp8"):
        dm.Mode(quantize="int4")
    with pytest.raises(ValueError, match="attention 'fp16' is not one of bf16, int8, fp8"):
        dm.Mode(attention="fp16")


def test_kandinsky5_decodes_by_rows_and_ltx2_whole():
    k5 = model_spec("kandinsky5-t2v-pro")
    geo = k5.geometry()
    assert decode_ranks(k5, geo, 8) == 8  # HunyuanVideo's VAE, split by rows
    one, eight = decode_cost(k5, geo, 1, 1e14, 450, 8), decode_cost(k5, geo, 8, 1e14, 450, 8)
    assert eight.compute == pytest.approx(one.compute * (-(-geo.latent_height // 8)) / geo.latent_height)
    ltx2 = model_spec("ltx-2")
    lgeo = ltx2.geometry()
    assert decode_ranks(ltx2, lgeo, 8) == 1  # the LTX-2 video decoder runs whole
    whole = decode_cost(ltx2, lgeo, 8, 1e14, 450, 8)
    assert whole.ranks == 1 and whole.halo == whole.gather == 0
    assert whole.compute == pytest.approx(lgeo.frames * lgeo.height * lgeo.width * 1.349e6 / (1e14 * VAE_EFFICIENCY))


def test_a_calibration_from_elsewhere_is_reported_not_used():
    from raydit.runtime.calibration_cache import entry_problem, names_gpu

    ok = {"device": "cuda", "device_name": "NVIDIA H200", "torch": "2.11.0",
          "measured": {"matmul_tflops": 700.0, "attention_plain_tflops_by_head_dim": {"128": 640.0}}}
    assert entry_problem("H200", ok, "2.11.0") is None
    other_gpu = dict(ok, device_name="NVIDIA A100-SXM4-80GB")
    assert entry_problem("H200", other_gpu, "2.11.0") == (
        "calibration entry 'H200' was measured on 'NVIDIA A100-SXM4-80GB', another GPU: not used; "
        "run `raydit doctor --calibrate --force` on a H200")
    line = entry_problem("H200", ok, "2.12.0")
    assert "measured with torch 2.11.0, this is torch 2.12.0: not used" in line and "\n" not in line
    # The type's model is a whole word of the GPU's name (was a substring: an L40S calibration
    # served the L4, an H200's the H20, an 80 GB A100's the 40 GB type with 79 GB of memory).
    for kind, gpu in (("L4", "NVIDIA L40S"), ("L40", "NVIDIA L40S"), ("H20", "NVIDIA H200"),
                      ("A100-40GB", "NVIDIA A100-SXM4-80GB"), ("A100-80GB", "NVIDIA A100-PCIE-40GB")):
        assert "another GPU: not used" in entry_problem(kind, dict(ok, device_name=gpu), "2.11.0"), (kind, gpu)
    for kind, gpu in (("H100", "NVIDIA H100 80GB HBM3"), ("L40S", "NVIDIA L40S"), ("L4", "NVIDIA L4"),
                      ("A100-80GB", "NVIDIA A100-SXM4-80GB"), ("A100", "NVIDIA A100-SXM4-40GB"),
                      ("RTX4090", "NVIDIA GeForce RTX 4090"), ("T4", "Tesla T4"), ("H100-SXM", "NVIDIA H100 80GB HBM3")):
        assert names_gpu(kind, gpu), (kind, gpu)
    slow = dict(ok, measured={"matmul_tflops": 300.0})
    line = entry_problem("H200", slow, "2.11.0")
    assert "disagrees with its op table" in line and "more than 2x: matmul 300 against 684.1" in line
    # Within 2x of the table: used.
    assert entry_problem("H200", dict(ok, measured={"matmul_tflops": 400.0}), "2.11.0") is None


@pytest.mark.long
def test_the_elementwise_count_matches_diffusers_blocks():
    """ModelSpec.elementwise_bytes of Wan, CogVideoX and HunyuanVideo: the count bench_opsweep
    makes on diffusers' blocks (meta device)."""
    import sys

    sys.path.insert(0, str(dm.TABLE_DIR.parents[2] / "bench"))
    import bench_opsweep

    got = bench_opsweep.count_blocks()
    for family, name in (("wan", "wan2.1-t2v-1.3b"), ("cogvideox", "cogvideox-2b"), ("hunyuanvideo", "hunyuanvideo")):
        assert model_spec(name).elementwise_bytes == pytest.approx(got[family], rel=0.03), family


def test_the_elementwise_bandwidth_is_the_measured_eager_chains():
    """Issue 56: the counted elementwise bytes are priced at what a DiT block's eager elementwise
    chain reached on the H100 (bench_opsweep 2026-11-27: its ops' bytes, counted by the rule the
    families' are, 7.065 GB in 2.893 ms), not at one large add's 2852 GB/s (kept beside); the H200
    and the scaled tables carry the same fraction of their published HBM peak."""
    h100, h200 = dm.table_for("H100"), dm.table_for("H200")
    assert h100.data["elementwise_gb_s"]["value"] == round(7.06515264e9 / 2.893e-3 / 1e9) == 2442
    assert h100.data["add_gb_s"]["value"] == 2852.0
    fraction = 2442 / 3350
    assert h200.data["elementwise_gb_s"]["value"] == pytest.approx(fraction * 4800, abs=0.1)
    for name, table in dm.builtin_tables().items():
        hbm = table.data["hbm_gb_s"]["value"]
        assert table.data["elementwise_gb_s"]["value"] == pytest.approx(fraction * hbm, rel=2e-3), name


def test_a_norm_kernel_copying_a_non_contiguous_input_is_counted():
    """The copy layer_norm's and group_norm's kernels make of a non-contiguous input inside
    themselves (no dispatch mode sees it): read and write of the input (CogVideoX's per-head
    LayerNorm of q and k: 8 bytes a token and channel)."""
    import sys
    from types import SimpleNamespace

    sys.path.insert(0, str(dm.TABLE_DIR.parents[2] / "bench"))
    import bench_opsweep

    view = SimpleNamespace(is_contiguous=lambda: False, numel=lambda: 1000, element_size=lambda: 2)
    whole = SimpleNamespace(is_contiguous=lambda: True, numel=lambda: 1000, element_size=lambda: 2)
    assert bench_opsweep.hidden_copy_bytes("native_layer_norm", (view, [64])) == 4000
    assert bench_opsweep.hidden_copy_bytes("native_group_norm", (view,)) == 4000
    assert bench_opsweep.hidden_copy_bytes("native_layer_norm", (whole, [64])) == 0
    assert bench_opsweep.hidden_copy_bytes("add", (view, view)) == 0
    assert model_spec("cogvideox-2b").elementwise_bytes == pytest.approx(84.3 + 8)


def test_the_sweep_names_the_gpu_types_it_knows():
    import sys

    sys.path.insert(0, str(dm.TABLE_DIR.parents[2] / "bench"))
    import bench_opsweep

    for cuda_name, want in (("NVIDIA H100 80GB HBM3", "H100"), ("NVIDIA H200", "H200"), ("NVIDIA H20", "H20"),
                            ("NVIDIA B200", "B200"), ("NVIDIA L40S", "L40S"), ("NVIDIA L4", "L4"),
                            ("NVIDIA A100-SXM4-80GB", "A100-80GB"), ("NVIDIA A100-SXM4-40GB", "A100-40GB")):
        assert bench_opsweep.gpu_device_type(cuda_name) == want, cuda_name
    with pytest.raises(ValueError, match="GPU 'NVIDIA RTX 6000' is not one of the planner's device types"):
        bench_opsweep.gpu_device_type("NVIDIA RTX 6000")


def test_unknown_devices_and_scaled_types():
    with pytest.raises(ValueError, match=r"unknown GPU type 'B300'; known: H100, H200, H20, B200"):
        device_type("B300")
    b200 = ClusterSpec((NodeSpec("n", device_type("B200"), 8),))
    result = plan("wan2.1-t2v-14b", cluster=b200)
    assert "B200 op table" in result.rates_sources[0] and "scaled from H200" in result.rates_sources[0]
    assert dataclasses.replace(device_type("B200"), use_op_table=False).rates_for(model_spec("wan2.1-t2v-14b")) != \
        device_type("B200").rates_for(model_spec("wan2.1-t2v-14b"))


@pytest.mark.long
def test_the_sweep_writes_a_table_the_planner_loads(tmp_path):
    """bench_opsweep --smoke (CPU, tiny shapes): every part guarded, the table written with its
    provenance; a part that cannot run here (fp8, p2p) is recorded, not fatal."""
    import sys

    sys.path.insert(0, str(dm.TABLE_DIR.parents[2] / "bench"))
    import bench_opsweep

    out = tmp_path / "t.json"
    assert bench_opsweep.main(["--smoke", "--out", str(out), "--budget-s", "120"]) == 0
    t = dm.load_table(out)
    assert t.provenance.startswith("smoke") and not t.priced and t.date and t.torch and t.gpu == "cpu (smoke)"
    parts = t.data["sweep_parts"]
    assert {k for k, v in parts.items() if v["status"] == "ok"} >= {"launch", "elementwise", "gemm", "attention"}, parts
    assert parts["fp8"]["status"].startswith("failed: RuntimeError: FP8 GEMMs need a CUDA GPU")
    today = t.date
    assert all(f"measured {today}" in r["source"] for r in t.gemm_rows("bf16"))
    assert f"measured {today}" in t.data["launch_us"]["source"]
    # Unmeasured here: the fp8 rows keep the H200's, with their source.
    assert t.gemm_rows("fp8") == dm.table_for("H200").gemm_rows("fp8")
    # A budget too small for a part skips it and says so.
    assert bench_opsweep.main(["--smoke", "--out", str(out), "--budget-s", "0.01", "--parts", "gemm"]) == 0
    assert json.loads(out.read_text())["sweep_parts"]["gemm"]["status"].startswith("skipped")


def test_collectives_are_latency_plus_bytes_at_the_nearest_message_size():
    data = json.loads((dm.TABLE_DIR / "h200.json").read_text())
    data["p2p"] = [{"bytes": 1 << 16, "gb_s": 50.0, "latency_us": 10.0, "source": "test"},
                   {"bytes": 1 << 26, "gb_s": 400.0, "latency_us": 20.0, "source": "test"}]
    t = dm.DeviceTable(data)
    assert t.collective("p2p", 1 << 14) == pytest.approx(10e-6 + (1 << 14) / 50e9)
    assert t.collective("p2p", 1 << 27) == pytest.approx(20e-6 + (1 << 27) / 400e9)
    with pytest.raises(ValueError, match="no ring figures"):
        t.collective("ring", 1)


def test_a_calibration_within_2x_keeps_the_table_pricing_the_step():
    from raydit.runtime.calibration_cache import apply_entry

    spec = model_spec("wan2.1-t2v-1.3b")
    h200 = device_type("H200")
    entry = {"measured": {"matmul_tflops": 684.1, "dit_linear_tflops": 434.0,
                          "attention_tflops_by_head_dim": {"128": 677.8}}, "when": "2026-11-26T07:00", "host": "h"}
    cal = apply_entry(h200, entry)
    assert cal.rates_for(spec) == h200.rates_for(spec) and cal.flops_per_second != h200.flops_per_second
    assert "calibration file of 2026-11-26T07:00 on h: links and memory" in cal.rates_source(spec)


def test_doctor_says_why_a_cached_entry_is_not_used(tmp_path):
    from raydit.runtime import calibration_cache

    path = tmp_path / "calibration.json"
    calibration_cache.save_calibration({"H200": {"name": "H200", "device": "cuda", "device_name": "NVIDIA A100-SXM4-80GB",
                                         "measured": {"matmul_tflops": 250.0}, "host": "a", "when": "now"}}, path)
    lines = calibration_cache.describe_calibration(path)
    assert any("measured on 'NVIDIA A100-SXM4-80GB', another GPU: not used" in line for line in lines)
    notes = []
    assert calibration_cache.calibrated_device_type("H200", path, notes) == device_type("H200")
    assert calibration_cache.calibrated_device_types(path, notes) == {} and len(notes) == 2


def test_full_precision_steps_price_the_requests_mean_step():
    """Mode(full_precision_steps=N, steps=S): 2N of S steps run in the unquantized mode (bf16
    GEMMs and attention, compiled as the rest), so a step is priced as the request's mean,
    part by part; the memory of the kept weights is Mode.keep_bf16's (planner/test_sharding.py)."""
    t = dm.table_for("H100")
    spec = model_spec("wan2.1-t2v-1.3b")
    geo = spec.geometry()
    mode = dm.Mode("fp8", "int8", True, full_precision_steps=2, steps=20)
    assert mode.full_precision_share == 0.2 and mode.unquantized == dm.Mode(compile=True)
    quantized = dm.step_ops(t, spec, geo, 2, dm.Mode("fp8", "int8", True))
    plain = dm.step_ops(t, spec, geo, 2, dm.Mode(compile=True))
    assert quantized.total != pytest.approx(plain.total, rel=1e-3)  # the two rates differ on the H100
    mixed = dm.step_ops(t, spec, geo, 2, mode)
    for part in ("gemm", "attention", "quantize", "elementwise", "attention_per_layer", "attention_lse_per_layer"):
        assert getattr(mixed, part) == pytest.approx(0.8 * getattr(quantized, part) + 0.2 * getattr(plain, part))
    # The plan's step on one device is that mean, and its label says how it was priced.
    one = plan(spec, gpus=1, gpu_type="H100", mode=mode)
    assert one.best.predicted_step_seconds == pytest.approx(mixed.total, rel=1e-9)
    assert one.mode.label == ("fp8 GEMMs + int8 attention, compiled, first and last 2 of 20 steps in bf16 "
                              "(the mean step priced)")
    assert one.to_dict()["mode"]["full_precision_steps"] == 2 and one.to_dict()["mode"]["steps"] == 20
    # On every layout too: the mean of the two plans' steps within the fitted rates' rounding.
    eight = {m: plan(spec, gpus=8, gpu_type="H100", mode=m, ulysses=4, cfg=2).best.predicted_step_seconds
             for m in (mode, dm.Mode("fp8", "int8", True), dm.Mode(compile=True))}
    assert eight[mode] == pytest.approx(0.8 * eight[dm.Mode("fp8", "int8", True)] + 0.2 * eight[dm.Mode(compile=True)],
                                        rel=0.02)
    # 2N >= S: every step in bf16; nothing quantized: nothing to price apart.
    assert dm.Mode("fp8", full_precision_steps=5, steps=10).full_precision_share == 1.0
    assert dm.step_ops(t, spec, geo, 2, dm.Mode("fp8", full_precision_steps=5, steps=10)) == dm.step_ops(t, spec, geo, 2)
    assert dm.Mode(compile=True, full_precision_steps=3).full_precision_share == 0.0
    for bad, why in ((dict(full_precision_steps=-1), "full_precision_steps must be a whole number >= 0, got -1"),
                     (dict(full_precision_steps=1.5), "full_precision_steps must be a whole number >= 0, got 1.5"),
                     (dict(steps=0), "steps must be a whole number >= 1, got 0")):
        with pytest.raises(ValueError, match=re.escape(why)):
            dm.Mode("fp8", **bad)


def test_a_calibrated_model_keeps_its_rates_under_modes_priced_as_bf16():
    """fp8-sim with full-precision steps plans as Mode(keep_bf16=True): bf16 rates, so a
    model's own calibration (bf16 eager) still prices it; a mode with other rates never does."""
    spec = model_spec("wan2.1-t2v-1.3b")
    h200 = dataclasses.replace(device_type("H200"), model_rates=((spec.calibration_key, 500.0, 400.0, 450.0),))
    assert h200.rates_kind(spec, dm.Mode(keep_bf16=True, full_precision_steps=1)) == "calibration"
    assert h200.rates_for(spec, dm.Mode(keep_bf16=True)) == (500e12, 400e12, 450e12)
    for other in (dm.Mode("fp8"), dm.Mode(attention="int8"), dm.Mode(compile=True)):
        assert h200.rates_kind(spec, other) == "table"
