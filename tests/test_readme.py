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


def test_codec_table_bits_are_payload_bytes():
    """The codec table's bits per value are ``payload_bytes``' (one scale per block of 256
    or one norm per bucket of 512 aside). Until 2026-11-27 it said "bits" for int_quant and
    ceil(log2(2s+1)) for qsgd: codes of 3, 5, 6 or 7 bits are packed ``32 // bits`` to a
    uint32 word, so int_quant(7) sends 8 bits a value and qsgd(16) 6.4, not 6."""
    import jaxcomp as jc

    d = 1 << 16
    per_value = {b: 8 * jc.int_quant(b).payload_bytes(d) / d - 32 / 256 for b in (3, 4, 5, 6, 7, 8)}
    assert {b: round(v, 2) for b, v in per_value.items()} == {
        3: 3.2,
        4: 4.0,
        5: 5.33,
        6: 6.4,
        7: 8.0,
        8: 8.0,
    }
    assert round(8 * jc.qsgd(16).payload_bytes(d) / d - 32 / 512, 2) == 6.4
    row = next(ln for ln in README.splitlines() if ln.startswith("| `int_quant("))
    assert "3.2 / 5.33 / 6.4 / 8" in row
    assert "(s = 16: 6.4)" in next(ln for ln in README.splitlines() if ln.startswith("| `qsgd("))
