"""Running a Triton kernel on a CPU in tests: a program in a fresh process under Triton's
interpreter (``TRITON_INTERPRET`` is read when Triton is imported, so not in this process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path


def run_interpreted(program: str, folder: Path) -> str:
    """Run ``program`` (Python source) with ``TRITON_INTERPRET=1`` under a 240 s limit; its
    stdout. Raises ``AssertionError`` with its output when it fails."""
    path = folder / "interpret.py"
    path.write_text(program)
    # The tests' support folder importable there too (the program may import a test module).
    paths = [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(p for p in paths if p)}  # fmt: skip
    done = subprocess.run(
        [sys.executable, str(path)], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    return done.stdout
