"""The launcher names the rank that failed and exits in the shell's convention (128 + signal)."""

from __future__ import annotations

import io
import signal
import subprocess
import sys

import pytest

from jaxcomp import launch

# Rank 1 fails (as argv[1] says), every other rank succeeds; no jax import: a fast child.
SCRIPT = """
import os, signal, sys
if os.environ["JAXCOMP_PROCESS_ID"] == "1":
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGTERM)
    sys.exit(int(sys.argv[1]))
"""


@pytest.fixture(scope="module")
def script(tmp_path_factory):
    path = tmp_path_factory.mktemp("launch") / "child.py"
    path.write_text(SCRIPT)
    return str(path)


@pytest.mark.parametrize(
    "how, status, said",
    [
        ("0", 0, None),
        ("3", 3, "[launch] rank 1 exited with status 3"),
        ("kill", 128 + signal.SIGTERM, "[launch] rank 1 was killed by signal 15 (SIGTERM)"),
    ],
)
def test_launcher_names_the_failed_rank(script, how, status, said):
    out = io.StringIO()
    assert launch.run([script, how], 3, timeout=60, grace=5, out=out) == status
    if said is None:
        assert "[launch]" not in out.getvalue()
    else:
        assert said in out.getvalue(), out.getvalue()
        assert "rank 0" not in out.getvalue() and "rank 2" not in out.getvalue()


def test_launcher_cli_exits_128_plus_signal(script):
    """``python -m jaxcomp.launch``: the process's own exit status, not ``sys.exit(-15)``'s 241."""
    proc = subprocess.run(
        [sys.executable, "-m", "jaxcomp.launch", "-n", "2", "--grace", "5", script, "kill"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 128 + signal.SIGTERM, proc.stdout + proc.stderr
    assert "rank 1 was killed by signal 15 (SIGTERM)" in proc.stdout


def test_exit_status_convention():
    assert [launch.exit_status(c) for c in (0, 1, 124, -9, -15)] == [0, 1, 124, 137, 143]


@pytest.mark.parametrize(
    "argv,flag",
    [
        (["-n", "0"], "-n/--num-processes"),
        (["--local-devices", "0"], "--local-devices"),
        (["--timeout", "-1"], "--timeout"),
        (["--grace", "nan"], "--grace"),
    ],
)
def test_cli_refuses_bad_numbers_naming_the_flag(script, argv, flag, capsys):
    """Were run()'s ValueError tracebacks ("num_processes must be >= 1")."""
    with pytest.raises(SystemExit) as exit_info:
        launch.main([*argv, script, "0"])
    assert exit_info.value.code == 2 and f"argument {flag}:" in capsys.readouterr().err


def test_cli_refuses_a_script_that_does_not_exist(tmp_path, capsys):
    """Every process used to start and fail alone with "can't open file" (status 2)."""
    with pytest.raises(SystemExit) as exit_info:
        launch.main(["-n", "2", str(tmp_path / "missing.py")])
    assert exit_info.value.code == 2 and "argument script: no such file" in capsys.readouterr().err


def test_cli_starts_a_directory_python_can_run(tmp_path, monkeypatch):
    """``python DIR`` runs ``DIR/__main__.py``, and so do the launched processes: the
    existence check takes a directory (it took files only, refusing it as "no such file")."""
    (tmp_path / "__main__.py").write_text("print('ran')\n")
    started = []
    monkeypatch.setattr(launch, "run", lambda argv, n, **kw: started.append((argv, n)) or 0)
    assert launch.main(["-n", "2", str(tmp_path), "--steps", "3"]) == 0
    assert started == [([str(tmp_path), "--steps", "3"], 2)]
