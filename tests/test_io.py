"""petfunc.io: the parameter file (save/load) and the metatrain importer."""

import copy
import gzip
import io
import json
import os
import pickle
import sys
import zipfile

import pytest
import torch

import petfunc


SMALL = dict(d_pet=8, d_node=16, d_head=8, d_feedforward=16, num_heads=2)


def _config(**kw):
    return petfunc.PETConfig(atomic_types=(1, 6, 8), **{**SMALL, **kw})


def _params(config, dtype=torch.float64, seed=0):
    params = petfunc.PET(config).init(seed=seed, dtype=dtype)
    params["composition_weights"] = torch.tensor([-13.6, -1029.5, -2041.3], dtype=torch.float64)
    params["energy_scale"] = torch.tensor(0.42, dtype=torch.float64)
    return params


def _assert_same(a, b):
    fa, fb = petfunc.tree.flatten(a), petfunc.tree.flatten(b)
    assert list(fa) == list(fb)
    for key in fa:
        assert fa[key].dtype == fb[key].dtype, key
        assert torch.equal(fa[key], fb[key]), key


# ---------------------------------------------------------------------------------------
# save_params / load_params


def test_roundtrip_is_exact(tmp_path):
    config = _config(num_neighbors_adaptive=7, adaptive_cutoff_method="grid", cutoff_function="Cosine")
    params = _params(config, dtype=torch.float32)  # float32 network, float64 composition
    path = tmp_path / "model.pft"
    petfunc.save_params(path, config, params)
    loaded_config, loaded = petfunc.load_params(path)
    assert loaded_config == config
    _assert_same(loaded, params)
    assert isinstance(loaded["gnn_layers"], list)
    # only the file: the temporary file was renamed into place
    assert os.listdir(tmp_path) == ["model.pft"]


def test_load_casts_dtype(tmp_path):
    config = _config()
    petfunc.save_params(tmp_path / "p", config, _params(config))
    _, params = petfunc.load_params(tmp_path / "p", dtype=torch.float32)
    assert {t.dtype for t in petfunc.tree.flatten(params).values()} == {torch.float32}


def test_file_is_plain_data(tmp_path):
    config = _config()
    petfunc.save_params(tmp_path / "p", config, _params(config))
    payload = torch.load(tmp_path / "p", weights_only=True)
    assert payload["format"] == "petfunc.params"
    assert set(payload["params"]) == set(petfunc.tree.flatten(_params(config)))


def test_overwrite_and_failed_save_keep_old_file(tmp_path, monkeypatch):
    config = _config()
    path = tmp_path / "p"
    petfunc.save_params(path, config, _params(config, seed=1))
    petfunc.save_params(path, config, _params(config, seed=2))
    _assert_same(petfunc.load_params(path)[1], _params(config, seed=2))

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(OSError, match="disk full"):
        petfunc.save_params(path, config, _params(config, seed=3))
    monkeypatch.undo()
    _assert_same(petfunc.load_params(path)[1], _params(config, seed=2))
    assert os.listdir(tmp_path) == ["p"]


def test_save_rejects_params_of_another_config(tmp_path):
    params = _params(_config())
    with pytest.raises(ValueError, match=r"gnn_layers\.0\.edge_embedder\.weight has shape"):
        petfunc.save_params(tmp_path / "p", _config(d_pet=12, num_heads=2), params)
    del params["energy_scale"]
    with pytest.raises(ValueError, match="missing.*energy_scale"):
        petfunc.save_params(tmp_path / "p", _config(), params)
    assert not os.listdir(tmp_path)


def test_load_missing_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="no petfunc parameter file"):
        petfunc.load_params(tmp_path / "nope")


