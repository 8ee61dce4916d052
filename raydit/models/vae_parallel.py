"""Exact row-parallel decoding for diffusers' video VAEs: AutoencoderKLCogVideoX, AutoencoderKLWan
(2.1's 8x and 2.2's 16x), AutoencoderKLHunyuanVideo, AutoencoderKLHunyuanVideo15,
AutoencoderKLLTXVideo and AutoencoderKLMochi (its causal convolutions pad by replicating, as
HunyuanVideo's; its group norms run per frame, each a group norm over every band; its up blocks
are a per-pixel linear and a channel-to-space rearrange).

Legend: B batch, C channels, T frames, H rows, W columns; h rows of one rank's band.

Every rank of a group decodes one band of latent rows through the unmodified diffusers
decoder (its own frame-batch loop and causal caches); hooks installed for the duration of
the decode make the band's result equal to the same rows of a one-device decode:

- every convolution with a kernel taller than one row gets the neighbours' rows where its
  zero padding along rows would be (raydit.parallel.halo). nn.Conv2d and nn.Conv3d (diffusers'
  CogVideoXSafeConv3d inside CogVideoXCausalConv3d included) keep their padding: the exchange
  is posted before the layer runs and, after it, the band's first and last rows are
  recomputed from thin slabs with the neighbours' rows (halo.fix_band_edges), so the exchange
  overlaps the convolution and the band is never copied; WanCausalConv3d loses its row
  padding and convolves the band with its halo attached (halo.halo_exchange). HunyuanVideo's
  (1 and 1.5) causal convolutions pad with F.pad before an unpadded Conv3d, by replicating
  the edge rows: they lose their row padding too, and get the neighbours' rows inside the
  frame and a copy of the band's own edge row (replicate; zeros for constant padding) at the
  frame's top and bottom, which is what F.pad gives the whole frame there. CogVideoX's
  and Wan's time caches hold the band's own rows: they are cut from the layer's input before
  the hook sees it, and Wan's cache passed to a causal convolution gets its halo in the same
  exchange as the frame;
- nn.GroupNorm (CogVideoX, HunyuanVideo, the group norm inside diffusers' Attention) computes
  its statistics over every band (halo.group_norm); Wan's, HunyuanVideo 1.5's and LTX's RMS
  norms normalise over channels at each pixel and need nothing;
- the middle block's attention (Wan: one head over the pixels of a frame; HunyuanVideo 1 and
  1.5: one head over every pixel of every frame of the call, with a frame-causal mask): queries
  stay on their band, keys and values of every band are gathered around diffusers' call to
  scaled_dot_product_attention, so each query attends to the whole frame. A frame-causal mask
  (a query of frame f sees every pixel of frames <= f) is rebuilt for the gathered keys from
  each key's frame, which is read off the band's own mask and gathered with the keys;
- upsampling is nearest (CogVideoX, HunyuanVideo) / nearest-exact (Wan) by 2, and Wan 2.2's
  DupUp3D, HunyuanVideo 1.5's and LTX's channel-to-space rearranges and unpatchify are per
  pixel: a band of h latent rows becomes a band of h x factor rows, so bands stay aligned at
  every resolution.

Refused (`supports_vae` is False and the runner decodes on one rank): padding modes other
than zeros on a plain convolution, row strides or dilations, and LTX decoders that inject
noise drawn per pixel of the whole frame (decoder_inject_noise).

Tiled decoding (a blended approximation) is switched off during a parallel decode.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from torch.overrides import TorchFunctionMode

from raydit.parallel.halo import (
    RowSplit,
    all_gather_uneven,
    fix_band_edges,
    gather_rows,
    group_norm,
    halo_exchange,
    start_halo_exchange,
)


def _vae_classes():
    from diffusers import (
        AutoencoderKLCogVideoX,
        AutoencoderKLHunyuanVideo,
        AutoencoderKLHunyuanVideo15,
        AutoencoderKLLTXVideo,
        AutoencoderKLMochi,
        AutoencoderKLWan,
    )

    return AutoencoderKLCogVideoX, AutoencoderKLWan, (AutoencoderKLHunyuanVideo, AutoencoderKLHunyuanVideo15,
                                                      AutoencoderKLLTXVideo, AutoencoderKLMochi)


def spatial_factor(vae) -> int:
    """Output rows per latent row of a supported VAE."""
    cog, wan, others = _vae_classes()
    if isinstance(vae, cog):
        return 2 ** (len(vae.config.block_out_channels) - 1)
    if isinstance(vae, wan):
        upsamples = len(vae.config.dim_mult) - 1
        return 2 ** upsamples * (vae.config.patch_size or 1)
    if isinstance(vae, others):
        return int(vae.spatial_compression_ratio)
    raise ValueError(
        "row-parallel decode supports AutoencoderKLCogVideoX, AutoencoderKLWan, AutoencoderKLHunyuanVideo, "
        f"AutoencoderKLHunyuanVideo15, AutoencoderKLMochi and AutoencoderKLLTXVideo, not {type(vae).__name__}"
    )


def _is_padded_conv(module) -> bool:
    """HunyuanVideo's (1 and 1.5) causal convolution: F.pad(x, time_causal_padding, pad_mode)
    then an unpadded nn.Conv3d `conv`."""
    return (isinstance(getattr(module, "time_causal_padding", None), tuple) and len(module.time_causal_padding) == 6
            and isinstance(getattr(module, "conv", None), nn.Conv3d) and hasattr(module, "pad_mode"))


def min_band_rows(vae) -> int:
    """The fewest latent rows a band may have: the tallest halo at the latent resolution."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    # The decoder's first convolution runs at the latent resolution; every later layer runs
    # at that resolution or a multiple of it, with halos no taller (3x3 kernels throughout).
    halo = 0
    for module in vae.decoder.modules():
        if isinstance(module, WanCausalConv3d):
            halo = max(halo, module._padding[2], module._padding[3])
        elif _is_padded_conv(module):
            halo = max(halo, module.time_causal_padding[2], module.time_causal_padding[3])
        elif isinstance(module, (nn.Conv2d, nn.Conv3d)) and not isinstance(module.padding, str):
            halo = max(halo, module.padding[-2])
    return max(1, halo)


