"""torch's error logs of a failed trace: dropped where petfunc's own error explains the
failure, handed on where torch's error is all there is."""

import logging

import pytest
import torch
import torchopt

import petfunc
from petfunc.compile.logs import TRACING_LOGGERS, deferred_torch_errors, raised_by_petfunc
from petfunc.train import TrainState, apply_gradients, trainable


F64 = torch.float64


@pytest.fixture
def torch_errors(caplog):
    """The error records that reach the handlers of torch's tracing loggers (which do
    not propagate to the root logger, where caplog listens)."""
    loggers = [logging.getLogger(name) for name in TRACING_LOGGERS]
    for logger in loggers:
        logger.addHandler(caplog.handler)
    yield lambda: [r for r in caplog.records if r.levelno >= logging.ERROR and r.name in TRACING_LOGGERS]
    for logger in loggers:
        logger.removeHandler(caplog.handler)


def test_logs_of_a_failure_petfunc_explains_are_dropped(torch_errors):
    """An optimizer state made for every parameter, handed to a compiled step as plain
    arguments: the trace fails inside the optimizer update, whose failed operation
    torch logs (twenty lines at error level) before petfunc names the problem."""
    g = torch.Generator().manual_seed(0)
    params = {
        "composition_weights": torch.zeros(2, dtype=F64),
        "energy_scale": torch.ones((), dtype=F64),
        "layers": [
            {"weight": torch.randn(3, 4, generator=g, dtype=F64)},
            {"weight": torch.randn(4, 2, dtype=F64)},
        ],
    }
    adamw = torchopt.adamw(1e-3)
    grads = petfunc.tree.tree_map(torch.ones_like, trainable(params))
    filters = {name: list(logging.getLogger(name).filters) for name in TRACING_LOGGERS}

    def update(params, opt_state, grads):
        return apply_gradients(adamw, TrainState(params, opt_state), grads, None)[0]

    with pytest.raises(ValueError, match="optimizer state was made for every parameter"):
        petfunc.compile(
            update, params, adamw.init(params), grads, backend="aot_eager", static_argnums=(0, 1, 2)
        )
    assert torch_errors() == []
    # the loggers are as they were
    assert {name: logging.getLogger(name).filters for name in TRACING_LOGGERS} == filters


def test_logs_of_torchs_own_error_are_kept(torch_errors):
    def add_in_place(x, y):
        return x.add_(y)

    with pytest.raises(RuntimeError, match="Attempting to broadcast a dimension"):
        petfunc.compile(
            add_in_place, torch.zeros(2, 3), torch.zeros(4, 3), backend="aot_eager", static_argnums=()
        )
    (record,) = torch_errors()
    assert "failed while attempting to run meta for aten.add_" in record.getMessage()


def test_only_petfunc_errors_count_as_explained():
    def raise_here():
        raise ValueError("a test's error")

    try:
        raise_here()
    except ValueError as error:
        assert not raised_by_petfunc(error)
    try:
        petfunc.PETConfig(atomic_types=(1, 300))
    except ValueError as error:
        assert raised_by_petfunc(error)
    try:
        torch.zeros(2) + torch.zeros(3)
    except RuntimeError as error:
        assert not raised_by_petfunc(error)
    # records below error level pass at once; error records wait for the block's end
    logger = logging.getLogger(TRACING_LOGGERS[0])
    seen = []
    handler = logging.Handler()
    handler.emit = lambda record: seen.append(record.getMessage())
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.INFO)
    try:
        with deferred_torch_errors():
            logger.info("info")
            logger.error("error")
            assert seen == ["info"]
        assert seen == ["info", "error"]
        with pytest.raises(ValueError), deferred_torch_errors():
            logger.error("explained")
            petfunc.PETConfig(atomic_types=(1, 300))
        assert seen == ["info", "error"]
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
