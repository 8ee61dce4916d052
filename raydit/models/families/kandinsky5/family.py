"""The Kandinsky 5 family: `Kandinsky5T2VPipeline` (text-to-video) and `Kandinsky5I2VPipeline`
(image-to-video): its adapter and steps.

Its tiny pipelines are in `tiny.py`, its conformance cases in `cases.py`.

Adapter. `Kandinsky5Transformer3DModel` runs two lists of blocks: `text_transformer_blocks`
(self-attention over the Qwen2.5-VL text alone, 1-D rotary) and then
`visual_transformer_blocks`, each with self-attention over the video (3-D rotary) and
cross-attention from the video to the text (no rotary, no mask), then a feed-forward. The
text never attends to the video, so the text blocks run whole on every rank (the same
numbers everywhere) and only the visual blocks are split: the split hook cuts the video
tokens (`visual_embed`) and the rotary table of all video tokens (`rope`, the same tensor
handed to every block, so it is cut once per forward) before the first visual block; the
gather hook restores the video after the last one. Self-attention gets
`Kandinsky5SPAttnProcessor` (projections, QK RMS norms and rotary on this rank's chunk, then
`sp_attention`); cross-attention keeps diffusers' own processor: each local query attends to
the whole text, as on one device. The timestep embedding is one per sample and stays whole.

Sparse attention. A transformer configured with `attention_type="nabla"` (NABLA: a block mask
from pooled q/k scores over 64-token blocks of the "fractal" token order, through
flex_attention) runs on one process exactly as diffusers does, but is refused under sequence
parallelism with one line: its mask is computed from the whole sequence's queries and keys
and its token order is another one (8 x 8 pixel tiles), which raydit's layout does not split.

Steps. As the pipelines: two transformer calls per step with guidance (conditional, then
unconditional; cfg = 2 runs one on each rank group), combined uncond + s (cond - uncond);
FlowMatchEulerDiscreteScheduler at its own sigmas (the scheduler config's shift). The latents
are channels-last ([B, F, H, W, C], what output_type="latent" returns); the transformer's
visual-conditioning channels (`visual_cond`: zeros and a frame mask; for I2V the mask marks
frame 0) are kept in the request's context and concatenated for each call. Image-to-video:
frame 0 of the latents is the image's VAE latents (drawn from the request's generator after
the noise, as the pipeline does), the scheduler steps frames 1.. only, and the output's first
four frames are renormalized (`normalize_first_frame`) before decode, as the pipeline does.
An empty negative prompt stands for diffusers' default negative prompt (the pipeline's
`negative_prompt=None`).

Text. Qwen2.5-VL (a chat template whose first 128 tokens the pipeline crops; at most 512
prompt tokens) gives the text tokens and CLIP's pooled output joins the timestep embedding;
both run in `encode`, once per request on the replica's rank 0. The pipeline's tokenizer
is a `Qwen2VLProcessor` in the released checkpoints, but Kandinsky 5 only ever calls it on
text (`images=None, videos=None`) and `decode`: the image and video processors are unused.
transformers 5 cannot build a Qwen2VLProcessor without torchvision (its constructor checks the
video processor against a torchvision-only base class, and from_pretrained loads one), so the
tiny built-ins save a text-only Qwen-like tokenizer as the pipeline's `tokenizer`, which the
pipeline calls the same way; and where torchvision is missing, raydit's loader hands a released
checkpoint's pipeline the processor's own text tokenizer (`load_components`).

Module-level imports stay light (no torch, no diffusers): the planner reads this family
through the registry without importing torch.

Legend: B batch, S local video tokens (this rank's chunk), Lv all video tokens, Lt text
tokens, H heads, D head dim, C = H*D; latents [B, F, H, W, C] are channels-last.
"""

from __future__ import annotations

import json

