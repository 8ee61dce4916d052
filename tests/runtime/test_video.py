"""raydit's mp4 writer: what x264 was asked to do, read back from the file, and what comes out."""

from __future__ import annotations

import re

import numpy as np
import pytest

from raydit.runtime.video import read_mp4, write_mp4


def _smooth_clip(frames: int = 9, height: int = 96, width: int = 128) -> np.ndarray:
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    out = []
    for t in range(frames):
        r = 128 + 100 * np.sin((x + 4 * t) / 20) * np.cos(y / 15)
        g = 128 + 80 * np.sin((y - 3 * t) / 12)
        b = 128 + 60 * np.cos((x + y + 5 * t) / 25)
        out.append(np.clip(np.stack([r, g, b], -1), 0, 255).astype(np.uint8))
    return np.stack(out)


def _x264_options(path) -> dict[str, str]:
    """x264 writes the settings it encoded with into the stream (an SEI message)."""
    data = open(path, "rb").read()
    m = re.search(rb"x264 - core \d+.*? options: ([^\x00]*?)(?:\x00|\x80)", data, re.S)
    assert m, "no x264 settings message in the file"
    return dict(kv.split("=", 1) for kv in m.group(1).decode("ascii", "replace").split() if "=" in kv)


def test_mp4_is_encoded_with_the_fast_preset_at_the_same_quality(tmp_path):
    """The veryfast preset (one reference frame, sub-pixel refinement 2, a 10-frame
    lookahead; the default medium has 3, 7 and 40) at constant quality 10, as before."""
    path = tmp_path / "v.mp4"
    write_mp4(str(path), _smooth_clip())
    opts = _x264_options(path)
    assert (opts["ref"], opts["subme"], opts["rc_lookahead"]) == ("1", "2", "10"), opts
    assert opts["rc"] == "crf" and float(opts["crf"]) == pytest.approx(10.0)


def test_mp4_round_trip_keeps_every_frame_and_the_picture(tmp_path):
    clip = _smooth_clip()
    path = tmp_path / "v.mp4"
    write_mp4(str(path), clip, fps=8)
    back = read_mp4(str(path))
    assert back.shape == clip.shape and back.dtype == np.uint8
    mse = float(((back.astype(np.float32) - clip.astype(np.float32)) ** 2).mean())
    psnr = 10 * np.log10(255.0**2 / mse)
    # yuv420p halves the chroma resolution, which alone bounds the PSNR: 40.5 dB measured on
    # this clip; its frames reversed give 13.5 dB, shifted by one 19.0 dB.
    assert psnr >= 35.0, psnr


def test_mp4_writer_refuses_frames_it_cannot_encode(tmp_path):
    with pytest.raises(ValueError, match="uint8"):
        write_mp4(str(tmp_path / "v.mp4"), np.zeros((2, 16, 16, 3), np.float32))


def test_ffmpeg_is_started_without_a_preexec_function():
    """A preexec_fn makes Python fork() the whole process to start ffmpeg, which crashed a
    Serve replica's child (gRPC's fork handlers; raydit/runtime/video.py); without one,
    Python uses vfork. Checked through imageio-ffmpeg's own choice of Popen arguments."""
    import raydit.runtime.video  # noqa: F401  (sets the switch)
    from imageio_ffmpeg._utils import _popen_kwargs

    assert _popen_kwargs(prevent_sigint=True)["preexec_fn"] is None


def test_a_video_ffmpeg_cannot_write_is_an_error_and_leaves_no_file(tmp_path):
    """ffmpeg's own failure reaches the caller (imageio-ffmpeg's writer returned silently), and
    the name asked for is never left holding a partial or an earlier video."""
    clip = _smooth_clip(frames=3)
    path = tmp_path / "v.mp4"
    write_mp4(str(path), clip)
    before = path.read_bytes()
    # 2 x 3 pixels: libx264 refuses yuv420p at an odd size, after ffmpeg has started.
    with pytest.raises(OSError, match=r"ffmpeg could not write .*v\.mp4.*exit status [1-9]\d*: width not divisible by 2"):
        write_mp4(str(path), np.zeros((2, 3, 3, 3), np.uint8))
    assert path.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["v.mp4"]


def test_an_output_path_no_file_can_be_created_in_is_refused_for_root_too():
    """access() says yes to root everywhere; /proc takes no new file for anyone, so its path is
    refused before the run whoever runs it (a video computed for nothing, otherwise)."""
    from raydit.runtime.video import check_output_path

    with pytest.raises(ValueError, match=r"--out '/proc/raydit-test\.mp4' cannot be written"):
        check_output_path("/proc/raydit-test.mp4", "--out")


@pytest.mark.parametrize("name,message", [
    ("v.txt", r"must end in \.mp4 .* e\.g\. .*v\.mp4$"),
    ("", r"must end in \.mp4"),
    ("folder", r"is a directory; give a file name in it"),
    ("file/v.mp4", r"cannot be written: .*file' is not a writable directory"),
])
def test_an_output_path_that_cannot_be_filled_is_refused_before_any_work(tmp_path, name, message):
    from raydit.runtime.video import check_output_path

    (tmp_path / "folder").mkdir()
    (tmp_path / "folder.mp4").mkdir()
    (tmp_path / "file").write_text("x")
    target = str(tmp_path / name) if name else ""
    if name == "folder":
        target = str(tmp_path / "folder.mp4")
    with pytest.raises(ValueError, match=message):
        check_output_path(target, "--out")
    with pytest.raises(ValueError, match=message):
        write_mp4(target, _smooth_clip(frames=1))
    check_output_path(str(tmp_path / "new" / "deeper" / "v.MP4"), "--out")  # created on write
    with pytest.raises(ValueError, match=r"--save-latents .*must end in \.npy"):
        check_output_path(str(tmp_path / "lat"), "--save-latents", ".npy")
