"""Videos and their status on disk, named by id only: `<id>.json`, `<id>.mp4`
(and `<id>.input.png` for an image-to-video request's reference image).

Every file is written to a temporary name and renamed into place, so a crash leaves either
the old file or the new one; the mp4 is in place before its status says `completed`.
A restarted server reads the JSON files back: finished videos are served again, and
requests that were queued or running are queued again.
"""

from __future__ import annotations

import json
import os
import re
import secrets
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

ID_PATTERN = re.compile(r"^video_[0-9a-f]{24}$")
STATUSES = ("queued", "in_progress", "completed", "failed")
FINISHED = ("completed", "failed")  # a video in these states changes no more


@dataclass
class VideoJob:
    """One request's public state (OpenAI's video object) plus what is needed to run it."""

    id: str
    model: str
    prompt: str
    params: dict  # the generation parameters (schema.resolve)
    fps: int
    status: str = "queued"
    progress: int = 0
    created_at: float = field(default_factory=time.time)
    completed_at: float | None = None
    error: dict | None = None
    has_image: bool = False
    info: dict = field(default_factory=dict)  # plan, recoveries, timings of the finished run

    @property
    def size(self) -> str:
        return f"{self.params['width']}x{self.params['height']}"

    @property
    def seconds(self) -> str:
        return f"{self.params['num_frames'] / self.fps:g}"

    def to_object(self) -> dict:
        """OpenAI's video object; raydit's own fields under `raydit`."""
        return {
            "id": self.id,
            "object": "video",
            "model": self.model,
            "status": self.status,
            "progress": int(self.progress),
            "created_at": int(self.created_at),
            "completed_at": None if self.completed_at is None else int(self.completed_at),
            "expires_at": None,
            "size": self.size,
            "seconds": self.seconds,
            "prompt": self.prompt,
            "error": self.error,
            "remixed_from_video_id": None,
            "raydit": {
                "num_frames": self.params["num_frames"],
                "num_inference_steps": self.params["num_inference_steps"],
                "guidance_scale": self.params["guidance_scale"],
                "negative_prompt": self.params["negative_prompt"],
                "seed": self.params["seed"],
                "lora": self.params.get("lora"),
                "guidance_options": self.params.get("guidance_options") or {},
                "fps": self.fps,
                **self.info,
            },
        }


def new_id() -> str:
    return f"video_{secrets.token_hex(12)}"


def valid_id(video_id: str) -> bool:
    return bool(ID_PATTERN.match(video_id))


class VideoStore:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).expanduser().resolve()
        if self.root.exists() and not self.root.is_dir():
            raise ValueError(f"--output-dir {str(self.root)!r} is a file; give a directory (new or existing)")
        try:
            self.root.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise ValueError(f"--output-dir {str(self.root)!r} cannot be a directory of videos "
                             f"({exc.strerror}); give a new or existing directory") from None
        probe = self.root / f".write-test-{os.getpid()}"
        try:
            probe.write_text("")
            probe.unlink()
        except OSError as exc:
            raise ValueError(f"--output-dir {str(self.root)!r} is not writable: {exc.strerror}") from None

    def _path(self, video_id: str, suffix: str) -> Path:
        # Ids are checked by the caller; this is the last line of defence against a path.
        if not valid_id(video_id):
            raise ValueError(f"not a video id: {video_id!r}")
        return self.root / f"{video_id}{suffix}"

    def video_path(self, video_id: str) -> Path:
        return self._path(video_id, ".mp4")

    def image_path(self, video_id: str) -> Path:
        return self._path(video_id, ".input.png")

    def _atomic_write(self, path: Path, data: bytes, durable: bool = True) -> None:
        tmp = path.with_name(path.name + f".tmp-{os.getpid()}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            if durable:
                os.fsync(f.fileno())
        os.replace(tmp, path)

    def save(self, job: VideoJob, durable: bool = True) -> None:
        """Write the job's status atomically. `durable=False` skips the fsync: for a transient
        status (in_progress), whose loss in a crash only means a restart sees the previous
        one (queued) and runs the request again, as it would anyway."""
        self._atomic_write(self._path(job.id, ".json"), json.dumps(asdict(job), indent=1).encode(), durable)

    def save_image(self, video_id: str, png: bytes) -> None:
        self._atomic_write(self.image_path(video_id), png)

    def write_video(self, video_id: str, frames, fps: int, audio=None) -> Path:
        from raydit.runtime.video import write_mp4

        path = self.video_path(video_id)
        write_mp4(str(path), frames, fps=fps, audio=audio)  # atomic: a temporary name, then replaced
        return path

    def delete(self, video_id: str) -> None:
        for suffix in (".json", ".mp4", ".input.png"):
            try:
                self._path(video_id, suffix).unlink()
            except FileNotFoundError:
                pass

    def load_all(self) -> tuple[list[VideoJob], list[str]]:
        """Every stored job, oldest first, and one note per file that could not be used."""
        jobs, notes = [], []
        for path in sorted(self.root.glob("video_*.json")):
            video_id = path.name[: -len(".json")]
            if not valid_id(video_id):
                continue
            try:
                data = json.loads(path.read_text())
                job = VideoJob(**data)
                if job.id != video_id or job.status not in STATUSES:
                    raise ValueError("id or status does not match")
            except (OSError, ValueError, TypeError) as exc:
                notes.append(f"skipped {path.name}: {exc}")
                continue
            if job.status == "completed" and not self.video_path(job.id).is_file():
                job.status, job.progress = "failed", 0
                job.error = {"code": "file_missing", "message": f"{job.id}.mp4 is missing from the output directory"}
                notes.append(f"{job.id}: completed but its mp4 is missing; marked failed")
            jobs.append(job)
        jobs.sort(key=lambda j: (j.created_at, j.id))
        return jobs, notes
