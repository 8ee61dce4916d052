"""Call `raydit serve` with OpenAI's official Python client, unchanged.

    RAYDIT_URL=http://127.0.0.1:8000 RAYDIT_API_TOKEN=$(cat ~/.raydit/api_token) \
        python examples/openai_client.py "a red fox running through fresh snow" [--out fox.mp4]

OpenAI's own fields (prompt, model, size "WxH", seconds) go as keyword arguments;
raydit's (num_inference_steps, guidance_scale, negative_prompt, seed, num_frames) as
`extra_body`. The client sends them as multipart/form-data, which the server accepts.
"""

from __future__ import annotations

import argparse
import os
import warnings

import openai

warnings.filterwarnings("ignore", message=".*Sora API.*")  # OpenAI's own endpoint is retired; this one is not


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("prompt")
    ap.add_argument("--out", default="video.mp4")
    ap.add_argument("--steps", type=int, default=None, help="denoising steps (server default if omitted)")
    ap.add_argument("--seconds", default=None, help="duration; the server rounds up to frames its VAE takes")
    ap.add_argument("--size", default=None, help="WIDTHxHEIGHT, at most what the server's plan holds")
    ap.add_argument("--seed", type=int, default=None)
    args = ap.parse_args()

    client = openai.OpenAI(
        base_url=os.environ.get("RAYDIT_URL", "http://127.0.0.1:8000").rstrip("/") + "/v1",
        api_key=os.environ["RAYDIT_API_TOKEN"],
    )
    extra = {k: v for k, v in (("num_inference_steps", args.steps), ("seed", args.seed)) if v is not None}
    kwargs = {k: v for k, v in (("seconds", args.seconds), ("size", args.size)) if v is not None}
    video = client.videos.create(prompt=args.prompt, extra_body=extra, **kwargs)
    print(f"{video.id}: {video.status}")
    # queued -> in_progress -> completed. A client that needs no progress can instead ask once:
    # client.videos.retrieve(video.id, extra_query={"wait": 60}) answers when the video is done
    # (or after 60 s; ask again while it is unfinished).
    video = client.videos.poll(video.id, poll_interval_ms=500)
    if video.status != "completed":
        raise SystemExit(f"{video.id} {video.status}: {video.error}")
    client.videos.download_content(video.id).write_to_file(args.out)
    print(f"{video.id}: wrote {args.out} ({video.size}, {video.seconds} s, "
          f"seed {video.model_extra['raydit']['seed']})")
    recent = client.videos.list(limit=5)
    print("recent:", ", ".join(f"{v.id} {v.status}" for v in recent.data))


if __name__ == "__main__":
    main()
