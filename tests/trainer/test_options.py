"""The options: errors that name the key, metatrain's defaults, the loss forms as
metatrain expands them.
"""

import pytest

from petfunc.trainer import fit
from petfunc.trainer.options import parse_loss, resolve_options
from tests.helpers.trainer import quiet, tiny_options


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda o: o.update(epochs=3), "unknown option 'epochs'"),
        (
            lambda o: o["architecture"]["training"].update(num_epoch=3),
            "'architecture.training.num_epoch'.*did you mean 'num_epochs'",
        ),
        (lambda o: o["architecture"]["model"].update(dpet=3), "'architecture.model.dpet'"),
        (
            lambda o: o.update(training_set={"systems": "x.xyz", "targets": {"energy": {"kye": "e"}}}),
            "'training_set.targets.energy.kye'",
        ),
        (
            lambda o: o["architecture"]["training"].update(loss={"energy": {"wieght": 2}}),
            "'architecture.training.loss.energy.wieght'",
        ),
        (
            lambda o: o["architecture"]["training"].update(loss={"forces": {"weight": 2}}),
            r"'architecture.training.loss.forces': the forces loss is set under the energy target, as "
            r"'architecture.training.loss.energy.gradients.positions' "
            r"\(or 'architecture.training.loss.energy.forces'\)",
        ),
        (
            lambda o: o["architecture"]["training"].update(loss={"energy": {"gradients": {"forces": 10}}}),
            r"metatrain names gradients 'positions' \(forces\) and 'strain'",
        ),
        (
            lambda o: o["architecture"]["training"].update(loss={"energy": {"type": "mse", "delta": 0.3}}),
            r"'architecture.training.loss.energy.delta' is the threshold of the 'huber' loss; "
            r"this term is 'mse'",
        ),
        (lambda o: o["architecture"]["training"].update(batch_size=0), "batch_size' must be positive"),
        (lambda o: o.update(base_precision=16), "base_precision"),
        (lambda o: o.update(validation_set=1.0), "validation_set"),
        (
            lambda o: o["architecture"]["training"].update(remat=True, compile=True),
            "'architecture.training.remat' and .*compile.* exclude",
        ),
        (
            lambda o: o["architecture"]["training"].update(remat="yes"),
            "'architecture.training.remat' must be true or false",
        ),
        (
            lambda o: o["architecture"]["training"].update(deterministic="yes"),
            "'architecture.training.deterministic' must be true, false or null",
        ),
    ],
)
def test_bad_options(change, message):
    options = tiny_options("data.xyz")
    change(options)
    with pytest.raises(ValueError, match=message):
        resolve_options(options)