def test_load_corrupt_and_truncated_files(tmp_path):
    (tmp_path / "junk").write_bytes(b"\x00\x01garbage" * 100)
    with pytest.raises(ValueError, match="not a readable petfunc parameter file"):
        petfunc.load_params(tmp_path / "junk")
    config = _config()
    petfunc.save_params(tmp_path / "good", config, _params(config))
    data = (tmp_path / "good").read_bytes()
    (tmp_path / "cut").write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match="not a readable petfunc parameter file"):
        petfunc.load_params(tmp_path / "cut")
    # a damaged central directory behind an intact end record: zipfile.is_zipfile says
    # yes, and opening it raised zipfile.BadZipFile (not a ValueError) from the loaders
    import zipfile

    broken = bytearray(data)
    start = zipfile.ZipFile(tmp_path / "good").start_dir
    broken[start + 3] ^= 0xFF
    (tmp_path / "directory").write_bytes(bytes(broken))
    assert zipfile.is_zipfile(tmp_path / "directory")
    from petfunc.io import load_model

    for load in (
        petfunc.load_params,
        petfunc.from_metatrain,
        load_model,
        petfunc.ase.PETCalculator.from_exported,
    ):
        with pytest.raises(ValueError, match="not a readable"):
            load(tmp_path / "directory")


class _Evil:
    def __reduce__(self):
        return (os.system, ("touch pwned_by_pickle",))


def test_load_never_runs_pickled_code(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with open("evil", "wb") as handle:
        pickle.dump({"format": "petfunc.params", "x": _Evil()}, handle)
    with pytest.raises(ValueError, match="not a readable petfunc parameter file"):
        petfunc.load_params("evil")
    torch.save({"format": "petfunc.params", "x": _Evil()}, "evil2")
    with pytest.raises(ValueError, match="from_metatrain"):
        petfunc.load_params("evil2")
    assert not os.path.exists("pwned_by_pickle")


def test_load_wrong_content(tmp_path):
    torch.save({"weight": torch.zeros(3)}, tmp_path / "other")
    with pytest.raises(ValueError, match="not a petfunc parameter file"):
        petfunc.load_params(tmp_path / "other")

    config = _config()
    petfunc.save_params(tmp_path / "p", config, _params(config))
    payload = torch.load(tmp_path / "p", weights_only=True)

    bad = dict(payload, format_version=99)
    torch.save(bad, tmp_path / "version")
    with pytest.raises(ValueError, match="format version 99"):
        petfunc.load_params(tmp_path / "version")

    bad = dict(payload, params={k: v for k, v in payload["params"].items() if "compress" not in k})
    torch.save(bad, tmp_path / "missing")
    with pytest.raises(ValueError, match=r"missing \[.*compress"):
        petfunc.load_params(tmp_path / "missing")

    bad = dict(payload, config=payload["config"].replace('"d_pet": 8', '"d_pet": 0'))
    torch.save(bad, tmp_path / "config")
    with pytest.raises(ValueError, match="invalid config: d_pet must be a positive integer, got 0"):
        petfunc.load_params(tmp_path / "config")

    bad = dict(payload, config="{not json")
    torch.save(bad, tmp_path / "json")
    with pytest.raises(ValueError, match="unreadable config"):
        petfunc.load_params(tmp_path / "json")


# ---------------------------------------------------------------------------------------
# from_metatrain


def _metatrain():
    pytest.importorskip("metatrain")
    from helpers import mtt_reference

    return mtt_reference


def _checkpoint_path(name):
    import metatrain.pet

    return os.path.join(os.path.dirname(metatrain.pet.__file__), "tests", "checkpoints", name)


@pytest.mark.parametrize("module", [None, "conditioning", "long_range"])
def test_from_metatrain_reads_back_a_fresh_model(module):
    ref = _metatrain()
    extra = {
        None: {},
        "conditioning": dict(system_conditioning=True, max_charge=4, max_spin_multiplicity=6),
        "long_range": dict(
            long_range=dict(enable=True, smearing=1.2, kspace_resolution=0.8, interpolation_nodes=3)
        ),
    }[module]
    if module == "long_range":
        pytest.importorskip("torchpme")
    config = _config(num_neighbors_adaptive=9, transformer_type="PostLN", attention_temperature=2.0, **extra)
    params = _params(config)
    model = ref.make_model(config)
    ref.load_params(model, params)
    checkpoint = model.get_checkpoint()
    loaded_config, loaded = petfunc.from_metatrain(checkpoint)
    assert loaded_config == config
    _assert_same(loaded, params)  # names, order, values and dtypes, bit for bit

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
    ref = _metatrain()
    config = _config(zbl=True)
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
    ref = _metatrain()
    metatomic_ase = pytest.importorskip("metatomic_ase")
    import ase.build
    import ase.io
    import numpy as np

    from petfunc.ase import PETCalculator

    config = _config(**hypers)
    model = ref.make_model(config, length_unit=length_unit, energy_unit=energy_unit)
    ref.load_params(model, _params(config))
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
            _config(**{**hypers, "adaptive_cutoff_method": "grid"}),
            length_unit=length_unit,
            energy_unit=energy_unit,
        )
        with pytest.raises(ValueError, match="works in lengths of 'bohr'.*'grid' adaptive cutoff"):
            petfunc.from_metatrain(grid.get_checkpoint())


