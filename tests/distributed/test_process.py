"""The process group of data-parallel training (petfunc.distributed.process): a
failing or stuck rank stops the run, ranks with other options are refused, an
incomplete torchrun environment is an error."""

import os
import subprocess
import sys

from tests.helpers.dist_launch import free_port, launch, rank_env


def test_failing_rank_stops_the_run(tmp_path):
    results, seconds = launch(
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
    results, seconds = launch(
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
    and the seed) stop before training with the same error naming the differences,
    rather than train different models without a word."""
    port = free_port()
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
        env = rank_env(rank, 2, port, PETFUNC_DIST_TIMEOUT="60")
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
    env = dict(os.environ, WORLD_SIZE="2", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    env.pop("RANK", None)
    done = subprocess.run(
        [sys.executable, "-c", "import petfunc.distributed as d; d.init_from_env(device='cpu')"],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode != 0 and "RANK not set: start with torchrun" in done.stderr, done.stderr[-2000:]
