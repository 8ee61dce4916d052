"""The README's command-line synopses say what the parsers take: every flag named exists,
every flag exists in the synopsis, and the defaults written in it are the commands' own; the
`ray job submit` example sends Ray's token. Pure Python: no Ray started."""

import re
from pathlib import Path

import pytest

from raydit.cli import build_parser
from raydit.runtime.options import command_defaults

README = (Path(__file__).resolve().parents[2] / "README.md").read_text()


ANCHORS = {"generate": "`raydit generate --prompt P [", "serve": "`raydit serve --model M ["}


def _synopsis(command: str) -> str:
    """The one code span (over several lines) that gives the command's every option."""
    start = README.index(ANCHORS[command]) + 1
    return README[start:README.index("`", start)]


def _flags(command: str) -> set[str]:
    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command").choices[command]
    return {f for a in sub._actions for f in a.option_strings if f.startswith("--") and f != "--help"}


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_the_readme_synopsis_names_the_command_s_flags(command):
    named = set(re.findall(r"--[a-z][a-z0-9-]*", _synopsis(command)))
    flags = _flags(command)
    assert named - flags == set(), f"README names flags raydit {command} lacks"
    missing = flags - named - {"--min-replicas"}  # --replicas' other name, said after the synopsis
    assert missing == set(), f"raydit {command} flags the README's synopsis leaves out"


def test_the_serve_defaults_written_in_its_synopsis_are_the_command_s():
    written = dict(re.findall(r"\[--([a-z-]+)\s+(\d+|127\.0\.0\.1)\]", _synopsis("serve")))
    assert written, "no default written in the serve synopsis"
    defaults = command_defaults("serve")
    for flag, value in written.items():
        assert str(defaults[flag.replace("-", "_")]) == value, flag


def test_the_ray_job_submit_example_sends_the_token():
    """The README's and examples/submit_job.sh's: Ray 2.60's `ray job submit` sends ~/.ray/auth_token only with RAY_AUTH_MODE=token; without
    it the head refuses the job (AuthenticationError), on the head's own machine too."""
    example = (Path(__file__).resolve().parents[2] / "examples" / "submit_job.sh").read_text()
    lines = [line for line in (README + "\n" + example).splitlines() if re.search(r"\bray job submit --", line)]
    assert lines
    for line in lines:
        assert "RAY_AUTH_MODE=token ray job submit" in line, line
