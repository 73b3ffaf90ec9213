"""Argument types the benchmark scripts share: a bad size or ratio is refused by argparse, in
one line naming the option, before anything is prepared or timed."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """An integer >= 1 (an argparse type).

    Raises:
        argparse.ArgumentTypeError: a smaller integer (argparse reports a non-integer itself).
    """
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is not >= 1")
    return value


def fraction(text: str) -> float:
    """A number in (0, 1] (an argparse type).

    Raises:
        argparse.ArgumentTypeError: a number outside (0, 1].
    """
    value = float(text)
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"{value} is not in (0, 1]")
    return value
