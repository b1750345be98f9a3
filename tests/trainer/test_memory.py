"""Out of memory in a run (CUDA's error, the CPU allocator's, Python's MemoryError):
one OutOfMemory naming the step, batch and its size and what to change; the
checkpoints written before intact; the log closed with the reason."""

import logging

import pytest
import torch

from petfunc.trainer import OutOfMemory, TrainingError, fit
from petfunc.trainer.memory import is_out_of_memory
from petfunc.trainer.runlog import LOG_NAME
from tests.helpers.runlog import (
    ALLOCATOR_ERRORS,
    cpu_out_of_memory,
    cuda_out_of_memory,
    petfunc_handlers,
    raise_in_step,
)
from tests.helpers.trainer import quiet, tiny_options


def test_allocator_errors_are_told_from_others():
    assert is_out_of_memory(cuda_out_of_memory()) and is_out_of_memory(cpu_out_of_memory())
    assert is_out_of_memory(MemoryError()) and is_out_of_memory(torch.cuda.OutOfMemoryError("x"))
    assert is_out_of_memory(RuntimeError("CUDA error: out of memory"))
    for other in (RuntimeError("shape mismatch"), ValueError("out of memory"), TrainingError("NaN")):
        assert not is_out_of_memory(other)


@pytest.mark.parametrize("kind", sorted(ALLOCATOR_ERRORS))
def test_out_of_memory_in_a_step_names_the_batch_and_what_to_change(dataset, tmp_path, monkeypatch, kind):
    run = tmp_path / "run"
    # 3 steps per epoch: the first of epoch 2 fails, after epoch 1's checkpoints
    raise_in_step(monkeypatch, ALLOCATOR_ERRORS[kind], at_call=4)
    with pytest.raises(OutOfMemory) as stopped:
        fit(tiny_options(dataset) | {"base_precision": 64}, run, progress=False, log=quiet())
    message = str(stopped.value)
    assert isinstance(stopped.value, TrainingError) and "\n" not in message
    assert message.startswith(
        "out of memory on the CPU in the training step of epoch 2, batch 1 of 3 (4 structures, "
    )
    assert " atoms, " in message and " edges" in message
    asked = {"cuda": "; it asked for 2.00 GiB more", "cpu": "; it asked for 32.00 GiB more", "python": ""}[
        kind
    ]
    assert f"edges{asked}): lower architecture.training.batch_size (now 4; --batch-size)" in message
    for advice in (
        "remat: true (--remat",
        "float32 (base_precision: 32",
        "smaller architecture.model.cutoff, now 3.0 Å",
    ):
        assert advice in message
    assert isinstance(stopped.value.__cause__, ALLOCATOR_ERRORS[kind]().__class__)
    assert torch.load(run / "last.ckpt", weights_only=True)["epoch"] == 1  # intact
    last = (run / LOG_NAME).read_text(encoding="utf-8").splitlines()[-1]
    assert last.endswith(f"[ERROR] - the run stopped: OutOfMemory: {message}")
    assert not petfunc_handlers() and logging.getLogger("petfunc").level == logging.NOTSET


def test_out_of_memory_in_the_validation(dataset, monkeypatch):
    raise_in_step(monkeypatch, cuda_out_of_memory, validation=True)
    with pytest.raises(OutOfMemory) as stopped:
        fit(tiny_options(dataset, num_epochs=1), None, progress=False, log=quiet())
    message = str(stopped.value)
    assert message.startswith(
        "out of memory on the CPU in the validation after epoch 1, batch 1 of 1 (4 structures"
    )
    # float32 already, validation has no backward pass to recompute
    assert "batch_size (now 4" in message and "remat" not in message and "float32" not in message
