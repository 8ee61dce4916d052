"""FP8 linear layers in the transformer blocks (quantize "fp8" / "fp8-sim"), once at load.

Which layers, in every family alike: the nn.Linear layers inside the blocks of the adapter's
plan (the blocks regional compilation compiles, raydit.models.compile): the attention's q / k /
v / out projections and the feed-forward. The rest stays in the run's dtype, as peers keep
it: what lies outside the blocks (patch and text embeddings, time embeddings, the final
norm_out and proj_out, the text encoders and the VAE), and inside a block every linear of a
submodule named like `Family.quantize_keep` (default "norm*": diffusers' adaptive norms, whose
`linear` makes the block's modulation from the time embedding; a family whose modulation
lives elsewhere adds its name). A linear whose in or out features are not multiples of 16
stays too (FP8 GEMMs, torch._scaled_mm, need them), said in a debug log. peft's adapter
factors (lora_A / lora_B) are never quantized; a LoRA is quantized only fused into the
weights (lora.load fuses before the Runner quantizes).

The numbers, with s the scales in float32 and q(v) = round_e4m3(clamp(v / s, -448, 448)):
    y = (q(x) * s_x) @ (q(W) * s_W)^T + b
s_W = amax|W| / 448 per output row ("row") or over W ("tensor"), fixed at load; s_x the same
per token (row of x over its last dim) or over x, from each call's activations (dynamic).
"fp8" runs it as torchao's Float8DynamicActivationFloat8WeightConfig (FP8 weights in memory,
FP8 tensor-core GEMMs; the activation's quantization fuses into its producer only under
torch.compile). "fp8-sim" emulates the same numbers on any device: W is replaced by its
dequantized q(W) * s_W in the run's dtype, and the layer's forward rounds x the same way, so
the product runs in the run's dtype (numerics only, no speed; an all-zero row gets scale 1):
an fp8-sim linear is a FakeFp8Linear, an nn.Linear whose forward rounds its input.

Full-precision steps (Runner(run=RunConfig(full_precision_steps=N))): a transformer quantized with
`keep_unquantized=True` keeps each quantized linear's weight as it was before the rounding (a
non-persistent buffer, UNQUANTIZED_BUFFER: it moves with the module and is in no state dict);
inside `unquantized(...)` those linears run on it as plain linears (fp8-sim's input rounding
skipped), so a step there is the unquantized model's step bit for bit.

Quantization is in place and stays with the pipeline when its Runner closes: a worker's next
Runner (a regroup, a recovery onto another mesh) finds the weights quantized in the same mode
and leaves them (quantizing twice would round twice); a fresh worker quantizes its freshly
loaded weights the same way, to the same numbers.

Legend: x [..., in] activations, W [out, in] a weight, s scales (float32).
"""

from __future__ import annotations

import contextlib
import fnmatch
import logging
from dataclasses import dataclass, field

import torch

from raydit.planner.modes import FP8_GRANULARITIES

log = logging.getLogger(__name__)

# Set on a transformer whose block linears are quantized (a QuantizedLinears), and on each
# quantized nn.Linear (its (mode, granularity)).
QUANTIZED_ATTR = "_raydit_quantized"
UNQUANTIZED_BUFFER = "_raydit_unquantized_weight"  # keep_unquantized: the weight before rounding
FULL_PRECISION_ATTR = "_raydit_full_precision"  # True inside `unquantized`: fp8-sim's rounding skipped
FP8_MAX = 448.0  # torch.finfo(torch.float8_e4m3fn).max
FP8_ALIGN = 16  # torch._scaled_mm: both dims of a weight multiples of 16
ACTIVATION_AMAX_FLOOR = 1e-12  # "fp8": the least amax an activation's scale is made from (_quantize_torchao)


@dataclass
class QuantizedLinears:
    """What `quantize_transformer` did to one transformer."""

    mode: str
    granularity: str
    names: list = field(default_factory=list)  # the quantized linears, names within the transformer
    skipped: list = field(default_factory=list)  # block linears left as they are: dims not multiples of 16


def select_linears(transformer, keep: tuple[str, ...] = ("norm*",)) -> tuple[list, list]:
    """([(name, nn.Linear)] to quantize, [names of block linears skipped for their dims]) of
    `transformer`: the linears of its plan's blocks, but none under a submodule whose name
    matches a pattern of `keep` (fnmatch) or is one of peft's adapter factors."""
    from raydit.models.registry import get_adapter

    names = {id(m): n for n, m in transformer.named_modules()}
    chosen, skipped = [], []
    for block in get_adapter(transformer).plan.block_list(transformer):
        base = names[id(block)]
        for rel, module in block.named_modules():
            if not isinstance(module, torch.nn.Linear):
                continue
            owners = rel.split(".")[:-1]
            if any(part.startswith("lora_") or any(fnmatch.fnmatchcase(part, p) for p in keep) for part in owners):
                continue
            name = f"{base}.{rel}"
            if module.in_features % FP8_ALIGN or module.out_features % FP8_ALIGN:
                log.debug("raydit quantize: %s (%d -> %d features) stays in %s: FP8 GEMMs need multiples of %d",
                          name, module.in_features, module.out_features, module.weight.dtype, FP8_ALIGN)
                skipped.append(name)
                continue
            chosen.append((name, module))
    return chosen, skipped


