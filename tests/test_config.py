"""PETConfig: metatrain's defaults, normalisation, and errors that name field and value."""

import dataclasses
import re

import pytest

import petfunc
from petfunc import PETConfig


def test_defaults_are_metatrains():
    c = PETConfig()
    assert (c.cutoff, c.cutoff_width, c.cutoff_function) == (4.5, 0.5, "Bump")
    assert (c.d_pet, c.d_head, c.d_node, c.d_feedforward, c.num_heads) == (128, 128, 256, 256, 8)
    assert (c.num_attention_layers, c.num_gnn_layers) == (2, 2)
    assert (c.normalization, c.activation, c.transformer_type, c.featurizer_type) == (
        "RMSNorm",
        "SwiGLU",
        "PreLN",
        "feedforward",
    )
    assert c.num_neighbors_adaptive is None and c.adaptive_cutoff_method == "solver"
    assert c.cutoff_width_adaptive == 1.0 and c.attention_temperature == 1.0
    assert not c.zbl and not c.long_range.enable and not c.system_conditioning


def test_defaults_match_installed_metatrain():
    pytest.importorskip("metatrain")
    from metatrain.utils.architectures import get_default_hypers

    hypers = get_default_hypers("pet")["model"]
    ours = PETConfig().to_hypers()
    for key, value in hypers.items():
        assert key in ours, key
        assert ours[key] == value, (key, ours[key], value)


def test_normalisation_and_hashing():
    c = PETConfig(atomic_types=[8, 1, 6], cutoff=5, cutoff_function="bump", num_neighbors_adaptive=12)
    assert c.atomic_types == (1, 6, 8) and c.num_species == 3
    assert c.cutoff == 5.0 and isinstance(c.cutoff, float)
    assert c.cutoff_function == "Bump" and c.num_neighbors_adaptive == 12.0 and c.adaptive
    assert c == PETConfig(atomic_types=(1, 6, 8), cutoff=5.0, num_neighbors_adaptive=12.0)
    assert hash(c) == hash(PETConfig(atomic_types=(1, 6, 8), cutoff=5.0, num_neighbors_adaptive=12.0))
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.d_pet = 3
    assert PETConfig(featurizer_type="residual", num_gnn_layers=3).num_readout_layers == 3
    assert PETConfig(num_gnn_layers=3).num_readout_layers == 1


def test_hypers_roundtrip():
    c = PETConfig(atomic_types=(1, 8), num_neighbors_adaptive=9, transformer_type="PostLN")
    assert PETConfig.from_hypers(c.to_hypers()) == c
    hypers = c.to_hypers()
    del hypers["atomic_types"]
    assert PETConfig.from_hypers(hypers, atomic_types=[8, 1]) == c


@pytest.mark.parametrize(
    "field, value",
    [
        ("cutoff_function", "Gaussian"),
        ("adaptive_cutoff_method", "bisection"),
        ("normalization", "BatchNorm"),
        ("activation", "ReLU"),
        ("transformer_type", "MidLN"),
        ("featurizer_type", "recurrent"),
        ("normalization", 3),
    ],
)
def test_bad_choice_names_field_and_value(field, value):
    with pytest.raises(ValueError, match=rf"^{field} must be one of .*got {re.escape(repr(value))}$"):
        PETConfig(**{field: value})


@pytest.mark.parametrize("field", ["d_pet", "d_head", "d_node", "d_feedforward", "num_heads"])
@pytest.mark.parametrize("value", [0, -2, 2.5, True, "8"])
def test_bad_sizes_name_field_and_value(field, value):
    with pytest.raises(
        ValueError, match=rf"^{field} must be a positive integer, got {re.escape(repr(value))}$"
    ):
        PETConfig(**{field: value})


@pytest.mark.parametrize("field", ["num_attention_layers", "num_gnn_layers"])
@pytest.mark.parametrize("value", [-1, 2.5, True, "8"])
def test_bad_layer_counts_name_field_and_value(field, value):
    """0 layers is a model metatrain builds (tests/parity/test_model.py); a
    residual featurizer without GNN layers is not (it fails there)."""
    with pytest.raises(ValueError, match=rf"^{field} must be an integer >= 0, got {re.escape(repr(value))}$"):
        PETConfig(**{field: value})
    PETConfig(num_attention_layers=0, num_gnn_layers=0, featurizer_type="feedforward")
    with pytest.raises(ValueError, match="num_gnn_layers 0 needs featurizer_type 'feedforward'"):
        PETConfig(num_gnn_layers=0, featurizer_type="residual")