def _frame_of_each_token(mask: Tensor) -> Tensor:
    """The frame of each token of a frame-causal attention mask [..., S, S] over tokens in
    (frame, row, column) order: a query of frame f sees the keys of frames 0..f. float masks are
    additive (0 or -inf), bool masks True where allowed. Raises ValueError for any other mask."""
    square = mask.reshape(-1, mask.shape[-2], mask.shape[-1])
    if square.shape[-1] != square.shape[-2] or not bool((square == square[:1]).all()):
        raise ValueError("row-parallel VAE attention supports one frame-causal mask shared by the batch and heads")
    square = square[0]
    if square.dtype == torch.bool:
        allowed = square
    else:
        allowed = square == 0
        if not bool((allowed | (square == float("-inf"))).all()):
            raise ValueError("row-parallel VAE attention supports additive masks of 0 and -inf only")
    seen = allowed.sum(-1)
    per_frame = int(seen[0])
    if per_frame == 0 or seen.shape[0] % per_frame:
        raise ValueError("row-parallel VAE attention: the mask is not frame-causal")
    frame = torch.div(seen, per_frame, rounding_mode="floor") - 1
    if not torch.equal(allowed, frame[None, :] <= frame[:, None]):
        raise ValueError("row-parallel VAE attention: the mask is not frame-causal")
    return frame


class _GatherKeysValues(TorchFunctionMode):
    """Inside it, scaled_dot_product_attention(q, k, v) attends to the keys and values of every
    band: k and v ([B', heads, s, D], s = h x W in row-major order, or frames x h x W for
    HunyuanVideo's) are gathered along s in rank order. Without a mask the order of the keys is
    immaterial; a frame-causal mask (HunyuanVideo's) is rebuilt for the gathered keys from the
    frame of each key, gathered the same way."""

    def __init__(self, group) -> None:
        super().__init__()
        self.group = group

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            kwargs = dict(kwargs)
            mask = args[3] if len(args) > 3 else kwargs.pop("attn_mask", None)
            if len(args) > 4 or kwargs.get("is_causal") or kwargs.get("dropout_p"):
                raise ValueError("row-parallel VAE attention supports no dropout and no is_causal")
            if mask is not None:
                frame = _frame_of_each_token(mask).to(torch.float64)
                key_frame = all_gather_uneven(frame[:, None], dim=0, group=self.group)[:, 0]
                allowed = key_frame[None, :] <= frame[:, None]  # [s, keys of every band]
                if mask.dtype == torch.bool:
                    mask = allowed
                else:
                    mask = torch.zeros(allowed.shape, dtype=mask.dtype, device=mask.device)
                    mask.masked_fill_(~allowed, float("-inf"))
                kwargs["attn_mask"] = mask
            k = all_gather_uneven(k, dim=-2, group=self.group)
            v = all_gather_uneven(v, dim=-2, group=self.group)
            return func(q, k, v, **kwargs)
        return func(*args, **kwargs)