def test_unit_factors_are_metatomics():
    """Labels in kcal/mol (Hartree, Bohr...) are converted with metatomic's factors,
    as a metatrain model's outputs are: ASE's differ by up to 8e-9 (kcal/mol), which
    moved a fine-tuned kcal/mol model's composition weights by that much."""
    _metatrain()
    from metatomic.torch import unit_conversion_factor

    from petfunc.units import energy_unit_factor, length_unit_factor

    for unit in ("eV", "meV", "Hartree", "Ry", "kcal/mol", "kJ/mol"):
        assert energy_unit_factor(unit) == float(unit_conversion_factor(unit, "eV")), unit
    for unit in ("angstrom", "bohr", "nm"):
        assert length_unit_factor(unit) == float(unit_conversion_factor(unit, "angstrom")), unit


def test_from_metatrain_zbl_only_on_ev_targets():
    """metatrain adds ZBL only to a target in exactly 'eV': with the default unit ''
    its model has no ZBL term, and petfunc's reading of it has none either."""
    ref = _metatrain()
    import ase

    config = _config(zbl=True)
    pair = ase.Atoms("CO", positions=[[0, 0, 0], [0.9, 0.2, 0.1]])  # deep in the repulsion
    for unit, zbl in (("eV", True), ("", False), ("meV", False)):
        model = ref.make_model(config, energy_unit=unit)
        ref.load_params(model, _params(config))
        loaded, params = petfunc.from_metatrain(model.get_checkpoint())
        assert loaded.zbl is zbl
        expected = ref.evaluate(model, [pair], stress=False)[0]
        positions, cell, neighbors = petfunc.from_atoms([pair], loaded, dtype=torch.float64)
        energy = petfunc.PET(loaded).energy(params, positions, cell, neighbors)
        factor = {"eV": 1.0, "": 1.0, "meV": 1e-3}[unit]
        torch.testing.assert_close(energy, expected * factor, rtol=1e-7, atol=0)


def test_from_metatrain_does_not_modify_its_input():
    _metatrain()
    with gzip.open(_checkpoint_path("model-v4_trainer-v3.ckpt.gz"), "rb") as handle:
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
    _assert_same(params2, params)


def test_from_metatrain_plain_ckpt_and_dtype(tmp_path):
    _metatrain()
    with gzip.open(_checkpoint_path("model-v16_trainer-v15.ckpt.gz"), "rb") as handle:
        data = handle.read()
    (tmp_path / "model.ckpt").write_bytes(data)
    config, params = petfunc.from_metatrain(tmp_path / "model.ckpt")
    config_gz, params_gz = petfunc.from_metatrain(_checkpoint_path("model-v16_trainer-v15.ckpt.gz"))
    assert config == config_gz
    _assert_same(params, params_gz)
    flat = petfunc.tree.flatten(params)
    assert flat["gnn_layers.0.edge_embedder.weight"].dtype == torch.float32  # as trained
    assert flat["composition_weights"].dtype == torch.float64  # lossless
    _, params64 = petfunc.from_metatrain(tmp_path / "model.ckpt", dtype=torch.float64)
    assert petfunc.tree.flatten(params64)["gnn_layers.0.edge_embedder.weight"].dtype == torch.float64


