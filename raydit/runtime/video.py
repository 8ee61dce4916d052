"""mp4 in and out through imageio-ffmpeg (the ffmpeg binary ships inside its wheel)."""

from __future__ import annotations

import os

import numpy as np

# imageio-ffmpeg starts ffmpeg with `preexec_fn=os.setpgrp` (so that Ctrl-C in a console does
# not reach ffmpeg), which makes Python fork() the whole process instead of vfork()-ing it. In a
# Ray worker that fork copies a large address space and runs gRPC's fork handlers while gRPC's
# threads are busy: measured in a Serve replica, one child in some hundreds aborted before it
# could exec ffmpeg (gRPC: "epoll_wait error: Bad file descriptor", SIGABRT) and the video
# failed with a broken pipe. imageio-ffmpeg's own switch drops the preexec_fn; a user's
# explicit setting of it is kept.
os.environ.setdefault("IMAGEIO_FFMPEG_NO_PREVENT_SIGINT", "1")


# x264's `veryfast` preset: measured on a smooth 49 x 480 x 720 clip at the same quality
# setting, 0.73 CPU-s against 2.47 for the default (`medium`), a 19% smaller file and 0.13 dB
# less PSNR (40.01 against 40.14 dB); for the 9 x 128 x 128 clips of the tests 27 against 53 ms.
# Every finished video is encoded, on the server beside the ranks, so the encoder's CPU counts.
X264_PRESET = "veryfast"


def write_mp4(path: str, frames: np.ndarray, fps: int = 8) -> None:
    """frames: uint8 [F, H, W, 3]; H and W even (raydit's sizes are multiples of 16).
    H.264 (libx264, preset X264_PRESET, imageio-ffmpeg's quality 8), yuv420p."""
    import imageio_ffmpeg

    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3:
        raise ValueError(f"frames must be uint8 [F, H, W, 3], got {frames.dtype} {frames.shape}")
    parent = os.path.dirname(os.path.abspath(path))
    os.makedirs(parent, exist_ok=True)
    f, h, w, _ = frames.shape
    writer = imageio_ffmpeg.write_frames(
        path, (w, h), fps=fps, codec="libx264", pix_fmt_out="yuv420p", macro_block_size=1,
        quality=8, ffmpeg_log_level="error", output_params=["-preset", X264_PRESET],
    )
    writer.send(None)
    for frame in frames:
        writer.send(np.ascontiguousarray(frame))
    writer.close()


def read_mp4(path: str) -> np.ndarray:
    """Decode an mp4 back to uint8 [F, H, W, 3] (for tests and `raydit verify`)."""
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(path)
    meta = next(reader)
    w, h = meta["size"]
    frames = [np.frombuffer(buf, dtype=np.uint8).reshape(h, w, 3) for buf in reader]
    return np.stack(frames)