from raydit.models.adapter import ForwardContext, GatherOutput, ModelAdapter, SequenceParallelPlan, SplitInput, attend
from raydit.models.decoders import HUNYUAN_VIDEO_DECODER
from raydit.models.family import Family, Prepared
from raydit.models.quantize_options import block_linear_params
from raydit.models.requests import check_frames, check_size, png_to_image, reference_call, round_frames_up
from raydit.models.tiny import request_defaults

VIDEO = 0  # the only part split across the visual blocks

T2V, I2V = "Kandinsky5T2VPipeline", "Kandinsky5I2VPipeline"
# Kandinsky5T2VPipeline.__call__'s defaults (the I2V pipeline's are the same).
PIPELINE_DEFAULTS = {"num_frames": 121, "height": 512, "width": 768}
MAX_SEQUENCE_LENGTH = 512
# Kandinsky5I2VPipeline.normalize_first_frame matches latent frames 0-3 to frames 4..8: with
# fewer than 5 latent frames the reference is empty and the output NaN.
I2V_MIN_LATENT_FRAMES = 5  # the pipelines' default: Qwen tokens after the template crop
# What the pipelines use when guidance is on and no negative prompt is given (their
# `negative_prompt=None`); a request's empty negative prompt means the same.
DEFAULT_NEGATIVE_PROMPT = (
    "Static, 2D cartoon, cartoon, 2d animation, paintings, images, worst quality, low quality, ugly, deformed, "
    "walking backwards"
)


# -- adapter -----------------------------------------------------------------------------------
def transformer_heads(config) -> int:
    """Attention heads of a Kandinsky5Transformer3DModel config: model_dim / sum(axes_dims)
    (the head dim is the rotary axes' sum; the config has no head count of its own)."""
    return int(config["model_dim"]) // sum(int(a) for a in config["axes_dims"])


def apply_rotary(x, rope):
    """Kandinsky 5's rotary on [B, S, H, D] with a table [B, S, 1, D/2, 2, 2], as its processor
    computes it (in float32, the result rounded through bfloat16, then the input's dtype)."""
    import torch

    pairs = x.reshape(*x.shape[:-1], -1, 1, 2).to(torch.float32)
    return (rope * pairs).sum(dim=-1).reshape(*x.shape).to(torch.bfloat16).type_as(x)


class Kandinsky5SPAttnProcessor:
    """Sequence-parallel replacement for Kandinsky5AttnProcessor in a visual block's
    self-attention. hidden_states: [B, S, C], this rank's video chunk; rotary_emb: the table of
    this rank's chunk (the split hook cut it). Returns [B, S, C]."""

    def __init__(self, context: ForwardContext):
        self.context = context

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, rotary_emb=None, sparse_params=None):
        if sparse_params is not None:
            raise ValueError("NABLA sparse attention (attention_type='nabla') cannot run under sequence parallelism; "
                             "run this checkpoint on one rank per replica (sp 1)")
        mesh, layout = self.context.self_attention("Kandinsky5SPAttnProcessor", hidden_states, encoder_hidden_states)

        def heads(x_BSC):
            return x_BSC.unflatten(2, (attn.num_heads, -1))  # [B, S, C] -> [B, S, H, D]

        q = heads(attn.to_query(hidden_states))
        k = heads(attn.to_key(hidden_states))
        v = heads(attn.to_value(hidden_states))
        q = attn.query_norm(q.float()).type_as(q)
        k = attn.key_norm(k.float()).type_as(k)
        if rotary_emb is not None:
            if rotary_emb.shape[1] != layout.local_len:
                raise ValueError(f"rotary table has {rotary_emb.shape[1]} rows for this rank's {layout.local_len} tokens")
            q, k = apply_rotary(q, rotary_emb), apply_rotary(k, rotary_emb)
        return attn.out_layer(attend(q, k, v, mesh, layout))


