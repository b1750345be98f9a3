"""Shared setup of the data-parallel tests (tests/distributed/), and their worker process.

Run as ``python tests/helpers/dist_worker.py SCENARIO OUT_DIR [CHECKPOINT]`` with torchrun's
environment variables (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT) set.
"""

import os
import sys
import time

import ase.build
import numpy as np
import torch
import torch.distributed as dist
from ase.calculators.emt import EMT

import petfunc
import petfunc.distributed as pdist
from petfunc.data import make_batch, sample_from_atoms
from petfunc.io.checkpoint import model_of, read_checkpoint, state_from_plain, write_checkpoint
from petfunc.train import (
    LossTerm,
    LossWeights,
    TrainState,
    init_state,
    make_optimizer,
    pack_state,
    trainable,
    warmup_cosine,
)


CONFIG = petfunc.PETConfig(
    atomic_types=(13, 29),
    cutoff=4.0,
    d_pet=8,
    d_node=16,
    d_head=8,
    d_feedforward=16,
    num_heads=2,
    num_gnn_layers=1,
    num_attention_layers=1,
)
DTYPE = torch.float64
WEIGHTS = LossWeights.make(energy=1.0, forces=1.0, stress=0.5)
# summed terms next to a mean one: a summed term's ranks add up with factor 1
SUM_WEIGHTS = LossWeights(
    LossTerm(1.0, reduction="sum"), LossTerm(1.0, "huber", delta=0.05, reduction="sum"), LossTerm(0.5)
)
SUM_STEPS = 2
# global batches of 5 structures: rank 0 gets 3, rank 1 gets 2 (4- and 8-atom cells,
# one structure without forces): unequal structure, atom and label counts per rank
GLOBAL_BATCHES = [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [2, 7, 4, 9, 0], [1, 3, 5, 6, 8], [9, 8, 7, 6, 5]]
STEPS = 5
CHECKPOINT_STEP = 3


def samples():
    rng = np.random.default_rng(0)
    out = []
    for k in range(10):
        atoms = ase.build.bulk("Cu", "fcc", a=3.6, cubic=True).repeat((1, 1, 1 + (k * 7 % 3 == 0)))
        atoms.numbers[rng.random(len(atoms)) < 0.3] = 13
        atoms.rattle(0.1, seed=int(rng.integers(1 << 30)))
        atoms.calc = EMT()
        atoms.get_stress()
        sample = sample_from_atoms(atoms, CONFIG)
        if k == 3:
            sample.forces = None  # a structure without force labels
        out.append(sample)
    return out


def setup():
    data = samples()
    w = petfunc.data.fit_composition(data, CONFIG.num_species)
    c = petfunc.data.fit_scale(data, w)
    params = petfunc.PET(CONFIG).init(seed=1, dtype=DTYPE)
    params["composition_weights"] = torch.tensor(w, dtype=DTYPE)
    params["energy_scale"] = torch.tensor(c, dtype=DTYPE)
    optimizer = make_optimizer(warmup_cosine(1e-2, 20, 0.1))
    return data, w, c, params, optimizer


def save_state(path, state, step, info):
    """Rank 0 writes ``state`` after ``step`` steps as a training checkpoint (the one
    format ``petfunc train`` writes and restarts from); every rank then waits."""
    if info.is_main:
        write_checkpoint(
            path,
            config=CONFIG,
            params=state.params,
            opt_state=state.opt_state,
            epoch=0,
            step=step,
            best_epoch=0,
            best_metric=float("inf"),
            best_params=None,
            composition=state.params["composition_weights"],
            energy_scale=float(state.params["energy_scale"]),
            dtype=DTYPE,
            seed=0,
            options={},
            history=[],
            split={},
            world_size=info.world_size,
            version=petfunc.__version__,
        )
    if info.distributed:
        dist.barrier()


