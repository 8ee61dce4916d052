"""mp4 in and out with the ffmpeg binary that ships inside imageio-ffmpeg's wheel."""

from __future__ import annotations

import os
import re
import tempfile

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
    # access() answers yes to root everywhere, /proc and /sys included: create (and remove) a
    # file there to be sure.
    try:
        fd, probe = tempfile.mkstemp(prefix=".raydit-probe-", dir=parent)
    except OSError as exc:
        raise ValueError(f"{flag} {text!r} cannot be written: no file can be created in {parent!r} "
                         f"({exc.strerror or exc}); choose another path") from None
    os.close(fd)
    os.unlink(probe)


def audio_latents_path(path: str) -> str:
    """Where a .npy `--save-latents PATH` puts the audio latents: beside it, NAME.audio.npy."""
    return os.fspath(path)[:-len(".npy")] + ".audio.npy"


def check_latents_path(path) -> None:
    """Refuse, before any work, a latents path that could never be filled (one line, ValueError):
    it must end in .npy (video; with sound, the audio beside it as NAME.audio.npy) or .npz."""
    text = os.fspath(path)
    if text.lower().endswith(".npz"):
        check_output_path(text, "--save-latents", ".npz")
        return
    if not text.lower().endswith(".npy"):
        raise ValueError(f"--save-latents {text!r} must end in .npy (the video latents; a model with sound adds "
                         f"NAME.audio.npy beside it) or .npz (keys latents, audio_latents); e.g. "
                         f"{os.path.splitext(text)[0] or 'latents'}.npy")
    check_output_path(text, "--save-latents", ".npy")
    check_output_path(audio_latents_path(text), "--save-latents (its audio beside it)", ".npy")


DEFAULT_FPS = 8


def playback_fps(frame_rate: float | None):
    """The mp4 frame rate when none is asked for: the rate a model's sound was made for (LTX-2:
    24, so the two play in sync), else DEFAULT_FPS; an int where the rate is whole."""
    rate = float(frame_rate or DEFAULT_FPS)
    return int(rate) if rate.is_integer() else rate


def write_mp4(path: str, frames: np.ndarray, fps: int = 8, audio=None) -> None:
    """frames: uint8 [F, H, W, 3]; H and W even (raydit's sizes are multiples of 16).
    H.264 (libx264, preset X264_PRESET, CRF X264_CRF), yuv420p.

    audio: None, or sound to mux beside the video (any family may return some): an object with
    `waveform` (float [channels, samples] in [-1, 1], 1 or 2 channels) and `sample_rate` (Hz),
    or a (waveform, sample_rate) pair. It goes in as AAC at AUDIO_BITRATE, as long as it is
    (ffmpeg's own aac encoder; 16-bit PCM through a temporary WAV beside `path`).

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
    sound = None if audio is None else _audio_pcm(audio)  # checked before ffmpeg starts
    _, h, w, _ = frames.shape
    wav = tmp[:-len(".mp4")] + ".wav"
    cmd = [imageio_ffmpeg.get_ffmpeg_exe(), "-y", "-loglevel", "error",
           "-f", "rawvideo", "-vcodec", "rawvideo", "-s", f"{w}x{h}", "-pix_fmt", "rgb24", "-r", str(fps),
           "-i", "-"]
    if sound is None:
        cmd += ["-an"]
    else:
        cmd += ["-i", wav, "-map", "0:v", "-map", "1:a", "-c:a", "aac", "-b:a", AUDIO_BITRATE]
    cmd += ["-vcodec", "libx264", "-pix_fmt", "yuv420p", "-crf", str(X264_CRF), "-preset", X264_PRESET, tmp]
    data = memoryview(np.ascontiguousarray(frames).reshape(-1))
    try:
        if sound is not None:
            _write_wav(wav, *sound)
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
        for leftover in (tmp, wav):
            if os.path.exists(leftover):
                os.unlink(leftover)


AUDIO_BITRATE = "128k"  # AAC, ample for the 16-48 kHz speech and effects video models make


def _audio_pcm(audio) -> tuple[np.ndarray, int]:
    """Sound as write_mp4 takes it -> (int16 [samples, channels], sample rate); ValueError with
    one line for anything else."""
    if isinstance(audio, tuple) and len(audio) == 2:
        waveform, rate = audio
    else:
        waveform, rate = getattr(audio, "waveform", None), getattr(audio, "sample_rate", None)
    wave = np.asarray(waveform, dtype=np.float32) if waveform is not None else None
    if wave is None or wave.ndim != 2 or wave.shape[0] not in (1, 2) or wave.shape[1] == 0:
        raise ValueError(f"audio waveform must be float [1 or 2 channels, samples], got "
                         f"{None if wave is None else wave.shape}")
    if isinstance(rate, bool) or not isinstance(rate, (int, np.integer)) or not 1000 <= rate <= 384000:
        raise ValueError(f"audio sample_rate {rate!r} must be an integer in Hz (1000 .. 384000)")
    if not np.isfinite(wave).all():
        raise ValueError("audio waveform holds NaN or infinite samples")
    pcm = (np.clip(wave, -1.0, 1.0) * 32767.0).round().astype("<i2").T  # [samples, channels]
    return np.ascontiguousarray(pcm), int(rate)


def _write_wav(path: str, pcm: np.ndarray, rate: int) -> None:
    import wave

    with wave.open(path, "wb") as out:
        out.setnchannels(pcm.shape[1])
        out.setsampwidth(2)
        out.setframerate(rate)
        out.writeframes(pcm.tobytes())


def read_mp4_audio(path: str) -> tuple[np.ndarray, int] | None:
    """The audio stream of an mp4 -> (float32 [channels, samples], sample rate), or None when it
    has none (for tests and `raydit verify`)."""
    import subprocess

    import imageio_ffmpeg

    exe = imageio_ffmpeg.get_ffmpeg_exe()
    probe = subprocess.run([exe, "-hide_banner", "-i", path], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                           check=False).stderr.decode("utf-8", "replace")
    found = re.search(r"Stream #\S+: Audio: [^,]+, (\d+) Hz, (mono|stereo|(\d+) channels)", probe)
    if found is None:
        return None
    rate = int(found.group(1))
    channels = {"mono": 1, "stereo": 2}.get(found.group(2)) or int(found.group(3))
    raw = subprocess.run([exe, "-loglevel", "error", "-i", path, "-map", "0:a:0", "-f", "f32le", "-acodec",
                          "pcm_f32le", "-ac", str(channels), "-ar", str(rate), "-"], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, check=True).stdout
    return np.frombuffer(raw, dtype="<f4").reshape(-1, channels).T.copy(), rate


def read_mp4(path: str) -> np.ndarray:
    """Decode an mp4 back to uint8 [F, H, W, 3] (for tests and `raydit verify`)."""
    import imageio_ffmpeg

    reader = imageio_ffmpeg.read_frames(path)
    meta = next(reader)
    w, h = meta["size"]
    frames = [np.frombuffer(buf, dtype=np.uint8).reshape(h, w, 3) for buf in reader]
    return np.stack(frames)
