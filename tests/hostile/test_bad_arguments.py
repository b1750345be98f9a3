"""Bad arguments to the pure API get errors that name the problem: inputs on two
devices or of two dtypes, parameters that do not fit their config, atomic types that
are no elements, and an optimizer state made for the wrong parameters."""

import logging

import ase.build
import pytest
import torch
import torchopt

import petfunc
from petfunc.compile.logs import TRACING_LOGGERS


CONFIG = petfunc.PETConfig(
    atomic_types=("H", "C", "O"), d_pet=8, d_node=16, d_head=8, d_feedforward=16, num_heads=2
)


def _inputs(dtype=torch.float32):
    atoms = ase.build.molecule("H2O", vacuum=3.0)
    atoms.pbc = True
    return petfunc.from_atoms([atoms], CONFIG, dtype=dtype)


def test_positions_and_cell_on_two_devices_or_of_two_dtypes():
    model = petfunc.PET(CONFIG)
    params = model.init()
    positions, cell, neighbors = _inputs()
    stress = petfunc.energy_forces_stress(model.energy)
    # without the check, torch says "BmmBackward0 returned an invalid gradient at index 0"
    with pytest.raises(
        TypeError, match=r"positions are torch.float32 on meta, but the cell is torch.float32 on cpu"
    ):
        stress(params, positions.to("meta"), cell, neighbors)
    # and here "expected scalar type Double but found Float"
    with pytest.raises(
        TypeError, match=r"positions are torch.float64 on cpu, but the cell is torch.float32 on cpu"
    ):
        stress(params, positions.double(), cell, neighbors)


def test_parameters_that_do_not_fit_the_config_are_named():
    model = petfunc.PET(CONFIG)
    params = model.init()
    del params["gnn_layers"][0]["compress"]["0"]["weight"]
    positions, cell, neighbors = _inputs()
    with pytest.raises(KeyError):  # the traced energy does not check the tree
        model.energy(params, positions, cell, neighbors)
    with pytest.raises(ValueError, match=r"missing \['gnn_layers.0.compress.0.weight'\]"):
        petfunc.check_params(CONFIG, params)
    params = model.init()
    params["node_heads"]["energy"][0]["0"]["weight"] = torch.zeros(16, 8)
    with pytest.raises(
        ValueError, match=r"node_heads.energy.0.0.weight has shape \[16, 8\], expected \[8, 16\]"
    ):
        petfunc.check_params(CONFIG, params)


@pytest.mark.parametrize(
    "types, message",
    [
        ((1.7, 6), r"entry 0 is 1.7, not an atomic number"),
        ((1, 300), r"entry 1 is 300, not an atomic number from 1 \(H\) to 118 \(Og\)"),
        (("H", "Xx"), r"entry 1 is 'Xx', not a chemical symbol"),
        ((False, 6), r"entry 0 is False, not an atomic number"),
    ],
)
def test_atomic_types_that_are_not_elements(types, message):
    with pytest.raises(ValueError, match=message):
        petfunc.PETConfig(atomic_types=types)


def test_compile_names_an_optimizer_state_of_every_parameter_without_torch_logs(caplog):
    params = {"w": torch.randn(3, 4), "composition_weights": torch.zeros(2), "energy_scale": torch.ones(())}
    adamw = torchopt.adamw(1e-3)
    loggers = [logging.getLogger(name) for name in TRACING_LOGGERS]
    for logger in loggers:
        logger.addHandler(caplog.handler)
    try:
        with pytest.raises(
            ValueError, match=r"made for every parameter.*petfunc.init_state\(params, optimizer\)"
        ):
            petfunc.compile(
                lambda state, x: x * 2, petfunc.TrainState(params, adamw.init(params)), torch.ones(2, 2)
            )
    finally:
        for logger in loggers:
            logger.removeHandler(caplog.handler)
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []
