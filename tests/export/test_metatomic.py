"""export_metatomic: the metatomic model's capabilities, dtype and metadata, and its
long-range features independent of the order of the engine's neighbour list."""

import pytest
import torch


pytest.importorskip("metatrain")

from metatensor.torch import Labels, TensorBlock
from metatomic.torch import (
    ModelEvaluationOptions,
    ModelMetadata,
    ModelOutput,
    System,
    load_atomistic_model,
    systems_to_torch,
)
from vesin.metatomic import neighbor_lists_for_model

import petfunc
from petfunc.export import export_metatomic
from tests.helpers.metatomic_export import config_of, params_of, structures


def test_capabilities_dtype_and_metadata(tmp_path):
    config = config_of("ZBL")
    params = params_of("ZBL", config)
    metadata = ModelMetadata(name="a PET", description="trained with petfunc")
    path = export_metatomic(config, params, tmp_path / "model.pt", dtype=torch.float32, metadata=metadata)
    assert [p.name for p in tmp_path.iterdir()] == ["model.pt"]  # no leftovers
    model = load_atomistic_model(str(path))
    capabilities = model.capabilities()
    assert capabilities.dtype == "float32"
    assert capabilities.length_unit == "angstrom"
    assert capabilities.outputs["energy"].unit == "eV"
    assert list(capabilities.atomic_types) == list(config.atomic_types)
    assert capabilities.interaction_range == config.num_gnn_layers * config.cutoff
    assert model.metadata().name == "a PET"
    [request] = [r for r in model.requested_neighbor_lists() if r.cutoff == config.cutoff]
    assert request.full_list
    # the weights' dtype by default
    default = load_atomistic_model(str(export_metatomic(config, params, tmp_path / "m64.pt")))
    assert default.capabilities().dtype == "float64"


def _energy_and_forces(model, atoms, permutation=None):
    """Energy and forces of ``atoms`` with vesin's neighbour lists, their rows
    reordered by ``permutation(n_rows)`` where given."""
    [system] = systems_to_torch([atoms], dtype=torch.float64, positions_requires_grad=True)
    for calculator in neighbor_lists_for_model("angstrom", model):
        calculator.add_neighbor_list([system])
    if permutation is not None:
        reordered = System(types=system.types, positions=system.positions, cell=system.cell, pbc=system.pbc)
        for request in model.requested_neighbor_lists():
            neighbors = system.get_neighbor_list(request)
            order = permutation(len(neighbors.samples))
            samples = Labels(neighbors.samples.names, neighbors.samples.values[order])
            block = TensorBlock(neighbors.values[order], samples, neighbors.components, neighbors.properties)
            reordered.add_neighbor_list(request, block)
        system = reordered
    options = ModelEvaluationOptions(
        length_unit="angstrom",
        outputs={"energy": ModelOutput(unit="eV", sample_kind="system")},
    )
    energy = model([system], options, check_consistency=True)["energy"].block().values.sum()
    (gradient,) = torch.autograd.grad(energy, system.positions)
    return energy.detach(), -gradient


def test_long_range_features_do_not_depend_on_the_neighbour_list_order(tmp_path):
    """metatrain's own export pairs its centre-sorted edge distances with the rows in
    the engine's order; this export gives each row its own distance: the energy and
    forces are the same with the rows grouped by centre atom, reversed or as vesin
    gives them, and equal petfunc's."""
    config = config_of("long-range")
    params = params_of("long-range", config)
    model = load_atomistic_model(str(export_metatomic(config, params, tmp_path / "model.pt")))
    atoms = structures()["periodic cell"]
    energy, forces = _energy_and_forces(model, atoms)
    calculator = petfunc.ase.PETCalculator(config, params)
    atoms.calc = calculator
    assert abs(float(energy) - atoms.get_potential_energy()) <= 1e-10 * abs(float(energy))
    expected = torch.as_tensor(atoms.get_forces())
    assert (forces - expected).abs().max() <= 1e-10 * expected.abs().max()

    def reverse(n):
        return torch.arange(n - 1, -1, -1)

    for permutation in (reverse, lambda n: torch.randperm(n, generator=torch.Generator().manual_seed(0))):
        e, f = _energy_and_forces(model, atoms.copy(), permutation)
        assert abs(float(e - energy)) <= 1e-12 * abs(float(energy))
        assert (f - forces).abs().max() <= 1e-11 * forces.abs().max()
