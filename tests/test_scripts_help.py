"""Every script under examples/ and benchmarks/ answers ``--help`` (exit 0, a usage line).

Examples run as ``python examples/NAME.py``, benchmarks as ``python -m benchmarks.NAME``
from the repository root. The benchmarks' shared modules are not scripts; any other file
must have a ``__main__`` entry point. ``examples/multihost.py`` run directly (outside
``python -m jaxcomp.launch`` and a cluster) exits non-zero and says how to launch it.
The ``--help`` answers come from one process (``tests/scripts/help_all.py``): an import of
jax per script would cost a second or two each.
"""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# Modules of the benchmarks package that other modules import and nobody runs.
HARNESS = {"__init__", "common", "digits_mlp"}
ENV = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_PLATFORMS")}


def _commands() -> dict[str, list[str]]:
    commands = {
        f"examples/{p.name}": [sys.executable, str(p)]
        for p in sorted((ROOT / "examples").glob("*.py"))
    }
    for p in sorted((ROOT / "benchmarks").glob("*.py")):
        if p.stem not in HARNESS:
            commands[f"benchmarks/{p.name}"] = [sys.executable, "-m", f"benchmarks.{p.stem}"]
    return commands


COMMANDS = _commands()


def _run(args: list[str]) -> subprocess.CompletedProcess:
    return subprocess.run(args, cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def helps() -> dict[str, subprocess.CompletedProcess]:
    driver = ROOT / "tests" / "scripts" / "help_all.py"
    proc = _run([sys.executable, str(driver), json.dumps(COMMANDS)])
    assert proc.returncode == 0, proc.stderr[-3000:]
    answers = json.loads(proc.stdout.strip().splitlines()[-1])
    return {name: subprocess.CompletedProcess(COMMANDS[name], **a) for name, a in answers.items()}


def test_every_benchmark_module_is_a_script_or_the_harness():
    for p in (ROOT / "benchmarks").glob("*.py"):
        has_main = 'if __name__ == "__main__":' in p.read_text()
        assert has_main == (p.stem not in HARNESS), p.name


@pytest.mark.parametrize("script", list(COMMANDS))
def test_script_answers_help(helps, script):
    proc = helps[script]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage:"), proc.stdout[:500]
    assert "--" in proc.stdout  # it lists its options


@pytest.mark.parametrize("script", [s for s in COMMANDS if s.startswith("benchmarks/")])
def test_benchmark_help_says_defaults_what_it_writes_and_how_long(helps, script):
    """Every option (but --help) has a help text with its default; the epilog names the files
    a run overwrites (or that it writes none) and how long it takes."""
    text = helps[script].stdout
    options = re.findall(r"^  -", text, re.M)
    assert text.count("(default:") == len(options) - 1, text
    out = " ".join(text.split())
    assert "Writes " in out and ("Takes " in out or " take " in out), out[-600:]


def test_multihost_run_directly_says_how_to_launch():
    proc = _run([sys.executable, str(ROOT / "examples" / "multihost.py"), "--steps", "1"])
    assert proc.returncode != 0
    assert "python -m jaxcomp.launch -n 2 examples/multihost.py" in proc.stderr
    assert "Traceback" not in proc.stderr
