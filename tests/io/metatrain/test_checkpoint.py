"""Reading metatrain checkpoints (petfunc.from_metatrain): a fresh model read back
bit for bit, its units converted to Å and eV, ZBL, LoRA merged, other targets, and
the checkpoints it refuses."""

import copy
import gzip
import json
import sys

import pytest
import torch

import petfunc
from tests.helpers.io_setup import (
    assert_same_params,
    metatrain_checkpoint,
    metatrain_reference,
    small_config,
    small_params,
)


@pytest.mark.parametrize("module", [None, "conditioning", "long_range"])
def test_from_metatrain_reads_back_a_fresh_model(module):
    ref = metatrain_reference()
    extra = {
        None: {},
        "conditioning": dict(system_conditioning=True, max_charge=4, max_spin_multiplicity=6),
        "long_range": dict(
            long_range=dict(enable=True, smearing=1.2, kspace_resolution=0.8, interpolation_nodes=3)
        ),
    }[module]
    if module == "long_range":
        pytest.importorskip("torchpme")
    config = small_config(
        num_neighbors_adaptive=9, transformer_type="PostLN", attention_temperature=2.0, **extra
    )
    params = small_params(config)
    model = ref.make_model(config)
    ref.load_params(model, params)
    checkpoint = model.get_checkpoint()
    loaded_config, loaded = petfunc.from_metatrain(checkpoint)
    assert loaded_config == config
    assert_same_params(loaded, params)  # names, order, values and dtypes, bit for bit

    state = petfunc.io.to_metatrain_state_dict(loaded, loaded_config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert not unexpected
    # torch-pme's buffers (smearing, prefactor, ...) are settings, not weights
    buffers = (
        "additive_models.",
        "scaler.",
        "long_range_featurizer.ewald_calculator.",
        "long_range_featurizer.p3m_calculator.",
        "long_range_featurizer.direct_calculator.",
    )
    assert all(k.startswith(buffers) for k in missing), missing


def test_from_metatrain_keeps_the_zbl_flag():
    ref = metatrain_reference()
    config = small_config(zbl=True)
    checkpoint = ref.make_model(config).get_checkpoint()
    loaded, params = petfunc.from_metatrain(checkpoint)
    assert loaded == config and loaded.zbl
    petfunc.io.check_params(config, params)  # ZBL has no trainable parameters


# (length unit, energy unit, hypers in those units): metatrain works in its data's units
UNIT_CASES = [
    ("angstrom", "kcal/mol", dict(num_neighbors_adaptive=6)),
    (
        "bohr",
        "Hartree",
        dict(cutoff=8.5, cutoff_width=0.9, num_neighbors_adaptive=6, cutoff_width_adaptive=1.9),
    ),
    ("nm", "kJ/mol", dict(cutoff=0.45, cutoff_width=0.05, cutoff_function="Cosine")),
]


@pytest.mark.parametrize("length_unit, energy_unit, hypers", UNIT_CASES)
def test_from_metatrain_converts_other_units_to_angstrom_and_ev(tmp_path, length_unit, energy_unit, hypers):
    """A metatrain model trained in other units gives what metatomic's calculator
    gives (it converts at the boundary), from the checkpoint and from the export."""
    ref = metatrain_reference()
    metatomic_ase = pytest.importorskip("metatomic_ase")
    import ase.build
    import ase.io
    import numpy as np

    from petfunc.ase import PETCalculator

    config = small_config(**hypers)
    model = ref.make_model(config, length_unit=length_unit, energy_unit=energy_unit)
    ref.load_params(model, small_params(config))
    torch.save(model.get_checkpoint(), tmp_path / "model.ckpt")
    model.export().save(str(tmp_path / "model.pt"))
    reference = metatomic_ase.MetatomicCalculator(str(tmp_path / "model.pt"), device="cpu")

    bulk = ase.build.bulk("C", "diamond", a=3.57, cubic=True)
    bulk.cell[0, 1] += 0.4
    bulk.rattle(0.1, seed=1)
    molecule = ase.build.molecule("CH3CH2OH")
    molecule.rattle(0.05, seed=2)
    for source in ("model.ckpt", "model.pt"):
        calculator = PETCalculator.from_metatrain(tmp_path / source, dtype=torch.float64)
        for atoms in (bulk, molecule):
            expected, got = atoms.copy(), atoms.copy()
            expected.calc, got.calc = reference, calculator
            energy = expected.get_potential_energy()
            assert abs(energy) > 1e-3  # the weights are not trivial
            assert got.get_potential_energy() == pytest.approx(energy, rel=1e-10, abs=1e-12)
            np.testing.assert_allclose(got.get_forces(), expected.get_forces(), rtol=1e-8, atol=1e-11)
            if atoms.pbc.all():
                np.testing.assert_allclose(got.get_stress(), expected.get_stress(), rtol=1e-8, atol=1e-12)

    # petfunc eval reads a file without units in the model's units, as mtt eval does:
    # metatomic's predictions written in those units evaluate to zero errors
    from petfunc.cli.commands import main
    from petfunc.units import energy_unit_factor, length_unit_factor

    to_energy, to_length = 1 / energy_unit_factor(energy_unit), 1 / length_unit_factor(length_unit)
    labelled = []
    for atoms in (bulk, molecule):
        atoms = atoms.copy()
        atoms.calc = reference
        energy, forces = atoms.get_potential_energy(), atoms.get_forces()
        scaled = ase.Atoms(
            atoms.numbers,
            positions=atoms.positions * to_length,
            cell=atoms.cell[:] * to_length,
            pbc=atoms.pbc,
        )
        scaled.info["energy"] = energy * to_energy
        scaled.arrays["forces"] = forces * to_energy / to_length
        labelled.append(scaled)
    ase.io.write(tmp_path / "labels.xyz", labelled)
    assert (
        main(
            [
                "eval",
                str(tmp_path / "model.ckpt"),
                str(tmp_path / "labels.xyz"),
                "--dtype",
                "float64",
                "--json",
                str(tmp_path / "errors.json"),
            ]
        )
        == 0
    )
    errors = json.loads((tmp_path / "errors.json").read_text())
    assert errors["energy_per_atom_rmse"] < 1e-6 and errors["forces_rmse"] < 1e-5

    if length_unit == "bohr":  # the grid method probes from a fixed 0.5 length units
        grid = ref.make_model(
            small_config(**{**hypers, "adaptive_cutoff_method": "grid"}),
            length_unit=length_unit,
            energy_unit=energy_unit,
        )
        with pytest.raises(ValueError, match="works in lengths of 'bohr'.*'grid' adaptive cutoff"):
            petfunc.from_metatrain(grid.get_checkpoint())


def test_from_metatrain_zbl_only_on_ev_targets():
    """metatrain adds ZBL only to a target in exactly 'eV': with the default unit ''
    its model has no ZBL term, and petfunc's reading of it has none either."""
    ref = metatrain_reference()
    import ase

    config = small_config(zbl=True)
    pair = ase.Atoms("CO", positions=[[0, 0, 0], [0.9, 0.2, 0.1]])  # deep in the repulsion
    for unit, zbl in (("eV", True), ("", False), ("meV", False)):
        model = ref.make_model(config, energy_unit=unit)
        ref.load_params(model, small_params(config))
        loaded, params = petfunc.from_metatrain(model.get_checkpoint())
        assert loaded.zbl is zbl
        expected = ref.evaluate(model, [pair], stress=False)[0]
        positions, cell, neighbors = petfunc.from_atoms([pair], loaded, dtype=torch.float64)
        energy = petfunc.PET(loaded).energy(params, positions, cell, neighbors)
        factor = {"eV": 1.0, "": 1.0, "meV": 1e-3}[unit]
        torch.testing.assert_close(energy, expected * factor, rtol=1e-7, atol=0)


def test_from_metatrain_does_not_modify_its_input():
    metatrain_reference()
    with gzip.open(metatrain_checkpoint("model-v4_trainer-v3.ckpt.gz"), "rb") as handle:
        checkpoint = torch.load(handle, weights_only=False)
    keys = list(checkpoint["model_state_dict"])
    hypers = copy.deepcopy(checkpoint["model_data"]["model_hypers"])
    config, params = petfunc.from_metatrain(checkpoint)
    assert checkpoint["model_ckpt_version"] == 4
    assert list(checkpoint["model_state_dict"]) == keys
    assert checkpoint["model_data"]["model_hypers"] == hypers
    assert config.featurizer_type == "residual" and config.normalization == "LayerNorm"
    config2, params2 = petfunc.from_metatrain(checkpoint)
    assert config2 == config
    assert_same_params(params2, params)


def test_from_metatrain_plain_ckpt_and_dtype(tmp_path):
    metatrain_reference()
    with gzip.open(metatrain_checkpoint("model-v16_trainer-v15.ckpt.gz"), "rb") as handle:
        data = handle.read()
    (tmp_path / "model.ckpt").write_bytes(data)
    config, params = petfunc.from_metatrain(tmp_path / "model.ckpt")
    config_gz, params_gz = petfunc.from_metatrain(metatrain_checkpoint("model-v16_trainer-v15.ckpt.gz"))
    assert config == config_gz
    assert_same_params(params, params_gz)
    flat = petfunc.tree.flatten(params)
    assert flat["gnn_layers.0.edge_embedder.weight"].dtype == torch.float32  # as trained
    assert flat["composition_weights"].dtype == torch.float64  # lossless
    _, params64 = petfunc.from_metatrain(tmp_path / "model.ckpt", dtype=torch.float64)
    assert petfunc.tree.flatten(params64)["gnn_layers.0.edge_embedder.weight"].dtype == torch.float64


def test_from_metatrain_merges_lora(tmp_path):
    ref = metatrain_reference()
    import ase.build
    from metatrain.pet.modules.finetuning import apply_finetuning_strategy
    from metatrain.utils.io import model_from_checkpoint

    config = small_config()
    model = ref.make_model(config)
    ref.load_params(model, small_params(config))
    strategy = {"method": "lora", "config": {"rank": 2, "alpha": 3.0}, "inherit_heads": {}}
    model = apply_finetuning_strategy(model, strategy)
    lora = {k: v for k, v in model.state_dict().items() if "lora_B" in k}
    assert lora and all(v.abs().sum() > 0 for v in lora.values())
    checkpoint = model.get_checkpoint()
    checkpoint["best_model_state_dict"]["finetune_config"] = strategy  # as the trainer does

    loaded_config, params = petfunc.from_metatrain(checkpoint, dtype=torch.float64)
    reference = model_from_checkpoint(checkpoint, "export").to(torch.float64).eval()
    atoms = ase.build.molecule("CH3CH2OH")
    atoms.rattle(0.05, seed=0)
    energy, _, forces, _ = ref.evaluate(reference, [atoms])
    positions, cell, neighbors = petfunc.from_atoms([atoms], loaded_config, dtype=torch.float64)
    e, f = petfunc.energy_and_forces(petfunc.PET(loaded_config).energy)(params, positions, cell, neighbors)
    assert abs(float(e[0] - energy[0])) <= 1e-10 * abs(float(energy[0]))
    assert float((f - forces).abs().max()) <= 1e-10 * float(forces.abs().max())

    # the merge matters: the weights before finetuning give another energy
    e0 = petfunc.PET(config).energy(small_params(config), positions, cell, neighbors)
    assert abs(float(e0[0] - e[0])) > 1e-6

    # an exported LoRA model carries its scaling alpha / rank on each LoRA module
    reference.export().save(str(tmp_path / "lora.pt"))
    config_pt, params_pt = petfunc.from_metatrain(tmp_path / "lora.pt", dtype=torch.float64)
    assert config_pt == loaded_config
    assert_same_params(params_pt, params)


def test_from_metatrain_other_target_name():
    ref = metatrain_reference()
    from metatrain.pet import PET as MetatrainPET
    from metatrain.utils.data import DatasetInfo
    from metatrain.utils.data.target_info import get_energy_target_info

    config = small_config()
    base = ref.make_model(config)
    info = DatasetInfo(
        length_unit="angstrom",
        atomic_types=[1, 6, 8],
        targets={"mtt::U0": get_energy_target_info("mtt::U0", {"quantity": "energy", "unit": "eV"})},
    )
    model = MetatrainPET(base.hypers, info)
    state = model.state_dict()
    _, params = petfunc.from_metatrain(model.get_checkpoint())
    flat = petfunc.tree.flatten(params)
    assert torch.equal(flat["node_heads.energy.0.0.weight"], state["backend.node_heads.mtt::U0.0.0.weight"])
    assert torch.equal(
        flat["edge_last_layers.energy.0.energy___0.bias"],
        state["backend.edge_last_layers.mtt::U0.0.mtt::U0___0.bias"],
    )
    with pytest.raises(ValueError, match="no target 'energy'"):
        petfunc.from_metatrain(model.get_checkpoint(), target="energy")


def test_from_metatrain_errors(tmp_path, monkeypatch):
    ref = metatrain_reference()
    checkpoint = ref.make_model(small_config()).get_checkpoint()

    with pytest.raises(ValueError, match="not a PET checkpoint"):
        petfunc.from_metatrain(dict(checkpoint, architecture_name="soap_bpnn"))
    with pytest.raises(ValueError, match="version 99"):
        petfunc.from_metatrain(dict(checkpoint, model_ckpt_version=99))

    long_range = copy.deepcopy(checkpoint["model_data"])
    long_range["model_hypers"]["long_range"]["enable"] = True
    with pytest.raises(ValueError, match="long_range_featurizer.charges_map.weight"):
        petfunc.from_metatrain(dict(checkpoint, model_data=long_range))  # hypers without weights

    with pytest.raises(FileNotFoundError):
        petfunc.from_metatrain(tmp_path / "missing.ckpt")
    (tmp_path / "junk.ckpt.gz").write_bytes(gzip.compress(b"not a checkpoint"))
    with pytest.raises(ValueError, match="not a readable metatrain checkpoint"):
        petfunc.from_metatrain(tmp_path / "junk.ckpt.gz")

    monkeypatch.setitem(sys.modules, "metatrain.pet", None)
    with pytest.raises(ImportError, match=r"petfunc\[metatrain\]"):
        petfunc.from_metatrain(checkpoint)
