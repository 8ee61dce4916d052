"""quantize="fp8-sim" / "fp8" (raydit.models.quantize): which layers, every plan under it, refusals.

Which layers: each family's tiny transformer (its main forward case) gets exactly the count of
block linears its architecture has at multiples of 16 features, and every other parameter
(embeddings, norms, modulation, proj_out, biases) stays bit for bit what it was.

Every plan == one rank under fp8-sim, in bfloat16 (the GPUs' dtype), on 2 gloo ranks (Ulysses
2, ring 2, cfg 2) for three families. FP8 rounding is a step function: where two runs differ
in the last bit of an activation, a value near a rounding boundary rounds the other way (one
e4m3 unit, 6-12% of it) and the difference then grows through the layers to the size of the
FP8 error itself. So the rule, per plan, measured in the same test:
- where the unquantized plan equals one rank bit for bit (the same ops), the fp8-sim plan
  must equal one rank under fp8-sim bit for bit: quantization adds no dependence on the plan;
- elsewhere raydit.models.precision's rule for the mode: relative L2 error against a float64
  unquantized run of the same request (same noise) at most BF16_ERROR_FACTOR (2) times one
  rank's under fp8-sim.
And fp8-sim must cost a plausible FP8 amount: its error against float64 between 1% and 20%
(2 steps of random tiny models) and at least 2x bfloat16's own (3.0-4.4x measured), so the test fails if
quantization is silently skipped.
"""

from __future__ import annotations

import pytest
import torch
from fp8_cpu import MODES

from raydit.models import conformance as harness
from raydit.models.precision import BF16_ERROR_FACTOR, relative_error
from raydit.planner.runconfig import RunConfig

from support.quantize import assert_batched_as_alone

# Quantized block linears of each family's main forward case: its blocks' attention and
# feed-forward linears at multiples of 16 features (LTX's tiny width 72 has none; LTX-2's
# 24-wide audio stream and its 24-wide cross-modal projections stay).
EXPECTED_COUNTS = {
    "cogvideox": 12,  # 2 blocks x (q, k, v, out, ff 2); norm1/norm2.linear are modulation
    "hunyuanvideo": 17,  # a dual block 12 (two streams) + a single block 5 (q, k, v, proj_mlp, proj_out)
    "hunyuanvideo15": 24,
    "kandinsky5": 20,  # 2 x (self 4, cross 4, ff 2); visual_modulation stays (Family.quantize_keep)
    "ltx": 0,
    "ltx2": 20,
    "mochi": 21,  # 12 + the last block's 9 (context_pre_only: no context output or ff)
    "skyreels": 20,
    "wan": 20,
}


def main_forward_cases():
    from raydit.models.registry import families

    return [(family, family.conformance_cases(harness._Unbuilt())["forward"][0]) for family in families().values()]


