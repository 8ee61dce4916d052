"""Exact row-parallel decoding for diffusers' AutoencoderKLCogVideoX and AutoencoderKLWan.

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
  padding and convolves the band with its halo attached (halo.halo_exchange). CogVideoX's
  and Wan's time caches hold the band's own rows: they are cut from the layer's input before
  the hook sees it, and Wan's cache passed to a causal convolution gets its halo in the same
  exchange as the frame;
- nn.GroupNorm (CogVideoX) computes its statistics over every band (halo.group_norm); Wan's
  RMS norm normalises over channels at each pixel and needs nothing;
- Wan's attention block (middle block, one head over all pixels of a frame): queries stay on
  their band, keys and values of every band are gathered around diffusers' call to
  scaled_dot_product_attention, so each query attends to the whole frame;
- upsampling is nearest (CogVideoX) / nearest-exact (Wan) by 2 and Wan 2.2's DupUp3D and
  unpatchify are per pixel: a band of h latent rows becomes a band of h x factor rows, so
  bands stay aligned at every resolution.

Tiled decoding (a blended approximation) is switched off during a parallel decode.
"""

from __future__ import annotations

import contextlib
import functools
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
    from diffusers import AutoencoderKLCogVideoX, AutoencoderKLWan

    return AutoencoderKLCogVideoX, AutoencoderKLWan


def spatial_factor(vae) -> int:
    """Output rows per latent row of a supported VAE."""
    cog, wan = _vae_classes()
    if isinstance(vae, cog):
        return 2 ** (len(vae.config.block_out_channels) - 1)
    if isinstance(vae, wan):
        upsamples = len(vae.config.dim_mult) - 1
        return 2 ** upsamples * (vae.config.patch_size or 1)
    raise ValueError(
        f"row-parallel decode supports AutoencoderKLCogVideoX and AutoencoderKLWan, not {type(vae).__name__}"
    )


def min_band_rows(vae) -> int:
    """The fewest latent rows a band may have: the tallest halo at the latent resolution."""
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanCausalConv3d

    # The decoder's first convolution runs at the latent resolution; every later layer runs
    # at that resolution or a multiple of it, with halos no taller (3x3 kernels throughout).
    halo = 0
    for module in vae.decoder.modules():
        if isinstance(module, WanCausalConv3d):
            halo = max(halo, module._padding[2], module._padding[3])
        elif isinstance(module, (nn.Conv2d, nn.Conv3d)):
            halo = max(halo, module.padding[-2])
    return max(1, halo)


class _GatherKeysValues(TorchFunctionMode):
    """Inside it, scaled_dot_product_attention(q, k, v) attends to the keys and values of every
    band: k and v ([B', heads, s, D], s = h x W in row-major order) are gathered along s in rank
    order, which is the row-major order of the whole frame."""

    def __init__(self, group) -> None:
        super().__init__()
        self.group = group

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k, v = args[:3]
            if "attn_mask" in kwargs and kwargs["attn_mask"] is not None or len(args) > 3 or kwargs.get("is_causal"):
                raise ValueError("row-parallel VAE attention supports unmasked, non-causal attention only")
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


def _install(vae, group) -> _Installed:
    from diffusers.models.autoencoders.autoencoder_kl_cogvideox import CogVideoXCausalConv3d
    from diffusers.models.autoencoders.autoencoder_kl_wan import WanAttentionBlock, WanCausalConv3d

    installed = _Installed()
    try:
        for name, module in vae.decoder.named_modules(prefix="decoder"):
            if isinstance(module, CogVideoXCausalConv3d) and module.pad_mode == "replicate" and module.height_pad:
                raise ValueError(f"{name}: replicate padding along rows is not supported by row-parallel decode")
            if isinstance(module, WanCausalConv3d):
                pads = module._padding  # (w, w, h, h, 2 * t, 0) for F.pad
                _check_row_conv(name, module.kernel_size[1], pads[2], module.stride[1], module.dilation[1])
                if pads[2] == 0:
                    continue
                old = module._padding
                module._padding = (pads[0], pads[1], 0, 0, pads[4], pads[5])
                installed.restore.append(functools.partial(setattr, module, "_padding", old))
                installed.hooks.append(module.register_forward_pre_hook(_wan_causal_halo_hook(pads[2], group)))
            elif isinstance(module, (nn.Conv2d, nn.Conv3d)):
                if module.padding_mode != "zeros":
                    raise ValueError(f"{name}: padding mode {module.padding_mode!r} is not supported (zeros only)")
                if isinstance(module.padding, str):
                    raise ValueError(f"{name}: padding {module.padding!r} is not supported (give it in rows)")
                pad_h = module.padding[-2]
                _check_row_conv(name, module.kernel_size[-2], pad_h, module.stride[-2], module.dilation[-2])
                if pad_h == 0:
                    continue
                installed.hooks.extend(_conv_band_hooks(module, pad_h, group))
            elif isinstance(module, nn.GroupNorm):
                module.forward = functools.partial(_group_norm_forward, module, group)
                installed.restore.append(functools.partial(_drop_instance_forward, module))
            elif isinstance(module, WanAttentionBlock):
                module.forward = functools.partial(_attention_forward, module, group)
                installed.restore.append(functools.partial(_drop_instance_forward, module))
            elif isinstance(module, nn.MultiheadAttention) or type(module).__name__.endswith("Attention"):
                raise ValueError(f"{name}: {type(module).__name__} is not supported by row-parallel decode")
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


def decode_rows(vae, latents: Tensor, group=None, dst: int | None = 0) -> Tensor | None:
    """Decode `latents` [B C T H W] (the same full tensor on every rank of `group`) with the work
    split by rows over the group; return the decoded video [B 3 T' H' W'] on group rank `dst`
    (None elsewhere), or on every rank with `dst=None`. Equal to `vae.decode(latents).sample`."""
    if latents.dim() != 5:
        raise ValueError(f"latents must be [batch, channels, frames, height, width], got shape {tuple(latents.shape)}")
    out_band, split = _decode_band(vae, latents, group)
    return gather_rows(out_band, split.scaled(spatial_factor(vae)), group, dst=dst)


def _decode_band(vae, latents: Tensor, group) -> tuple[Tensor, RowSplit]:
    """This rank's band of the decoded video, and the latent split."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    split = latent_split(vae, latents.shape[-2], world)
    band = split.shard(latents, rank).contiguous()
    with row_parallel(vae, group):
        return type(vae).decode(vae, band).sample, split  # the class's own: an instance override may be ours


def supports_vae(vae) -> bool:
    """Whether `vae` is one this module decodes by rows."""
    try:
        spatial_factor(vae)
    except ValueError:
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

    def decode(z, return_dict: bool = True):
        info["ranks"] = 1
        if z.dim() == 5 and can_decode_rows(vae, z.shape[-2], ranks):
            info["ranks"] = ranks
            out_band, split = _decode_band(vae, z, group)
            video = gather_rows(out_band, split.scaled(spatial_factor(vae)), group, dst=dst)
            if video is None:
                shape = list(out_band.shape)
                shape[-2] = split.rows * spatial_factor(vae)
                video = out_band.new_zeros(shape)
        else:
            video = type(vae).decode(vae, z).sample
        return DecoderOutput(sample=video) if return_dict else (video,)

    vae.decode = decode
    try:
        yield info
    finally:
        vae.__dict__.pop("decode", None)

