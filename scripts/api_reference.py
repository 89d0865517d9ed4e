"""Write ``docs/api.md``, the API reference, from the public names' signatures and docstrings.

    python scripts/api_reference.py           # rewrite docs/api.md
    python scripts/api_reference.py --check   # exit 1 if docs/api.md is not what it writes

The public API is listed in :data:`PUBLIC`; everything else is internal. Each entry gets its
signature (``inspect.signature``) and its docstring in plain Markdown: the Sphinx roles and
double backticks of the source become code spans, ``::`` blocks become fenced code. A
module-level constant takes the ``#`` comment above its definition as its description.
``tests/architecture/test_api_reference.py`` regenerates the page and compares, so that the
page cannot drift from the code.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import inspect
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUTPUT = ROOT / "docs" / "api.md"

# (module, names, why it is public). None: the module's __all__.
PUBLIC: tuple[tuple[str, tuple[str, ...] | None, str], ...] = (
    ("shardmuon", None, "the optimizer, its records and the Newton-Schulz functions"),
    ("shardmuon.routing", None, "which parameters Muon takes, in which group"),
    (
        "shardmuon.config",
        ("MuonConfig", "build_optimizer", "build_qk_clip"),
        "the optimizer and QK-clip from one validated config",
    ),
    ("shardmuon.functional", None, "the update on plain tensors, without the optimizer"),
    ("shardmuon.qk_clip", None, "QK-clip (MuonClip)"),
)

INTRO = """\
# API reference

Generated from the code by `scripts/api_reference.py`; do not edit by hand. Rerun the script
after changing a public signature or docstring (`tests/architecture/test_api_reference.py`
fails until then).

The public API is what these modules export; everything else (`shardmuon.ops`,
`shardmuon.planning`, `shardmuon.runtime`, `shardmuon.harness`, `shardmuon.bench`,
`shardmuon.train` and the modules not listed) is internal and may change without notice.
The command line is documented by `shardmuon --help` and in [benchmarks.md](benchmarks.md)
and [training.md](training.md).
"""

# Sphinx roles (``:func:`x` ``, ``:class:`~a.b.C` ``...): the target as a code span; a
# leading "~" shows only its last component, as Sphinx does.
_ROLE = re.compile(r":(?:func|class|mod|meth|attr|data|exc|obj|const|py:\w+):`(~?)([^`]+)`")
_DOUBLE = re.compile(r"``(.+?)``", re.DOTALL)
# A "<" that would open an HTML tag in prose (``<value>``); "<=" and "<-" are left as they are.
_TAG = re.compile(r"<(?=[A-Za-z/!?])")
# An address in memory in a default's repr would change at every run.
_ADDRESS = re.compile(r" at 0x[0-9a-f]+")


def _role(match: re.Match) -> str:
    target = match.group(2)
    if match.group(1):
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


def _inline(text: str) -> str:
    """Roles and double backticks to code spans; a ``<`` that would open an HTML tag
    outside them escaped, so that ``<value>`` in prose stays text."""
    text = _ROLE.sub(_role, text)
    text = _DOUBLE.sub(lambda m: "`" + m.group(1).replace("\n", " ") + "`", text)
    parts = re.split(r"(`[^`]*`)", text)
    return "".join(p if p.startswith("`") else _TAG.sub("&lt;", p) for p in parts)


# Google-style sections: the indented entries under them become a list.
_SECTION = re.compile(r"(Args|Arguments|Returns|Raises|Yields|Attributes):")


def _section(lines: list[str]) -> list[str]:
    """``name: text`` entries (continued on deeper-indented lines) as ``- `name`: text``."""
    indent = min(len(x) - len(x.lstrip()) for x in lines if x.strip())
    items: list[str] = []
    for line in lines:
        if not line.strip():
            continue
        if len(line) - len(line.lstrip()) == indent:
            name, _, text = line.strip().partition(": ")
            items.append(f"- `{name}`: {text}" if text else f"- {name}")
        else:
            items[-1] += " " + line.strip()
    return items


def markdown(doc: str) -> str:
    """A docstring (already dedented) in plain Markdown."""
    out: list[str] = []
    lines = doc.splitlines()
    i = 0
    while i < len(lines):
        line = lines[i]
        if _SECTION.fullmatch(line.strip()) and i + 1 < len(lines) and lines[i + 1][:1] == " ":
            i += 1
            block = []
            while i < len(lines) and (not lines[i].strip() or lines[i][:1] == " "):
                block.append(lines[i])
                i += 1
            out += [f"**{line.strip()}**", "", *_section(block), ""]
            continue
        if line.rstrip().endswith("::"):
            # A literal block follows: the indented lines after a blank one.
            head = line.rstrip()[:-2].rstrip()
            if head:
                out.append(_inline(head) + ":")
            i += 1
            block: list[str] = []
            while i < len(lines) and (not lines[i].strip() or lines[i].startswith((" ", "\t"))):
                block.append(lines[i])
                i += 1
            while block and not block[-1].strip():
                block.pop()
            while block and not block[0].strip():
                block.pop(0)
            out += ["", "```text", *inspect.cleandoc("\n".join(block)).splitlines(), "```", ""]
            continue
        out.append(line)
        i += 1
    text = "\n".join(out)
    # Inline conversion on prose only: the fenced blocks stay as written.
    pieces = re.split(r"(```text\n.*?\n```)", text, flags=re.DOTALL)
    text = "".join(p if p.startswith("```") else _inline(p) for p in pieces)
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def _annotation(annotation: object) -> str:
    if isinstance(annotation, str):  # postponed evaluation: as written in the source
        return annotation
    return inspect.formatannotation(annotation)


def _default(value: object) -> str:
    return _ADDRESS.sub("", repr(value))


def signature(name: str, obj: object, method: bool = False) -> str:
    """``name(a: int, b=1) -> str``, one parameter a line when it does not fit 88 columns.
    ``method``: ``obj`` is a function defined in a class; its ``self`` is left out."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        return f"{name}(...)"
    params = []
    previous = None
    listed = list(sig.parameters.values())[1:] if method else sig.parameters.values()
    for param in listed:
        kind = param.kind
        if kind is param.KEYWORD_ONLY and previous not in (param.VAR_POSITIONAL, kind):
            params.append("*")
        if previous is param.POSITIONAL_ONLY and kind is not param.POSITIONAL_ONLY:
            params.append("/")
        text = {param.VAR_POSITIONAL: "*", param.VAR_KEYWORD: "**"}.get(kind, "") + param.name
        if param.annotation is not param.empty:
            text += f": {_annotation(param.annotation)}"
        if param.default is not param.empty:
            spaced = param.annotation is not param.empty
            text += (" = " if spaced else "=") + _default(param.default)
        params.append(text)
        previous = kind
    if previous is inspect.Parameter.POSITIONAL_ONLY:
        params.append("/")
    tail = ""
    if sig.return_annotation is not sig.empty and not inspect.isclass(obj):
        tail = f" -> {_annotation(sig.return_annotation)}"
    one_line = f"{name}({', '.join(params)}){tail}"
    if len(one_line) <= 88:
        return one_line
    return f"{name}(\n" + "".join(f"    {p},\n" for p in params) + f"){tail}"