@pytest.mark.parametrize("family, case", main_forward_cases(), ids=lambda v: getattr(v, "name", ""))
def test_fp8_sim_quantizes_the_block_linears_and_nothing_else(family, case):
    from raydit.models.quantize import QUANTIZED_ATTR, FakeFp8Linear, quantize_transformer

    transformer, kwargs = case.make()
    before = {k: v.clone() for k, v in transformer.state_dict().items()}
    done = quantize_transformer(transformer, "fp8-sim", keep=family.quantize_keep)
    if family.name in EXPECTED_COUNTS:
        assert len(done.names) == EXPECTED_COUNTS[family.name], done.names
    modules = dict(transformer.named_modules())
    for name in done.names:
        module = modules[name]
        assert type(module) is FakeFp8Linear and isinstance(module, torch.nn.Linear)
        assert getattr(module, QUANTIZED_ATTR) == ("fp8-sim", "row")
        owners = name.split(".")[:-1]
        assert not any(p.startswith("norm") or "modulation" in p for p in owners), name
        assert not torch.equal(module.weight, before[f"{name}.weight"]), f"{name}'s weight was not rounded"
    changed = {k for k, v in transformer.state_dict().items() if not torch.equal(v, before[k])}
    assert changed == {f"{name}.weight" for name in done.names}
    # Outside the blocks nothing is quantized: embeddings, time embeddings, norm_out, proj_out.
    for name, module in modules.items():
        if isinstance(module, torch.nn.Linear) and name not in done.names:
            assert type(module) is not FakeFp8Linear and not hasattr(module, QUANTIZED_ATTR), name
    for name in ("proj_out", "norm_out.linear", "patch_embed.proj", "time_embedding.linear_1"):
        assert name not in done.names
    assert len(done.names) + len(done.skipped) > 0
    # Quantizing again (the next Runner on this pipeline) leaves the weights and layers alone.
    after = {k: v.clone() for k, v in transformer.state_dict().items()}
    assert quantize_transformer(transformer, "fp8-sim", keep=family.quantize_keep) is done
    assert all(torch.equal(v, after[k]) for k, v in transformer.state_dict().items())
    assert all(type(modules[name]) is FakeFp8Linear and not modules[name]._forward_pre_hooks for name in done.names)
    with pytest.raises(ValueError, match="quantized fp8-sim \\(row\\) already; load the pipeline again"):
        quantize_transformer(transformer, "fp8-sim", "tensor", keep=family.quantize_keep)


def test_fake_fp8_rounds_to_e4m3_with_row_and_tensor_scales():
    from raydit.models.quantize import fake_fp8

    x = torch.tensor([[448.0, 0.3, 3.0], [0.0, 0.0, 0.0], [2.0, -1.1, 0.0005]], dtype=torch.bfloat16)
    row = fake_fp8(x, "row")
    # Row 0's scale is 1: 3.0 is an e4m3 value; bf16's 0.30078 lies between 0.28125 and 0.3125
    # (e4m3 steps of 1/32 in [0.25, 0.5)) and rounds to the nearer.
    assert row[0].tolist() == [448.0, 0.3125, 3.0]
    assert torch.equal(row[1], x[1])  # an all-zero row stays zero (scale 1)
    tensor = fake_fp8(x, "tensor")
    assert float(tensor[2, 2]) == 0.0  # under the tensor's scale (1) it is below e4m3's smallest subnormal / 2
    assert float(row[2, 2]) != 0.0  # under its own row's scale (2 / 448) it is kept
    assert torch.equal(fake_fp8(row, "row"), row)  # rounding twice changes nothing


PLANS = (harness.MeshPlan(2, 1), harness.MeshPlan(1, 2), harness.MeshPlan(1, 1, 2))  # Ulysses 2, ring 2, cfg 2
PLAN_CASES = ("cogvideox-2b-h30-rows30", "ltx2-t2v", "mochi-t2v")