@dataclass
class _Installed:
    hooks: list = field(default_factory=list)
    restore: list = field(default_factory=list)  # callables undoing attribute changes

    def remove(self) -> None:
        for hook in self.hooks:
            hook.remove()
        for undo in reversed(self.restore):
            undo()
        self.hooks.clear()
        self.restore.clear()


def _conv_band_hooks(module, halo: int, group) -> list:
    """A pre-hook that posts the halo exchange of the layer's input and returns at once, so the
    layer convolves its band (with its own zero row padding) while the rows travel, and a hook
    after it that corrects the band's first and last `halo` output rows from the neighbours' rows
    (raydit.parallel.halo.fix_band_edges). A band thinner than 2 x halo is convolved again with
    its halo attached."""
    pending: list = []
    pad = tuple(module.padding[:-2]) + (0, module.padding[-1])
    conv = F.conv2d if isinstance(module, nn.Conv2d) else F.conv3d

    def unpadded(slab: Tensor) -> Tensor:  # the layer with no zero rows
        return conv(slab, module.weight, module.bias, module.stride, pad, module.dilation, module.groups)

    def before(module, args):
        pending.append(start_halo_exchange(args[0], halo, halo, group))

    def after(module, args, out):
        x = args[0]
        top, bottom = pending.pop().wait()
        if x.shape[-2] < 2 * halo:
            return unpadded(torch.cat([top, x, bottom], dim=-2))
        return fix_band_edges(out, x, top, bottom, unpadded)

    return [module.register_forward_pre_hook(before), module.register_forward_hook(after)]


def _wan_causal_halo_hook(halo: int, group):
    def hook(module, args):
        x = args[0]
        cache = args[1] if len(args) > 1 else None
        if cache is None or module._padding[4] == 0:  # Wan only reads the cache for causal time padding
            return (halo_exchange(x, halo, halo, group),) + tuple(args[1:])
        # One exchange for the cached frames and the new ones: [B C (Tc + T) h W].
        cache = cache.to(x.device)
        joined = halo_exchange(torch.cat([cache, x], dim=2), halo, halo, group)
        tc = cache.shape[2]
        return (joined[:, :, tc:], joined[:, :, :tc]) + tuple(args[2:])

    return hook


def _check_row_conv(name: str, kernel_h: int, pad_h: int, stride_h: int, dilation_h: int) -> None:
    if kernel_h == 1 and pad_h == 0:
        return
    if stride_h != 1 or dilation_h != 1 or 2 * pad_h != kernel_h - 1:
        raise ValueError(
            f"{name}: row-parallel decode needs stride 1, dilation 1 and 'same' zero padding along rows "
            f"(kernel {kernel_h}, padding {pad_h}, stride {stride_h}, dilation {dilation_h})"
        )


def _padded_conv_hook(halo: int, group):
    """HunyuanVideo's causal convolution with its row padding taken out: attach the neighbours'
    rows, and at the frame's top and bottom (no neighbour) copies of the band's edge row, which is
    what F.pad(mode="replicate") gives the whole frame there (padding is per dimension, so rows
    first and then columns and frames gives what one F.pad gives)."""

    def hook(module, args):
        x = args[0]
        joined = halo_exchange(x, halo, halo, group)
        if module.pad_mode == "replicate":
            rank, world = dist.get_rank(group), dist.get_world_size(group)
            if rank == 0:
                joined[..., :halo, :] = x[..., :1, :]
            if rank == world - 1:
                joined[..., -halo:, :] = x[..., -1:, :]
        return (joined,) + tuple(args[1:])

    return hook


def _attention_classes() -> tuple:
    """Attention blocks of the supported decoders, run with every band's keys and values."""
    from diffusers.models.attention_processor import Attention
    from diffusers.models.autoencoders.autoencoder_kl_hunyuanvideo15 import HunyuanVideo15AttnBlock
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanAttentionBlock

    return WanAttentionBlock, Attention, HunyuanVideo15AttnBlock


