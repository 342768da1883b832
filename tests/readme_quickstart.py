"""Run the quickstart of README.md as written and check what it prints.

Used twice: ``tests/test_readme.py`` runs it with the test environment, and
``make smoke-wheel`` runs it with ``--installed`` in a fresh venv that holds only the built
wheel and what pip resolved for it (no lock), where it also checks that jaxcomp was imported
from that venv and not from the checkout. Run it as a script, not with ``-m``: the checkout
is then not on ``sys.path``.

    python tests/readme_quickstart.py [--installed] [--readme README.md]
"""

from __future__ import annotations

import argparse
import contextlib
import io
import logging
import pathlib
import re
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def quickstart_code(readme: pathlib.Path) -> str:
    """The first ```python block after the ``## Quickstart`` heading."""
    text = readme.read_text()
    section = text.split("\n## Quickstart", 1)[1]
    match = re.search(r"```python\n(.*?)\n```", section, re.S)
    if match is None:
        raise SystemExit(f"{readme}: no ```python block under '## Quickstart'")
    return match.group(1) + "\n"


class _CompileCounter(logging.Handler):
    """Counts jax's "Finished XLA compilation of <name>" log records."""

    def __init__(self, name: str):
        super().__init__(logging.DEBUG)
        self.name, self.count = name, 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        self.count += "XLA compilation of" in message and self.name in message


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--readme", type=pathlib.Path, default=ROOT / "README.md")
    parser.add_argument(
        "--installed", action="store_true", help="jaxcomp must come from outside the checkout"
    )
    args = parser.parse_args(argv)

    import jax

    # Count the XLA compiles of the step: params placed as the step returns them compile once
    # (comm_report's compile is reused by the first call).
    compiles = _CompileCounter("jit(step)")
    logging.getLogger("jax").addHandler(compiles)
    jax.config.update("jax_log_compiles", True)
    out = io.StringIO()
    namespace = {"__name__": "__main__"}
    with contextlib.redirect_stdout(out):
        exec(compile(quickstart_code(args.readme), str(args.readme), "exec"), namespace)
    jax.config.update("jax_log_compiles", False)
    printed = out.getvalue()
    print(printed, end="")

    import jaxcomp

    where = pathlib.Path(jaxcomp.__file__).resolve()
    print(f"jaxcomp {jaxcomp.__version__} from {where}; jax {jax.__version__}; {sys.version}")
    if args.installed and where.is_relative_to(ROOT / "jaxcomp"):
        raise SystemExit(f"jaxcomp was imported from the checkout ({where}), not the wheel")

    loss = re.search(r"loss ([\d.]+) -> ([\d.]+)", printed)
    saving = re.search(r"([\d.]+)x fewer than pmean", printed)
    assert loss and saving, printed
    first, last = map(float, loss.groups())
    assert last < 0.01 * first, f"the quickstart did not learn: {first} -> {last}"
    # sign: 1 bit + a scale per block for w; the 16-float bias goes through plain pmean.
    assert float(saving.group(1)) > 20, printed
    assert jax.device_count() == 8
    assert compiles.count <= 1, f"the step compiled {compiles.count} times"
    print(f"step compiled {compiles.count} time(s)")
    print("quickstart OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