def test_options_defaults_and_loss_forms():
    options = resolve_options(
        {"training_set": "data.xyz", "architecture": {"name": "pet", "training": {"num_workers": 4}}}
    )
    training = options["architecture"]["training"]
    # metatrain's PET trainer defaults.
    assert (training["batch_size"], training["num_epochs"], training["learning_rate"]) == (16, 1000, 1e-4)
    assert training["augmentation"] is True and training["compile"] is False
    assert training["best_model_metric"] == "mae_prod" and "num_workers" not in training
    # metatrain's top-level logging keys: accepted, ignored (wandb with a warning)
    logging_keys = resolve_options({"training_set": "data.xyz", "print_stats": True, "final_eval": False})
    assert "print_stats" not in logging_keys and "final_eval" not in logging_keys
    with pytest.warns(UserWarning, match="does not log to Weights & Biases"):
        resolve_options({"training_set": "data.xyz", "wandb": {"project": "x"}})
    # one energy target of another name (metatrain's mtt::NAME; its key is the name by default)
    named = resolve_options(
        {"training_set": {"systems": "data.xyz", "targets": {"mtt::U0": {"unit": "kcal/mol"}}}}
    )
    assert named["training_set"]["targets"]["energy"]["key"] == "mtt::U0"
    assert named["training_set"]["targets"]["energy"]["unit"] == "kcal/mol"
    # as in metatrain: no forces or stress by default for such a target without an
    # explicit 'quantity: energy', and its loss keyed by its name
    assert named["training_set"]["targets"]["energy"]["forces"] is False
    assert named["training_set"]["targets"]["energy"]["stress"] is False
    explicit = resolve_options(
        {
            "training_set": {"systems": "data.xyz", "targets": {"mtt::U0": {"quantity": "energy"}}},
            "architecture": {"training": {"loss": {"mtt::U0": "mae"}}},
        }
    )
    assert explicit["training_set"]["targets"]["energy"]["forces"] == "auto"
    assert explicit["architecture"]["training"]["loss"] == {"energy": "mae"}
    with pytest.raises(ValueError, match=r"unknown option 'training_set.targets.mtt::U0'"):
        resolve_options({"training_set": {"systems": "data.xyz", "targets": {"energy": {}, "mtt::U0": {}}}})
    assert options["training_set"]["targets"]["energy"]["forces"] == "auto"
    assert options["validation_set"] == 0.1
    # metatrain's deprecated 'distributed': false is fine; true needs several processes
    training = {"distributed": False, "distributed_port": 1234}
    resolve_options({"training_set": "data.xyz", "architecture": {"name": "pet", "training": training}})
    with pytest.raises(ValueError, match="must be true or false"):
        resolve_options({"training_set": "data.xyz", "architecture": {"training": {"distributed": "yes"}}})
    distributed = {"training_set": "missing.xyz", "architecture": {"training": {"distributed": True}}}
    with pytest.raises(ValueError, match="is true, but this is one process"):
        fit(distributed, None, progress=False, log=quiet())
    with pytest.raises(FileNotFoundError):  # two ranks: past that check, to the data
        fit(
            distributed,
            None,
            progress=False,
            log=quiet(),
            world_size=2,
            reduce_grads=lambda g: g,
            reduce_metrics=lambda m: m,
        )
    weights, explicit = parse_loss(
        {"energy": {"type": "mae", "gradients": {"positions": {"weight": 10}}, "stress": 0.5}}
    )
    # metatrain: the energy type does not carry over to the gradient terms
    assert (weights.energy.type, weights.forces.weight, weights.forces.type, weights.stress.weight) == (
        "mae",
        10.0,
        "mse",
        0.5,
    )
    assert explicit == {"forces", "stress"}
    weights, explicit = parse_loss("huber")
    assert weights.stress.type == "huber" and explicit == set()
    weights, _ = parse_loss(
        {"energy": {"type": "huber", "delta": 0.1, "forces": {"type": "huber", "delta": 0.3}}}
    )
    assert (weights.energy.delta, weights.forces.delta, weights.stress.type) == (0.1, 0.3, "mse")
    with pytest.raises(ValueError, match="delta"):
        parse_loss({"energy": {"type": "huber", "delta": -1.0}})


LOSS_FORMS = [
    None,
    "huber",
    "mae",
    {"energy": "huber"},
    {"energy": {"type": "mae", "gradients": {"positions": {"weight": 10}}}},
    {"energy": {"type": "huber", "delta": 0.1, "forces": {"type": "huber", "delta": 0.3}}},
    {"energy": {"weight": 2.0, "forces": "mae", "virial": {"weight": 0.5}}},
    {"energy": {"gradients": {"positions": "huber", "strain": {"type": "mae", "weight": 3.0}}}},
    {"energy": {"reduction": "sum", "forces": {"reduction": "sum", "weight": 2.0}}},
    {"energy": {"type": "huber", "gradients": {"strain": {"reduction": "sum"}}}},
]


