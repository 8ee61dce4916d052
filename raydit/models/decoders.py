"""VAE decoders that more than one family decodes with, as the planner prices them
(raydit.planner.model.DecoderShape). A decoder one family alone uses stays in its package;
one shared lives here, so no family imports another's."""

from __future__ import annotations

from raydit.planner.model import DecoderShape

# AutoencoderKLHunyuanVideo, the VAE of HunyuanVideo and Kandinsky 5 (diffusers' default config =
# theirs: blocks 128/256/512/512, 2 layers each, mid-block attention), counted with
# torch.utils.flop_counter on the decoder built on the meta device (a throwaway script:
# `FlopCounterMode` around `vae.decoder(torch.randn(1, 16, T, h, w, device="meta"))`, T x h x w =
# 3x8x8, 5x32x32, 9x32x32 latents): 9x32x32 (33 x 256 x 256 out) 3.711e13 FLOP in convolutions +
# 1.9e10 in linear layers, 1.716e7 FLOP per output pixel-frame (5x32x32: 1.754e7 incl. attention;
# 3x8x8: 1.808e7, edges weigh more), plus the mid block's one-head attention over the call's
# latent tokens, 4 N^2 x 512 FLOP (1.74e11 at N = 9216: the bmm count). diffusers decodes it
# framewise (5 latent frames a call, stride 3) and, with enable_tiling() (the official repository,
# xDiT and SGLang tile), in 32 x 32 latent tiles at stride 24. raydit splits it by rows (issue
# 18). Halo counts by forward pre-hooks on the same meta-device decoder (5 x 32 x 32 latents, one
# call of 17 frames: 35 convolutions with a 1-row halo, 30 group norms; 2342 halo values per
# output frame and column): per latent frame of the framewise decode (stride 3, each output frame
# decoded 17/12 times) 3318 values, 11.7 exchanges, 10 norms. Its other ops move 12792.4 values per
# decoded pixel-frame (bench/bench_decodecounts.py on diffusers' framewise, tiled decode of
# 77 x 480 x 848: replicate pads, group norms, SiLU, residual adds, cache cats, upsampling).
HUNYUAN_VIDEO_DECODER = DecoderShape(1.716e7, 3318, 11.7, 10.0, 128, 17, attention_channels=512,
                                      call_frames=5, call_stride=3, tile=32, tile_stride=24,
                                      elementwise_values=12792.4)