def _plan(vae, group) -> list:
    """What a row-parallel decode changes in `vae.decoder`: callables that each install one
    change into an _Installed. Raises ValueError for a layer it cannot decode exactly by rows."""
    from diffusers.models.autoencoders.autoencoder_kl_cogvideox import CogVideoXCausalConv3d
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    spatial_factor(vae)  # validates the class
    attention = _attention_classes()
    steps, inside_padded = [], set()

    def set_attr(module, attr, value):
        def step(installed: _Installed):
            old = getattr(module, attr)
            setattr(module, attr, value)
            installed.restore.append(functools.partial(setattr, module, attr, old))
        return step

    def pre_hook(module, hook):
        return lambda installed: installed.hooks.append(module.register_forward_pre_hook(hook))

    def own_forward(module, forward):
        def step(installed: _Installed):
            module.forward = functools.partial(forward, module, group)
            installed.restore.append(functools.partial(_drop_instance_forward, module))
        return step

    for name, module in vae.decoder.named_modules(prefix="decoder"):
        if id(module) in inside_padded:
            continue
        if getattr(module, "per_channel_scale1", None) is not None or getattr(module, "per_channel_scale2", None) is not None:
            raise ValueError(f"{name}: noise drawn per pixel of the whole frame (decoder_inject_noise) cannot be split by rows")
        if isinstance(module, CogVideoXCausalConv3d) and module.pad_mode != "replicate":
            continue  # its time padding is its cache; the rows are padded by the Conv3d inside
        # (with replicate padding, Mochi's, it pads with F.pad before an unpadded Conv3d: below)
        if isinstance(module, WanCausalConv3d):
            pads = module._padding  # (w, w, h, h, 2 * t, 0) for F.pad
            _check_row_conv(name, module.kernel_size[1], pads[2], module.stride[1], module.dilation[1])
            if pads[2] == 0:
                continue
            steps.append(set_attr(module, "_padding", (pads[0], pads[1], 0, 0, pads[4], pads[5])))
            steps.append(pre_hook(module, _wan_causal_halo_hook(pads[2], group)))
        elif _is_padded_conv(module):
            conv, pads = module.conv, module.time_causal_padding  # (w, w, h, h, t, t) for F.pad
            inside_padded.add(id(conv))
            if module.pad_mode not in ("replicate", "constant"):
                raise ValueError(f"{name}: padding mode {module.pad_mode!r} is not supported (replicate or constant)")
            if conv.padding_mode != "zeros" or isinstance(conv.padding, str) or conv.padding[-2]:
                raise ValueError(f"{name}: the convolution inside must not pad rows itself")
            _check_row_conv(name, conv.kernel_size[-2], pads[2], conv.stride[-2], conv.dilation[-2])
            if pads[2] != pads[3]:
                raise ValueError(f"{name}: row padding {pads[2]} above and {pads[3]} below is not supported")
            if pads[2] == 0:
                continue
            steps.append(set_attr(module, "time_causal_padding", (pads[0], pads[1], 0, 0, pads[4], pads[5])))
            steps.append(pre_hook(module, _padded_conv_hook(pads[2], group)))
        elif isinstance(module, (nn.Conv2d, nn.Conv3d)):
            if module.padding_mode != "zeros":
                raise ValueError(f"{name}: padding mode {module.padding_mode!r} is not supported (zeros only)")
            if isinstance(module.padding, str):
                raise ValueError(f"{name}: padding {module.padding!r} is not supported (give it in rows)")
            pad_h = module.padding[-2]
            _check_row_conv(name, module.kernel_size[-2], pad_h, module.stride[-2], module.dilation[-2])
            if pad_h == 0:
                continue
            steps.append(lambda installed, m=module, h=pad_h: installed.hooks.extend(_conv_band_hooks(m, h, group)))
        elif isinstance(module, nn.GroupNorm):
            steps.append(own_forward(module, _group_norm_forward))
        elif isinstance(module, attention):
            steps.append(own_forward(module, _attention_forward))
        elif isinstance(module, nn.MultiheadAttention) or type(module).__name__.endswith(("Attention", "AttnBlock")):
            raise ValueError(f"{name}: {type(module).__name__} is not supported by row-parallel decode")
    return steps


def _install(vae, group) -> _Installed:
    steps = _plan(vae, group)
    installed = _Installed()
    try:
        for step in steps:
            step(installed)
    except BaseException:
        installed.remove()
        raise
    return installed


def _drop_instance_forward(module: nn.Module) -> None:
    module.__dict__.pop("forward", None)


def _group_norm_forward(module: nn.GroupNorm, group, x: Tensor) -> Tensor:
    return group_norm(x, module.num_groups, module.weight, module.bias, module.eps, group)


def _attention_forward(module: nn.Module, group, *args, **kwargs):
    # The class's own forward (diffusers'), with scaled_dot_product_attention seeing every band.
    with _GatherKeysValues(group):
        return type(module).forward(module, *args, **kwargs)