def _saved_with(tmp_path, extra):
    """A shipped metatrain checkpoint with ``extra`` stored under a new key, saved."""
    with gzip.open(_checkpoint_path("model-v16_trainer-v15.ckpt.gz"), "rb") as handle:
        checkpoint = torch.load(handle, weights_only=False)
    checkpoint["extra"] = extra
    torch.save(checkpoint, tmp_path / "model.ckpt")
    return tmp_path / "model.ckpt"


class _RunsCode:
    """Unpickling this calls ``exec``: what a malicious checkpoint would do."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').close()",))


def test_from_metatrain_runs_no_pickled_code(tmp_path, monkeypatch):
    """Checkpoints load with weights_only=True and metatrain's own objects allowed:
    every shipped one loads so (the parity tests), a file with any other object is
    refused with its name and no code runs, and PETFUNC_TRUST_CHECKPOINTS=1 opts in."""
    _metatrain()
    import fractions

    monkeypatch.delenv("PETFUNC_TRUST_CHECKPOINTS", raising=False)
    marker = tmp_path / "ran"
    path = _saved_with(tmp_path, _RunsCode(marker))
    with pytest.raises(
        ValueError, match=r"model.ckpt' holds pickled objects .*builtins.exec.*PETFUNC_TRUST_CHECKPOINTS=1"
    ):
        petfunc.from_metatrain(path)
    with pytest.raises(ValueError, match="builtins.exec"):
        petfunc.load_model(path)
    assert not marker.exists()

    path = _saved_with(tmp_path, fractions.Fraction(1, 3))
    with pytest.raises(ValueError, match=r"\(fractions.Fraction\)"):
        petfunc.from_metatrain(path)
    monkeypatch.setenv("PETFUNC_TRUST_CHECKPOINTS", "1")
    config, params = petfunc.from_metatrain(path)
    config_ref, params_ref = petfunc.from_metatrain(_checkpoint_path("model-v16_trainer-v15.ckpt.gz"))
    assert config == config_ref
    _assert_same(params, params_ref)


def test_from_metatrain_damaged_pickle(tmp_path):
    _metatrain()
    with gzip.open(_checkpoint_path("model-v16_trainer-v15.ckpt.gz"), "rb") as handle:
        data = handle.read()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        names = archive.namelist()
        files = {name: archive.read(name) for name in names}
    pkl = next(name for name in names if name.endswith("data.pkl"))
    files[pkl] = files[pkl][: len(files[pkl]) // 2]  # a pickle cut short
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w") as archive:
        for name in names:
            archive.writestr(name, files[name])
    (tmp_path / "cut.ckpt").write_bytes(buffer.getvalue())
    with pytest.raises(ValueError, match="'.*cut.ckpt' is not a readable metatrain checkpoint"):
        petfunc.from_metatrain(tmp_path / "cut.ckpt")


def test_from_metatrain_exported_model(tmp_path):
    _metatrain()
    from metatrain.utils.io import model_from_checkpoint

    path = _checkpoint_path("model-v16_trainer-v15.ckpt.gz")
    with gzip.open(path, "rb") as handle:
        checkpoint = torch.load(handle, weights_only=False)
    model_from_checkpoint(checkpoint, "export").export().save(str(tmp_path / "model.pt"))
    config, params = petfunc.from_metatrain(tmp_path / "model.pt")
    config_ck, params_ck = petfunc.from_metatrain(path)
    assert config == config_ck
    _assert_same(params, params_ck)


def test_from_metatrain_exported_long_range_model(tmp_path):
    """The long-range settings and weights of an exported model are read back."""
    ref = _metatrain()
    pytest.importorskip("torchpme")
    from metatrain.utils.io import model_from_checkpoint

    config = _config(
        long_range=dict(
            enable=True, use_ewald=True, smearing=1.1, kspace_resolution=0.9, interpolation_nodes=4
        )
    )
    params = _params(config)
    model = ref.make_model(config)
    ref.load_params(model, params)
    model_from_checkpoint(model.get_checkpoint(), "export").export().save(str(tmp_path / "model.pt"))
    loaded_config, loaded = petfunc.from_metatrain(tmp_path / "model.pt")
    assert loaded_config == config
    _assert_same(loaded, params)


def test_from_metatrain_merges_lora(tmp_path):
    ref = _metatrain()
    import ase.build
    from metatrain.pet.modules.finetuning import apply_finetuning_strategy
    from metatrain.utils.io import model_from_checkpoint

    config = _config()
    model = ref.make_model(config)
    ref.load_params(model, _params(config))
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
    e0 = petfunc.PET(config).energy(_params(config), positions, cell, neighbors)
    assert abs(float(e0[0] - e[0])) > 1e-6

    # an exported LoRA model carries its scaling alpha / rank on each LoRA module
    reference.export().save(str(tmp_path / "lora.pt"))
    config_pt, params_pt = petfunc.from_metatrain(tmp_path / "lora.pt", dtype=torch.float64)
    assert config_pt == loaded_config
    _assert_same(params_pt, params)


def test_from_metatrain_other_target_name():
    ref = _metatrain()
    from metatrain.pet import PET as MetatrainPET
    from metatrain.utils.data import DatasetInfo
    from metatrain.utils.data.target_info import get_energy_target_info

    config = _config()
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
    ref = _metatrain()
    checkpoint = ref.make_model(_config()).get_checkpoint()

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


def test_written_files_get_ordinary_permissions(tmp_path):
    """Files are written through a temporary file (mkstemp: mode 0600) and renamed; they
    must end up with the mode a plain open() gives (0666 less the umask), or keep the
    mode of the file they replace."""
    import stat

    from petfunc._files import atomic_write

    mask = os.umask(0o027)
    try:
        path = tmp_path / "params.pt"
        petfunc.save_params(path, _config(), _params(_config()))
        assert stat.S_IMODE(path.stat().st_mode) == 0o640
    finally:
        os.umask(mask)
    path.chmod(0o604)
    atomic_write(path, lambda handle: handle.write(b"x"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o604 and path.read_bytes() == b"x"
    assert [p.name for p in tmp_path.iterdir()] == ["params.pt"]  # no temporary left


def test_which_picks_best_or_last_weights_of_a_metatrain_checkpoint(tmp_path):
    """metatrain checkpoints hold the best and the last weights; ``which`` (``petfunc
    eval/export --which``) picks one, as it does for petfunc's own checkpoints."""
    ref = _metatrain()
    from petfunc.io import load_model

    config = _config()
    model = ref.make_model(config)
    ref.load_params(model, _params(config))
    checkpoint = model.get_checkpoint()
    key = "backend.gnn_layers.0.edge_embedder.weight"
    last = dict(checkpoint["model_state_dict"])
    last[key] = last[key] + 1.0
    checkpoint["model_state_dict"] = last
    torch.save(checkpoint, tmp_path / "model.ckpt")
    _, best = load_model(tmp_path / "model.ckpt", which="best")
    _, latest = load_model(tmp_path / "model.ckpt", which="last")
    name = "gnn_layers.0.edge_embedder.weight"
    torch.testing.assert_close(
        petfunc.tree.flatten(latest)[name] - petfunc.tree.flatten(best)[name],
        torch.ones_like(petfunc.tree.flatten(best)[name]),
    )
    model.export().save(str(tmp_path / "model.pt"))
    load_model(tmp_path / "model.pt")
    with pytest.raises(ValueError, match="exported model, with one set of weights"):
        load_model(tmp_path / "model.pt", which="last")


def test_float32_hypers_of_an_export_read_as_written():
    """An exported float32 long-range model keeps its smearing as a float32 tensor;
    read back as 1.100000023841858 its config would differ from the checkpoint's."""
    from petfunc.io.metatrain.exported import _as_written

    assert _as_written(torch.tensor(1.1, dtype=torch.float32)) == 1.1
    assert _as_written(torch.tensor(0.9, dtype=torch.float32)) == 0.9
    assert _as_written(torch.tensor(1.1, dtype=torch.float64)) == 1.1
    assert _as_written(torch.tensor(1.0 / 3.0, dtype=torch.float64)) == 1.0 / 3.0  # float64: exact
    assert _as_written(1.33) == 1.33
