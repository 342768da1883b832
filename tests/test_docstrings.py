"""Docstrings against the code: every public function's ``Args:`` names its parameters (no
more, no fewer) and every public class's ``Attributes:`` its fields, its ``Raises:`` names the
errors docs/errors.md lists for it (at construction, or at the call), the API overview
(docs/api/index.md) lists every public name on the page that renders it (tests/test_docs.py
checks that each name is on some page), and the overview's table of defaults that differ from
the design is the code's.
"""

import dataclasses
import inspect
import re
from pathlib import Path

import pytest

import jaxcomp as jc

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api"
ERRORS = ROOT / "docs" / "errors.md"

FUNCTIONS = sorted(n for n in jc.__all__ if inspect.isfunction(getattr(jc, n)))


def section(doc: str, title: str) -> str | None:
    """The body of a Google-style section (``Args:`` ...), or None where it is missing."""
    match = re.search(rf"^{title}:\n((?:[ \t]+.*\n|[ \t]*\n)*)", doc + "\n", re.M)
    return match.group(1) if match else None


def entries(body: str) -> dict[str, str]:
    """``{name: text}`` of a section's two-space-indented ``name: text`` entries."""
    found = {}
    for match in re.finditer(r"^  (\*{0,2}\w+)(?: \([^)]*\))?:(.*(?:\n    .*)*)", body, re.M):
        found[match.group(1).lstrip("*")] = match.group(2)
    return found


def test_section_parser():
    doc = "Sum.\n\nArgs:\n  x: a value\n    on two lines.\n  *rest: more.\n\nReturns:\n  y.\n"
    assert entries(section(doc, "Args")) == {"x": " a value\n    on two lines.", "rest": " more."}
    assert section(doc, "Raises") is None


@pytest.mark.parametrize("name", FUNCTIONS)
def test_args_name_every_parameter(name):
    params = list(inspect.signature(getattr(jc, name)).parameters)
    doc = inspect.getdoc(getattr(jc, name)) or ""
    body = section(doc, "Args")
    if not params:
        assert body is None, f"jaxcomp.{name} takes no arguments but documents Args"
        return
    assert body is not None, f"jaxcomp.{name}: no Args section for {params}"
    documented = list(entries(body))
    assert sorted(documented) == sorted(params), (
        f"jaxcomp.{name}: Args {documented} against the signature's {params}"
    )


CLASSES = sorted(n for n in jc.__all__ if inspect.isclass(getattr(jc, n)))


def fields(cls: type) -> list[str]:
    """A NamedTuple's or dataclass's fields; for another class, its ``__init__``'s arguments."""
    if hasattr(cls, "_fields"):
        return list(cls._fields)
    if dataclasses.is_dataclass(cls):
        return [f.name for f in dataclasses.fields(cls)]
    return [p for p in inspect.signature(cls.__init__).parameters if p != "self"]


@pytest.mark.parametrize("name", CLASSES)
def test_attributes_name_every_field(name):
    cls = getattr(jc, name)
    names = fields(cls)
    doc = inspect.getdoc(cls) or ""
    body = section(doc, "Attributes") or section(doc, "Args")
    if not names:
        return
    assert body is not None, f"jaxcomp.{name}: no Attributes (or Args) section for {names}"
    documented = list(entries(body))
    assert sorted(documented) == sorted(names), f"jaxcomp.{name}: {documented} against {names}"


def construction_rows() -> dict[str, dict[str, list[str]]]:
    """``{function: {error type: [arguments]}}`` of docs/errors.md's rows whose function cell
    names public functions: the construction-time rows, and the trace-time rows of a call
    itself (``jc.pmean(...)`` inside ``shard_map``; rows of a transform's ``(update)`` are
    not its factory's). ``OverlappedStep.__call__``, ``launch.run`` and the like are
    documented on their own pages."""
    text = ERRORS.read_text().split("## Construction time", 1)[1].split("\n## Not raised", 1)[0]
    rows: dict[str, dict[str, list[str]]] = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|") or len(cells) != 4 or cells[0] in ("function", "---"):
            continue
        if "(" in cells[0]:  # (update), (init/update), (every timed candidate failed)
            continue
        argument = cells[1].strip("`")
        for function in re.findall(r"`([\w.]+)`", cells[0]):
            if function not in FUNCTIONS:
                continue
            for error in ("ValueError", "TypeError"):
                if error in cells[3]:
                    rows.setdefault(function, {}).setdefault(error, []).append(argument)
    return rows


