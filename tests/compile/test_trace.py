"""Tracing in petfunc.compile (petfunc.compile.trace): graphs traced on the CPU and
moved to another device, vmap's symbolic rules held for the whole trace."""

import pytest
import torch
from torch.utils import _pytree as pytree

import petfunc
from petfunc.compile import PatchUnavailableError, move_graph, symbolic_vmap_rules, trace_device
from tests.helpers.patches import patch


def test_graph_traced_on_the_cpu_moves_to_another_device():
    """Inputs on one accelerator are traced as CPU tensors (torch.autograd's CUDA
    thread fails under make_fx on torch 2.11), and the graph is then moved: every
    tensor it creates (arange, zeros, eye, scalar_tensor...) and every constant it
    keeps must follow. Checked by moving a PET training step to the meta device and
    running it there: any tensor left on the CPU fails the run."""
    config = petfunc.PETConfig(
        atomic_types=(1, 6, 8),
        d_pet=4,
        d_node=4,
        d_head=4,
        d_feedforward=4,
        num_heads=1,
        cutoff=4.0,
        num_gnn_layers=1,
        num_attention_layers=1,
        num_neighbors_adaptive=6.0,
    )
    import ase.build

    from petfunc.data import make_batch, sample_from_atoms

    samples = []
    for k, name in enumerate(["CH3CH2OH", "H2O", "CH4", "CH3OH"]):
        atoms = ase.build.molecule(name)
        atoms.rattle(0.05, seed=k)
        sample = sample_from_atoms(atoms, config, energy_key=None, forces_key=None, stress_key=None)
        sample.energy = -float(k)
        samples.append(sample)
    model = petfunc.PET(config)
    params = model.init(seed=0, dtype=torch.float64)
    optimizer = petfunc.make_optimizer(petfunc.warmup_cosine(1e-3, 10, 0.1))
    state = petfunc.init_state(params, optimizer)
    step = petfunc.make_train_step(model, optimizer, petfunc.LossWeights.make(forces=1.0, stress=0.0))
    batch = make_batch(samples[:2], config, [0.0] * 3, 1.0, dtype=torch.float64)
    compiled = petfunc.compile(step, state, batch, backend="aot_eager")

    assert trace_device([torch.zeros(1), torch.zeros(1)]) is None
    assert trace_device([torch.zeros(1, device="meta")]) is None
    inputs, _ = compiled.call_inputs(
        compiled.checked_tensors(
            (state, make_batch(samples[1:], config, [0.0] * 3, 1.0, dtype=torch.float64))
        )
    )
    on_meta = [torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="meta") for t in inputs]
    creates = [n for n in compiled.graph.graph.nodes if n.kwargs.get("device") == torch.device("cpu")]
    assert len(creates) >= 3
    with pytest.raises(RuntimeError, match="device"):
        compiled.graph(*on_meta)

    def values_on_cpu():
        return [
            n
            for n in compiled.graph.graph.nodes
            if any(
                isinstance(v, torch.Tensor) and v.device.type == "cpu"
                for v in pytree.tree_leaves(n.meta.get("val"))
            )
        ]

    assert any(n.op == "placeholder" for n in values_on_cpu())
    move_graph(compiled.graph, torch.device("cpu"), torch.device("meta"))
    out = compiled.graph(*on_meta)
    assert out and all(t.device.type == "meta" for t in out)
    assert not any("cpu" in str(n.args) + str(n.kwargs) for n in compiled.graph.graph.nodes)
    # no trace-time values of the old device are left for a backend to read (the C++
    # wrapper takes the placeholders' as its inputs)
    assert not values_on_cpu()


class _Twice(torch.autograd.Function):
    """``2 x``, whose derivative is written with ``cat`` (as petfunc.ops.bmm's are
    written with products): under vmap, torch runs it as a vmap of the backward."""

    generate_vmap_rule = True

    @staticmethod
    def forward(x):
        return 2 * x

    @staticmethod
    def setup_context(ctx, inputs, output):
        pass

    @staticmethod
    def backward(ctx, g):
        return 2 * torch.cat([g[:1], g[1:]])


def test_vmap_inside_grad_keeps_sizes_symbolic():
    """A vmap inside a differentiated function (as in a Hessian-vector loss) runs the
    backward of an autograd.Function as a vmap again, in the backward of the outer
    grad, after the function's own ``symbolic_vmap_rules`` block has exited. torch's
    C++ batching rule of ``cat`` reads sizes as integers, which fixed the data sizes
    of the trace to the example's (torch 2.12 did so with ``bmm``, in petfunc.ops.bmm's
    derivatives); petfunc.compile keeps its symbolic rules in place for the whole
    trace."""
    from torch.func import grad, vmap

    def loss(w, x):
        def row(r):
            return torch.tanh(_Twice.apply(r * w)).square().sum()

        with symbolic_vmap_rules():
            values = vmap(row)(x)
        return values.sum()

    def fn(w, x):
        return grad(loss)(w, x)

    g = torch.Generator().manual_seed(0)

    def example(rows):
        return torch.randn(7, generator=g, dtype=torch.float64), torch.randn(
            rows, 7, generator=g, dtype=torch.float64
        )

    if not patch("vmap_rules").allowed():  # PETFUNC_STOCK_TORCH: refused, as documented
        with pytest.raises(PatchUnavailableError, match="vmap_rules"):
            petfunc.compile(fn, *example(3), backend="aot_eager")
        return
    compiled = petfunc.compile(fn, *example(3), backend="aot_eager")
    for rows in (3, 4, 9):
        args = example(rows)
        torch.testing.assert_close(compiled(*args), fn(*args), rtol=1e-12, atol=1e-12)
    assert compiled.num_graphs == 1


# -----------------------------------------------------------------------------------
# data-dependent sizes are refused when traced, naming the operation and the fix


def masked_sum(params, x):
    return (x[x > 0] * params["w"]).sum()


def nonzero_count(params, x):
    return x.nonzero().sum() * params["w"]


def unique_sum(params, x):
    return torch.unique(x).sum() * params["w"]


def item_scale(params, x):
    return (x * params["w"]).sum().item() * x


@pytest.mark.parametrize(
    "fn, operation, fix",
    [
        (
            masked_sum,
            r"aten\.index\.Tensor",
            r"torch\.where\(mask, x, 0\) or x \* mask instead of boolean-mask indexing",
        ),
        (nonzero_count, r"aten\.nonzero", r"multiply by the mask"),
        (unique_sum, r"aten\._unique2", r"a table of fixed size"),
        (item_scale, r"aten\._local_scalar_dense", r"no \.item\(\)"),
    ],
    ids=["mask-index", "nonzero", "unique", "item"],
)
def test_data_dependent_sizes_are_refused_when_traced(fn, operation, fix):
    params, x = {"w": torch.tensor(2.0)}, torch.randn(5, 3)
    with pytest.raises(
        ValueError,
        match=rf"petfunc\.compile: the function calls {operation}.*depends on the input data.*Fix: .*{fix}",
    ):
        petfunc.compile(fn, params, x, backend="aot_eager")
    # the fix the message names compiles, and equals the masked sum
    compiled = petfunc.compile(
        lambda p, x: (torch.where(x > 0, x, 0.0) * p["w"]).sum(), params, x, backend="aot_eager"
    )
    assert torch.allclose(compiled(params, x), masked_sum(params, x))
