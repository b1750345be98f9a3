"""LoRA adapters (petfunc.lora): attached to the targeted layers, merged exactly, and
LoRAPET, a PET wrapped so that its evaluations see the merged weights."""

import pytest
import torch

import petfunc
from petfunc import lora


CONFIG = petfunc.PETConfig(atomic_types=(1, 6, 8), d_pet=8, d_node=8, d_head=8, d_feedforward=8, num_heads=2)


def _inputs():
    import ase.build

    return petfunc.from_atoms([ase.build.molecule("CH3OH")], CONFIG, dtype=torch.float64)


def test_adapters_of_the_attention_layers():
    params = petfunc.PET(CONFIG).init(seed=0, dtype=torch.float64)
    layers = lora.target_layers(params)
    assert layers and all(layer.rsplit(".", 1)[-1] in lora.DEFAULT_TARGETS for layer in layers)
    adapted = lora.attach(params, rank=2, seed=1)
    a = petfunc.tree.flatten(adapted[lora.KEY])
    assert set(a) == {f"{layer}.lora_{x}.weight" for layer in layers for x in "AB"}
    assert lora.scaling_of(8.0, adapted) == 4.0  # alpha / rank
    with pytest.raises(ValueError, match="already have LoRA adapters"):
        lora.attach(adapted)
    with pytest.raises(ValueError, match="positive integer"):
        lora.attach(params, rank=0)


def test_lora_pet_evaluates_the_merged_weights():
    params = lora.attach(petfunc.PET(CONFIG).init(seed=0, dtype=torch.float64), rank=2, seed=1)
    # non-zero B (nn.Linear's initialisation of both) so the merge changes the weights
    merged = lora.merge(params, 0.5)
    assert not torch.equal(
        petfunc.tree.flatten(merged)[lora.target_layers(params)[0] + ".weight"],
        petfunc.tree.flatten(params)[lora.target_layers(params)[0] + ".weight"],
    )
    model, plain = lora.LoRAPET(CONFIG, 0.5), petfunc.PET(CONFIG)
    inputs = _inputs()
    for name in petfunc.PET.EVALUATIONS:
        ours = getattr(model, name)(params, *inputs)
        reference = getattr(plain, name)(merged, *inputs)
        for x, y in zip(
            ours if isinstance(ours, tuple) else (ours,),
            reference if isinstance(reference, tuple) else (reference,),
        ):
            assert torch.equal(x, y), name
    # the rest is the wrapped PET's
    assert model.config == CONFIG and model.pet == plain
    assert petfunc.tree.flatten(model.init(seed=3)).keys() == petfunc.tree.flatten(plain.init(seed=3)).keys()
    assert model == lora.LoRAPET(CONFIG, 0.5) and model != lora.LoRAPET(CONFIG, 1.0)


def test_lora_pet_forces_are_the_merged_models():
    params = lora.attach(petfunc.PET(CONFIG).init(seed=0, dtype=torch.float64), rank=2, seed=1)
    inputs = _inputs()
    ours = petfunc.energy_forces_stress(lora.LoRAPET(CONFIG, 0.5).energy)(params, *inputs)
    reference = petfunc.energy_forces_stress(petfunc.PET(CONFIG).energy)(lora.merge(params, 0.5), *inputs)
    torch.testing.assert_close(ours[1], reference[1], rtol=0, atol=1e-12)


def test_the_loss_trains_a_lora_pet_in_training_units():
    """make_loss takes a model's raw_energy: a LoRAPET's is the merged model's."""
    from petfunc.train.loss import training_energy

    model = lora.LoRAPET(CONFIG, 0.5)
    params = lora.attach(petfunc.PET(CONFIG).init(seed=0, dtype=torch.float64), rank=2, seed=1)
    inputs = _inputs()
    torch.testing.assert_close(
        training_energy(model)(params, *inputs),
        petfunc.PET(CONFIG).raw_energy(lora.merge(params, 0.5), *inputs),
        rtol=0,
        atol=0,
    )
