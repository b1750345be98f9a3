"""petfunc's ``(config, params)`` as a metatrain PET: its checkpoint and its model.

:func:`to_metatrain` is the inverse of :func:`petfunc.io.metatrain.from_metatrain`:
it builds metatrain's own ``PET`` from the hypers and a dataset description (the
atomic types, one energy target in eV, lengths in Å), loads the network weights
(``backend.*``, ``long_range_featurizer.*``), the composition weights and the energy
scale into its modules and buffers, and returns the checkpoint that metatrain's
trainer would save for it (``PET.get_checkpoint`` plus the trainer's entries, at the
installed metatrain's checkpoint versions). ``mtt export`` turns that file into a
metatomic model, and ``mtt train --restart`` continues training from it.

Needs the optional ``metatrain`` extra (``pip install 'petfunc[metatrain]'``).
"""

from __future__ import annotations

import contextlib
import copy
import io
import warnings
from typing import Any

import torch

from petfunc import lora, tree
from petfunc._files import PathLike, atomic_write
from petfunc.config import PETConfig
from petfunc.io.metatrain.convert import to_metatrain_state_dict
from petfunc.io.metatrain.unpickle import require_metatrain
from petfunc.io.params import check_params
from petfunc.model import TARGET


#: metatrain's names of the units petfunc's parameters are in
LENGTH_UNIT, ENERGY_UNIT = "angstrom", "eV"


def metatrain_hypers(config: PETConfig) -> dict:
    """metatrain's ``model_hypers`` of ``config`` (without the atomic types)."""
    hypers = config.to_hypers()
    del hypers["atomic_types"]
    nu = hypers["num_neighbors_adaptive"]
    if nu is not None and float(nu).is_integer():
        # metatrain's options type it as an integer; its model computes with any number
        hypers["num_neighbors_adaptive"] = int(nu)
    return hypers


def _dataset_info(config: PETConfig):
    """metatrain's description of a dataset of energies in eV, lengths in Å."""
    from metatrain.utils.data import DatasetInfo
    from metatrain.utils.data.target_info import get_energy_target_info

    target = get_energy_target_info(TARGET, {"quantity": "energy", "unit": ENERGY_UNIT, "description": ""})
    return DatasetInfo(
        length_unit=LENGTH_UNIT, atomic_types=list(config.atomic_types), targets={TARGET: target}
    )


def _with_values(buffer: torch.Tensor, values_of) -> torch.Tensor:
    """A metatensor buffer (a serialized one-block ``TensorMap``) with its values
    replaced by ``values_of(block)`` (float64, the block's shape)."""
    import metatensor.torch as mts

    tensor_map = mts.load_buffer(buffer)
    block = tensor_map.block()
    values = values_of(block).to(torch.float64).reshape(block.values.shape)
    new_block = mts.TensorBlock(values, block.samples, block.components, block.properties)
    return mts.save_buffer(mts.make_contiguous(mts.TensorMap(tensor_map.keys, [new_block])))


def _composition_values(weights: torch.Tensor, atomic_types):
    """The composition block's values: one energy (eV) per sample's ``center_type``."""
    by_type = {int(t): weights[i] for i, t in enumerate(atomic_types)}

    def values_of(block):
        column = block.samples.names.index("center_type")
        return torch.stack([by_type[int(sample[column])] for sample in block.samples.values])

    return values_of


def _load_weights(pet, config: PETConfig, params) -> None:
    """Load ``params``' weights, composition weights and energy scale into the
    metatrain ``pet`` (through its state dict, as ``PET.load_checkpoint`` does)."""
    state = pet.state_dict()
    weights = {k: v.detach().cpu() for k, v in to_metatrain_state_dict(params, config).items()}
    unknown = sorted(set(weights) - set(state))
    missing = sorted({name for name, _ in pet.named_parameters()} - set(weights))
    if unknown or missing:
        raise ValueError(
            f"the installed metatrain's PET does not match petfunc's parameters (missing there: "
            f"{unknown[:5]}, missing here: {missing[:5]}): install a metatrain version petfunc supports"
        )
    state.update({k: v.to(state[k].dtype) for k, v in weights.items()})
    composition = f"additive_models.0.{TARGET}_composition_buffer"
    weights_ev = params["composition_weights"].detach().cpu()
    state[composition] = _with_values(
        state[composition], _composition_values(weights_ev, config.atomic_types)
    )
    scale = params["energy_scale"].detach().cpu().to(torch.float64).reshape(())
    # an energy has one property: its scale is the per-target scale, the per-property one is 1
    for name in (f"scaler.{TARGET}_scaler_buffer", f"scaler.{TARGET}_per_target_scaler_buffer"):
        state[name] = _with_values(state[name], lambda block: scale.expand(block.values.shape))
    pet.load_state_dict(state)
    pet.additive_models[0].sync_tensor_maps()
    pet.scaler.sync_tensor_maps()


