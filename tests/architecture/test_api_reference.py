"""``docs/api.md`` is what ``scripts/api_reference.py`` writes from the code today, so that the
API reference cannot drift from the signatures and docstrings; and it covers every public
name."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import shardmuon

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "api_reference.py"
PAGE = ROOT / "docs" / "api.md"


def _script():
    spec = importlib.util.spec_from_file_location("api_reference", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_page_is_what_the_script_writes():
    fresh = _script().render()
    committed = PAGE.read_text()
    assert committed == fresh, (
        "docs/api.md is out of date with the code: run python scripts/api_reference.py"
    )


def test_every_public_name_has_an_entry():
    text = PAGE.read_text()
    missing = [name for name in shardmuon.__all__ if f"### `shardmuon.{name}`" not in text]
    assert not missing, missing
    script = _script()
    for module_name, names, _ in script.PUBLIC:
        module = importlib.import_module(module_name)
        for name in names if names is not None else module.__all__:
            assert f"### `{module_name}.{name}`" in text, f"{module_name}.{name}"


def test_the_page_is_plain_markdown():
    text = PAGE.read_text()
    for markup in ("``", ":func:", ":class:", ":mod:", ":meth:", ":data:", ":attr:"):
        assert markup not in text.replace("```", ""), markup


def test_docstring_markup_becomes_markdown():
    markdown = _script().markdown
    assert markdown("See :func:`shardmuon.routing.build_param_groups`.") == (
        "See `shardmuon.routing.build_param_groups`."
    )
    assert markdown("A :class:`~shardmuon.qk_clip.QKClip` with ``threshold=None``.") == (
        "A `QKClip` with `threshold=None`."
    )
    assert markdown("The rule::\n\n    M <- mu * M + G\n\nThen <value> or x <= 1.") == (
        "The rule:\n\n```text\nM <- mu * M + G\n```\n\nThen &lt;value> or x <= 1."
    )
    assert markdown("Args:\n    lr: the rate,\n        per group.\n    mu: momentum.") == (
        "**Args:**\n\n- `lr`: the rate, per group.\n- `mu`: momentum."
    )