@pytest.mark.parametrize(
    "field", ["cutoff", "cutoff_width", "cutoff_width_adaptive", "attention_temperature"]
)
@pytest.mark.parametrize("value", [0, -1.0, "4.5", None])
def test_bad_lengths_name_field_and_value(field, value):
    with pytest.raises(
        ValueError, match=rf"^{field} must be a positive number, got {re.escape(repr(value))}$"
    ):
        PETConfig(**{field: value})


def test_other_errors_name_fields_and_values():
    with pytest.raises(
        ValueError, match="d_pet must be divisible by num_heads, got d_pet=20 and num_heads=8"
    ):
        PETConfig(d_pet=20)
    PETConfig(cutoff_width=5.0)  # wider than the cutoff: every edge is switched (metatrain builds it)
    with pytest.raises(ValueError, match=r"num_neighbors_adaptive must be a number >= 0 or None, got -3"):
        PETConfig(num_neighbors_adaptive=-3)
    with pytest.raises(ValueError, match="atomic_types must not be empty"):
        PETConfig(atomic_types=())
    with pytest.raises(ValueError, match=r"atomic_types has duplicates: \(1, 6, 1\)"):
        PETConfig(atomic_types=(1, 6, 1))
    with pytest.raises(ValueError, match=r"atomic_types must be non-negative, got \(-1, 6\)"):
        PETConfig(atomic_types=(-1, 6))
    with pytest.raises(ValueError, match="atomic_types must be a sequence of atomic numbers, got 6"):
        PETConfig(atomic_types=6)
    with pytest.raises(ValueError, match=r"unknown PET hyperparameters: \['d_pett'\]"):
        PETConfig.from_hypers({"d_pett": 16})


def test_long_range_settings_are_checked():
    config = PETConfig(long_range={"enable": True, "smearing": 2, "interpolation_nodes": 3})
    assert config.long_range.enable and config.long_range.smearing == 2.0
    assert isinstance(config.long_range.smearing, float)
    assert PETConfig.from_hypers(config.to_hypers()) == config
    with pytest.raises(ValueError, match="long_range.smearing must be a positive number, got 0"):
        PETConfig(long_range={"enable": True, "smearing": 0})
    with pytest.raises(ValueError, match="long_range.kspace_resolution must be a positive number"):
        PETConfig(long_range={"enable": True, "kspace_resolution": -1.0})
    with pytest.raises(ValueError, match="interpolation_nodes must be an integer from 1 to 5, got 6"):
        PETConfig(long_range={"enable": True, "interpolation_nodes": 6})
    with pytest.raises(ValueError, match=r"unknown long_range hyperparameters: \['cutof'\]"):
        PETConfig(long_range={"enable": True, "cutof": 1.0})
    with pytest.raises(ValueError, match="long_range.enable must be true or false"):
        PETConfig(long_range={"enable": "yes"})


def test_conditioning_table_sizes_are_checked():
    assert PETConfig(system_conditioning=True, max_charge=0, max_spin_multiplicity=1).system_conditioning
    with pytest.raises(ValueError, match="max_charge must be an integer >= 0, got -1"):
        PETConfig(system_conditioning=True, max_charge=-1)
    with pytest.raises(ValueError, match="max_spin_multiplicity must be an integer >= 1, got 0"):
        PETConfig(system_conditioning=True, max_spin_multiplicity=0)
    with pytest.raises(ValueError, match="system_conditioning must be true or false"):
        PETConfig(system_conditioning="yes")


def test_model_needs_a_config():
    with pytest.raises(TypeError, match="PET needs a PETConfig, got dict"):
        petfunc.PET({"d_pet": 8})