@pytest.mark.slow
@pytest.mark.long  # the second stage (suite time)
@pytest.mark.parametrize("mode", MODES)
def test_every_plan_under_fp8_equals_one_rank_within_the_modes_noise(mode):
    """fp8-sim, and fp8 itself: torchao's FP8 tensors on the CPU, the gates lifted in the
    ranks' processes (tests/models/fp8_cpu.py)."""
    from fp8_cpu import lifted

    from raydit.parallel.testing import run_distributed

    cases = [c for c in harness.family_cases(build=True)["runner"] if c.name in PLAN_CASES]
    assert len(cases) == len(PLAN_CASES)
    modes = {None: {}, mode: {"quantize": mode}}
    if mode == "fp8":
        results = run_distributed(lifted, 2, "raydit.models.conformance:mode_plan_runs", cases, PLANS, modes,
                                  timeout=900)
    else:
        results = run_distributed(harness.mode_plan_runs, 2, cases, PLANS, modes, timeout=900)
    exact = 0
    for rank, out in enumerate(results):
        for case in cases:
            truth = out[(case.name, "float64")]
            one_none, one_q = out[(case.name, None, "None")], out[(case.name, mode, "None")]
            e_bf16, e_q = relative_error(one_none, truth), relative_error(one_q, truth)
            assert 0.01 <= e_q <= 0.2 and e_q >= 2 * e_bf16, (case.name, e_q, e_bf16)
            for plan in PLANS:
                plan_none, plan_q = out[(case.name, None, str(plan))], out[(case.name, mode, str(plan))]
                where = f"rank {rank} {case.name} {plan}"
                if torch.equal(plan_none, one_none):
                    assert torch.equal(plan_q, one_q), f"{where}: the same ops, yet {mode} differs by " \
                                                       f"{relative_error(plan_q, one_q):.3g}"
                    exact += 1
                else:
                    e_plan = relative_error(plan_q, truth)
                    assert e_plan <= BF16_ERROR_FACTOR * e_q, f"{where}: error {e_plan:.3g} against one rank's {e_q:.3g}"
    assert exact > 0  # the bit-for-bit branch ran (cfg 2 evaluates each branch as one rank does)


def test_fp8_sim_blocks_compile_whole_and_match_eager():
    """A quantized block compiles as one graph (fullgraph=True: the input-rounding hook in
    it is traced, no graph break) and gives the eager numbers: Dynamo's trace run as
    captured ("eager" backend), on Wan's forward case, in bfloat16."""
    from raydit.models.compile import compile_blocks
    from raydit.models.quantize import quantize_transformer
    from raydit.models.registry import families

    case = families()["wan"].conformance_cases(harness._Unbuilt())["forward"][0]
    transformer, kwargs = harness.at_dtype(*case.make(), torch.bfloat16)
    assert quantize_transformer(transformer, "fp8-sim").names
    eager = harness.forward_once(transformer, kwargs)
    compiled = compile_blocks(transformer, fullgraph=True, backend="eager")
    try:
        assert torch.equal(harness.forward_once(transformer, kwargs), eager)
    finally:
        compiled.remove()


# -- refusals -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def tiny_pipe():
    from raydit.models.loading import load_pipeline

    return load_pipeline("tiny")


def test_runner_refuses_fp8_on_cpu_unknown_modes_and_lora_switching(tiny_pipe):
    from raydit.models.requests import GenerationRequest
    from raydit.models.loading import load_pipeline
    from raydit.models.runner import Runner

    with pytest.raises(ValueError, match="quantize 'fp8' runs FP8 GEMMs on NVIDIA GPUs of compute capability 8.9 "
                                         "or newer, not on cpu; there use quantize fp8-sim"):
        Runner(tiny_pipe, run=RunConfig(quantize="fp8"))
    with pytest.raises(ValueError, match="quantize 'int8' is not a mode; use one of: none, fp8, fp8-sim"):
        Runner(tiny_pipe, run=RunConfig(quantize="int8"))
    with pytest.raises(ValueError, match="attention 'fp16' is not a mode; use one of: bf16, auto, int8, fp8"):
        Runner(tiny_pipe, run=RunConfig(attention="fp16"))
    with pytest.raises(ValueError, match="fp8_granularity 'block'"):
        Runner(tiny_pipe, run=RunConfig(quantize="fp8-sim", fp8_granularity="block"))
    assert Runner(tiny_pipe, run=RunConfig(attention="int8")).attention == "int8"
    assert Runner(tiny_pipe).attention == "bf16" and Runner(tiny_pipe, run=RunConfig(quantize="none")).quantize is None

    pipe = load_pipeline("tiny")
    runner = Runner(pipe, run=RunConfig(quantize="fp8-sim"))
    request = GenerationRequest(prompt="a fox", num_frames=5, height=32, width=32, num_inference_steps=2,
                                lora=(("style", 1.0),))
    with pytest.raises(ValueError, match="quantize 'fp8-sim' cannot switch LoRA adapters per request.*fuse_lora"):
        runner.prepare(request)
    with pytest.raises(ValueError, match="quantized already; load it again to run it without quantize"):
        Runner(pipe)