@pytest.mark.parametrize("form", LOSS_FORMS, ids=[str(f) for f in LOSS_FORMS])
def test_loss_options_expand_like_metatrain(form):
    """Every term's type, weight, Huber delta and reduction as metatrain's
    expand_loss_config gives them, for an energy target with forces and stress."""
    pytest.importorskip("metatrain")
    from metatrain.utils.omegaconf import expand_loss_config
    from omegaconf import OmegaConf

    targets = {"energy": {"quantity": "energy", "forces": {"key": "forces"}, "stress": {"key": "stress"}}}
    conf = OmegaConf.create(
        {"training_set": [{"targets": targets}], "architecture": {"training": {"loss": form}}}
    )
    expanded = OmegaConf.to_container(expand_loss_config(conf)["architecture"]["training"]["loss"])["energy"]
    weights, _ = parse_loss(form if form is not None else {})
    reference = {
        "energy": expanded,
        "forces": expanded["gradients"]["positions"],
        "stress": expanded["gradients"]["strain"],
    }
    for name, ref in reference.items():
        term = getattr(weights, name)
        assert (term.type, term.weight, term.delta, term.reduction) == (
            ref["type"],
            ref["weight"],
            ref.get("delta", 1.0),
            ref.get("reduction", "mean"),
        ), name


@pytest.mark.parametrize("name", ["energy", "energy/pbe", "mtt::U0", "mtt::U0/pbe", "mtt::dipole"])
def test_target_names_metatrain_accepts(name):
    """metatrain's names of an energy target: trained as the energy."""
    options = resolve_options({"training_set": {"systems": "data.xyz", "targets": {name: {}}}})
    assert options["training_set"]["targets"]["energy"]["key"] == name


@pytest.mark.parametrize(
    "name, message",
    [
        (
            "enrgy",
            r"'training_set(\[0\])?.targets.enrgy': unknown target name 'enrgy' \(did you mean 'energy'\?\)",
        ),
        ("Energy", r"unknown target name 'Energy' \(did you mean 'energy'\?\)"),
        ("U0", r"unknown target name 'U0'\. A target is named .*'mtt::NAME'.*\(here 'mtt::U0'\)"),
        ("energy/", r"unknown target name 'energy/'"),
        (
            "dft::U0",
            r"targets.dft::U0': target names with '::' must start with 'mtt::'.*did you mean 'mtt::U0'",
        ),
        ("mtt::", r"'mtt::' needs a name after it"),
        ("mtt::aux::energy_uncertainty", r"'mtt::aux::' names are metatrain's auxiliary outputs"),
        ("non_conservative_force", r"standard output petfunc does not train; petfunc trains energies only"),
        ("non_conservative_forces", r"standard output petfunc does not train; petfunc trains energies only"),
        ("energy_ensemble", r"standard output petfunc does not train; petfunc trains energies only"),
        ("charges", r"standard output petfunc does not train; petfunc trains energies only"),
        ("forces", r"'forces' looks like a derivative of the energy.*targets: \{energy: \{forces"),
        ("dft_virial", r"'dft_virial' looks like a derivative of the energy"),
    ],
)
def test_target_names_metatrain_refuses(name, message):
    """A misspelt target name would train a target of its own, without the forces and
    stress of the file; names of targets that are not energies are refused too."""
    with pytest.raises(ValueError, match=message):
        resolve_options({"training_set": {"systems": "data.xyz", "targets": {name: {"key": "energy"}}}})
    # in a list of datasets and beside the energy, too
    with pytest.raises(ValueError, match=message):
        resolve_options({"training_set": [{"systems": "data.xyz", "targets": {"energy": {}, name: {}}}]})


def test_a_non_energy_mtt_target_is_refused():
    """An mtt:: target declared as something other than a total energy."""
    for entry, message in (
        ({"quantity": "dipole"}, r"'training_set.targets.mtt::dipole.quantity' must be 'energy'"),
        ({"type": {"cartesian": {"rank": 1}}}, r"'training_set.targets.mtt::dipole.type' must be 'scalar'"),
        ({"per_atom": True}, r"'training_set.targets.mtt::dipole.per_atom' must be False"),
    ):
        with pytest.raises(ValueError, match=message + r" \(petfunc trains total energies\)"):
            resolve_options({"training_set": {"systems": "data.xyz", "targets": {"mtt::dipole": entry}}})


T = "architecture.training"


