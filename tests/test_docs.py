"""The docs: every public name documented (math and paper where there is one), every name
on an API page and `mkdocs build --strict` (the benchmark tables: tests/test_docs_tables.py).
"""

import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

import jaxcomp as jc

ROOT = Path(__file__).resolve().parents[1]
API = ROOT / "docs" / "api"

# Public names that implement a method from the literature: their docstring names the paper.
WITH_PAPER = {
    "cast",
    "int_quant",
    "qsgd",
    "terngrad",
    "natural",
    "sign",
    "threshold_2bit",
    "top_k",
    "random_k",
    "threshold",
    "pmean",
    "strategy_bytes",
    "comm_report",
    "CommReport",
    "Codec",
    "compressed_allreduce",
    "dgc",
    "powersgd",
}
PAPER = re.compile(r"et al\.|References|(19|20)\d\d")


def _doc(name: str) -> str:
    obj = getattr(jc, name)
    if inspect.isfunction(obj) or inspect.isclass(obj):
        return inspect.getdoc(obj) or ""
    griffe = pytest.importorskip("griffe")  # module-level constants: attribute docstrings
    pkg = griffe.load("jaxcomp", search_paths=[str(ROOT)])
    doc = pkg[name].docstring
    return doc.value if doc else ""


@pytest.mark.parametrize("name", jc.__all__)
def test_public_name_has_docstring(name):
    doc = _doc(name)
    assert len(doc) >= 60, f"jaxcomp.{name}: docstring missing or one-liner: {doc!r}"
    if name in WITH_PAPER:
        assert PAPER.search(doc), f"jaxcomp.{name}: docstring names no paper"


def _documented_names() -> set[str]:
    names = set()
    for page in API.glob("*.md"):
        text = page.read_text()
        for members in re.findall(r"members:\s*\[([^\]]*)\]", text):
            names |= {m.strip() for m in members.split(",")}
        names |= {m.rsplit(".", 1)[-1] for m in re.findall(r"^::: ([\w.]+)", text, re.M)}
    return names


def test_every_public_name_is_on_an_api_page():
    missing = sorted(set(jc.__all__) - _documented_names())
    assert not missing, f"add to a docs/api/*.md members list: {missing}"


def test_no_text_after_a_closing_code_fence():
    """A fence line with text after a space (docs/api/transforms.md had "``` Without
    `param_specs`, ...") is no closing fence: the paragraph after it rendered as code, and
    mkdocs --strict does not warn."""
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for number, line in enumerate(page.read_text().splitlines(), 1):
            assert not re.match(r"\s*```+\w* +\S", line), f"{page.name}:{number}: {line}"


@pytest.mark.slow
def test_mkdocs_build_strict(tmp_path):
    pytest.importorskip("mkdocs")
    pytest.importorskip("material")
    pytest.importorskip("mkdocstrings_handlers.python")
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        # the search index is left out (mkdocs.yml): no link or anchor is checked there
        env={"NO_MKDOCS_2_WARNING": "1", "PATH": "/usr/bin:/bin", "JAXCOMP_DOCS_SEARCH": "false"},
    )
    assert result.returncode == 0, result.stderr[-4000:]
    html = (tmp_path / "api" / "codecs" / "index.html").read_text()
    assert "int_quant" in html and "Alistarh" in html
    assert (tmp_path / "choosing-a-codec" / "index.html").exists()
