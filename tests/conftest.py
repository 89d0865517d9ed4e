"""The test tree reads like the package (``ops/``, ``planning/``, ``runtime/``,
``optimizer/``, ``clients/``, ``bench/``, ``train/``). Shared helpers live apart from the
pytest modules: ``support/`` (independent references, the dion fixtures, copies) and
``worlds/`` (the multi-process harness and the per-world case modules it runs). Both are on
``sys.path`` here, so that test modules and the spawned ranks import them by name."""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).parent
for folder in ("support", "worlds"):
    path = str(HERE / folder)
    if path not in sys.path:
        sys.path.insert(0, path)