def _comment_above(module_name: str, name: str) -> str:
    """The ``#`` comment lines right above ``name``'s assignment in its module."""
    source = inspect.getsource(importlib.import_module(module_name)).splitlines()
    for index, line in enumerate(source):
        if re.match(rf"{re.escape(name)}\s*(:[^=]*)?=", line):
            comments = []
            for above in reversed(source[:index]):
                if not above.startswith("#"):
                    break
                comments.append(above.lstrip("#").strip())
            return " ".join(reversed(comments))
    return ""


def _defining_module(module_name: str, name: str) -> str:
    """Where a re-exported constant is assigned: found through an import of it."""
    module = importlib.import_module(module_name)
    source = inspect.getsource(module)
    match = re.search(rf"from ([\w.]+) import \([^)]*\b{re.escape(name)}\b", source)
    match = match or re.search(rf"from ([\w.]+) import [^\n(]*\b{re.escape(name)}\b", source)
    return match.group(1) if match else module_name


def _constant(module_name: str, name: str, value: object) -> list[str]:
    shown = f"`{name} = {value!r}`"
    if isinstance(value, dict) and len(shown) > 88:
        shown = f"A `dict` with keys {', '.join(f'`{k!r}`' for k in value)}."
    lines = [f"### `{module_name}.{name}`", "", shown]
    comment = _comment_above(_defining_module(module_name, name), name)
    if comment:
        lines += ["", _inline(comment)]
    return [*lines, ""]


def _members(cls: type) -> list[tuple[str, object]]:
    """The public methods and properties ``cls`` defines itself (dataclass fields are in
    its signature), in source order."""
    fields = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    found = []
    for key, value in vars(cls).items():
        if key.startswith("_") or key in fields:
            continue
        if isinstance(value, (staticmethod, classmethod)):
            value = value.__func__
        if inspect.isfunction(value) or isinstance(value, property):
            found.append((key, value))
    return found


def _class(module_name: str, name: str, cls: type) -> list[str]:
    lines = [f"### `{module_name}.{name}`", "", "```python", f"class {signature(name, cls)}"]
    lines += ["```", ""]
    doc = inspect.getdoc(cls)
    if doc:
        lines += [markdown(doc), ""]
    for key, member in _members(cls):
        if isinstance(member, property):
            lines += [f"#### `{name}.{key}` (property)", ""]
            doc = inspect.getdoc(member)
        else:
            method = not isinstance(inspect.getattr_static(cls, key), staticmethod)
            lines += [f"#### `{name}.{key}`", "", "```python"]
            lines += [signature(f"{name}.{key}", member, method), "```", ""]
            doc = inspect.getdoc(member)
        if doc:
            lines += [markdown(doc), ""]
    return lines


def _function(module_name: str, name: str, func: object) -> list[str]:
    lines = [f"### `{module_name}.{name}`", "", "```python", signature(name, func), "```", ""]
    doc = inspect.getdoc(func)
    if doc:
        lines += [markdown(doc), ""]
    return lines


def _anchor(module_name: str) -> str:
    return module_name.replace(".", "")


def render() -> str:
    """The whole page."""
    sections: list[str] = [INTRO, "## Modules", ""]
    for module_name, _, why in PUBLIC:
        sections.append(f"- [`{module_name}`](#{_anchor(module_name)}): {why}")
    sections.append("")
    for module_name, names, _ in PUBLIC:
        module = importlib.import_module(module_name)
        names = names if names is not None else tuple(module.__all__)
        sections += [f"## `{module_name}`", ""]
        doc = inspect.getdoc(module)
        if doc:
            sections += [markdown(doc), ""]
        for name in names:
            obj = getattr(module, name)
            if inspect.isclass(obj):
                sections += _class(module_name, name, obj)
            elif callable(obj):
                sections += _function(module_name, name, obj)
            else:
                sections += _constant(module_name, name, obj)
    return "\n".join(sections).rstrip() + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write docs/api.md from the public API.")
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md is not current")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        if current != text:
            print(f"{OUTPUT} is out of date: run python scripts/api_reference.py", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    print(f"wrote {OUTPUT.relative_to(ROOT)}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