@contextlib.contextmanager
def row_parallel(vae, group=None):
    """While inside, `vae.decode(z_band)` on every rank of `group` returns that band's rows of
    the one-device decode (collective: every rank must decode the same frames)."""
    spatial_factor(vae)  # validates the class
    installed = _install(vae, group)
    tiling = vae.use_tiling
    vae.use_tiling = False
    try:
        yield
    finally:
        vae.use_tiling = tiling
        installed.remove()


def latent_split(vae, latent_rows: int, ranks: int) -> RowSplit:
    """Bands of latent rows for `ranks` ranks, checked against the decoder's halo."""
    split = RowSplit.even(latent_rows, ranks)
    need = min_band_rows(vae)
    if min(split.sizes) < need:
        raise ValueError(
            f"{latent_rows} latent rows on {ranks} ranks leave a band of {min(split.sizes)} rows; "
            f"the decoder needs at least {need}: use at most {latent_rows // need} ranks"
        )
    return split


def decode_rows(vae, latents: Tensor, group=None, dst: int | None = 0, **decode_kwargs) -> Tensor | None:
    """Decode `latents` [B C T H W] (the same full tensor on every rank of `group`) with the work
    split by rows over the group; return the decoded video [B 3 T' H' W'] on group rank `dst`
    (None elsewhere), or on every rank with `dst=None`. Equal to
    `vae.decode(latents, **decode_kwargs).sample` (LTX's decoder takes `temb`)."""
    if latents.dim() != 5:
        raise ValueError(f"latents must be [batch, channels, frames, height, width], got shape {tuple(latents.shape)}")
    out_band, split = _decode_band(vae, latents, group, decode_kwargs)
    return gather_rows(out_band, split.scaled(spatial_factor(vae)), group, dst=dst)


def _decode_band(vae, latents: Tensor, group, decode_kwargs: dict) -> tuple[Tensor, RowSplit]:
    """This rank's band of the decoded video, and the latent split."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    split = latent_split(vae, latents.shape[-2], world)
    band = split.shard(latents, rank).contiguous()
    with row_parallel(vae, group):
        # The class's own decode: an instance override may be ours.
        return type(vae).decode(vae, band, **decode_kwargs, return_dict=True).sample, split


def _decode_arguments(vae, z, args: tuple, kwargs: dict) -> tuple[dict, bool]:
    """vae.decode(z, *args, **kwargs) -> (its other arguments by name, return_dict)."""
    bound = inspect.signature(type(vae).decode).bind(vae, z, *args, **kwargs)
    named = dict(bound.arguments)
    for own in list(named)[:2]:  # self, z
        named.pop(own)
    return named, named.pop("return_dict", True)


def supports_vae(vae) -> bool:
    """Whether `vae` is one this module decodes by rows (its class and every layer of its decoder)."""
    try:
        _plan(vae, None)
    except (ValueError, AttributeError):
        return False
    return True


def can_decode_rows(vae, latent_rows: int, ranks: int) -> bool:
    """Whether `vae` can decode `latent_rows` rows split over `ranks` ranks (same answer on every rank)."""
    if ranks < 2:
        return False
    try:
        latent_split(vae, latent_rows, ranks)
    except ValueError:
        return False
    return True


@contextlib.contextmanager
def decode_on_ranks(vae, group=None, dst: int = 0):
    """While inside, `vae.decode(z)` on every rank of `group` is one row-parallel decode
    (collective): group rank `dst` gets the video, the other ranks zeros of its shape (their
    frames are never used: a family's decode stays as it is, only the caller keeps dst's).
    Where the rows cannot be split over the group, every rank decodes the whole video itself.
    Tiled decoding stays off."""
    from diffusers.models.autoencoders.vae import DecoderOutput

    ranks = dist.get_world_size(group)
    info = {"ranks": 1}  # how many ranks the last decode ran on

    def decode(z, *args, **kwargs):
        named, return_dict = _decode_arguments(vae, z, args, kwargs)
        info["ranks"] = 1
        if z.dim() == 5 and can_decode_rows(vae, z.shape[-2], ranks):
            info["ranks"] = ranks
            out_band, split = _decode_band(vae, z, group, named)
            video = gather_rows(out_band, split.scaled(spatial_factor(vae)), group, dst=dst)
            if video is None:
                shape = list(out_band.shape)
                shape[-2] = split.rows * spatial_factor(vae)
                video = out_band.new_zeros(shape)
        else:
            video = type(vae).decode(vae, z, **named, return_dict=True).sample
        return DecoderOutput(sample=video) if return_dict else (video,)

    vae.decode = decode
    try:
        yield info
    finally:
        vae.__dict__.pop("decode", None)

