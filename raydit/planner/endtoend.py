"""A video's seconds end to end on one replica: the denoising steps that raydit.planner.cost
prices, plus the parts published figures include around them (pure Python).

    t_video = steps x t_step + t_text + t_decode

    t_text   2 x encoder params x text tokens FLOP per prompt (one prompt per guidance branch,
             two at most: LTX-2's other branches reuse the positive prompt) on the replica's
             encoding rank, then the embeddings' broadcast to its other ranks
             (raydit.planner.decode.broadcast_seconds)
    t_decode the VAE decode split over the replica's ranks (raydit.planner.decode.decode_cost)
"""

from __future__ import annotations

from dataclasses import dataclass

from raydit.planner.cost import Link
from raydit.planner.decode import DEFAULT_ELEMENTWISE_GB_S, broadcast_seconds, decode_cost
from raydit.planner.model import ModelSpec, VideoGeometry


@dataclass(frozen=True)
class EndToEnd:
    """Seconds of one video: the denoising steps and the parts around them."""

    steps: int
    denoise: float
    text_encode: float
    decode: float

    @property
    def total(self) -> float:
        return self.denoise + self.text_encode + self.decode

    def to_dict(self) -> dict:
        return {"steps": self.steps, "denoise": round(self.denoise, 4), "text_encode": round(self.text_encode, 4),
                "decode": round(self.decode, 4), "total": round(self.total, 4)}


def text_encode_seconds(spec: ModelSpec, prompts: int, flops_per_s: float, ranks: int = 1,
                        link: Link | None = None) -> float:
    """One forward of the text encoder per prompt (2 FLOP per parameter per token) on the
    encoding rank, then (ranks > 1) the embeddings' broadcast to the replica's other ranks."""
    seconds = prompts * 2 * spec.text_encoder_params * spec.text_tokens / flops_per_s
    if ranks > 1:
        if link is None:
            raise ValueError(f"a replica of {ranks} ranks broadcasts the embeddings: give its link")
        seconds += broadcast_seconds(spec, prompts, ranks, link.gb_s, link.latency_us)
    return seconds


def end_to_end(spec: ModelSpec, step_seconds: float, steps: int, branches: int, flops_per_s: float,
               decode_seconds: float | None = None, *, geo: VideoGeometry | None = None, ranks: int = 1,
               link: Link | None = None, elementwise_gb_s: float = DEFAULT_ELEMENTWISE_GB_S) -> EndToEnd:
    """A video's predicted seconds on a replica of `ranks` ranks: `steps` x `step_seconds`
    plus the text encoding (with the broadcast of the embeddings) and the VAE decode of `geo`
    (default: the model's default request) split over the ranks (raydit.planner.decode); a
    `decode_seconds` given replaces the decode's estimate. `link`: the replica's link, needed
    for ranks > 1; `elementwise_gb_s`: the device's elementwise bandwidth the decode's other ops
    run at (devicemodel.device_elementwise_gb_s)."""
    if ranks < 1:
        raise ValueError(f"ranks {ranks} must be >= 1")
    if ranks > 1 and link is None:
        raise ValueError(f"a replica of {ranks} ranks exchanges halos and embeddings: give its link")
    if decode_seconds is None:
        geo = geo if geo is not None else spec.geometry()
        gb_s, latency_us = (link.gb_s, link.latency_us) if link is not None else (1.0, 0.0)
        decode_seconds = decode_cost(spec, geo, ranks, flops_per_s, gb_s, latency_us,
                                     elementwise_gb_s=elementwise_gb_s).seconds
    prompts = min(branches, 2)  # the positive and negative prompts; LTX-2's other branches reuse the positive
    return EndToEnd(steps, steps * step_seconds, text_encode_seconds(spec, prompts, flops_per_s, ranks, link),
                    decode_seconds)