def fp8_scale(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """float32 scales of `x`: amax|x| / 448 over its last dim ("row": [..., 1]) or over all of
    it ("tensor": a scalar), divided in x's dtype and then widened, as torchao's torch path
    computes them (a bf16 scale carries bf16's rounding); 1 where the amax is 0 (an all-zero
    row stays zero; torchao would divide by 0 there)."""
    xa = x.detach().abs()
    amax = xa.amax(dim=-1, keepdim=True) if granularity == "row" else xa.amax()
    return torch.where(amax > 0, (amax / FP8_MAX).to(torch.float32), torch.ones((), dtype=torch.float32))


def fake_fp8(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """x rounded to e4m3 with its scales and dequantized, in x's dtype: q(x) * s_x."""
    scale = fp8_scale(x, granularity)
    q = (x.to(torch.float32) / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return (q.to(torch.float32) * scale).to(x.dtype)


class FakeFp8Linear(torch.nn.Linear):
    """An fp8-sim linear: its (already rounded) weight, and its input rounded as the FP8 GEMM
    rounds it (not inside `unquantized`). A class of its own rather than a forward pre-hook:
    torch.compile does not guard on a submodule's hooks (Dynamo's skip_nnmodule_hook_guards),
    so a block graph compiled for plain linears in the same process (an unquantized Runner)
    would be reused for these and skip the rounding; it does guard on the module's class."""

    def forward(self, x):
        if not getattr(self, FULL_PRECISION_ATTR, False):
            x = fake_fp8(x, getattr(self, QUANTIZED_ATTR)[1])
        return torch.nn.functional.linear(x, self.weight, self.bias)


def quantize_transformer(transformer, mode: str, granularity: str = "row",
                         keep: tuple[str, ...] = ("norm*",), device=None, stay: bool = True,
                         keep_unquantized: bool = False) -> QuantizedLinears:
    """Quantize `transformer`'s block linears in place (module doc), once: a transformer
    already quantized in this mode and granularity is left as it is; in another, refused.

    device: where the linears are quantized, one at a time: each is moved there, quantized,
    and left there (`stay`; the rest of the pipeline follows it) or moved back where it was
    (the sharded path lays its shards out in host memory). So the device holds at most one
    unquantized linear beside the quantized ones - a transformer that fits a GPU only in FP8
    (Wan 14B on a 24 GB card) is never there whole in bf16 - and the host does none of the
    rounding (torchao on one CPU thread: 2.8 s a Wan-14B block). None: where each linear is.
    keep_unquantized: each quantized linear keeps its weight as it was (module doc: full-precision
    steps); a transformer quantized without it refuses `unquantized`."""
    if mode not in ("fp8", "fp8-sim"):
        raise ValueError(f"quantize {mode!r} is not fp8 or fp8-sim")
    if granularity not in FP8_GRANULARITIES:
        raise ValueError(f"fp8_granularity {granularity!r} is not one of: {', '.join(FP8_GRANULARITIES)}")
    done = getattr(transformer, QUANTIZED_ATTR, None)
    if done is not None:
        if (done.mode, done.granularity) != (mode, granularity):
            raise ValueError(f"{type(transformer).__name__} is quantized {done.mode} ({done.granularity}) already; "
                             f"load the pipeline again to run it {mode} ({granularity})")
        return done
    chosen, skipped = select_linears(transformer, keep)
    odd = [f"{name} ({type(m).__name__})" for name, m in chosen if type(m) is not torch.nn.Linear]
    if mode == "fp8-sim" and odd:  # a subclass's forward is not ours to replace
        raise ValueError(f"quantize fp8-sim emulates plain torch.nn.Linear layers, not {', '.join(odd)}")
    with torch.no_grad():
        for _, module in chosen:
            home = module.weight.device
            if device is not None:
                module.to(device)
            if keep_unquantized:
                module.register_buffer(UNQUANTIZED_BUFFER, module.weight.detach().clone(), persistent=False)
            if mode == "fp8":
                _quantize_torchao(module, [module], granularity)
            else:
                module.weight.copy_(fake_fp8(module.weight, granularity))
                module.__class__ = FakeFp8Linear
            if not stay:
                module.to(home)
            setattr(module, QUANTIZED_ATTR, (mode, granularity))
            setattr(module, FULL_PRECISION_ATTR, False)  # set from the start: compile guards see 2 states, not 3
    done = QuantizedLinears(mode, granularity, [n for n, _ in chosen], skipped)
    setattr(transformer, QUANTIZED_ATTR, done)
    return done


def quantize_transformers(transformers, mode: str | None, granularity: str = "row",
                          keep: tuple[str, ...] = ("norm*",), device=None, stay: bool = True,
                          full_precision_steps: int = 0) -> list:
    """A run's transformers made what its `mode` asks (None: unquantized), one after the other
    (quantize_transformer: `device` and `stay` as there; full_precision_steps > 0 keeps the
    unquantized weights); returns each one's QuantizedLinears (empty without a mode).
    ValueError where a transformer was quantized before in a way this run cannot use: without
    its unquantized weights where the run keeps them, or at all where the run has no mode."""
    if mode is None:
        if any(quantized(t) is not None for t in transformers):
            raise ValueError("this pipeline's transformer is quantized already; load it again to run it "
                             "without quantize")
        return []
    done = [quantize_transformer(t, mode, granularity, keep=keep, device=device, stay=stay,
                                 keep_unquantized=bool(full_precision_steps)) for t in transformers]
    if full_precision_steps and not all(keeps_unquantized(t) for t in transformers):
        raise ValueError(f"full_precision_steps {full_precision_steps}: this pipeline's transformer was "
                         "quantized without keeping its unquantized weights; load it again")
    return done


def _quantize_torchao(transformer, modules: list, granularity: str) -> None:
    try:
        from torchao.quantization import (
            Float8DynamicActivationFloat8WeightConfig,
            PerRow,
            PerTensor,
            quantize_,
        )
    except ImportError:
        raise ValueError("quantize 'fp8' needs torchao, which is not installed: pip install torchao "
                         "(or pip install 'raydit[fp8]')") from None
    ids = {id(m) for m in modules}
    # activation_value_lb: an all-zero activation row (a zero-padded token with no shift after
    # its norm: Mochi's RMSNormZero) would get scale 0 and NaNs (0 / 0) that a ring's padded keys
    # carry into attention; a floor far below any real amax gives it scale > 0 and zeros, as
    # fp8-sim gives. It also makes torchao take its torch quantization path rather than mslk's
    # row kernel, which torch.compile fuses into the producer anyway.
    config = Float8DynamicActivationFloat8WeightConfig(granularity=PerRow() if granularity == "row" else PerTensor(),
                                                       activation_value_lb=ACTIVATION_AMAX_FLOOR)
    quantize_(transformer, config, filter_fn=lambda module, fqn: id(module) in ids)


def keeps_unquantized(transformer) -> bool:
    """Whether every quantized linear of `transformer` kept its unquantized weight."""
    done = quantized(transformer)
    modules = dict(transformer.named_modules())
    return done is not None and all(hasattr(modules[name], UNQUANTIZED_BUFFER) for name in done.names)


@contextlib.contextmanager
def unquantized(transformers):
    """Inside: the quantized linears of `transformers` (quantized with keep_unquantized) run as
    the plain linears they were - their kept weight as the parameter, fp8-sim's input rounding
    skipped - and after it as quantized again. ValueError where a linear kept no weight."""
    swapped = []
    try:
        for transformer in transformers:
            done = quantized(transformer)
            if done is None:
                continue
            modules = dict(transformer.named_modules())
            for name in done.names:
                module = modules[name]
                kept = getattr(module, UNQUANTIZED_BUFFER, None)
                if kept is None:
                    raise ValueError(f"{name} was quantized without keeping its unquantized weight; load the pipeline "
                                     "again to run full-precision steps")
                swapped.append((module, module._parameters["weight"]))
                module._parameters["weight"] = torch.nn.Parameter(kept, requires_grad=False)
                setattr(module, FULL_PRECISION_ATTR, True)
        yield
    finally:
        for module, weight in swapped:
            module._parameters["weight"] = weight
            setattr(module, FULL_PRECISION_ATTR, False)


def requantize_rebuilt(modules) -> int:
    """Quantized linears among `modules` whose weights were rebuilt unquantized (sharded weights
    re-read from the checkpoint files, raydit.models.sharded): quantized again as at load, so
    the weights stay what their QUANTIZED_ATTR says ("fp8-sim": rounded in place; "fp8": a
    plain weight made torchao's FP8 weight again; one still quantized is left). Returns how
    many were quantized again."""
    from torch.utils._python_dispatch import is_traceable_wrapper_subclass

    count = 0
    with torch.no_grad():
        for module in modules:
            mode_granularity = getattr(module, QUANTIZED_ATTR, None)
            if not isinstance(module, torch.nn.Linear) or mode_granularity is None:
                continue
            mode, granularity = mode_granularity
            if mode == "fp8-sim":
                module.weight.copy_(fake_fp8(module.weight, granularity))
            elif is_traceable_wrapper_subclass(module.weight):
                continue  # gathered back whole: torchao's FP8 weight as it was
            else:
                _quantize_torchao(module, [module], granularity)
            count += 1
    return count


def quantized(transformer) -> QuantizedLinears | None:
    """What quantize_transformer did to `transformer`, or None."""
    return getattr(transformer, QUANTIZED_ATTR, None)
