"""Processes started by SLURM's srun without torchrun (petfunc.distributed.slurm):
the SLURM variables read as metatrain reads them, and a two-task CPU run of
``petfunc train`` started as srun starts it."""

import os
import subprocess
import sys

import pytest
import torch

from petfunc.cli.train import join_processes
from petfunc.distributed import first_host, in_slurm_job, slurm_distributed, slurm_environment
from tests.helpers.dist_launch import free_port


TASK = {"SLURM_JOB_ID": "77", "SLURM_PROCID": "1", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1"}


@pytest.mark.parametrize(
    "nodelist, host",
    [
        ("node17", "node17"),
        ("node[007-009,012]", "node007"),
        ("gpu[3,5-6],cpu1", "gpu3"),
        ("a-b[10-11]c[2-3],x", "a-b10c2"),
        ("nid001234,nid001240", "nid001234"),
    ],
)
def test_first_host_of_a_node_list(nodelist, host):
    assert first_host(nodelist) == host
    hostlist = pytest.importorskip("hostlist")  # metatrain's reader of node lists
    assert hostlist.expand_hostlist(nodelist)[0] == host


def test_slurm_variables_become_torchrun_ones():
    env = dict(TASK, SLURM_JOB_NODELIST="node[02-03]")
    assert slurm_environment(1234, env) == {
        "RANK": "1",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "MASTER_ADDR": "node02",
        "MASTER_PORT": "1234",
    }
    # SLURM_NODELIST when the job's list is not there; a job script's own address kept
    assert slurm_environment(1234, dict(TASK, SLURM_NODELIST="n1"))["MASTER_ADDR"] == "n1"
    chosen = slurm_environment(1234, dict(TASK, MASTER_ADDR="10.0.0.1", MASTER_PORT="99"))
    assert (chosen["MASTER_ADDR"], chosen["MASTER_PORT"]) == ("10.0.0.1", "99")
    with pytest.raises(
        ValueError, match="SLURM_LOCALID, SLURM_JOB_NODELIST not set: start the tasks with srun"
    ):
        slurm_environment(1234, {k: v for k, v in TASK.items() if k != "SLURM_LOCALID"})
    with pytest.raises(ValueError, match="SLURM_NTASKS is 'x', not a number"):
        slurm_environment(1234, dict(TASK, SLURM_NTASKS="x", SLURM_NODELIST="n1"))


def test_when_a_slurm_job_trains_on_several_processes():
    """metatrain's rule: several tasks of a SLURM job unless 'distributed: false'."""
    assert in_slurm_job(TASK) and not in_slurm_job({"SLURM_PROCID": "0"})
    assert slurm_distributed(None, TASK)
    assert not slurm_distributed(None, dict(TASK, SLURM_NTASKS="1"))
    assert not slurm_distributed(None, {})
    assert not slurm_distributed(False, TASK)


def test_distributed_false_keeps_one_process(monkeypatch):
    for name, value in dict(TASK, SLURM_JOB_NODELIST="n1").items():
        monkeypatch.setenv(name, value)
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    options = {"architecture": {"training": {"distributed": False}}}
    assert join_processes(options) == (0, {})
    assert "WORLD_SIZE" not in os.environ
    with pytest.raises(ValueError, match=r"'architecture.training.distributed_port' must be a port number"):
        join_processes({"architecture": {"training": {"distributed_port": "x"}}})


def test_two_srun_tasks_train_one_model(tmp_path):
    """Two ``petfunc train`` processes with the variables srun gives its tasks (no
    torchrun's): they join one process group and train one run."""
    port = free_port()
    out = tmp_path / "run"
    procs = []
    for task in range(2):
        env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
        env.update(
            SLURM_JOB_ID="1",
            SLURM_PROCID=str(task),
            SLURM_LOCALID=str(task),
            SLURM_NTASKS="2",
            SLURM_JOB_NODELIST="localhost",
            OMP_NUM_THREADS="1",
            PETFUNC_DIST_TIMEOUT="60",
        )
        env.pop("MASTER_ADDR", None)
        env.pop("MASTER_PORT", None)
        command = [sys.executable, "-m", "petfunc", "train", "--structures", "12", "--epochs", "1"]
        command += ["--no-progress", "--threads", "1", "-o", str(out), "--device", "cpu"]
        command += ["-r", "architecture.model.d_pet=8", "-r", "architecture.model.num_gnn_layers=1"]
        command += ["-r", f"architecture.training.distributed_port={port}"]
        procs.append(
            subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        )
    results = []
    try:
        for p in procs:
            results.append(p.communicate(timeout=150))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for p, (_, stderr) in zip(procs, results):
        assert p.returncode == 0, stderr[-3000:]
    assert "output folder" in results[0][0] and "output folder" not in results[1][0]  # rank 0 alone logs
    assert torch.load(out / "last.ckpt", weights_only=True)["world_size"] == 2
