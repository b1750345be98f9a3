"""LoRA fine-tuning: low-rank adapters on chosen linear layers (metatrain's
``finetune: {method: lora}``).

metatrain wraps each targeted ``nn.Linear`` (by default every attention
``input_linear`` and ``output_linear``) as ``y = W x + b + (alpha / rank) B (A x)``
with ``A`` [rank, d_in] and ``B`` [d_out, rank] (both initialised as ``nn.Linear``
weights, without bias), and trains ``A`` and ``B`` only. Here the adapters are one
more subtree of the parameters, ``params["lora"]``, whose paths are those of the
targeted layers (``lora.gnn_layers.0.trans.layers.0.attention.input_linear.lora_A.weight``),
and :class:`LoRAPET` evaluates PET with ``W + (alpha / rank) B A`` in place of ``W``:
the same function (``W x + s B (A x) = (W + s B A) x``), and every petfunc code path
(forces, stress, compile, Hessians) sees plain PET weights. Train the adapters alone
with ``train=TRAIN`` (:func:`petfunc.train.trainable`); :func:`merge` gives the
plain parameters of the fine-tuned model.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import torch

from petfunc import tree
from petfunc.model import PET
from petfunc.model.nn import init_linear


KEY = "lora"
TRAIN = (KEY + ".",)  # the ``train`` selection of the adapters
DEFAULT_TARGETS = ("input_linear", "output_linear")  # metatrain's default target_modules
DEFAULT_RANK, DEFAULT_ALPHA = 4, 8.0  # metatrain's defaults when the config omits them


def target_layers(params, targets: Sequence[str] = DEFAULT_TARGETS):
    """Dotted paths of the linear layers named ``targets`` (their last path
    component, as metatrain matches module attribute names). Every linear layer of
    PET has a bias; a 2-d weight without one is an embedding table, which metatrain
    does not adapt either."""
    flat = tree.flatten(params)
    paths = []
    for path, value in flat.items():
        if not path.endswith(".weight") or path.startswith(TRAIN) or value.dim() != 2:
            continue
        layer = path[: -len(".weight")]
        if layer.rsplit(".", 1)[-1] in targets and f"{layer}.bias" in flat:
            paths.append(layer)
    return paths


def attach(params, rank: int = DEFAULT_RANK, targets: Sequence[str] = DEFAULT_TARGETS, seed: int = 0):
    """``params`` plus adapters ``params["lora"]`` for every targeted layer (A and B
    drawn like ``nn.Linear`` weights from ``seed``). Raises ``ValueError`` when no
    layer matches or ``rank`` is not a positive integer."""
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise ValueError(f"LoRA rank must be a positive integer, got {rank!r}")
    if KEY in params:
        raise ValueError("these parameters already have LoRA adapters")
    layers = target_layers(params, targets)
    if not layers:
        raise ValueError(f"no linear layer is named any of {list(targets)} (LoRA target_modules)")
    flat = tree.flatten(params)
    generator = torch.Generator().manual_seed(int(seed))
    adapters = {}
    for layer in layers:
        weight = flat[f"{layer}.weight"]
        d_out, d_in = weight.shape
        a = init_linear(d_in, rank, generator, weight.dtype, "cpu", bias=False)["weight"]
        b = init_linear(rank, d_out, generator, weight.dtype, "cpu", bias=False)["weight"]
        adapters[f"{layer}.lora_A.weight"] = a.to(weight.device)
        adapters[f"{layer}.lora_B.weight"] = b.to(weight.device)
    return {**params, KEY: tree.unflatten(adapters)}


def merge(params, scaling: float):
    """Plain PET parameters: every adapted ``W`` replaced by ``W + scaling B A``
    (``params`` without adapters come back unchanged). Differentiable."""
    if KEY not in params:
        return params
    flat = {k: v for k, v in tree.flatten(params).items() if not k.startswith(TRAIN)}
    adapters = tree.flatten(params[KEY])
    for path, a in adapters.items():
        if not path.endswith(".lora_A.weight"):
            continue
        layer = path[: -len(".lora_A.weight")]
        b = adapters[f"{layer}.lora_B.weight"]
        flat[f"{layer}.weight"] = flat[f"{layer}.weight"] + scaling * (b @ a)
    return tree.unflatten(flat)


def scaling_of(alpha: float, params) -> float:
    """``alpha / rank`` with the rank read from the adapters' shapes."""
    ranks = {a.shape[0] for k, a in tree.flatten(params[KEY]).items() if k.endswith(".lora_A.weight")}
    if len(ranks) != 1:
        raise ValueError(f"LoRA adapters of different ranks {sorted(ranks)}")
    return float(alpha) / ranks.pop()


class LoRAPET:
    """A :class:`~petfunc.PET` whose parameters carry LoRA adapters: it wraps the PET
    (``.pet``), and each of its evaluations (:data:`petfunc.model.pet.PET.EVALUATIONS`:
    ``energy``, ``energy_terms``, ``per_atom_energies``, ``raw_energy``) evaluates the
    PET on :func:`merge` ``(params, scaling)`` (``scaling = alpha / rank``); every other
    attribute is the PET's."""

    def __init__(self, config, scaling: float):
        self.pet = PET(config)
        self.scaling = float(scaling)

    def __repr__(self) -> str:
        return f"LoRAPET({self.pet.config!r}, scaling={self.scaling!r})"

    def __eq__(self, other) -> bool:
        return isinstance(other, LoRAPET) and other.pet == self.pet and other.scaling == self.scaling

    def __hash__(self) -> int:
        return hash((self.pet, self.scaling))

    def __getattr__(self, name: str):
        if name in ("pet", "scaling"):  # not set yet (unpickling): no recursion
            raise AttributeError(name)
        attribute = getattr(self.pet, name)
        if name not in PET.EVALUATIONS:
            return attribute

        @functools.wraps(attribute)
        def evaluation(params, positions, cell, neighbors):
            return attribute(merge(params, self.scaling), positions, cell, neighbors)

        return evaluation


def config_of(finetune) -> dict | None:
    """``{rank, alpha, targets}`` of a validated ``finetune`` options section with
    ``method: lora`` (metatrain's defaults filled in), else ``None``."""
    if finetune.get("method", "full") != "lora":
        return None
    config = finetune.get("config") or {}
    return {
        "rank": int(config.get("rank", DEFAULT_RANK)),
        "alpha": float(config.get("alpha", DEFAULT_ALPHA)),
        "targets": tuple(config.get("target_modules", DEFAULT_TARGETS)),
    }
