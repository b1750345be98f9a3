"""The options of ``petfunc train``: the example file holds the defaults, numbers read
as metatrain reads them.
"""

import yaml


def test_example_options_are_the_defaults():
    from pathlib import Path

    from petfunc.config import PETConfig
    from petfunc.trainer.options import TRAINING_DEFAULTS, resolve_options

    path = Path(__file__).resolve().parents[2] / "examples" / "options.yaml"
    options = resolve_options(yaml.safe_load(path.read_text()))
    model = options["architecture"]["model"]
    assert PETConfig.from_hypers({"atomic_types": [1], **model}) == PETConfig(atomic_types=(1,))
    assert options["architecture"]["training"] == TRAINING_DEFAULTS
    defaults = resolve_options({"training_set": "train.xyz"})
    options["architecture"]["model"] = defaults["architecture"]["model"] = {}
    assert options == defaults


def test_options_read_exponent_numbers_as_metatrain_does(tmp_path):
    """metatrain reads options with OmegaConf, where ``1e-3`` is a number; PyYAML's
    YAML 1.1 rules alone would give the string '1e-3' (a rejected learning rate, or a
    validation "file" named 1e-1)."""
    from petfunc.cli.commands import parser
    from petfunc.cli.options import overrides, read_options_file
    from petfunc.trainer.options import resolve_options

    path = tmp_path / "options.yaml"
    path.write_text(
        "training_set: train.xyz\nvalidation_set: 1e-1\n"
        "architecture:\n  training:\n    learning_rate: 1e-3\n    weight_decay: 5E-5\n"
        "  model:\n    cutoff: 45e-1\n    d_pet: 1e3x\n"
    )
    given = read_options_file(path)
    assert given["validation_set"] == 0.1 and given["architecture"]["model"]["d_pet"] == "1e3x"
    given["architecture"]["model"].pop("d_pet")
    options = resolve_options(given)
    training = options["architecture"]["training"]
    assert training["learning_rate"] == 1e-3 and training["weight_decay"] == 5e-5
    assert options["architecture"]["model"]["cutoff"] == 4.5
    args = parser().parse_args(
        ["train", "--set", "architecture.training.learning_rate=2e-3", "--set", "seed='7'"]
    )
    assert dict(overrides(args)) == {"architecture.training.learning_rate": 2e-3, "seed": "7"}
