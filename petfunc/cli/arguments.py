"""Argument types and flags the ``petfunc`` commands share."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    """argparse type: an integer of at least 1 (a batch size of -3 read no structure)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value}")
    return value


def add_threads(parser: argparse.ArgumentParser) -> None:
    """The ``--threads N`` flag (torch's CPU threads)."""
    parser.add_argument("--threads", type=positive_int, help="torch CPU threads (default: torch's choice)")