class Kandinsky5Adapter(ModelAdapter):
    name = "kandinsky5"
    transformer_classes = ("Kandinsky5Transformer3DModel",)
    plan = SequenceParallelPlan(
        blocks="visual_transformer_blocks",
        # Kandinsky5TransformerDecoderBlock.forward(visual_embed, text_embed, time_embed, rope,
        # sparse_params): the video and its rotary table are split (the model hands the same
        # table to every block); the text and the per-sample timestep embedding stay whole.
        split_inputs=(SplitInput("visual_embed", VIDEO), SplitInput("rope", VIDEO, every_block=True)),
        gather_outputs=(GatherOutput(0, VIDEO),),  # the block returns the video alone
        attention="self_attention",
    )
    processor = Kandinsky5SPAttnProcessor
    block_outputs = ("visual_embed",)
    block_temb = "time_embed"

    def validate(self, transformer, mesh) -> None:
        from raydit.parallel.attention import feasible_ulysses

        config = transformer.config
        if not self.plan.block_list(transformer):
            raise ValueError("the transformer has no visual blocks to parallelize (num_visual_blocks = 0)")
        if config.attention_type != "regular":
            raise ValueError(
                f"attention_type {config.attention_type!r} (NABLA sparse attention) cannot run under sequence "
                "parallelism: its block mask needs the whole sequence; run it with sp 1 (cfg or data parallel only)"
            )
        heads = transformer_heads(config)  # FrozenDict: indexable
        if heads % mesh.ulysses != 0:
            raise ValueError(
                f"ulysses_degree {mesh.ulysses} does not divide the {heads} attention heads; "
                f"feasible: {', '.join(map(str, feasible_ulysses(heads)))}"
            )



# -- the family --------------------------------------------------------------------------------
# -- the planner's built-in models and decoder (data the registry hands raydit.planner) ----------
# Qwen2.5-VL-7B (the whole Qwen2_5_VLForConditionalGeneration the pipelines load, 8.29e9) + CLIP
# ViT-L/14's text model (0.12e9).
TEXT_ENCODER_PARAMS = 8.29e9 + 0.12e9

def builtin_models() -> list:
    """The planner's built-in models of this family (raydit.planner.BUILTIN_MODELS)."""
    from raydit.planner.model import ModelSpec

    # tiny-kandinsky5 / -i2v: Kandinsky 5's layout (patch (1, 2, 2), HunyuanVideo VAE, Qwen text
    # cross-attended) at 6 heads x 8; I2V at 17 frames (its pipeline needs 5 latent frames).
    tiny = dict(family="kandinsky5", heads=6, head_dim=8, layers=2, ffn_hidden=64, patch_size=2, patch_size_t=1,
                text_tokens=512, text_in_sequence=False, positional="rotary", in_channels=9, params=9.2e4,
                text_encoder_params=2.2e4, vae_params=7.1e4)
    common = dict(family="kandinsky5", patch_size=2, patch_size_t=1, text_tokens=512, text_in_sequence=False,
                  positional="rotary", in_channels=33, text_encoder_params=TEXT_ENCODER_PARAMS, vae_params=0.25e9,
                  default_frames=121, default_height=512, default_width=768)
    return [
        # Kandinsky 5 (kandinskylab/Kandinsky-5.0-*-Diffusers, Kandinsky5T2VPipeline / I2V),
        # Kandinsky5Transformer3DModel as its configs set it: Lite 2B (model_dim 1792 = 28 heads x
        # 64, 32 visual + 2 text blocks, FFN 7168, time_dim 512) and Pro 19B (4096 = 32 x 128,
        # 60 + 4 blocks, FFN 16384, time_dim 1024); patch (1, 2, 2), 33 = 16 noise + 16
        # conditioning + 1 mask channels; 2.008e9 / 1.931e10 parameters on the meta device
        # (tests/models/test_family_kandinsky5.py). Layers count the visual blocks (the text
        # blocks run on the text alone, whole on every rank); the text is cross-attended, at most
        # 512 Qwen2.5-VL tokens. The HunyuanVideo VAE (8x / 4x, 0.25e9); the pipelines' defaults
        # 121 x 512 x 768. The 10 s Lite checkpoints use NABLA sparse attention: one process per
        # replica only (sequence parallelism refuses it).
        ModelSpec(name="kandinsky5-t2v-lite", heads=28, head_dim=64, layers=32, ffn_hidden=7168,
                  params=2.008e9, **common),
        ModelSpec(name="kandinsky5-t2v-pro", heads=32, head_dim=128, layers=60, ffn_hidden=16384,
                  params=19.31e9, **common),
        ModelSpec(name="kandinsky5-i2v-pro", heads=32, head_dim=128, layers=60, ffn_hidden=16384,
                  params=19.31e9, **common),
        ModelSpec(name="tiny-kandinsky5", default_frames=9, default_height=48, default_width=80, **tiny),
        ModelSpec(name="tiny-kandinsky5-i2v", default_frames=17, default_height=32, default_width=48, **tiny),
    ]


