"""The ``petfunc`` command line: the parser of its commands and :func:`main`."""

from __future__ import annotations

import argparse
import errno
import signal
import sys
import threading

import torch

from petfunc import allocator
from petfunc.cli import eval as eval_command
from petfunc.cli import export as export_command
from petfunc.cli import train as train_command
from petfunc.trainer import OutOfMemory, TrainingError


COMMANDS = {"train": train_command, "eval": eval_command, "export": export_command}


def parser() -> argparse.ArgumentParser:
    """The parser of ``petfunc COMMAND ...``."""
    top = argparse.ArgumentParser(
        prog="petfunc",
        description="Train and evaluate PET interatomic potentials (pure-functional PyTorch).",
    )
    sub = top.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for command in COMMANDS.values():
        command.add_parser(sub)
    return top


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``petfunc`` command; returns the exit status.

    Errors in options or data print ``petfunc: error: ...`` and return 2; a diverged
    training (NaN/inf loss) returns 1, and so does a full disk (or quota), with one
    line naming the file system and the file kept, and out of memory, with one line
    naming what ran out and what to change; Ctrl-C 130 and SIGTERM 143.
    """
    top = parser()
    args = top.parse_args(argv)
    # a step frees and reallocates the same memory every call: keep it mapped
    allocator.keep_freed_memory()
    if args.threads is not None:
        if args.threads < 1:
            top.error("--threads must be at least 1")
        torch.set_num_threads(args.threads)
    previous = None
    if args.command == "train" and threading.current_thread() is threading.main_thread():
        # SIGTERM (a scheduler, torchrun stopping the other processes when one fails)
        # ends the run as Ctrl-C does: an output folder the run has not written to yet
        # is put back as it was (else another run's options.yaml would stay replaced)
        previous = signal.signal(signal.SIGTERM, terminate)
    try:
        return COMMANDS[args.command].run(args)
    except OutOfMemory as error:
        print(f"petfunc: {error}", file=sys.stderr)
        return 1
    except TrainingError as error:
        print(f"petfunc: training stopped: {error}", file=sys.stderr)
        return 1
    except (ValueError, FileNotFoundError, NotImplementedError, TypeError) as error:
        print(f"petfunc: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        # petfunc's writers say which file system and what was kept; another write
        # (options.yaml, --json) gives the OS's words and the file
        where = f" (writing {error.filename})" if error.filename and error.filename not in str(error) else ""
        print(f"petfunc: error: {error.strerror}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as error:
        wrote = args.command == "train" and not getattr(args, "wrote_nothing", False)
        terminated = isinstance(error, Terminated)
        print(
            f"petfunc: {'terminated' if terminated else 'interrupted'}"
            + (" (the checkpoints written so far are intact)" if wrote else ""),
            file=sys.stderr,
        )
        return 128 + signal.SIGTERM if terminated else 130
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised where the run is, so that its clean-up runs."""


def terminate(signum, frame):
    """The SIGTERM handler of ``petfunc train``: raises :class:`Terminated`."""
    raise Terminated()
