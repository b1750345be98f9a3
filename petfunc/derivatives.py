"""Forces and stress as derivatives of any energy function.

An energy function has the signature ``energy_fn(params, positions, cell, neighbors)
-> [n_structures]`` (eV, positions in Å, cell rows as lattice vectors). The
transformations here return functions with that same signature.

Stress uses a per-structure strain eps (identity at evaluation):
``x' = x eps``, ``cell' = cell eps``, and ``stress = (1 / V) dE/d eps`` in eV/Å^3, the
sign convention of ASE and metatomic: the stress is positive when stretching the
cell raises the energy (a cell under tension). ``V = |det cell|``. For a structure that is not
periodic in all three directions V is 0 and its stress is NaN, by definition.
The strain derivative of PET is not symmetric (PET is not rotation-equivariant);
it is returned as is, like metatrain does.

**Two ways to differentiate, the same derivative** (``autodiff=``):

* ``"func"`` (default): ``torch.func.grad``. Composes with every ``torch.func``
  transform (``vmap``, ``grad`` of it, ``jacrev``/``jacfwd``) and traces with
  ``make_fx``: this is what :func:`petfunc.compile`, ``petfunc export``, ensembles
  and Hessians use.
* ``"autograd"``: ``torch.autograd.grad`` on the same function, for eager calls only
  (it raises inside ``torch.func`` transforms, ``make_fx`` and ``torch.compile``).
  The graph is built with ``create_graph=True`` exactly when something upstream
  needs it: grad mode is on and a parameter, the positions or the cell require
  grad (training: the loss is then differentiated again by autograd). Eagerly it
  is faster than ``"func"``, whose per-operation wrappers cost 20-30 % of a PET
  step on CPU, and it keeps fewer tensors alive. The trainer and the ASE
  calculator use it when they do not compile.

Both differentiate the whole function of the positions (edge vectors, cutoff
factors, adaptive cutoff radii): nothing is detached. Under ``torch.inference_mode``
both leave it for the derivative (on copies of any inference tensors), and return
results without a graph.
"""

from __future__ import annotations

import torch
from torch.func import grad
from torch.fx.experimental.proxy_tensor import get_proxy_mode

from petfunc.graph import check_sizes


AUTODIFF = ("func", "autograd")


def check_autodiff(autodiff: str) -> str:
    if autodiff not in AUTODIFF:
        raise ValueError(f"autodiff must be one of {AUTODIFF}, got {autodiff!r}")
    return autodiff


def assert_eager(what: str) -> None:
    """autograd.grad must not run where torch.func or a tracer would see it: under
    make_fx it records a first derivative that a later differentiation of the graph
    gets silently wrong (the detach nodes of a traced backward)."""
    if (
        torch._C._functorch.peek_interpreter_stack() is not None
        or get_proxy_mode() is not None
        or torch.compiler.is_compiling()
    ):
        raise RuntimeError(
            f"{what} with autodiff='autograd' runs eagerly only; inside torch.func transforms, "
            "make_fx (petfunc.compile, petfunc export) or torch.compile use autodiff='func'"
        )


def _parameter_device(params) -> str:
    """Where the parameters are, for an error message (the first tensor of any size)."""
    for leaf in torch.utils._pytree.tree_leaves(params):
        if isinstance(leaf, torch.Tensor) and leaf.dim() > 0:
            return f"; the parameters are {leaf.dtype} on {leaf.device}"
    return ""


def check_inputs(params, positions, cell) -> None:
    """Raise ``TypeError`` when ``positions`` or ``cell`` is not a tensor, or when the two
    differ in dtype or device.

    The strain derivative multiplies them before the energy function sees them, and
    torch's error there (``BmmBackward0 returned an invalid gradient``, ``expected
    scalar type Double``) names neither. Dtypes and devices are static properties of
    a tensor, also of a traced or batched one, so the check is the same under
    ``make_fx``, ``torch.compile`` and ``vmap``. The parameters are named in the
    message only: their dtypes may differ from the inputs' (float64 composition
    weights), and the energy function checks them against its inputs.
    """
    for name, tensor in (("positions", positions), ("cell", cell)):
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(
                f"{name} must be a torch.Tensor, got {type(tensor).__name__} (from_atoms, collate or "
                "make_batch build the inputs)"
            )
    if positions.dtype != cell.dtype or positions.device != cell.device:
        raise TypeError(
            f"positions are {positions.dtype} on {positions.device}, but the cell is {cell.dtype} on "
            f"{cell.device}{_parameter_device(params)}: give the positions, the cell and the network "
            "weights the same dtype and device (from_atoms(..., dtype=, device=) builds both inputs)"
        )