def test_a_lora_is_not_loaded_into_quantized_weights(tiny_pipe, tmp_path):
    from raydit.models import lora
    from support.lora_files import write_random_lora
    from raydit.models.loading import load_pipeline
    from raydit.models.registry import family_for_pipeline
    from raydit.models.runner import Runner

    path = write_random_lora(tiny_pipe, tmp_path)
    pipe = load_pipeline("tiny")
    Runner(pipe, run=RunConfig(quantize="fp8-sim"))
    with pytest.raises(ValueError, match="cannot be loaded into weights quantized fp8-sim already"):
        lora.load(pipe, family_for_pipeline(pipe), lora.LoraSpec(name="style", path=str(lora.lora_file(path))))


@pytest.mark.parametrize("mode", MODES)
def test_a_fused_lora_is_quantized_with_the_weights(mode, tiny_pipe, tmp_path, monkeypatch):
    """bfloat16, the tiny CogVideoX: a LoRA fused at load (lora.load with fuse_scale) is part of
    the weights the Runner then quantizes, so each quantized attention projection holds the
    fused weight rounded to FP8 with its row scales, bit for bit (fp8: torchao's FP8 bytes times
    their scales; on the CPU, the gates lifted for this test), and not the weight without the
    LoRA; the request runs."""
    from raydit.models import lora
    from support.lora_files import write_random_lora
    from raydit.models.requests import GenerationRequest
    from raydit.models.loading import load_pipeline
    from raydit.models.quantize import fake_fp8
    from raydit.models.registry import family_for_pipeline
    from raydit.models.runner import Runner

    if mode == "fp8":
        from fp8_cpu import lift_fp8_gates

        lift_fp8_gates(monkeypatch)
    path = str(lora.lora_file(write_random_lora(tiny_pipe, tmp_path)))
    plain = load_pipeline("tiny", dtype=torch.bfloat16)
    pipe = load_pipeline("tiny", dtype=torch.bfloat16)
    lora.load(pipe, family_for_pipeline(pipe), lora.LoraSpec("style", path, fuse_scale=1.0))
    projections = [n for n, m in pipe.transformer.named_modules() if n.endswith(("attn1.to_q", "attn1.to_v"))]
    assert projections
    fused = {n: pipe.transformer.get_submodule(n).weight.detach().clone() for n in projections}
    runner = Runner(pipe, dtype=torch.bfloat16, run=RunConfig(quantize=mode))
    for name in projections:
        weight = pipe.transformer.get_submodule(name).weight
        if mode == "fp8":  # torchao's Float8Tensor: FP8 bytes and float32 row scales
            weight = (weight.qdata.float() * weight.scale).to(torch.bfloat16)
        assert torch.equal(weight, fake_fp8(fused[name], "row")), name
        without = fake_fp8(plain.transformer.get_submodule(name).weight.detach(), "row")
        assert not torch.equal(weight, without), name  # the LoRA is in the quantized weights
    request = GenerationRequest(prompt="a red fox", num_frames=5, height=32, width=32, num_inference_steps=2,
                                guidance_scale=6.0, seed=1, lora={"style": 1.0})
    assert torch.isfinite(harness.run_steps(runner, request, None).latents.float()).all()


def test_gpu_before_sm89_is_refused_naming_it():
    from raydit.models.quantize_options import check_quantize_device

    with pytest.raises(ValueError, match="compute capability 8.9 or newer .*; NVIDIA A100-SXM4-80GB has 8.0: "
                                         "on it use quantize fp8-sim"):
        check_quantize_device("fp8", "cuda", (8, 0), "NVIDIA A100-SXM4-80GB")
    check_quantize_device("fp8", "cuda", (9, 0), "NVIDIA H100")
    check_quantize_device("fp8-sim", "cpu")