def load_state(path, optimizer):
    """``(state, step)`` of :func:`save_state`'s checkpoint, for any number of processes."""
    payload = read_checkpoint(path)
    _, params = model_of(payload, "last")
    opt_state = state_from_plain(payload["opt_state"], optimizer.init(trainable(params)))
    return pack_state(TrainState(params, opt_state)), int(payload["step"])


def difference_from_rank0(params, info) -> float:
    """Largest absolute difference of ``params`` from rank 0's (0 on one process)."""
    if not info.distributed:
        return 0.0
    flat = torch.cat([t.reshape(-1) for t in petfunc.tree.flatten(params).values()])
    reference = flat.clone()
    dist.broadcast(reference, src=0)
    return float((flat - reference).abs().max())


def batch(data, w, c, indices):
    return make_batch([data[i] for i in indices], CONFIG, w, c, dtype=DTYPE)


def run(
    state,
    optimizer,
    data,
    w,
    c,
    first,
    last,
    info,
    out=None,
    checkpoint=None,
    weights=WEIGHTS,
    grad_clip_norm=1.0,
):
    """Steps ``first..last-1`` (each rank on its shard); optional checkpoint."""
    dp = pdist.DataParallel(petfunc.PET(CONFIG), optimizer, weights, grad_clip_norm=grad_clip_norm, info=info)
    shards = pdist.shard_batches(GLOBAL_BATCHES, info.rank, info.world_size)
    losses = []
    for step in range(first, last):
        if os.environ.get("PETFUNC_TEST_FAIL_RANK") == str(info.rank) and step == 1:
            raise RuntimeError(f"injected failure on rank {info.rank}")
        if os.environ.get("PETFUNC_TEST_HANG_RANK") == str(info.rank) and step == 1:
            time.sleep(300)  # a stuck rank (alive, never reaching the collective)
        state, metrics = dp.step(state, batch(data, w, c, shards[step]))
        losses.append(float(metrics["loss"]))
        if checkpoint is not None and step + 1 == CHECKPOINT_STEP:
            save_state(checkpoint, state, step + 1, info)
    return state, losses


def main():
    torch.set_num_threads(1)
    scenario, out_dir = sys.argv[1], sys.argv[2]
    info = pdist.init_from_env(device="cpu", timeout_s=float(os.environ.get("PETFUNC_DIST_TIMEOUT", 30)))
    data, w, c, params, optimizer = setup()
    try:
        if scenario == "fresh":
            # 5 steps from scratch, checkpoint (rank 0) after step 3
            state, losses = run(
                init_state(params, optimizer),
                optimizer,
                data,
                w,
                c,
                0,
                STEPS,
                info,
                checkpoint=os.path.join(out_dir, "dp.ckpt"),
            )
            torch.save(
                {
                    "params": petfunc.tree.flatten(state.params),
                    "losses": losses,
                    "diff": difference_from_rank0(state.params, info),
                },
                os.path.join(out_dir, f"fresh_rank{info.rank}.pt"),
            )
            # resume the one-process checkpoint in this 2-process run
            state, step = load_state(sys.argv[3], optimizer)
            state, _ = run(state, optimizer, data, w, c, step, STEPS, info)
            torch.save(
                {"params": petfunc.tree.flatten(state.params)},
                os.path.join(out_dir, f"resumed_rank{info.rank}.pt"),
            )
            # summed loss terms, unclipped (a clip would hide a wrong scale of the gradient)
            state, losses = run(
                init_state(setup()[3], optimizer),
                optimizer,
                data,
                w,
                c,
                0,
                SUM_STEPS,
                info,
                weights=SUM_WEIGHTS,
                grad_clip_norm=None,
            )
            torch.save(
                {"params": petfunc.tree.flatten(state.params), "losses": losses},
                os.path.join(out_dir, f"sum_rank{info.rank}.pt"),
            )
        elif scenario == "fail":
            run(init_state(params, optimizer), optimizer, data, w, c, 0, STEPS, info)
    except BaseException:
        pdist.shutdown(wait_for_all=False)  # the other rank may never come
        raise
    pdist.shutdown()


if __name__ == "__main__":
    main()