def test_check_partial():
    """A partial model section (fine-tuning, restart): every given value is checked,
    rules between two hypers only where both are given."""
    PETConfig.check_partial({"d_pet": 6})  # num_heads comes from a checkpoint
    PETConfig.check_partial({"cutoff_width": 9.0})
    PETConfig.check_partial({})
    for bad, message in (
        ({"d_pet": 6, "num_heads": 4}, "d_pet must be divisible by num_heads"),
        ({"num_gnn_layers": 0, "featurizer_type": "residual"}, "num_gnn_layers 0 needs"),
        ({"num_heads": 0}, "num_heads must be a positive integer"),
        ({"cutoff": -1.0}, "cutoff must be a positive number"),
        ({"activation": "tanh"}, "activation must be one of"),
        ({"d_pett": 8}, r"unknown PET hyperparameters: \['d_pett'\]"),
    ):
        with pytest.raises(ValueError, match=message):
            PETConfig.check_partial(bad)


def test_atomic_types_are_atomic_numbers_or_symbols():
    import numpy as np

    # chemical symbols become atomic numbers; numpy integers are integers
    assert PETConfig(atomic_types=("H", "C")).atomic_types == (1, 6)
    assert PETConfig(atomic_types=("O", 1, np.int64(6))).atomic_types == (1, 6, 8)
    assert PETConfig(atomic_types=np.array([118, 1])).atomic_types == (1, 118)
    # a float is never rounded, even one of integral value; the entry is named
    with pytest.raises(ValueError, match=r"atomic_types entry 0 is 1.7, not an atomic number"):
        PETConfig(atomic_types=(1.7, 6))
    with pytest.raises(ValueError, match=r"atomic_types entry 1 is 6.0, not an atomic number.*\(write 6\)"):
        PETConfig(atomic_types=(1, 6.0))
    with pytest.raises(ValueError, match=r"atomic_types entry 0 is True, not an atomic number"):
        PETConfig(atomic_types=(True, 6))
    with pytest.raises(ValueError, match=r"atomic_types entry 1 is None, not an atomic number"):
        PETConfig(atomic_types=(1, None))
    # 1 (H) to 118 (Og)
    with pytest.raises(
        ValueError, match=r"atomic_types entry 1 is 300, not an atomic number from 1 \(H\) to 118"
    ):
        PETConfig(atomic_types=(1, 300))
    with pytest.raises(ValueError, match=r"atomic_types entry 0 is 0, not an atomic number from 1 \(H\)"):
        PETConfig(atomic_types=(0, 1))
    # symbols are matched exactly; "X" (ASE's dummy atom) is no element
    for symbol in ("h", "X", "Hx"):
        with pytest.raises(ValueError, match=rf"atomic_types entry 0 is '{symbol}', not a chemical symbol"):
            PETConfig(atomic_types=(symbol, 6))
    with pytest.raises(ValueError, match=r"atomic_types has duplicates: \(1, 1\)"):
        PETConfig(atomic_types=("H", 1))
    with pytest.raises(ValueError, match="atomic_types must be a sequence of atomic numbers, got 'HC'"):
        PETConfig(atomic_types="HC")
    # the hypers of an options file take symbols too
    assert PETConfig.from_hypers({"atomic_types": ["Cu", "Al"]}).atomic_types == (13, 29)


@pytest.mark.parametrize(
    "field", ["cutoff", "cutoff_width", "cutoff_width_adaptive", "attention_temperature"]
)
def test_lengths_must_be_finite(field):
    with pytest.raises(ValueError, match=rf"^{field} must be finite, got inf$"):
        PETConfig(**{field: float("inf")})
    with pytest.raises(ValueError, match=rf"^{field} must be a positive number, got nan$"):
        PETConfig(**{field: float("nan")})


def test_adaptive_count_and_long_range_must_be_finite():
    with pytest.raises(ValueError, match=r"^num_neighbors_adaptive must be finite, got inf \(None: a fixed"):
        PETConfig(num_neighbors_adaptive=float("inf"))
    with pytest.raises(ValueError, match="num_neighbors_adaptive must be a number >= 0 or None, got nan"):
        PETConfig(num_neighbors_adaptive=float("nan"))
    for name in ("smearing", "kspace_resolution"):
        with pytest.raises(ValueError, match=rf"^long_range.{name} must be finite, got inf$"):
            PETConfig(long_range={"enable": True, name: float("inf")})
        with pytest.raises(ValueError, match=rf"^long_range.{name} must be a positive number, got nan$"):
            PETConfig(long_range={"enable": True, name: float("nan")})