@pytest.mark.parametrize(
    "training, message",
    [
        ({"learning_rate": float("nan")}, rf"'{T}.learning_rate' must be a finite number, got nan"),
        ({"learning_rate": float("inf")}, rf"'{T}.learning_rate' must be a finite number, got inf"),
        ({"num_epochs": float("inf")}, rf"'{T}.num_epochs' must be a finite number, got inf"),
        ({"batch_size": float("nan")}, rf"'{T}.batch_size' must be a finite number, got nan"),
        ({"warmup_fraction": float("nan")}, rf"'{T}.warmup_fraction' must be a finite number"),
        ({"weight_decay": float("nan")}, rf"'{T}.weight_decay' must be a finite number"),
        ({"grad_clip_norm": float("inf")}, rf"'{T}.grad_clip_norm' must be a finite number, got inf"),
        ({"max_atoms_per_batch": float("inf")}, rf"'{T}.max_atoms_per_batch' must be a finite number"),
        ({"loss": {"energy": {"weight": float("nan")}}}, rf"'{T}.loss.energy.weight' must be a finite"),
        ({"loss": {"energy": {"forces": float("inf")}}}, rf"'{T}.loss.energy.forces' must be a finite"),
        ({"loss": {"energy": {"forces": -1}}}, rf"'{T}.loss.energy.forces' must be >= 0.0, got -1"),
        (
            {"loss": {"energy": {"type": "huber", "delta": float("inf")}}},
            rf"'{T}.loss.energy.delta' must be a finite number, got inf",
        ),
        (
            {"loss": {"energy": {"type": "huber", "delta": 0}}},
            rf"^option '{T}.loss.energy.delta' must be positive, got 0$",
        ),
        ({"atomic_baseline": {"energy": float("nan")}}, rf"'{T}.atomic_baseline.energy' must be a finite"),
        (
            {"atomic_baseline": {"energy": {29: float("inf")}}},
            rf"'{T}.atomic_baseline.energy.29' must be a finite number, got inf",
        ),
        (
            {"fixed_scaling_weights": {"energy": float("inf")}},
            rf"'{T}.fixed_scaling_weights.energy' must be a finite number",
        ),
    ],
)
def test_numbers_must_be_finite(training, message):
    """YAML's .nan and .inf are numbers to Python: no option means anything by them."""
    with pytest.raises(ValueError, match=message):
        resolve_options({"training_set": "data.xyz", "architecture": {"training": training}})


def test_top_level_and_model_numbers_must_be_finite():
    with pytest.raises(ValueError, match=r"option 'validation_set' must be a finite number, got nan"):
        resolve_options({"training_set": "data.xyz", "validation_set": float("nan")})
    with pytest.raises(ValueError, match=r"option 'seed' must be a finite number, got inf"):
        resolve_options({"training_set": "data.xyz", "seed": float("inf")})
    with pytest.raises(ValueError, match=r"option 'architecture.model': cutoff must be finite, got inf"):
        resolve_options({"training_set": "data.xyz", "architecture": {"model": {"cutoff": float("inf")}}})


def test_unused_metatrain_options_are_named_once_each():
    """Every metatrain option petfunc accepts and does not use gets one warning that
    names it; the device defaults to metatrain's auto and takes its names."""
    import warnings

    given = {
        "training_set": "data.xyz",
        "print_stats": True,
        "final_eval": False,
        "architecture": {
            "name": "pet",
            "training": {"num_workers": 4, "log_mae": True, "log_separate_blocks": True},
        },
    }
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        resolve_options(given)
    messages = [str(w.message) for w in caught]
    for name in (
        "architecture.training.num_workers",
        "architecture.training.log_mae",
        "architecture.training.log_separate_blocks",
        "print_stats",
        "final_eval",
    ):
        assert sum(f"option '{name}' is metatrain's and not used by petfunc" in m for m in messages) == 1, (
            messages
        )
    assert len(messages) == 5
    assert resolve_options({"training_set": "data.xyz"})["device"] == "auto"
    assert resolve_options({"training_set": "data.xyz", "device": "GPU"})["device"] == "gpu"
    with pytest.raises(
        ValueError, match="option 'device' is 'multi-gpu': petfunc trains on one device per process"
    ):
        resolve_options({"training_set": "data.xyz", "device": "multi-gpu"})
    with pytest.raises(ValueError, match="option 'device' must be 'auto', 'cpu', 'cuda'"):
        resolve_options({"training_set": "data.xyz", "device": "tpu"})
