"""README.md: short, starts with the two set-up-free commands, and its quickstart runs as
written (in a subprocess: it asks for 8 CPU devices before jax starts, as a user would)."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_readme_is_short_and_starts_with_the_two_commands():
    lines = README.splitlines()
    assert len(lines) <= 150
    assert lines[0].startswith("# jaxcomp")
    first_block = README.split("```bash\n", 1)[1].split("```", 1)[0].splitlines()
    assert [ln.split()[:2] for ln in first_block] == [["make", "demo"], ["make", "test"]]
    assert README.index("make demo") < README.index("## ")  # before any section


def test_readme_names_only_public_api_and_marks_planned_recipes():
    import jaxcomp as jc

    for line in README.splitlines():
        if "planned" in line:
            continue
        for name in re.findall(r"`jc\.(\w+)", line):
            assert hasattr(jc, name), f"README names jc.{name}, which jaxcomp does not export"
    for planned in ("sgd", "onebit_adam", "local_sgd", "diloco", "gossip"):
        if not hasattr(jc, planned):
            row = next(ln for ln in README.splitlines() if f"`jc.{planned}`" in ln)
            assert "planned" in row


def test_readme_links_exist():
    for target in re.findall(r"\]\(([^)#]+)", README):
        if "://" not in target:
            assert (ROOT / target).exists(), target
    # Anchors into the docs, slugged as mkdocs' toc extension does (lower case, words joined
    # by hyphens, punctuation dropped).
    for page, anchor in re.findall(r"\]\(([^)#:]+\.md)#([^)]+)\)", README):
        headings = re.findall(r"^#+ (.+)$", (ROOT / page).read_text(), re.M)
        slugs = {
            re.sub(r"[\s-]+", "-", re.sub(r"[^\w\s-]", "", h).strip().lower()) for h in headings
        }
        assert anchor in slugs, f"{page}#{anchor}"


def test_quickstart_runs_as_written():
    # The README's own settings, on CPU devices as it says (a GPU host would default to its GPU).
    env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"} | {"JAX_PLATFORMS": "cpu"}
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "readme_quickstart.py")],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "quickstart OK" in proc.stdout
