"""LTX-2: video with sound, text-to-video (`LTX2Pipeline`) and image-to-video
(`LTX2ImageToVideoPipeline`).

Model. LTX2VideoTransformer3DModel denoises two token streams in one list of blocks: the video
(packed latents [B, Lv, Cv], patch 1) and the audio (packed mel latents [B, La, Ca]). Each block
runs, per stream, self-attention (rotary), cross-attention to the prompt (the Gemma 3 text
through the pipeline's connectors, one text per stream), then audio-to-video cross-attention
(video queries, audio keys) and video-to-audio (audio queries, video keys), then the FFNs.

What differs: the only family with sound (the audio stream whole on every rank, or split over
the sp ranks from the plan's `audio_split_tokens`), and four guidance branches a step (negative,
positive, STG, modality: a cfg degree divides 4), with the request's guidance knobs in
`GenerationRequest.guidance_options`.

The package: `family` (the Family: the steps, branches, state and outputs), `guidance` (the
request's guidance knobs and how a step combines its passes), `adapter` (sequence parallelism:
the plan and the attention processors of both streams), `tiny` (the tiny pipelines), `cases`
(the conformance cases).
"""

from raydit.models.families.ltx2.family import FAMILY

__all__ = ["FAMILY"]
