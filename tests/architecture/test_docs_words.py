"""The documentation speaks of the software, not of how it was made.

README.md, CHANGELOG.md and the Markdown under docs/ (not the raw logs of docs/gpu-runs)
must not name the work process: "brief", "session", "lent", "subagent", "helper" (whole
words, any case, plurals too), tracker numbers ("issue #12", "issues #3", a bare "#12";
an upstream reference such as "microsoft/dion#89" names the other project's tracker and is
kept), or the project's first version as "the seed". "Seed" stays free where it means a
random seed: "--seed", "seed 0", "seed=", "(seed, k)", "a 2-seed sweep", "seeds",
"seeded", "the seed and the step". The rule for it is explicit forms only:
"seed's", "seed" followed by a word for a code base ("seed PR", "seed code", "seed
repo"...), and "the/this/our seed" ending a sentence or followed by a verb of history
("the seed had ...").

A hit names the file, the line and the words; say instead what the thing is ("the
prime-rl PR that replaced dion", "the 2-core CPU machine").
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

_WORDS = r"briefs?|sessions?|lent|subagents?|helpers?"
_CODE_BASE = (
    r"PR|pull request|commit|code|codebase|repo|repository|branch|project|version|"
    r"implementation|tree|work"
)
_HISTORY = r"was|were|had|did|has|shipped|left|used|said|came|wrote|gave|kept|ran"
RULES: tuple[tuple[str, re.Pattern], ...] = (
    ("process word", re.compile(rf"\b(?:{_WORDS})\b", re.IGNORECASE)),
    ("tracker number", re.compile(r"\bissues? #|(?<![\w/&])#\d+", re.IGNORECASE)),
    ("the first version as 'seed'", re.compile(r"\bseed's\b", re.IGNORECASE)),
    (
        "the first version as 'seed'",
        re.compile(rf"\bseed (?:{_CODE_BASE})\b", re.IGNORECASE),
    ),
    (
        "the first version as 'seed'",
        re.compile(rf"\b(?:the|this|our) seed(?=\s*[.;:!?]|\s*$|\s+(?:{_HISTORY})\b)", re.I),
    ),
)


def documents() -> list[Path]:
    found = [ROOT / "README.md", ROOT / "CHANGELOG.md"]
    found += sorted(p for p in (ROOT / "docs").rglob("*.md") if "gpu-runs" not in p.parts)
    return [p for p in found if p.exists()]


def hits(text: str) -> list[tuple[int, str, str]]:
    """``(line number, what, matched words)`` of every rule's match in ``text``."""
    found = []
    for number, line in enumerate(text.splitlines(), 1):
        for what, pattern in RULES:
            found += [(number, what, m.group(0)) for m in pattern.finditer(line)]
    return found


def test_the_documents_are_found():
    names = {p.relative_to(ROOT).as_posix() for p in documents()}
    assert {"README.md", "docs/design.md", "docs/training.md"} <= names, names
    assert not any(n.startswith("docs/gpu-runs/") for n in names)


@pytest.mark.parametrize("path", documents(), ids=lambda p: p.relative_to(ROOT).as_posix())
def test_docs_name_the_software_not_the_work_process(path):
    found = hits(path.read_text())
    where = path.relative_to(ROOT).as_posix()
    assert not found, "\n".join(f"{where}:{n}: {what}: {words!r}" for n, what, words in found)


@pytest.mark.parametrize(
    "text",
    [
        "the seed's README", "the seed PR replaced dion", "code from the seed.",
        "as the seed had it", "a helper ran the tests", "in this session", "none lent",
        "Issue #31's targets", "issues #3 and #4", "(#28)", "a subagent", "In brief,",
    ],
)  # fmt: skip
def test_the_rule_flags_process_words(text):
    assert hits(text), text


@pytest.mark.parametrize(
    "text",
    [
        "--seed 0", "seed 0", "every run has --seeds seeds", "a 2-seed sweep",
        "`(seed, k)`", "a generator seeded with it", "a pure function of the seed and the step",
        "the default's seed range", "random seed", "seed=3", "microsoft/dion#89",
        "## Usage", "lentil", "helpful", "sessionless",
    ],
)  # fmt: skip
def test_the_rule_leaves_random_seeds_and_ordinary_words(text):
    assert not hits(text), hits(text)
