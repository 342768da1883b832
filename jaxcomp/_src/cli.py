"""What jaxcomp's command lines share (``python -m jaxcomp.launch``, ``jaxcomp.autotune``)."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import Any


def bounded(kind: type, low: float, open_low: bool = False) -> Callable[[str], Any]:
    """An argparse ``type``: a finite ``kind`` of the text, at least ``low`` (above it with
    ``open_low``), so that ``-n 0`` or ``--timeout -1`` is a usage error naming the flag
    (exit status 2), not a traceback from the code it reaches."""

    def parse(text: str):
        value = kind(text)
        if not math.isfinite(value) or value < low or (open_low and value == low):
            raise argparse.ArgumentTypeError(
                f"must be finite and {'>' if open_low else '>='} {low}"
            )
        return value

    parse.__name__ = kind.__name__  # argparse says "invalid int value: 'x'"
    return parse
