"""The command line as users run it: `python -m raydit.cli` in a process of its own, or many
refusals in one process.

Each refused command costs a fresh Python importing torch and diffusers (5-10 s on 2 cores, and
several times that while the other stream of the suite runs). `raydit_each` runs a list of
command lines through the same `raydit.cli.main` the console script calls, in one child
process, each with its own stdout and stderr, and reports whether it started Ray.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass

_EACH = r"""
import contextlib, io, json, sys
from raydit.cli import main

results = []
for argv in json.load(sys.stdin):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(argv)
        except SystemExit as exc:  # argparse's refusals
            code = exc.code if isinstance(exc.code, int) else 1
    ray = sys.modules.get("ray")
    results.append({"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue(),
                    "ray_started": bool(ray is not None and ray.is_initialized())})
print("\n" + json.dumps(results))
"""


def raydit(*args, timeout=300, **kw) -> subprocess.CompletedProcess:
    """`python -m raydit.cli ARGS` in a process of its own."""
    return subprocess.run([sys.executable, "-m", "raydit.cli", *args], capture_output=True, text=True,
                          timeout=timeout, **kw)


@dataclass(frozen=True)
class Outcome:
    argv: tuple[str, ...]
    returncode: int
    stdout: str
    stderr: str
    ray_started: bool


def raydit_each(argvs: list[list[str]], timeout=300, **kw) -> list[Outcome]:
    """`raydit.cli.main(argv)` for each argv, one after another in one child process."""
    res = subprocess.run([sys.executable, "-c", _EACH], input=json.dumps(argvs), capture_output=True, text=True,
                         timeout=timeout, **kw)
    if res.returncode != 0:
        raise AssertionError(f"the child running {len(argvs)} command lines failed: {res.stderr[-3000:]}")
    results = json.loads(res.stdout.strip().splitlines()[-1])
    return [Outcome(tuple(a), **r) for a, r in zip(argvs, results)]
