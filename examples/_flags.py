"""The argparse ``type`` the examples share (a helper module, not an example to run)."""

from __future__ import annotations

import argparse
import math


def bounded(kind: type, low: float, open_low: bool = False):
    """An argparse ``type``: a finite ``kind`` at least ``low`` (above it with ``open_low``),
    so that ``--steps -1`` or ``--lr 0`` is a usage error naming the flag (exit status 2)."""

    def parse(text: str):
        value = kind(text)
        if not math.isfinite(value) or value < low or (open_low and value == low):
            raise argparse.ArgumentTypeError(
                f"must be finite and {'>' if open_low else '>='} {low}"
            )
        return value

    parse.__name__ = kind.__name__  # argparse says "invalid int value: 'x'"
    return parse


class WithDefaults(argparse.RawDescriptionHelpFormatter, argparse.ArgumentDefaultsHelpFormatter):
    """``--help`` shows each flag's default after its help, and the description and
    epilog as written."""
