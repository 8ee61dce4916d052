"""mp4 in and out with the ffmpeg binary that ships inside imageio-ffmpeg's wheel."""

from __future__ import annotations

import os
import re

import numpy as np

# imageio-ffmpeg (read_mp4 reads through it) starts ffmpeg with `preexec_fn=os.setpgrp` (so
# that Ctrl-C in a console does not reach ffmpeg), which makes Python fork() the whole process
# instead of vfork()-ing it. In a Ray worker that fork copies a large address space and runs
# gRPC's fork handlers while gRPC's threads are busy: measured in a Serve replica, one child in
# some hundreds aborted before it could exec ffmpeg (gRPC: "epoll_wait error: Bad file
# descriptor", SIGABRT) and the video failed with a broken pipe. imageio-ffmpeg's own switch
# drops the preexec_fn; a user's explicit setting of it is kept. write_mp4 starts ffmpeg itself,
# without one.
os.environ.setdefault("IMAGEIO_FFMPEG_NO_PREVENT_SIGINT", "1")


# x264's `veryfast` preset: measured on a smooth 49 x 480 x 720 clip at the same quality
# setting, 0.73 CPU-s against 2.47 for the default (`medium`), a 19% smaller file and 0.13 dB
# less PSNR (40.01 against 40.14 dB); for the 9 x 128 x 128 clips of the tests 27 against 53 ms.
# Every finished video is encoded, on the server beside the ranks, so the encoder's CPU counts.
X264_PRESET = "veryfast"


# x264's constant quality for every video: CRF 10, what imageio-ffmpeg's quality 8 gave before
# the writer started ffmpeg itself (int((1 - 8 / 10) * 51)).
X264_CRF = 10


def check_output_path(path, flag: str = "--out", suffix: str = ".mp4") -> None:
    """Refuse, before any work, an output path that could never be filled: not ending in
    `suffix`, an existing directory, or inside a directory that cannot be created or written."""
    text = os.fspath(path)
    if not text.lower().endswith(suffix):
        kind = "an H.264 mp4" if suffix == ".mp4" else f"a {suffix} file"
        raise ValueError(f"{flag} {text!r} must end in {suffix} (raydit writes {kind} there); "
                         f"e.g. {os.path.splitext(text)[0] or 'out'}{suffix}")
    full = os.path.abspath(text)
    if os.path.isdir(full):
        raise ValueError(f"{flag} {text!r} is a directory; give a file name in it, e.g. "
                         f"{os.path.join(text, 'out' + suffix)}")
    parent = os.path.dirname(full)
    while not os.path.exists(parent):  # the nearest folder that exists must let us create the rest
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent) or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {text!r} cannot be written: {parent!r} is not a writable directory; "
                         "choose another path")


def write_mp4(path: str, frames: np.ndarray, fps: int = 8) -> None:
    """frames: uint8 [F, H, W, 3]; H and W even (raydit's sizes are multiples of 16).
    H.264 (libx264, preset X264_PRESET, CRF X264_CRF), yuv420p.

    ffmpeg (the binary in imageio-ffmpeg's wheel) runs as our own child, so that its exit status
    is read: imageio-ffmpeg's writer returned silently when ffmpeg could not write the file. The
    video goes to a temporary name beside `path` and replaces `path` only when ffmpeg succeeded,
    so a failed write never leaves a truncated or stale file under the name asked for."""
    import subprocess
    import threading

    import imageio_ffmpeg

    frames = np.asarray(frames)
    if frames.dtype != np.uint8 or frames.ndim != 4 or frames.shape[-1] != 3 or frames.shape[0] == 0:
        raise ValueError(f"frames must be uint8 [F, H, W, 3] with F >= 1, got {frames.dtype} {frames.shape}")
    check_output_path(path, "video path")
    full = os.path.abspath(path)
    os.makedirs(os.path.dirname(full), exist_ok=True)
    # Unique per thread (two saves to one name must not share it); ffmpeg creates it, so the
    # mp4 gets the mode the umask gives, as a direct write would.
    tmp = os.path.join(os.path.dirname(full),
                       f".{os.path.basename(full)}.tmp-{os.getpid()}-{threading.get_ident()}.mp4")
    _, h, w, _ = frames.shape
    cmd = [imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-loglevel", "error",
           "-f", "rawvideo", "-vcodec", "rawvideo", "-s", f"{w}x{h}", "-pix_fmt", "rgb24", "-r", str(fps),
           "-i", "-", "-an", "-vcodec", "libx264", "-pix_fmt", "yuv420p", "-crf", str(X264_CRF),
           "-preset", X264_PRESET, tmp]
    data = memoryview(np.ascontiguousarray(frames).reshape(-1))
    try:
        # No preexec_fn: Python spawns ffmpeg with vfork (see the note at the top of this file).
        proc = subprocess.run(cmd, input=data, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              check=False)
        if proc.returncode != 0 or not os.path.isfile(tmp) or os.path.getsize(tmp) == 0:
            # ffmpeg's first error line names the cause; the rest are its consequences.
            said = [re.sub(r"^(\[[^\]]*\] ?)+", "", line)
                    for line in proc.stderr.decode("utf-8", "replace").strip().splitlines()]
            raise OSError(f"ffmpeg could not write {path!r} (exit status {proc.returncode}"
                          + (f": {said[0]}" if said else "") + ")")
        os.replace(tmp, full)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_mp4(path: str) -> np.ndarray:
    """Decode an mp4 back to uint8 [F, H, W, 3] (for tests and `raydit verify`)."""
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(path)
    meta = next(reader)
    w, h = meta["size"]
    frames = [np.frombuffer(buf, dtype=np.uint8).reshape(h, w, 3) for buf in reader]
    return np.stack(frames)
