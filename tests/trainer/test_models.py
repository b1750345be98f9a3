"""The model a run starts from: a fine-tuning checkpoint (petfunc's or metatrain's,
its heads or LoRA adapters, a target of several), its architecture against the
options; fine-tuning runs train what their method says and resume exactly.
"""

import json

import numpy as np
import pytest
import torch

from petfunc import lora, tree
from petfunc.cli import main, make_default_dataset
from petfunc.io import load_model
from petfunc.train import HEADS, trainable
from petfunc.trainer import fit
from petfunc.trainer.options import resolve_options, trained_parameters
from tests.helpers.trainer import TINY_MODEL, quiet, tiny_options


try:  # the metatrain comparisons need the test extra
    from tests.helpers import mtt_reference as ref
except ImportError:
    ref = None

needs_metatrain = pytest.mark.skipif(ref is None, reason="metatrain (the test extra) is not installed")


def test_unknown_species_when_finetuning(dataset, tmp_path):
    import ase.io

    # A model trained on Cu/Ni/Al ...
    fit(tiny_options(dataset, num_epochs=1), tmp_path / "base", progress=False, log=quiet())
    # ... fine-tuned on data with gold.
    frames = ase.io.read(dataset, ":")
    frames[2].numbers[0] = 79
    gold = tmp_path / "gold.xyz"
    ase.io.write(gold, frames)
    options = tiny_options(gold, finetune={"read_from": str(tmp_path / "base" / "best.ckpt")})
    del options["architecture"]["model"]
    with pytest.raises(ValueError, match=r"atomic number\(s\) \[79\]"):
        fit(options, None, progress=False, log=quiet())


def test_finetune_from_metatrain_checkpoint(tmp_path):
    # A tiny metatrain PET (types H, C, N, O; d_pet=1) fine-tuned on EMT molecules.
    metatrain_pet = pytest.importorskip("metatrain.pet")
    import os

    import ase.build
    import ase.io
    from ase.calculators.emt import EMT
    from ase.calculators.singlepoint import SinglePointCalculator

    from petfunc.io import from_metatrain

    checkpoint = os.path.join(
        os.path.dirname(metatrain_pet.__file__), "tests", "checkpoints", "model-v16_trainer-v15.ckpt.gz"
    )
    frames = []
    for i, name in enumerate(["CH4", "H2O", "NH3", "CH3OH", "HCN", "C2H6"] * 2):
        atoms = ase.build.molecule(name)
        atoms.rattle(0.05, seed=i)
        atoms.calc = EMT()
        atoms.calc = SinglePointCalculator(
            atoms, energy=atoms.get_potential_energy(), forces=atoms.get_forces()
        )
        frames.append(atoms)
    ase.io.write(tmp_path / "molecules.xyz", frames)
    options = {
        "architecture": {
            "name": "pet",
            "training": {"batch_size": 4, "num_epochs": 1, "finetune": {"read_from": checkpoint}},
        },
        "training_set": str(tmp_path / "molecules.xyz"),
        "validation_set": 0.25,
    }
    result = fit(options, None, progress=False, log=quiet())
    config, start = from_metatrain(checkpoint)
    assert result.config == config
    # Trained from the checkpoint's weights; its composition and scale kept, as
    # metatrain keeps those of a target the model has.
    moved = [
        k
        for k, v in tree.flatten(trainable(start)).items()
        if not torch.equal(v, tree.flatten(result.last_params)[k])
    ]
    assert moved, "no parameter changed"
    assert torch.equal(result.params["composition_weights"], start["composition_weights"])
    assert torch.equal(result.params["energy_scale"], start["energy_scale"])
    # Options may not redefine the architecture when fine-tuning; as in metatrain, the
    # keys they give must match the checkpoint's (an unchanged options file works).
    from petfunc.trainer import check_model_section

    check_model_section(
        {"d_pet": config.d_pet, "cutoff": config.cutoff, "normalization": config.normalization.lower()},
        config,
        "it",
    )
    options["architecture"]["model"] = {"cutoff": config.cutoff + 0.5, "num_heads": config.num_heads}
    with pytest.raises(
        ValueError, match=r"differs from the architecture of the fine-tuning checkpoint .*\(cutoff: "
    ):
        fit(options, None, progress=False, log=quiet())


