"""Data parallelism on torch.distributed (2 gloo processes on CPU): exact equality with
the one-process step on the union batch, checkpoints across world sizes, failures."""

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import petfunc
import petfunc.distributed as pdist
from petfunc.train import init_state, make_train_step

from helpers import dist_worker as W


WORKER = Path(W.__file__)
RTOL = 1e-10


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(args, world_size=2, timeout=120, extra_env=None, only_rank0=False):
    """torchrun-like: one subprocess per rank; returns [(returncode, stderr)] and seconds.
    ``only_rank0``: stop the other ranks once rank 0 has exited."""
    port = _free_port()
    procs = []
    t0 = time.perf_counter()
    for rank in range(world_size):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            **(extra_env or {}),
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(WORKER), *args],
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    results = []
    try:
        for p in procs:
            remaining = max(1.0, timeout - (time.perf_counter() - t0))
            _, err = p.communicate(timeout=remaining)
            results.append((p.returncode, err))
            if only_rank0:
                break
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return results, time.perf_counter() - t0


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
    results, seconds = _launch(["fresh", str(out), str(out / "single.ckpt")])
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

    # loss terms with reduction "sum" (they were scaled by the rank's share of the
    # labels: 4e-2 apart). Unclipped, Adam's first steps g/(|g| + 1e-8) lift the
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


def test_failing_rank_stops_the_run(tmp_path):
    results, seconds = _launch(
        ["fail", str(tmp_path)],
        timeout=90,
        extra_env={"PETFUNC_TEST_FAIL_RANK": "1", "PETFUNC_DIST_TIMEOUT": "20"},
    )
    (rc0, err0), (rc1, err1) = results
    assert rc1 != 0 and "injected failure on rank 1" in err1
    assert rc0 != 0 and "DistributedError" in err0 and "another rank stopped" in err0, err0[-3000:]
    assert seconds < 80
    print(f"failure detected in {seconds:.1f} s")


def test_stuck_rank_times_out(tmp_path):
    """A rank that never reaches the collective: the others raise after the timeout."""
    results, seconds = _launch(
        ["fail", str(tmp_path)],
        timeout=90,
        only_rank0=True,
        extra_env={"PETFUNC_TEST_HANG_RANK": "1", "PETFUNC_DIST_TIMEOUT": "5"},
    )
    rc0, err0 = results[0]
    assert rc0 != 0 and "DistributedError" in err0 and "5 s timeout" in err0, err0[-3000:]
    assert seconds < 80
    print(f"stuck rank detected in {seconds:.1f} s")


def test_ranks_with_other_options_are_refused(tmp_path):
    """Each rank reads its own options: ranks that disagree (here the learning rate
    and the seed) stop before training with the same error naming the differences;
    they trained a different model without a word."""
    port = _free_port()
    common = [
        sys.executable,
        "-m",
        "petfunc",
        "train",
        "--structures",
        "12",
        "--epochs",
        "1",
        "--no-progress",
        "--threads",
        "1",
        "-o",
        str(tmp_path / "run"),
        "-s",
        "architecture.model.d_pet=8",
        "-s",
        "architecture.model.num_gnn_layers=1",
    ]
    extra = [["--lr", "1e-3"], ["--lr", "3e-3", "--seed", "5"]]
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE="2",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            OMP_NUM_THREADS="1",
            PETFUNC_DIST_TIMEOUT="60",
        )
        procs.append(
            subprocess.Popen(
                common + extra[rank], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
            )
        )
    try:
        errors = [p.communicate(timeout=180)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    for p, err in zip(procs, errors):
        assert p.returncode == 2, err[-2000:]
        assert "the processes do not train the same run" in err, err[-2000:]
    # rank 0 names the differences, the others point to it
    assert "rank 1: seed: 0 -> 5; architecture.training.learning_rate: 0.001 -> 0.003" in errors[0], errors[
        0
    ][-3000:]
    assert "rank 0's error names the differences" in errors[1] and "learning_rate" not in errors[1]
    assert not (tmp_path / "run" / "last.ckpt").exists()


def test_partial_environment_is_an_error():
    """WORLD_SIZE and the rendezvous address without RANK: every process would be
    rank 0 and wait for the others until the timeout, without a word."""
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env.pop("RANK", None)
    done = subprocess.run(
        [sys.executable, "-c", "import petfunc.distributed as d; d.init_from_env(device='cpu')"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "RANK not set: start with torchrun" in done.stderr, done.stderr[-2000:]


@pytest.mark.slow
def test_petfunc_train_under_torchrun_equals_one_process(tmp_path):
    """``torchrun --nproc_per_node=2 -m petfunc train`` with batch_size B equals the
    one-process run with 2B: the union batches are the same sets, rotated the same
    way (augmentation on), and the validation loss is that of the whole set."""
    import inspect
    import shutil

    import petfunc.cli.commands

    if "petfunc.distributed" not in inspect.getsource(petfunc.cli):
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
            f"--master_port={_free_port()}",
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
    # rank 0 alone wrote: one output folder, no other
    assert sorted(p.name for p in tmp_path.iterdir()) == ["one", "two"]