def _checked(config: PETConfig, params, dtype):
    """``params`` on the CPU with the network weights in ``dtype`` (default: theirs),
    checked against ``config``; LoRA adapters are refused (merge them first)."""
    if not isinstance(config, PETConfig):
        raise TypeError(f"config must be a PETConfig, got {type(config).__name__}")
    if isinstance(params, dict) and lora.KEY in params:
        raise ValueError(
            "the parameters carry LoRA adapters (params['lora']): merge them into the weights first, "
            "petfunc.lora.merge(params, petfunc.lora.scaling_of(alpha, params)); load_model merges them"
        )
    check_params(config, params, what="the parameters to write for metatrain")
    if dtype not in (None, torch.float32, torch.float64):
        raise ValueError(f"metatrain's PET computes in float32 or float64, not {dtype}")
    frozen = ("composition_weights", "energy_scale")
    flat = tree.flatten(params)
    network = dtype or next(v.dtype for k, v in flat.items() if k not in frozen)
    return tree.unflatten(
        {k: v.detach().cpu().to(torch.float64 if k in frozen else network) for k, v in flat.items()}
    ), network


def to_metatrain(config: PETConfig, params, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """metatrain's checkpoint of a PET with ``config`` and ``params`` (Å, eV).

    The dict :meth:`Trainer.save_checkpoint` of metatrain's PET writes: its
    ``architecture_name``, ``model_ckpt_version`` and ``trainer_ckpt_version`` (the
    installed metatrain's), ``metadata``, ``model_data`` (the hypers and a dataset
    description: the atomic types, one target ``energy`` in eV, lengths in Å),
    ``model_state_dict`` and ``best_model_state_dict`` (the same weights), and
    ``train_hypers`` (metatrain's defaults). No epoch, optimizer or scheduler state
    is carried over (``None``, as in a checkpoint of an untrained model): ``mtt train
    --restart`` starts from these weights with a fresh optimizer at epoch 0.

    :func:`petfunc.io.metatrain.from_metatrain` of the result gives ``params`` back
    bitwise. Save it with ``torch.save`` (or :func:`save_metatrain`).

    Args:
        config: the architecture.
        params: its parameters (without LoRA adapters: merge them first).
        dtype: of the network weights, ``torch.float32`` or ``torch.float64``
            (default: theirs). The composition weights and scale stay float64, as
            metatrain keeps them.
    """
    try:
        require_metatrain()
    except ImportError as error:
        raise ImportError(
            "writing a metatrain checkpoint or a metatomic model needs metatrain, an optional "
            "dependency: install it with `pip install 'petfunc[metatrain]'`"
        ) from error
    from metatrain.pet import PET
    from metatrain.pet.trainer import Trainer
    from metatrain.utils.architectures import get_default_hypers

    params, dtype = _checked(config, params, dtype)
    with _quiet_long_range():
        pet = PET(metatrain_hypers(config), _dataset_info(config))
    # as metatrain's trainer keeps them: the network in its dtype, the additive
    # models and the scaler in float64
    pet.to(dtype)
    pet.additive_models.to(torch.float64)
    pet.scaler.to(torch.float64)
    _load_weights(pet, config, params)
    checkpoint = pet.get_checkpoint()
    best = dict(checkpoint["best_model_state_dict"])
    best["finetune_config"] = copy.deepcopy(pet.finetune_config)
    checkpoint.update(
        trainer_ckpt_version=Trainer.__checkpoint_version__,
        train_hypers=get_default_hypers("pet")["training"],
        epoch=None,
        optimizer_state_dict=None,
        scheduler_state_dict=None,
        best_epoch=None,
        best_metric=None,
        best_model_state_dict=best,
        best_optimizer_state_dict=None,
    )
    return checkpoint


def save_metatrain(config: PETConfig, params, path: PathLike, dtype: torch.dtype | None = None) -> None:
    """Write :func:`to_metatrain` ``(config, params, dtype)`` to ``path`` (a ``.ckpt``
    file ``mtt export`` and ``mtt train --restart`` read), atomically."""
    checkpoint = to_metatrain(config, params, dtype)
    buffer = io.BytesIO()
    torch.save(checkpoint, buffer)
    atomic_write(path, lambda handle: handle.write(buffer.getbuffer()), what="checkpoint")


def metatrain_model(config: PETConfig, params, dtype: torch.dtype | None = None):
    """metatrain's PET (a ``torch.nn.Module`` in eval mode) with ``config`` and
    ``params``, built from :func:`to_metatrain`'s checkpoint by metatrain's own
    ``model_from_checkpoint(..., context="export")``, as ``mtt export`` builds it.
    Its ``export()`` is the metatomic ``AtomisticModel``."""
    from metatrain.utils.io import model_from_checkpoint

    checkpoint = to_metatrain(config, params, dtype)
    with _quiet_long_range():
        return model_from_checkpoint(checkpoint, context="export").eval()


@contextlib.contextmanager
def _quiet_long_range():
    """Silences metatrain's warning, on building a long-range PET, that it trains with
    Ewald whatever ``use_ewald`` says: nothing is trained here."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="Training PET with the LongRangeFeaturizer", category=UserWarning
        )
        yield