class Kandinsky5Family(Family):
    """Kandinsky5T2VPipeline / Kandinsky5I2VPipeline steps: classifier-free guidance, two
    transformer calls per step (conditional and unconditional), as the pipelines make them."""

    name = "kandinsky5"
    pipelines = (T2V, I2V)
    image_pipelines = (I2V,)
    adapter = Kandinsky5Adapter
    batch_branches = False  # the pipelines call the transformer once per branch
    # Per video token and channel, and kernels per block and call, of the block's ops besides GEMMs and
    # attention in eager bf16: bench/bench_blockcounts.py (the family's tiny forward case, FFN at the released ratio; the modulation in float32, as diffusers loads it).
    elementwise_bytes = 440.8
    elementwise_launches = 75
    # Kandinsky 5 decodes with HunyuanVideo's VAE (AutoencoderKLHunyuanVideo), split by rows as
    # HunyuanVideo's is: priced as that decoder, split.
    decoder = HUNYUAN_VIDEO_DECODER
    # The visual blocks' modulation (visual_modulation.out_layer) stays in the run's dtype under quantize.
    quantize_keep = Family.quantize_keep + ("visual_modulation",)

    round_frames = staticmethod(round_frames_up)  # Kandinsky5T2VPipeline / I2V's

    models = staticmethod(builtin_models)

    def fp8_weight_params(self, spec) -> float:
        # per visual block: self- and cross-attention's query, key, value, out (8 h^2) and the
        # feed-forward (2 h f); the text blocks and the modulation stay in bf16
        return block_linear_params(spec, 8, 2)

    def spec_from_dir(self, path, configs):
        """Geometry from transformer/config.json and vae/config.json (diffusers' defaults for
        absent keys); request defaults: the pipeline's 121 frames at 512 x 768 unless the
        directory says otherwise (DEFAULTS_FILE); sizes from the weights' headers."""
        from raydit.planner.model import ModelSpec
        from raydit.planner.pipeline_dir import component_params, transformer_config

        cfg, where = transformer_config(path, configs, "Kandinsky5Transformer3DModel", "a Kandinsky 5 pipeline")
        axes = [int(a) for a in cfg.get("axes_dims", (16, 24, 24))]
        head_dim = sum(axes)
        hidden = int(cfg.get("model_dim", 2048))
        if hidden % head_dim:
            raise ValueError(f"{where}: model_dim {hidden} is not a multiple of the head dim sum(axes_dims) = {head_dim}")
        heads = hidden // head_dim
        layers = int(cfg.get("num_visual_blocks", 32))
        text_layers = int(cfg.get("num_text_blocks", 2))
        ffn = int(cfg.get("ff_dim", 5120))
        time_dim = int(cfg.get("time_dim", 512))
        patch = [int(p) for p in cfg.get("patch_size", (1, 2, 2))]
        vae = configs.get("vae", {})
        defaults = request_defaults(path, PIPELINE_DEFAULTS)
        # visual block: self- and cross-attention 8 h^2, FFN 2 h ffn, modulation 9 h time_dim;
        # text block: attention 4 h^2, FFN 2 h ffn, modulation 6 h time_dim
        estimate = float(layers * (8 * hidden * hidden + 2 * hidden * ffn + 9 * hidden * time_dim)
                         + text_layers * (4 * hidden * hidden + 2 * hidden * ffn + 6 * hidden * time_dim))
        encoders = sum(component_params(path / c) or 0.0 for c in ("text_encoder", "text_encoder_2"))
        visual_dim = int(cfg.get("in_visual_dim", 4))
        return ModelSpec(
            name=str(path), family=self.name, heads=heads, head_dim=head_dim, layers=layers, ffn_hidden=ffn,
            patch_size=patch[1], patch_size_t=patch[0],
            text_tokens=MAX_SEQUENCE_LENGTH, text_in_sequence=False, positional="rotary",
            in_channels=2 * visual_dim + 1 if cfg.get("visual_cond", False) else visual_dim,
            params=component_params(path / "transformer") or estimate, text_encoder_params=encoders,
            vae_params=component_params(path / "vae") or 0.0,
            **defaults, vae_spatial=int(vae.get("spatial_compression_ratio", 8)),
            vae_temporal=int(vae.get("temporal_compression_ratio", 4)),
        )

    def load_components(self, path):
        """Without torchvision, a checkpoint whose `tokenizer` is a Qwen2VLProcessor (the released
        ones) gets the processor's own text tokenizer instead: transformers cannot load the
        processor (its video processor needs torchvision), and the pipelines only ever tokenize
        text with it (images=None, videos=None) and decode."""
        from transformers.utils import is_torchvision_available

        index = json.loads((path / "model_index.json").read_text())
        entry = index.get("tokenizer") or [None, None]
        if entry[1] != "Qwen2VLProcessor" or is_torchvision_available():
            return {}
        from transformers import AutoTokenizer

        return {"tokenizer": AutoTokenizer.from_pretrained(str(path / "tokenizer"))}

    def reference_latents(self, pipe, request):
        pipe.set_progress_bar_config(disable=True)
        kwargs = reference_call(request, negative_none=True)
        if type(pipe).__name__ == I2V:
            kwargs["image"] = png_to_image(request.image)
        return pipe(**kwargs).frames

    # -- hooks ---------------------------------------------------------------------------------
    def check_request(self, pipe, request) -> None:
        super().check_request(pipe, request)
        time_dtype = pipe.transformer.time_embeddings.in_layer.weight.dtype
        if str(time_dtype) != "torch.float32":
            raise ValueError(
                f"the transformer's time embedding is {str(time_dtype).replace('torch.', '')}, but Kandinsky 5 computes "
                "its sinusoids in float32 and needs it float32: load the pipeline with from_pretrained(dtype=...) "
                "(which keeps it float32) instead of casting with .to(dtype); float64 runs are not supported")
        temporal = pipe.vae_scale_factor_temporal
        check_frames(request.num_frames, temporal)
        patch = pipe.transformer.config.patch_size
        multiple = pipe.vae_scale_factor_spatial * int(patch[1])
        check_size(request, multiple, pipe.vae_scale_factor_spatial, patch[1])
        if type(pipe).__name__ == I2V and (request.num_frames - 1) // temporal + 1 < I2V_MIN_LATENT_FRAMES:
            least = (I2V_MIN_LATENT_FRAMES - 1) * temporal + 1
            raise ValueError(f"num_frames {request.num_frames} is too few for {I2V}: it renormalizes the first 4 "
                             f"latent frames against the next ones (NaN without them); give at least {least}")

    def encode(self, pipe, request, device, dtype):
        model_dtype = pipe.transformer.dtype

        def branch(prompt):
            qwen, clip, cu_seqlens = pipe.encode_prompt(prompt=prompt, max_sequence_length=MAX_SEQUENCE_LENGTH,
                                                        device=device, dtype=model_dtype)
            if int(cu_seqlens[-1]) != qwen.shape[1]:  # one prompt, no padding: every token valid
                raise RuntimeError(f"the Qwen encoding has {qwen.shape[1]} tokens but {int(cu_seqlens[-1])} are valid")
            return {"encoder_hidden_states": qwen, "pooled_projections": clip}

        positive = branch(request.prompt)
        negative = branch(request.negative_prompt or DEFAULT_NEGATIVE_PROMPT) if self.do_cfg(pipe, request) else None
        return positive, negative

    def init(self, pipe, request, generator, device, dtype):
        import torch

        pipe.scheduler.set_timesteps(request.num_inference_steps, device=device)
        timesteps = pipe.scheduler.timesteps
        channels = pipe.transformer.config.in_visual_dim
        shape = dict(batch_size=1, num_channels_latents=channels, height=request.height, width=request.width,
                     num_frames=request.num_frames, dtype=dtype, device=device, generator=generator)
        if type(pipe).__name__ == I2V:
            full = pipe.prepare_latents(image=png_to_image(request.image), **shape)
        else:
            full = pipe.prepare_latents(**shape)
        spatial = pipe.vae_scale_factor_spatial
        frames = (request.num_frames - 1) // pipe.vae_scale_factor_temporal + 1
        context = {
            "visual_rope_pos": [torch.arange(frames, device=device),
                                torch.arange(request.height // spatial // 2, device=device),
                                torch.arange(request.width // spatial // 2, device=device)],
            "scale_factor": pipe._get_scale_factor(request.height, request.width),
        }
        sparse = pipe.get_sparse_params(full, device)
        if sparse is not None:
            context["sparse_params"] = sparse
        if full.shape[-1] > channels:  # visual_cond: zeros and the frame mask, fixed for the request
            context["condition"] = full[..., channels:].clone()
        return Prepared(latents=full[..., :channels].clone(), timesteps=timesteps, context=context)

    def predict(self, pipe, state, t, branch):
        import torch

        transformer = pipe.transformer
        dtype = transformer.dtype
        text = branch["encoder_hidden_states"]
        b = text.shape[0]
        condition = state.context.get("condition")
        latents = state.latents if condition is None else torch.cat([state.latents, condition], dim=-1)
        return transformer(
            hidden_states=latents.to(dtype).expand(b, -1, -1, -1, -1),
            encoder_hidden_states=text.to(dtype),
            pooled_projections=branch["pooled_projections"].to(dtype),
            timestep=t.unsqueeze(0).repeat(b).to(dtype),
            visual_rope_pos=state.context["visual_rope_pos"],
            text_rope_pos=torch.arange(text.shape[1], device=text.device),
            scale_factor=state.context["scale_factor"],
            sparse_params=state.context.get("sparse_params"),
            return_dict=False,
        )

    def guidance_scale(self, pipe, state, t) -> float:
        return state.request.guidance_scale

    def scheduler_step(self, pipe, state, noise, t, generator):
        import torch

        from raydit.models.schedules import step

        latents = state.latents
        if type(pipe).__name__ != I2V:
            return step(pipe.scheduler, noise, t, latents, generator), dict(state.carry)
        # The image's frame stays; frames 1.. are stepped (as the I2V pipeline's loop).
        stepped = step(pipe.scheduler, noise[:, 1:], t, latents[:, 1:], generator)
        return torch.cat([latents[:, :1], stepped.to(latents.dtype)], dim=1), dict(state.carry)

    def output_latents(self, pipe, state, latents=None):
        latents = state.latents if latents is None else latents
        if type(pipe).__name__ == I2V:
            return pipe.normalize_first_frame(latents)  # the I2V pipeline's last step ("mesh artifacts")
        return latents

    def decode_video(self, pipe, state, latents):
        vae = pipe.vae
        latents = self.output_latents(pipe, state, latents)  # [1, F, H, W, C]
        video = latents.to(vae.device, vae.dtype).permute(0, 4, 1, 2, 3) / vae.config.scaling_factor
        return vae.decode(video, return_dict=False)[0]


FAMILY = Kandinsky5Family()
