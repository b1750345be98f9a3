"""torch's error logs during a trace, held back while petfunc's own error explains them.

When a traced operation fails on fake tensors, torch logs the failure with its
traceback at error level (``fake_tensor.py ... failed while attempting to run meta``,
some twenty lines) before raising. Where petfunc code catches that failure and
raises an error that names the problem (an optimizer state made for other
parameters, say), those lines only bury the explanation. :func:`deferred_torch_errors`
holds back the error records of torch's tracing loggers while a trace runs and
hands them on afterwards, unless the trace ended in a ``ValueError`` or
``TypeError`` raised by petfunc's own code.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from pathlib import Path


#: the loggers that report failures of operations traced by make_fx (fake tensors,
#: symbolic sizes, proxies). A logger's filter sees the records of that logger only,
#: not those its children pass up, so these are the modules' own loggers.
TRACING_LOGGERS = (
    "torch._subclasses.fake_tensor",
    "torch.fx.experimental.symbolic_shapes",
    "torch.fx.experimental.proxy_tensor",
)

#: the folder of the petfunc package
PACKAGE_DIR = Path(__file__).resolve().parents[1]


class HeldRecords(logging.Filter):
    """A logger filter that keeps the records of level ERROR and above back (in
    ``records``) and lets the others through."""

    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno >= logging.ERROR:
            self.records.append(record)
            return False
        return True


def raised_by_petfunc(error: BaseException) -> bool:
    """Whether ``error`` is a ``ValueError`` or ``TypeError`` raised by a ``raise`` in
    petfunc's code (the innermost frame of its traceback is in the package): an error
    petfunc wrote to explain the failure, not one of torch's passed on."""
    if not isinstance(error, (ValueError, TypeError)) or error.__traceback__ is None:
        return False
    frame = error.__traceback__
    while frame.tb_next is not None:
        frame = frame.tb_next
    path = Path(frame.tb_frame.f_code.co_filename).resolve()
    return PACKAGE_DIR in path.parents


@contextlib.contextmanager
def deferred_torch_errors() -> Iterator[None]:
    """Hold back the error records of :data:`TRACING_LOGGERS` inside the block.

    Afterwards they go to their loggers' handlers as they would have, unless the
    block raised an error of petfunc's own (:func:`raised_by_petfunc`), which names
    the problem: they are dropped then. Records below error level pass at once.
    """
    held = HeldRecords()
    loggers = [logging.getLogger(name) for name in TRACING_LOGGERS]
    for logger in loggers:
        logger.addFilter(held)
    explained = False
    try:
        yield
    except BaseException as error:
        explained = raised_by_petfunc(error)
        raise
    finally:
        for logger in loggers:
            logger.removeFilter(held)
        if not explained:
            for record in held.records:
                logging.getLogger(record.name).handle(record)
