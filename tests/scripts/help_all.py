"""Ask every script for ``--help`` in ONE process and print the answers as JSON.

``python tests/scripts/help_all.py CMD_JSON`` where CMD_JSON maps a name to the command a
user types (``[python, examples/x.py]`` or ``[python, -m, benchmarks.x]``). Each script runs
as its command would run it (``runpy`` with ``__main__``, ``sys.argv`` and ``sys.path[0]``
as Python sets them) with ``--help`` appended (``--as-given``: nothing appended, for flags
argparse refuses; a script still running after ``AS_GIVEN_SECONDS`` got past its argument
checks and is stopped, exit code 1; ``--parse-only``: as given, and a parse that leaves no
argument over stops the script with exit code 0 before it runs anything, for the command
lines the docs quote); its stdout, stderr and exit code are kept.
One process imports jax, flax and the harness once instead of once per script: the
scripts' ``--help`` paths never touch a device, so they do not disturb each other.
"""

import argparse
import contextlib
import io
import json
import runpy
import signal
import sys

#: ``--as-given``: seconds a script may run before it counts as having accepted its flags.
AS_GIVEN_SECONDS = 20
#: ``--parse-only``: a complete parse stops the script (exit code 0).
PARSE_ONLY = "--parse-only" in sys.argv[2:]


class _Parsed(Exception):
    """A parse with no argument left over (``--parse-only``): the command line is valid."""


def _parse_only() -> None:
    """Make every complete parse stop the script: ``parse_args`` goes through
    ``parse_known_args``; a parser that leaves arguments over (a front parser passing the
    rest to another, as ``benchmarks.lm_diloco`` does to ``benchmarks.lm``) returns them."""
    known = argparse.ArgumentParser.parse_known_args

    def parse_known_args(self, args=None, namespace=None):
        namespace, extras = known(self, args, namespace)
        if not extras:
            raise _Parsed
        return namespace, extras

    argparse.ArgumentParser.parse_known_args = parse_known_args


def _stop(signum, frame):
    raise TimeoutError(f"still running after {AS_GIVEN_SECONDS} s: the flags were accepted")


def _answer(command: list[str], extra: tuple[str, ...] = ("--help",)) -> dict:
    out, err = io.StringIO(), io.StringIO()
    is_module = command[1] == "-m"
    target = command[2] if is_module else command[1]
    argv, path = sys.argv[:], sys.path[:]
    sys.argv = [target, *command[3 if is_module else 2 :], *extra]
    if not is_module:
        sys.path.insert(0, target.rsplit("/", 1)[0])
    code = 0
    if not extra:
        signal.signal(signal.SIGALRM, _stop)
        signal.alarm(AS_GIVEN_SECONDS)
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            if is_module:
                runpy.run_module(target, run_name="__main__", alter_sys=True)
            else:
                runpy.run_path(target, run_name="__main__")
            if PARSE_ONLY:  # it ran without a complete parse (and may have written files)
                print("ran to its end without a parse that stopped it", file=err)
                code = 1
        except _Parsed:
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException as e:  # noqa: BLE001 - reported to the test, like a crash
            print(f"{type(e).__name__}: {e}", file=err)
            code = 1
        finally:
            signal.alarm(0)
    sys.argv, sys.path[:] = argv, path
    return {"returncode": code, "stdout": out.getvalue(), "stderr": err.getvalue()}


def _import_shared() -> None:
    """Import what the scripts share before any of them runs: under a load of 25 on 2 cores
    the first script's imports alone outlasted ``AS_GIVEN_SECONDS``, and the alarm left jax
    half-imported for every script after it (``module 'jax' has no attribute 'core'``)."""
    import importlib

    for name in ("jax", "jax.numpy", "optax", "flax.nnx", "jaxcomp", "benchmarks.common"):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


if __name__ == "__main__":
    commands = json.loads(sys.argv[1])
    _import_shared()
    given = {"--as-given", "--parse-only"} & set(sys.argv[2:])
    extra = () if given else ("--help",)
    if PARSE_ONLY:
        _parse_only()
    print(json.dumps({name: _answer(cmd, extra) for name, cmd in commands.items()}))
