"""The Hessian-training setup shared by tests/train/test_hessian_loss.py and the
fused-attention tests: the smallest PET, batches labelled with a teacher's
Hessian-vector products, and the check of the compiled gradient step."""

import torch

import petfunc
from petfunc.hessian import hessian
from petfunc.train.hessian_loss import hessian_batch, hvp_targets, make_hessian_grad_step
from tests.helpers import toy


F64 = torch.float64
MINI = petfunc.PETConfig(
    atomic_types=(1, 6, 7, 8),
    d_pet=4,
    d_node=4,
    d_head=4,
    d_feedforward=4,
    num_heads=1,
    cutoff=4.0,
    num_gnn_layers=1,
    num_attention_layers=1,
    activation="SiLU",
)


WEIGHTS = petfunc.LossWeights.make(1.0, 10.0, 1.0)


def hessian_batch_of(energy_fn, teacher, n, seed, n_probes=2, config=MINI):
    """EMT energies/forces/stress plus HVP labels from a teacher's Hessian."""
    batch = toy.labelled_batch(config, n, seed)
    g = torch.Generator().manual_seed(seed)
    directions = torch.randn((n_probes,) + tuple(batch.positions.shape), generator=g, dtype=F64)
    h = hessian(energy_fn)(teacher, batch.positions, batch.cell, batch.neighbors)
    return hessian_batch(batch, directions, hvp_targets(h, directions))


def check_compiled(energy_fn, params, teacher, backend):
    """The compiled Hessian-loss gradient step equals eager (1e-9) on three batches of
    other sizes, from one graph; returns the largest relative error."""
    grad_step = make_hessian_grad_step(energy_fn, WEIGHTS, hvp_weight=2.0)
    batches = [hessian_batch_of(energy_fn, teacher, n, seed) for n, seed in [(3, 0), (2, 1), (4, 2)]]
    compiled = petfunc.compile(grad_step, params, batches[0], backend=backend)
    worst = 0.0
    for hb in batches:
        out, ref = compiled(params, hb), grad_step(params, hb)
        for a, b in zip(petfunc.tree.tree_leaves(out), petfunc.tree.tree_leaves(ref)):
            worst = max(worst, float((a - b).abs().max() / b.abs().max().clamp_min(1e-300)))
    assert worst < 1e-9, f"compiled Hessian-loss gradient: relative error {worst:.1e}"
    assert compiled.num_graphs == 1
    return worst
