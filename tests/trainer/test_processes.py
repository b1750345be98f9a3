"""A run shared by processes: the split step equals the fused one, the checks of
rank, world size and hooks.
"""

import pytest

from petfunc.trainer import fit
from petfunc.trainer.processes import processes
from tests.helpers.trainer import params_equal, quiet, tiny_options


def test_split_step_matches_fused(dataset, tmp_path):
    # grad_step + reduce_grads + apply_gradients (the data-parallel path) == train_step.
    options = tiny_options(dataset, num_epochs=1)
    options["base_precision"] = 64
    calls = []

    def reduce_grads(grads):
        calls.append(1)
        return grads

    fused = fit(options, None, progress=False, log=quiet())
    split = fit(options, None, progress=False, log=quiet(), reduce_grads=reduce_grads)
    assert len(calls) == 3
    assert params_equal(fused.last_params, split.last_params)


def test_too_few_structures_for_the_processes(dataset, tmp_path):
    # 3 structures (2 for training) and 3 processes: an error before any step, not
    # "0 steps per epoch", a NaN loss and untrained checkpoints
    import ase.io

    small = tmp_path / "three.xyz"
    ase.io.write(small, ase.io.read(dataset, ":3"))
    options = tiny_options(small, batch_size=1)
    options["validation_set"] = 0.34
    with pytest.raises(ValueError, match="2 training structure.*cannot be shared by 3 processes"):
        fit(
            options,
            tmp_path / "out",
            progress=False,
            log=quiet(),
            rank=0,
            world_size=3,
            reduce_grads=lambda g: g,
            reduce_metrics=lambda m: m,
        )
    assert not (tmp_path / "out" / "last.ckpt").exists()


def test_several_processes_need_a_process_group(dataset):
    """fit(world_size=2) without torch.distributed and without the hooks trained
    each process alone on its shard of every batch, without a word."""
    options = tiny_options(dataset, num_epochs=1)
    with pytest.raises(ValueError, match=r"fit\(world_size=2\) needs a torch.distributed process group of 2"):
        fit(options, None, progress=False, log=quiet(), rank=1, world_size=2)
    with pytest.raises(ValueError, match="reduce_grads and reduce_metrics"):
        fit(options, None, progress=False, log=quiet(), rank=1, world_size=2, reduce_grads=lambda g: g)
    for rank, world_size in ((2, 2), (0, 0), (-1, 2)):
        with pytest.raises(
            ValueError, match=rf"fit\(rank={rank}, world_size={world_size}\): need 0 <= rank < world_size"
        ):
            fit(
                options,
                None,
                progress=False,
                log=quiet(),
                rank=rank,
                world_size=world_size,
                reduce_grads=lambda g: g,
                reduce_metrics=lambda m: m,
            )


def test_processes_say_which_step_a_run_takes():
    """Without a process group: one process takes the fused step; a reduce_grads hook
    or several processes (with both hooks) split it; only rank 0 writes."""
    one = processes()
    assert (one.rank, one.world_size, one.reduce_grads) == (0, 1, None)
    assert one.is_main and not one.split_step and not one.data_parallel
    assert one.reduce_metrics({"loss": 2.0}) == {"loss": 2.0}
    one.check_same_run({"seed": 1})  # one process: nothing to compare with

    def hook(value):
        return value

    hooked = processes(reduce_grads=hook)
    assert hooked.split_step and not hooked.data_parallel and hooked.reduce_grads is hook
    second = processes(1, 2, hook, hook)
    assert not second.is_main and second.split_step and not second.data_parallel
    assert second.reduce_metrics is hook
