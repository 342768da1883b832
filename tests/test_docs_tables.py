"""The measured tables committed in docs/*.md match benchmarks/results/*.json.

Pure Python (no jax): the tables are rendered by ``docs/hooks/bench_tables.py``; a page whose
committed table differs from what the results give now is stale. The fix for a failure here is
``python -m docs.hooks.bench_tables --write``.
"""

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = sorted(p for p in DOCS.rglob("*.md") if "hooks" not in p.parts)


def _load_hook():
    path = DOCS / "hooks" / "bench_tables.py"
    spec = importlib.util.spec_from_file_location("bench_tables", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


bench_tables = _load_hook()


def test_no_committed_table_is_stale():
    stale = [str(p.relative_to(ROOT)) for p in bench_tables.stale_pages(DOCS)]
    assert stale == [], f"run `{bench_tables.WRITE_COMMAND}`: stale {stale}"


def test_every_marker_holds_its_table():
    for page in PAGES:
        text = page.read_text()
        begins = re.findall(r"^<!--\s*bench:([\w.-]+)\s*-->$", text, re.M)
        ends = re.findall(r"^<!--\s*/bench:([\w.-]+)\s*-->$", text, re.M)
        assert begins == ends, f"{page.name}: a marker without its table"
        for name in begins:
            body = text.split(f"\n<!-- bench:{name} -->\n", 1)[1].split(f"<!-- /bench:{name} -->")[
                0
            ]
            assert "|---|" in body or "No other result files" in body, (page.name, name)
            assert "rendered generically" not in body, (page.name, name)  # a format changed


def test_every_result_file_is_quoted_on_a_page():
    text = "\n".join(p.read_text() for p in PAGES)
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        stem = path.stem.removesuffix("_quick")
        quoted = [f"`benchmarks/results/{stem}{q}.json`" in text for q in ("", "_quick")]
        assert any(quoted), f"{path.name} is on no page: run `{bench_tables.WRITE_COMMAND}`"


def test_render_fills_a_lone_marker_and_finds_an_edited_number():
    page = "Intro.\n\n<!-- bench:wire_bytes -->\n\nAfter.\n"
    out = bench_tables.render_page(page)
    assert out.count("<!-- /bench:wire_bytes -->") == 1 and "| `sign` |" in out
    assert bench_tables.render_page(out) == out  # rendering twice changes nothing
    edited = re.sub(r"\| (\d+\.\d)x", lambda m: f"| {float(m.group(1)) + 1:.1f}x", out, count=1)
    assert edited != out and bench_tables.render_page(edited) == out
    assert bench_tables.on_page_markdown(edited) == edited  # the build hook never rewrites


def test_generic_table_puts_a_column_no_shown_row_carries_beside_it():
    """A key that only rows past the first ``MAX_GENERIC_ROWS`` carry (``convergence.json``'s
    ``seed``, ``program_bytes`` and ``mean_bytes_per_step`` on its re-run fp8 rows) was a
    column of dashes whose figures were never shown: it is a second table of the rows that
    carry it, named by the text columns; a key some shown row carries stays a column."""
    n = bench_tables.MAX_GENERIC_ROWS
    rows = [{"task": "t", "method": f"m{i}", "value": 0.5, "note": None} for i in range(n)]
    rows[1]["shown"] = 7
    rows += [{"task": "t", "method": "late", "value": 0.25, "seed": 3, "program_bytes": 99.0}]
    text = bench_tables._records_table(rows)
    first, second = text.split("Columns that only 1 of the 41 rows carry:")
    assert first.splitlines()[0] == "| task | method | value | note | shown |"
    assert "seed" not in first and f"(first {n} of {n + 1} rows)" in first
    assert second.split("\n\n")[1] == (
        "| task | method | seed | program_bytes |\n|---|---|---|---|\n| t | late | 3 | 99 |"
    )
    assert "Columns that" not in bench_tables._records_table(rows[:n])