def test_engine_and_command_line_refuse_before_ray(capsys):
    from raydit.cli import main
    from raydit.runtime.engine import Engine

    with pytest.raises(ValueError, match="quantize 'fp8' runs FP8 GEMMs .* not on cpu"):
        Engine(model="tiny", workers=1, device="cpu", quantize="fp8")
    with pytest.raises(ValueError, match="attention 'int4' is not a mode"):
        Engine(model="tiny", workers=1, device="cpu", attention="int4")
    with pytest.raises(ValueError, match="quantize 'fp4' is not a mode"):
        Engine(model="tiny", workers=1, device="cpu", quantize="fp4")
    assert main(["generate", "--prompt", "a fox", "--device", "cpu", "--quantize", "fp8"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not on cpu" in err, err
    # Both lists are the options table's choices (raydit.planner.modes): argparse names them.
    for argv, needle in ((["--quantize", "fp4"], "invalid choice: 'fp4'"),
                         (["--attention", "int4"], "invalid choice: 'int4' (choose from 'bf16', 'auto', 'int8', 'fp8')")):
        assert main(["generate", "--prompt", "a fox", *argv]) == 2
        err = capsys.readouterr().err
        assert needle in err, err


def test_generate_and_serve_pass_quantize_and_attention_to_the_engine(tmp_path):
    import inspect

    from raydit.cli import build_parser
    from raydit.commands import engine_kwargs, resolve_generate_options
    from raydit.models.quantize_options import check_precision_options
    from raydit.runtime.engine import Engine
    from raydit.serve import config as serve_config

    parser = build_parser()

    def generate(*argv):
        kwargs = engine_kwargs(resolve_generate_options(parser.parse_args(["generate", *argv])))
        return kwargs["quantize"], kwargs["attention"]

    def serve(given):
        kwargs = serve_config.engine_kwargs(serve_config.resolve_serve_options(given))
        return kwargs["quantize"], kwargs["attention"]

    job = tmp_path / "job.yaml"
    job.write_text("prompt: a cat\nquantize: fp8-sim\nattention: auto\n")
    assert generate("--prompt", "x", "--quantize", "fp8", "--attention", "int8") == ("fp8", "int8")
    assert generate("--config", str(job)) == ("fp8-sim", "auto")
    assert generate("--prompt", "x") == (None, None)
    assert serve(parser.parse_args(["serve", "--quantize", "fp8-sim", "--attention", "fp8"])) == ("fp8-sim", "fp8")
    assert serve({"quantize": "fp8", "attention": "auto"}) == ("fp8", "auto")
    assert serve({}) == (None, None)
    with pytest.raises(ValueError, match="quantize 'fp8' runs FP8 GEMMs .* not on cpu"):
        serve({"quantize": "fp8", "device": "cpu"})
    with pytest.raises(ValueError, match="quantize 'yes' is not a mode"):
        serve({"quantize": "yes"})
    with pytest.raises(ValueError, match="attention 'bf32' is not a mode"):
        serve({"attention": "bf32"})
    with pytest.raises(ValueError, match="quantize 'fp8-sim' cannot switch LoRA adapters per request, but "
                                         "--lora without --fuse-lora and --lora-dir asks for it"):
        check_precision_options({"quantize": "fp8-sim", "lora_table": {"a": object()}, "lora_dir": "/tmp"})
    check_precision_options({"quantize": "fp8-sim", "lora_table": {"a": object()}, "fuse_lora": True})
    takes = set(inspect.signature(Engine).parameters)
    assert {"quantize", "attention"} <= takes


@pytest.mark.slow
@pytest.mark.long  # the second stage (suite time)
@pytest.mark.parametrize("mode", MODES)
def test_step_batching_and_step_caching_run_under_fp8(mode, monkeypatch):
    """bfloat16, one process, the tiny CogVideoX; fp8 through torchao's FP8 tensors on the CPU
    (the gates lifted for this test, tests/models/fp8_cpu.py). Step batching: two requests
    sharing steps (the second joins at the first's step 1) against each alone; where the
    unquantized run batched equals it alone bit for bit (the same ops per row), so must the
    mode's: its scales are per token, so a neighbour in the batch changes none. Step caching
    (fbcache at 1.3, which caches a step of this request) runs on quantized blocks and caches
    as many steps as unquantized."""
    if mode == "fp8":
        from fp8_cpu import lift_fp8_gates

        lift_fp8_gates(monkeypatch)
    from raydit.models.cache import CACHED_STEPS
    from raydit.models.requests import GenerationRequest
    from raydit.models.loading import load_pipeline
    from raydit.models.runner import Runner

    gen = dict(num_frames=5, height=32, width=32, num_inference_steps=3, guidance_scale=6.0)
    requests = [GenerationRequest(prompt="a red fox", seed=1, **gen), GenerationRequest(prompt="a red fox", seed=2, **gen)]
    cached = GenerationRequest(prompt="a red fox running through fresh snow", seed=7, cache="fbcache",
                               cache_threshold=1.3, **{**gen, "num_inference_steps": 4})
    out = {}
    for quantize in (None, mode):
        runner = Runner(load_pipeline("tiny", dtype=torch.bfloat16), dtype=torch.bfloat16,
                        run=RunConfig(quantize=quantize))
        out[quantize, "batched"] = [s.latents for s in harness.run_batched(runner, requests, [0, 1])]
        out[quantize, "alone"] = [harness.run_steps(runner, r, None).latents for r in requests]
        state = harness.run_steps(runner, cached, None)
        out[quantize, "cached"] = (int(state.carry.get(CACHED_STEPS, 0)), state.latents)
    assert_batched_as_alone(out, mode)
    assert relative_error(out[mode, "alone"][0], out[None, "alone"][0]) > 1e-3  # quantized (0.0085 measured)
    (steps_q, latents_q), (steps, _) = out[mode, "cached"], out[None, "cached"]
    assert steps_q == steps >= 1 and torch.isfinite(latents_q).all()


@pytest.mark.slow
@pytest.mark.long  # the second stage (suite time): two compiled Runners
def test_a_compiled_fp8_sim_runner_is_not_changed_by_a_plain_one_in_the_process():
    """torch.compile does not guard on a submodule's forward hooks (Dynamo's
    skip_nnmodule_hook_guards): while fp8-sim rounded its inputs in a forward pre-hook, a
    block graph compiled for an unquantized Runner's plain linears was reused for the fp8-sim
    Runner's, which then ran without the input rounding (its latents changed after a plain
    compiled Runner ran in the same process: a notebook comparing modes, a bench). The
    fp8-sim linears are a class of their own now (FakeFp8Linear), which Dynamo does guard.
    Rule: bit for bit, the same Runner before and after."""
    from raydit.models.requests import GenerationRequest
    from raydit.models.loading import load_pipeline
    from raydit.models.runner import Runner

    bf16 = torch.bfloat16
    request = GenerationRequest(prompt="a red fox", num_frames=5, height=32, width=32, num_inference_steps=3,
                                guidance_scale=6.0, seed=6)
    quantized = Runner(load_pipeline("tiny", dtype=bf16), dtype=bf16, run=RunConfig(quantize="fp8-sim", compile=True))
    plain = Runner(load_pipeline("tiny", dtype=bf16), dtype=bf16, run=RunConfig(compile=True))
    try:
        before = harness.run_steps(quantized, request, None).latents
        unquantized = harness.run_steps(plain, request, None).latents
        after = harness.run_steps(quantized, request, None).latents
    finally:
        quantized.close()
        plain.close()
    assert torch.equal(before, after)
    assert relative_error(before, unquantized) > 1e-3
