"""Data parallelism on torch.distributed (2 gloo processes on CPU,
petfunc.distributed.step): exact equality with the one-process step on the union
batch, checkpoints across world sizes, and ``petfunc train`` under torchrun."""

import os
import subprocess
import sys

import pytest
import torch

import petfunc
import petfunc.distributed as pdist
from petfunc.train import init_state, make_train_step
from tests.helpers import dist_worker as W
from tests.helpers.dist_launch import free_port, launch


RTOL = 1e-10


def _relative(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-300)).item()


def _assert_close(flat, reference, rtol=RTOL):
    assert list(flat) == list(reference)
    worst = max(_relative(flat[k], reference[k]) for k in reference)
    assert worst < rtol, worst
    return worst


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """One process, union batches, the same optimizer: params after 3 and 5 steps."""
    data, w, c, params, optimizer = W.setup()
    step = make_train_step(petfunc.PET(W.CONFIG), optimizer, W.WEIGHTS, grad_clip_norm=1.0)
    state = init_state(params, optimizer)
    losses = []
    out = tmp_path_factory.mktemp("dp")
    for i in range(W.STEPS):
        state, metrics = step(state, W.batch(data, w, c, W.GLOBAL_BATCHES[i]))
        losses.append(float(metrics["loss"]))
        if i + 1 == W.CHECKPOINT_STEP:
            state3 = state
            W.save_state(out / "single.ckpt", state, i + 1, pdist.DistInfo())
    summed_step = make_train_step(petfunc.PET(W.CONFIG), optimizer, W.SUM_WEIGHTS, grad_clip_norm=None)
    summed, summed_losses = init_state(W.setup()[3], optimizer), []
    for i in range(W.SUM_STEPS):
        summed, metrics = summed_step(summed, W.batch(data, w, c, W.GLOBAL_BATCHES[i]))
        summed_losses.append(float(metrics["loss"]))
    return {
        "state3": state3,
        "state5": state,
        "losses": losses,
        "dir": out,
        "setup": (data, w, c, optimizer),
        "summed": summed,
        "summed_losses": summed_losses,
    }


def test_shard_batches_cover_union_with_equal_steps():
    shards = [pdist.shard_batches(W.GLOBAL_BATCHES + [[1]], r, 2) for r in range(2)]
    assert len(shards[0]) == len(shards[1]) == len(W.GLOBAL_BATCHES)  # [1] dropped on both
    for a, b, g in zip(shards[0], shards[1], W.GLOBAL_BATCHES):
        assert list(a) + list(b) == g and (len(a), len(b)) == (3, 2)


def test_one_process_data_parallel_equals_train_step(reference):
    """DataParallel with world size 1 is make_train_step."""
    data, w, c, optimizer = reference["setup"]
    params = W.setup()[3]
    state, _ = W.run(init_state(params, optimizer), optimizer, data, w, c, 0, W.STEPS, pdist.DistInfo())
    _assert_close(petfunc.tree.flatten(state.params), petfunc.tree.flatten(reference["state5"].params))