ROWS = construction_rows()


def test_errors_page_has_construction_rows():
    assert len(ROWS) >= 30, sorted(ROWS)
    assert ROWS["int_quant"] == {"ValueError": ["bits", "block_size"]} | {
        "TypeError": ["bits", "block_size", "stochastic"]
    }


@pytest.mark.parametrize("name", sorted(ROWS))
def test_raises_names_the_errors_of_its_rows(name):
    doc = inspect.getdoc(getattr(jc, name)) or ""
    body = section(doc, "Raises")
    assert body is not None, f"jaxcomp.{name}: no Raises section; docs/errors.md: {ROWS[name]}"
    documented = entries(body)
    for error, arguments in ROWS[name].items():
        assert error in documented, f"jaxcomp.{name}: Raises lacks {error} ({arguments})"
        missing = [a for a in arguments if f"``{a}``" not in documented[error]]
        assert not missing, f"jaxcomp.{name}: Raises {error} does not name {missing}"


def rendered_names(page: Path) -> set[str]:
    """The public names a docs/api page renders (``::: object`` and its ``members:``)."""
    text = page.read_text()
    names = {m.rsplit(".", 1)[-1] for m in re.findall(r"^::: ([\w.]+)", text, re.M)}
    for members in re.findall(r"members:\s*\[([^\]]*)\]", text):
        names |= {m.strip() for m in members.split(",")}
    return names & set(jc.__all__)


def test_api_overview_lists_each_page_names():
    rows = re.findall(
        r"^\| \[[^\]]+\]\((\w[\w-]*\.md)\) \| (.*) \|$", (API / "index.md").read_text(), re.M
    )
    listed = {page: set(re.findall(r"`(\w+)`", names)) & set(jc.__all__) for page, names in rows}
    pages = {p.name for p in API.glob("*.md")} - {"index.md"}
    assert set(listed) == pages, f"pages without an overview row: {sorted(pages - set(listed))}"
    for page, names in listed.items():
        rendered = rendered_names(API / page)
        assert names == rendered, (
            f"docs/api/index.md's row for {page}: lists {sorted(names - rendered)} it does not "
            f"render, misses {sorted(rendered - names)}"
        )


def test_design_deviations_table_matches_the_defaults():
    """docs/api/index.md's table of defaults that differ from the design: the code's column
    is each argument's default today (a default changed back, or changed again, shows)."""
    text = (API / "index.md").read_text().split("## Defaults that differ from the design", 1)[1]
    rows = re.findall(r"^\| `(\w+)` \| `(\w+)` \| `([^`]+)` \| `([^`]+)` \|", text, re.M)
    assert len(rows) == 6, rows
    for name, argument, design, code in rows:
        default = inspect.signature(getattr(jc, name)).parameters[argument].default
        assert repr(default).replace("'", '"') == code, (name, argument, default)
        assert code != design


def test_api_overview_names_the_rendered_helpers_that_are_not_public():
    """A page's ``members:`` outside ``jc.__all__`` are named in the overview as ``jaxcomp._src``
    helpers (Autotune's, which its own page introduces, and the Codec class's methods aside)."""
    index = (API / "index.md").read_text()
    note = index.split("Only the names in this table are public", 1)[1].split("\n\n", 1)[0]
    for page in API.glob("*.md"):
        text = page.read_text()
        for module, members in re.findall(
            r"^::: ([\w.]+)\n(?:.*\n){0,4}?\s*members: \[([^\]]*)\]", text, re.M
        ):
            if not module.startswith("jaxcomp._src") or module.endswith(
                (".Codec", "autotune", "autotune_steps")
            ):
                continue
            extra = [m.strip() for m in members.split(",") if m.strip() not in jc.__all__]
            missing = [m for m in extra if f"`{m}`" not in note]
            assert not missing, f"{page.name} renders {missing}: name them in docs/api/index.md"
