"""LTX-2's guidance: the request's knobs resolved as `LTX2Pipeline` resolves them, and how a
step combines the x0 predictions of its passes into one velocity (the family's module docstring
says which passes run)."""

from __future__ import annotations

# LTX2Pipeline.__call__'s default prompt length, what the planner counts (it reads no pipeline);
# a loaded pipeline's own default is read from its signature (max_sequence_length(pipe)).
MAX_SEQUENCE_LENGTH = 1024
STG_BLOCK = 28  # the pipeline's default spatio_temporal_guidance_blocks = [28]

# GenerationRequest.guidance_options this family takes, with LTX2Pipeline's defaults. None: the
# pipeline's fallback (audio_x or x; stg_blocks: [28], which names no block of a transformer with
# fewer, as in the pipeline; image_crf: 33 for Gemma 3 checkpoints, 18 for Gemma 4).
OPTION_DEFAULTS = {
    "stg_scale": 1.0,
    "modality_scale": 3.0,
    "guidance_rescale": 0.7,
    "audio_guidance_scale": 7.0,
    "audio_stg_scale": 1.0,
    "audio_modality_scale": 3.0,
    "audio_guidance_rescale": 0.7,
    "stg_blocks": None,
    "use_cross_timestep": True,
    "image_crf": None,
}


def max_sequence_length(pipe) -> int:
    """The prompt length the pipeline pads to when called with its defaults: its __call__'s
    max_sequence_length default (1024 for LTX2Pipeline and LTX2ImageToVideoPipeline), whatever
    the tokenizer's model_max_length says (the pipeline pads and truncates to it regardless)."""
    import inspect

    return int(inspect.signature(type(pipe).__call__).parameters["max_sequence_length"].default)


def default_crf(pipe) -> int:
    """The image CRF LTX2ImageToVideoPipeline uses for this checkpoint (by its text encoder)."""
    from diffusers.pipelines.ltx2.utils import resolve_default_image_crf

    encoder = getattr(pipe, "text_encoder", None)
    if encoder is None:  # dropped on a rank that does not encode: its class says the generation
        from types import SimpleNamespace

        from raydit.models.text_encoding import _DROPPED

        cls = getattr(pipe, _DROPPED, {}).get("text_encoder", (type(None), None))[0]
        encoder = SimpleNamespace(config=SimpleNamespace(model_type="gemma4" if "Gemma4" in cls.__name__ else "gemma3"))
    return int(resolve_default_image_crf(encoder))


def guidance(pipe, request) -> dict:
    """Every guidance knob of `request` for this pipeline, resolved as LTX2Pipeline does."""
    o = {name: request.option(name, default) for name, default in OPTION_DEFAULTS.items()}
    g = dict(o, guidance_scale=request.guidance_scale)
    # The pipeline's own fallbacks: `audio_x = audio_x or x`.
    g["audio_guidance_scale"] = o["audio_guidance_scale"] or request.guidance_scale
    g["audio_stg_scale"] = o["audio_stg_scale"] or o["stg_scale"]
    g["audio_modality_scale"] = o["audio_modality_scale"] or o["modality_scale"]
    g["audio_guidance_rescale"] = o["audio_guidance_rescale"] or o["guidance_rescale"]
    if o["stg_blocks"] is None:  # the pipeline's default, even where it names no block (a small model)
        g["stg_blocks"] = (STG_BLOCK,)
    g["cfg"] = g["guidance_scale"] > 1.0 or g["audio_guidance_scale"] > 1.0
    g["stg"] = g["stg_scale"] > 0.0 or g["audio_stg_scale"] > 0.0
    g["modality"] = g["modality_scale"] > 1.0 or g["audio_modality_scale"] > 1.0
    return g


def guide(pipe, g: dict, step_index: int, video, audio, x0: dict):
    """x0 predictions -> the guided velocity [1, N]: x0_pos plus the guidance deltas, rescaled
    per stream, turned back into a velocity (v = (latents - x0) / sigma). `g`: guidance(...);
    video [1, Lv, Cv] (in the pipeline's layout) and audio [1, La, Ca]: the step's latents;
    x0: {"pos": (video, audio), and "neg", "stg", "mod" where those passes ran}."""
    import torch
    from diffusers.pipelines.ltx2.pipeline_ltx2 import rescale_noise_cfg

    i = step_index
    (v_pos, a_pos) = x0["pos"]
    v_cfg = a_cfg = v_stg = a_stg = v_mod = a_mod = 0
    if "neg" in x0:
        v_cfg = (g["guidance_scale"] - 1) * (v_pos - x0["neg"][0])
        a_cfg = (g["audio_guidance_scale"] - 1) * (a_pos - x0["neg"][1])
    if "stg" in x0:
        v_stg = g["stg_scale"] * (v_pos - x0["stg"][0])
        a_stg = g["audio_stg_scale"] * (a_pos - x0["stg"][1])
    if "mod" in x0:
        v_mod = (g["modality_scale"] - 1) * (v_pos - x0["mod"][0])
        a_mod = (g["audio_modality_scale"] - 1) * (a_pos - x0["mod"][1])
    v_guided = v_pos + v_cfg + v_stg + v_mod
    a_guided = a_pos + a_cfg + a_stg + a_mod
    if g["guidance_rescale"] > 0:
        v_guided = rescale_noise_cfg(v_guided, v_pos, guidance_rescale=g["guidance_rescale"])
    if g["audio_guidance_rescale"] > 0:
        a_guided = rescale_noise_cfg(a_guided, a_pos, guidance_rescale=g["audio_guidance_rescale"])
    v_velocity = pipe.convert_x0_to_velocity(video, v_guided, i, pipe.scheduler)
    a_velocity = pipe.convert_x0_to_velocity(audio, a_guided, i, pipe.scheduler)
    return torch.cat([v_velocity.flatten(1), a_velocity.flatten(1)], dim=1)