def test_two_processes_equal_union_batch_and_checkpoints_cross_world_sizes(reference):
    out = reference["dir"]
    results, seconds = launch(["fresh", str(out), str(out / "single.ckpt")])
    for rc, err in results:
        assert rc == 0, err[-3000:]
    ref5 = petfunc.tree.flatten(reference["state5"].params)
    r0 = torch.load(out / "fresh_rank0.pt", weights_only=True)
    r1 = torch.load(out / "fresh_rank1.pt", weights_only=True)
    # identical on both ranks, bit for bit
    assert r0["diff"] == 0.0 and r1["diff"] == 0.0
    for k in r0["params"]:
        assert torch.equal(r0["params"][k], r1["params"][k]), k
    # equal to the one-process run on the union batches (unequal counts per rank)
    worst = _assert_close(r0["params"], ref5)
    print(f"2 ranks vs union batch after {W.STEPS} steps: max relative {worst:.2e} ({seconds:.1f} s)")
    assert max(abs(a - b) / abs(b) for a, b in zip(r0["losses"], reference["losses"])) < RTOL

    # loss terms with reduction "sum" (scaled by the rank's share of the labels, they
    # would be 4e-2 apart). Unclipped, Adam's first steps g/(|g| + 1e-8) lift the
    # round-off of tiny gradient entries to ~1e-10: hence 1e-8
    for rank in range(2):
        summed = torch.load(out / f"sum_rank{rank}.pt", weights_only=True)
        _assert_close(summed["params"], petfunc.tree.flatten(reference["summed"].params), rtol=1e-8)
        assert max(abs(a - b) / abs(b) for a, b in zip(summed["losses"], reference["summed_losses"])) < RTOL

    # 2-process checkpoint (step 3) -> 1 process, 2 more steps
    data, w, c, optimizer = reference["setup"]
    state, step = W.load_state(out / "dp.ckpt", optimizer)
    assert step == W.CHECKPOINT_STEP
    _assert_close(petfunc.tree.flatten(state.params), petfunc.tree.flatten(reference["state3"].params))
    train_step = make_train_step(petfunc.PET(W.CONFIG), optimizer, W.WEIGHTS, grad_clip_norm=1.0)
    for i in range(step, W.STEPS):
        state, _ = train_step(state, W.batch(data, w, c, W.GLOBAL_BATCHES[i]))
    _assert_close(petfunc.tree.flatten(state.params), ref5)

    # 1-process checkpoint (step 3) -> 2 processes, 2 more steps
    for rank in range(2):
        resumed = torch.load(out / f"resumed_rank{rank}.pt", weights_only=True)
        _assert_close(resumed["params"], ref5)


@pytest.mark.slow
def test_petfunc_train_under_torchrun_equals_one_process(tmp_path):
    """``torchrun --nproc_per_node=2 -m petfunc train`` with batch_size B equals the
    one-process run with 2B: the union batches are the same sets, rotated the same
    way (augmentation on), and the validation loss is that of the whole set."""
    import inspect
    import shutil

    import petfunc.cli.train

    if "petfunc.distributed" not in inspect.getsource(petfunc.cli.train):
        pytest.skip("petfunc.cli is not wired to petfunc.distributed")
    torchrun = shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("no torchrun")
    # 40 structures, 5 for validation: an odd count, so the ranks' validation shards
    # differ (3 and 2) and every structure must still be evaluated once
    common = [
        "train",
        "--structures",
        "40",
        "-s",
        "validation_set=0.125",
        "--epochs",
        "2",
        "--dtype",
        "float64",
        "--no-compile",
        "--no-progress",
        "--threads",
        "1",
        "-s",
        "architecture.model.d_pet=8",
        "-s",
        "architecture.model.d_head=8",
        "-s",
        "architecture.model.d_node=16",
        "-s",
        "architecture.model.d_feedforward=16",
        "-s",
        "architecture.model.num_gnn_layers=1",
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    two = subprocess.run(
        [
            torchrun,
            "--nproc_per_node=2",
            "--master_addr=127.0.0.1",
            f"--master_port={free_port()}",
            "-m",
            "petfunc",
            *common,
            "--batch-size",
            "4",
            "-o",
            str(tmp_path / "two"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    one = subprocess.run(
        [sys.executable, "-m", "petfunc", *common, "--batch-size", "8", "-o", str(tmp_path / "one")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr[-3000:]
    a = torch.load(tmp_path / "one" / "last.ckpt", weights_only=True)
    b = torch.load(tmp_path / "two" / "last.ckpt", weights_only=True)
    assert a["step"] == b["step"]
    _assert_close(b["params"], a["params"])
    for row_a, row_b in zip(a["history"], b["history"]):
        for key in (
            "train_loss",
            "train_energy_rmse",
            "train_forces_rmse",
            "train_stress_rmse",
            "val_loss",
            "val_energy_rmse",
            "val_forces_rmse",
            "val_stress_rmse",
        ):
            assert abs(row_a[key] - row_b[key]) <= 1e-10 * abs(row_a[key]), key
    # rank 0 alone wrote: one output folder, no other, and one log of the run
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]
    log = (tmp_path / "two" / "train.log").read_text(encoding="utf-8")
    assert log.count("[INFO] - epoch    2/2 |") == 1 and "; 2 processes" in log