def test_partial_model_section_is_checked_against_the_checkpoint(dataset):
    """A fine-tuning or restart options file may name a few model keys; the keys it
    omits come from the checkpoint, so relations such as d_pet % num_heads are checked
    there, not against the defaults ({d_pet: 4} fails with the default num_heads 8 but
    suits a checkpoint with num_heads 2)."""
    from petfunc.config import PETConfig
    from petfunc.trainer import check_model_section

    config = PETConfig(atomic_types=(13, 28, 29), **{**TINY_MODEL, "d_pet": 4, "num_heads": 2})
    options = tiny_options(dataset)
    options["architecture"]["model"] = {"d_pet": 4, "cutoff_width": 0.5}
    resolve_options(
        options
    )  # each value is fine; d_pet 4 against the default num_heads 8 is not checked here
    check_model_section({"d_pet": 4, "cutoff_width": 0.5}, config, "it")
    with pytest.raises(
        ValueError, match=r"d_pet must be divisible by num_heads, got d_pet=4 and num_heads=3"
    ):
        check_model_section({"num_heads": 3}, config, "it")
    # relations among the keys given are still checked by the options
    options["architecture"]["model"] = {"d_pet": 4, "num_heads": 3}
    with pytest.raises(ValueError, match=r"option 'architecture.model': d_pet must be divisible"):
        resolve_options(options)
    options["architecture"]["model"] = {"num_gnn_layers": 0, "featurizer_type": "residual"}
    with pytest.raises(
        ValueError, match=r"option 'architecture.model': num_gnn_layers 0 needs featurizer_type"
    ):
        resolve_options(options)
    options["architecture"]["model"] = {"d_pet": 0}
    with pytest.raises(ValueError, match=r"option 'architecture.model': d_pet must be a positive integer"):
        resolve_options(options)
    # a fresh model fills the omitted keys with the defaults, and names the relation
    options["architecture"]["model"] = {"d_pet": 4}
    with pytest.raises(
        ValueError,
        match=r"option 'architecture.model': d_pet must be divisible by num_heads, "
        r"got d_pet=4 and num_heads=8",
    ):
        fit(options, None, progress=False, log=quiet())


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A tiny model trained from scratch, and the dataset it was trained on."""
    folder = tmp_path_factory.mktemp("heads")
    data = make_default_dataset(folder / "emt.xyz", n_structures=12, seed=2)
    options = {
        "seed": 1,
        "base_precision": 64,
        "architecture": {
            "name": "pet",
            "model": {
                "d_pet": 8,
                "d_node": 8,
                "d_head": 8,
                "d_feedforward": 8,
                "num_heads": 2,
                "num_gnn_layers": 1,
            },
            "training": {"batch_size": 4, "num_epochs": 1},
        },
        "training_set": str(data),
        "validation_set": 0.25,
    }
    fit(options, folder / "base", progress=False, log=lambda m: None)
    return data, folder / "base" / "best.ckpt"


def _heads_options(data, checkpoint, **finetune):
    return {
        "seed": 2,
        "base_precision": 64,
        "architecture": {
            "name": "pet",
            "training": {
                "batch_size": 4,
                "num_epochs": 3,
                "learning_rate": 1e-2,
                "checkpoint_interval": 1,
                "finetune": {"read_from": str(checkpoint), "method": "heads", **finetune},
            },
        },
        "training_set": str(data),
        "validation_set": 0.25,
    }


def test_heads_finetuning_trains_only_the_heads_and_resumes(base, tmp_path):
    data, checkpoint = base
    _, start = load_model(checkpoint, dtype=torch.float64)
    lines = []
    result = fit(_heads_options(data, checkpoint), tmp_path / "run", progress=False, log=lines.append)
    assert any(
        "fine-tuning node_heads, edge_heads, node_last_layers, edge_last_layers only" in m for m in lines
    )
    before, after = tree.flatten(trainable(start)), tree.flatten(result.last_params)
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert moved and all(k.startswith(HEADS) for k in moved), moved
    assert len(moved) == len([k for k in before if k.startswith(HEADS)])
    # resuming from epoch 1 gives the uninterrupted run's weights, bit for bit
    resumed = fit(
        None,
        tmp_path / "resumed",
        restart=tmp_path / "run" / "epoch_1.ckpt",
        progress=False,
        log=lambda m: None,
    )
    a, b = tree.flatten(result.last_params), tree.flatten(resumed.last_params)
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_finetuning_keeps_the_composition_and_scale(base, tmp_path):
    """metatrain fits the composition weights and energy scale only for a target new
    to the model: fine-tuning keeps the checkpoint's (petfunc refitted them, so a
    fine-tuned model did not start from the pretrained one: 0.4-0.9 eV per cell
    apart on the helpers' data). A weights dict in the options is not used then,
    as in metatrain."""
    data, checkpoint = base
    _, start = load_model(checkpoint, dtype=torch.float64)
    for method in ("heads", "full"):
        options = _heads_options(data, checkpoint, method=method)
        options["architecture"]["training"].update(num_epochs=1, atomic_baseline={"energy": 0.5})
        lines = []
        result = fit(options, tmp_path / method, progress=False, log=lines.append)
        for key in ("composition_weights", "energy_scale"):
            assert torch.equal(result.last_params[key], start[key]), key
        assert any(
            "composition weights of the fine-tuning checkpoint, energy scale of the fine-tuning checkpoint"
            in line
            and "atomic_baseline given as weights are not used" in line
            for line in lines
        ), lines
    # atomic types the options add to the checkpoint's were ignored; metatrain refuses them
    options = _heads_options(data, checkpoint)
    options["architecture"]["atomic_types"] = [1, 6, 7, 8, 29, 79]
    with pytest.raises(
        ValueError, match=r"'architecture.atomic_types' has type\(s\) \[.*79\] that the model of"
    ):
        fit(options, None, progress=False, log=lambda m: None)


def test_heads_selection_from_options(base, tmp_path):
    data, checkpoint = base
    custom = {"config": {"head_modules": ["backend.node_heads"], "last_layer_modules": ["node_last_layers"]}}
    options = resolve_options(_heads_options(data, checkpoint, **custom))
    assert trained_parameters(options["architecture"]["training"]["finetune"]) == (
        "node_heads",
        "node_last_layers",
    )
    default = resolve_options(_heads_options(data, checkpoint))
    assert trained_parameters(default["architecture"]["training"]["finetune"]) == HEADS


def test_lora_finetuning_writes_plain_models_and_resumes(base, tmp_path):
    data, checkpoint = base
    _, start = load_model(checkpoint, dtype=torch.float64)
    lines = []
    options = _heads_options(data, checkpoint, method="lora", config={"rank": 2, "alpha": 4})
    result = fit(options, tmp_path / "run", progress=False, log=lines.append)
    adapted = lora.target_layers(start)  # 2 attention layers, input and output linear
    assert len(adapted) == 4 and all(
        k.endswith(("attention.input_linear", "attention.output_linear")) for k in adapted
    )
    assert any("LoRA adapters of rank 2 (alpha 4) on 4 layers" in m for m in lines), lines
    assert "lora" not in result.last_params and "lora" not in result.params
    before, after = tree.flatten(trainable(start)), tree.flatten(result.last_params)
    moved = sorted(k for k in before if not torch.equal(before[k], after[k]))
    assert moved == sorted(f"{k}.weight" for k in adapted), moved
    # the best model, as petfunc eval and the calculator read it, is the merged one
    for path in (tmp_path / "run" / "best.ckpt", tmp_path / "run" / "best_params.pt"):
        _, loaded = load_model(path, dtype=torch.float64)
        a, b = tree.flatten(loaded), tree.flatten(result.params)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    resumed = fit(
        None,
        tmp_path / "resumed",
        restart=tmp_path / "run" / "epoch_1.ckpt",
        progress=False,
        log=lambda m: None,
    )
    a, b = tree.flatten(result.last_params), tree.flatten(resumed.last_params)
    assert all(torch.equal(a[k], b[k]) for k in a)
    # options with another rank and alpha: the checkpoint's adapters and scaling go on
    # (the adapters stayed rank 2 and were scaled by the new alpha over the old rank)
    lines = []
    other = _heads_options(data, checkpoint, method="lora", config={"rank": 3, "alpha": 5})
    resumed = fit(
        other,
        tmp_path / "resumed_other",
        restart=tmp_path / "run" / "epoch_1.ckpt",
        progress=False,
        log=lines.append,
    )
    b = tree.flatten(resumed.last_params)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any("has LoRA adapters of rank 2 (alpha 4" in line for line in lines), lines
    # another method: a clear error (it failed on the optimizer state's keys)
    with pytest.raises(
        ValueError,
        match=r"is of a run with fine-tuning method 'lora', the options ask for "
        r"fine-tuning method 'heads'",
    ):
        fit(
            _heads_options(data, checkpoint),
            tmp_path / "resumed_heads",
            restart=tmp_path / "run" / "epoch_1.ckpt",
            progress=False,
            log=lambda m: None,
        )


@pytest.mark.parametrize(
    "finetune, match",
    [
        ({"method": "adapters"}, r"must be 'full', 'heads' or 'lora', got 'adapters'"),
        ({"method": "lora", "config": {"rank": 0}}, r"finetune.config.rank' must be positive"),
        ({"method": "lora", "config": {"alpha": "big"}}, r"finetune.config.alpha' must be a number"),
        ({"method": "lora", "config": {"ranks": 2}}, r"did you mean 'rank'"),
        ({"method": "lora", "config": {"target_modules": "w_in"}}, r"target_modules' must be a list"),
        ({"method": "full", "config": {"rank": 2}}, r"only used with methods 'heads' and 'lora'"),
        (
            {"config": {"head_module": ["node_heads"]}},
            r"finetune.config.head_module' .*did you mean 'head_modules'",
        ),
        ({"config": {"head_modules": "node_heads"}}, r"must be a list of module names"),
        ({"inherit_heads": {"energy2": "energy"}}, r"unknown option .*inherit_heads.energy2'"),
        ({"inherit_heads": {"energy": 3}}, r"inherit_heads.energy' must be the name of a target"),
        ({"read_from": None}, r"method: heads' needs .*finetune.read_from"),
    ],
)
def test_bad_finetune_sections(base, finetune, match):
    data, checkpoint = base
    with pytest.raises(ValueError, match=match):
        resolve_options(_heads_options(data, checkpoint, **finetune))


@needs_metatrain
def test_inherit_heads_picks_the_source_target(base, tmp_path):
    """``inherit_heads: {energy: NAME}`` fine-tunes from target NAME of a metatrain
    checkpoint with several energy targets: the initial heads are NAME's; without it
    the error names the option; a petfunc file has only 'energy'."""
    from metatrain.pet import PET as MetatrainPET
    from metatrain.utils.data import DatasetInfo
    from metatrain.utils.data.target_info import get_energy_target_info

    from petfunc.trainer.models import initial_model

    data, checkpoint = base
    config, _ = load_model(checkpoint)
    targets = {
        name: get_energy_target_info(name, {"quantity": "energy", "unit": "eV"})
        for name in ("mtt::a", "mtt::b")
    }
    info = DatasetInfo(length_unit="angstrom", atomic_types=list(config.atomic_types), targets=targets)
    model = MetatrainPET(ref.make_model(config).hypers, info)
    path = tmp_path / "two_targets.ckpt"
    torch.save(model.get_checkpoint(), path)
    state = model.state_dict()

    options = resolve_options(_heads_options(data, path, inherit_heads={"energy": "mtt::b"}))
    lines = []
    _, params = initial_model(options, {}, [], torch.float64, "cpu", 0, lines.append)
    flat = tree.flatten(params)
    assert torch.equal(
        flat["node_heads.energy.0.0.weight"], state["backend.node_heads.mtt::b.0.0.weight"].double()
    )
    assert not torch.equal(
        flat["node_heads.energy.0.0.weight"], state["backend.node_heads.mtt::a.0.0.weight"].double()
    )
    assert "heads of its target 'mtt::b'" in lines[-1]
    # a metatrain checkpoint is fine-tuned, not restarted
    with pytest.raises(
        ValueError, match="is a metatrain checkpoint, not a petfunc training checkpoint.*--finetune"
    ):
        fit(None, tmp_path / "restart", restart=path, progress=False, log=lambda m: None)
    result = fit(
        _heads_options(data, path, inherit_heads={"energy": "mtt::b"}),
        None,
        progress=False,
        log=lambda m: None,
    )
    assert np.isfinite(result.history[-1]["val_loss"])
    with pytest.raises(ValueError, match=r"inherit_heads: \{energy: NAME\}"):
        fit(_heads_options(data, path), None, progress=False, log=lambda m: None)
    with pytest.raises(ValueError, match=r"no target 'mtt::c'"):
        fit(
            _heads_options(data, path, inherit_heads={"energy": "mtt::c"}),
            None,
            progress=False,
            log=lambda m: None,
        )
    # petfunc eval --target reads that head too

    assert main(["eval", str(path), str(data), "--target", "mtt::b", "--json", str(tmp_path / "m.json")]) == 0
    assert main(["eval", str(path), str(data)]) == 2
    with pytest.raises(ValueError, match=r"only target is 'energy', not 'mtt::b'"):
        fit(
            _heads_options(data, checkpoint, inherit_heads={"energy": "mtt::b"}),
            None,
            progress=False,
            log=lambda m: None,
        )
    # a dataset target named like one of the checkpoint's: that target is fine-tuned,
    # its heads and its composition and scale kept, as metatrain does
    named = _heads_options(data, path)
    named["training_set"] = {
        "systems": str(data),
        "targets": {"mtt::b": {"key": "energy", "quantity": "energy"}},
    }
    _, params = initial_model(resolve_options(named), {}, [], torch.float64, "cpu", 0, lambda m: None)
    assert torch.equal(
        tree.flatten(params)["node_heads.energy.0.0.weight"],
        state["backend.node_heads.mtt::b.0.0.weight"].double(),
    )
    result = fit(named, None, progress=False, log=lambda m: None)
    _, source = load_model(path, dtype=torch.float64, target="mtt::b")
    assert torch.equal(result.params["composition_weights"], source["composition_weights"])
    # a name the checkpoint lacks: metatrain starts new heads; petfunc asks which to start from
    named["training_set"]["targets"] = {"mtt::c": {"key": "energy", "quantity": "energy"}}
    with pytest.raises(ValueError, match=r"has no target 'mtt::c': metatrain would start new heads"):
        fit(named, None, progress=False, log=lambda m: None)
    # metatrain's inherit_heads is keyed by the trained target's name: the composition
    # of that new target is fitted on the new data
    named["architecture"]["training"]["finetune"]["inherit_heads"] = {"mtt::c": "mtt::a"}
    lines = []
    result = fit(named, None, progress=False, log=lines.append)
    assert not torch.equal(result.params["composition_weights"], source["composition_weights"])
    assert not any("of the fine-tuning checkpoint" in line for line in lines)


def test_heads_that_match_nothing(base, tmp_path):
    data, checkpoint = base
    options = _heads_options(data, checkpoint, config={"head_modules": ["readout"], "last_layer_modules": []})
    with pytest.raises(ValueError, match=r"no parameter path starts with any of \['readout'\]"):
        fit(options, tmp_path / "run", progress=False, log=lambda m: None)
    assert not (tmp_path / "run" / "last.ckpt").exists()
    options = _heads_options(data, checkpoint, method="lora", config={"target_modules": ["attention"]})
    with pytest.raises(ValueError, match=r"no linear layer is named any of \['attention'\]"):
        fit(options, tmp_path / "lora", progress=False, log=lambda m: None)


def test_command_line_flags(base, tmp_path, capsys):
    """`petfunc train options.yaml --finetune MODEL --finetune-method lora`."""
    import yaml

    data, checkpoint = base
    options = _heads_options(data, checkpoint)
    del options["architecture"]["training"]["finetune"]
    options["architecture"]["training"]["num_epochs"] = 1
    (tmp_path / "options.yaml").write_text(yaml.safe_dump(options))
    args = [
        "train",
        str(tmp_path / "options.yaml"),
        "--finetune",
        str(checkpoint),
        "--finetune-method",
        "lora",
        "--output",
        str(tmp_path / "run"),
        "--no-progress",
    ]
    assert main(args) == 0, capsys.readouterr().err
    saved = json.loads(torch.load(tmp_path / "run" / "last.ckpt", weights_only=True)["options"])
    assert saved["architecture"]["training"]["finetune"]["method"] == "lora"
    assert "LoRA adapters of rank 4 (alpha 8)" in capsys.readouterr().out
    # without an options file: the model is the checkpoint's (the demo's architecture
    # was compared with it: "d_pet: 32 here, 8 in it")
    args = [
        "train",
        "--set",
        f"training_set={data}",
        "--finetune",
        str(checkpoint),
        "--finetune-method",
        "heads",
        "--epochs",
        "1",
        "--output",
        str(tmp_path / "bare"),
        "--no-progress",
    ]
    assert main(args) == 0, capsys.readouterr().err
    assert json.loads(torch.load(tmp_path / "bare" / "last.ckpt", weights_only=True)["config"])["d_pet"] == 8


def test_model_section_atomic_types_may_be_symbols():
    from petfunc.config import PETConfig
    from petfunc.trainer.models import check_model_section

    config = PETConfig(atomic_types=(1, 6, 8))
    check_model_section({"atomic_types": ["O", "H"]}, config, "the checkpoint")
    with pytest.raises(ValueError, match=r"has type\(s\) \[29\] that the model of the checkpoint lacks"):
        check_model_section({"atomic_types": ["H", "Cu"]}, config, "the checkpoint")