def _requires_graph(params, *tensors) -> bool:
    """Whether an autograd derivative must itself be differentiable."""
    if not torch.is_grad_enabled():
        return False
    leaves = torch.utils._pytree.tree_leaves(params)
    return any(isinstance(t, torch.Tensor) and t.requires_grad for t in list(leaves) + list(tensors))


def _outside_inference_mode(fn, *args):
    """``fn(*args)`` with inference mode switched off and without a graph.

    A derivative needs it off: autograd records nothing in inference mode, and
    torch 2.11's ``torch.func.grad`` returns zeros there (2.13's differentiates).
    Inference tensors among ``args`` are copied first (autograd cannot save them
    for its backward pass); the results are ordinary tensors.
    """

    def ordinary(t):
        return t.clone() if isinstance(t, torch.Tensor) and t.is_inference() else t

    with torch.inference_mode(False), torch.no_grad():
        return fn(*torch.utils._pytree.tree_map(ordinary, args))


def _variable(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as something autograd differentiates with respect to (kept in the
    caller's graph when it already requires grad)."""
    return tensor if tensor.requires_grad else tensor.detach().requires_grad_(True)


def cell_volume(cell: torch.Tensor) -> torch.Tensor:
    """``[n_structures]`` |a . (b x c)| of each cell (a triple product: exportable)."""
    return torch.linalg.cross(cell[:, 0], cell[:, 1], dim=-1).mul(cell[:, 2]).sum(-1).abs()


def strained(positions, cell, strain, structure_index):
    # bmm, what einsum("ia,iab->ib") and matmul run for these shapes: torch 2.11
    # fails an internal assert tracing einsum or matmul here (a grad of a grad under
    # make_fx with symbolic sizes)
    positions = torch.bmm(positions.unsqueeze(1), strain[structure_index]).squeeze(1)
    return positions, torch.bmm(cell, strain)


def identity_strain(cell: torch.Tensor) -> torch.Tensor:
    eye = torch.eye(3, dtype=cell.dtype, device=cell.device)
    return eye.expand(cell.shape[0], 3, 3).clone()


def _autograd_energy_and_gradient(energy_fn, params, positions, cell, neighbors):
    assert_eager("energy_and_forces")
    create = _requires_graph(params, positions, cell)
    with torch.enable_grad():
        x = _variable(positions)
        energies = energy_fn(params, x, cell, neighbors)
        (de_dx,) = torch.autograd.grad(energies.sum(), x, create_graph=create)
    return (energies if create else energies.detach()), de_dx


def forces(energy_fn, autodiff: str = "func"):
    """``fn(params, positions, cell, neighbors) -> forces [n_atoms, 3]`` (eV/Å)."""
    inner = energy_and_forces(energy_fn, autodiff)

    def fn(params, positions, cell, neighbors):
        return inner(params, positions, cell, neighbors)[1]

    return fn


def energy_and_forces(energy_fn, autodiff: str = "func"):
    """``fn(...) -> (energy [n_structures], forces [n_atoms, 3])``."""
    check_autodiff(autodiff)

    def fn(params, positions, cell, neighbors):
        check_inputs(params, positions, cell)
        if torch.is_inference_mode_enabled():
            return _outside_inference_mode(fn, params, positions, cell, neighbors)
        if autodiff == "autograd":
            energies, de_dx = _autograd_energy_and_gradient(energy_fn, params, positions, cell, neighbors)
            return energies, -de_dx

        def total(x):
            e = energy_fn(params, x, cell, neighbors)
            return e.sum(), e

        de_dx, energies = grad(total, has_aux=True)(positions)
        return energies, -de_dx

    return fn


def _position_and_strain_grad(terms_fn, params, positions, cell, neighbors, autodiff: str = "func"):
    """``(terms, dE/dx, dE/d eps)`` at the identity strain, where ``terms = terms_fn(params,
    x, cell, neighbors)`` is a tuple whose first item is the energy [n_structures]."""
    check_inputs(params, positions, cell)  # the strain below would fail first, less clearly
    if torch.is_inference_mode_enabled():
        return _outside_inference_mode(
            _position_and_strain_grad, terms_fn, params, positions, cell, neighbors, autodiff
        )
    check_sizes(positions, cell, neighbors)  # the strain below would fail first, less clearly
    if autodiff == "autograd":
        assert_eager("the strain derivative")
        create = _requires_graph(params, positions, cell)
        with torch.enable_grad():
            x = _variable(positions)
            eps = identity_strain(cell).requires_grad_(True)
            xs, cs = strained(x, cell, eps, neighbors.structure_index)
            terms = terms_fn(params, xs, cs, neighbors)
            de_dx, de_deps = torch.autograd.grad(terms[0].sum(), (x, eps), create_graph=create)
        if not create:
            terms = tuple(t.detach() for t in terms)
        return terms, de_dx, de_deps

    strain = identity_strain(cell)

    def total(x, eps):
        xs, cs = strained(x, cell, eps, neighbors.structure_index)
        terms = terms_fn(params, xs, cs, neighbors)
        return terms[0].sum(), terms

    (de_dx, de_deps), terms = grad(total, argnums=(0, 1), has_aux=True)(positions, strain)
    return terms, de_dx, de_deps


def energy_forces_strain_derivative(energy_fn, autodiff: str = "func"):
    """``fn(...) -> (energy, forces, dE/d strain [n_structures, 3, 3])``.

    The strain derivative is the (negative) virial W = -dE/d eps and is finite for
    every structure, periodic or not. ``autodiff``: see the module docstring.
    """
    check_autodiff(autodiff)

    def energy_only(*args):
        return (energy_fn(*args),)

    def fn(params, positions, cell, neighbors):
        (energies,), de_dx, de_deps = _position_and_strain_grad(
            energy_only, params, positions, cell, neighbors, autodiff
        )
        return energies, -de_dx, de_deps

    return fn


def energy_terms_forces_strain_derivative(terms_fn, autodiff: str = "func"):
    """``fn(...) -> (energy, per-atom energies, forces, dE/d eps)`` from one pass.

    ``terms_fn(params, positions, cell, neighbors) -> (energy [n_structures],
    per-atom energies [n_atoms])``, e.g. :meth:`petfunc.PET.energy_terms`. As
    :func:`energy_forces_strain_derivative`; the per-atom energies come from the same
    forward pass (no second evaluation).
    """
    check_autodiff(autodiff)

    def fn(params, positions, cell, neighbors):
        (energy, per_atom), de_dx, de_deps = _position_and_strain_grad(
            terms_fn, params, positions, cell, neighbors, autodiff
        )
        return energy, per_atom, -de_dx, de_deps

    return fn


def energy_forces_stress(energy_fn, autodiff: str = "func"):
    """``fn(...) -> (energy [n_structures], forces [n_atoms, 3], stress [n_structures, 3, 3])``.

    Stress is ``(1/V) dE/d eps`` (eV/Å^3), NaN for structures that are not fully
    periodic (zero cell volume).
    """
    inner = energy_forces_strain_derivative(energy_fn, autodiff)

    def fn(params, positions, cell, neighbors):
        energies, f, de_deps = inner(params, positions, cell, neighbors)
        volume = cell_volume(cell)
        safe = torch.where(volume > 0, volume, torch.ones_like(volume))
        stress = de_deps / safe[:, None, None]
        stress = torch.where((volume > 0)[:, None, None], stress, torch.full_like(stress, float("nan")))
        return energies, f, stress

    return fn
