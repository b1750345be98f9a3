"""Saving, loading and importing PET parameters.

* :func:`save_params` / :func:`load_params`: petfunc's own file, a ``torch.save`` of
  plain data (strings, ints and a ``{dotted.name: tensor}`` dict, the config as JSON).
  It loads with ``torch.load(weights_only=True)``, so reading a file never runs
  pickled code, and it is written atomically (temporary file + ``os.replace``).
* :func:`from_metatrain`: a metatrain PET checkpoint (``.ckpt`` or ``.ckpt.gz``, model
  versions 1 to 16) or an exported metatomic ``model.pt`` to ``(config, params)``.
  This needs the optional ``metatrain`` extra. The checkpoint loads with
  ``torch.load(weights_only=True)``, allowing only the objects metatrain checkpoints
  hold (its dataset and target descriptions, metatensor layouts), so reading one
  runs no pickled code; ``PETFUNC_TRUST_CHECKPOINTS=1`` allows other objects in a
  file you trust.
* :func:`to_metatrain_state_dict`: the reverse for the network weights.

The composition weights and the energy scale that :func:`from_metatrain` reads are
kept in float64 whatever the network dtype: :func:`petfunc.model.energy` casts them
to the computation dtype, as metatrain does with its float64 buffers.
"""

from __future__ import annotations

import copy
import dataclasses
import gzip
import io
import json
import os
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from petfunc import tree
from petfunc._files import PathLike, atomic_write, not_a_file
from petfunc.config import PETConfig
from petfunc.model.pet import BLOCK, TARGET, init


FORMAT = "petfunc.params"
FORMAT_VERSION = 1

#: parameters that are not metatrain ``backend.*`` network weights
EXTRA_KEYS = ("composition_weights", "energy_scale")

#: the long-range weights, which metatrain's PET keeps outside ``backend.`` (its
#: ``long_range_featurizer`` also holds torch-pme buffers, which are not weights)
LONG_RANGE_WEIGHTS = ("long_range_featurizer.charges_map.", "long_range_featurizer.out_projection.")


# ---------------------------------------------------------------------------------------
# checking a parameter tree against a config


def _expected_shapes(config: PETConfig) -> dict[str, torch.Size]:
    """``{name: shape}`` of every parameter of ``config`` (in init's order)."""
    # the draws are cheap next to reading a file; float32 halves them for big models
    return {k: v.shape for k, v in tree.flatten(init(config, dtype=torch.float32)).items()}


def network_dtype(params) -> torch.dtype:
    """The dtype of the network weights (the first floating leaf outside ``EXTRA_KEYS``)."""
    for key, value in tree.flatten(params).items():
        if key not in EXTRA_KEYS and value.is_floating_point():
            return value.dtype
    return torch.get_default_dtype()


def cast_params(params, dtype, device):
    """Network weights to ``dtype``/``device``; the composition weights and energy
    scale (``EXTRA_KEYS``) and integer leaves keep their dtype."""
    flat = tree.flatten(params)
    out = {}
    for key, value in flat.items():
        keep = key in EXTRA_KEYS or not value.is_floating_point()
        out[key] = value.to(device=device, dtype=None if keep else dtype)
    return tree.unflatten(out)


def check_params(config: PETConfig, params, what: str = "parameters", expected=None) -> None:
    """Raise ``ValueError`` naming every missing, unexpected or misshapen parameter."""
    expected = _expected_shapes(config) if expected is None else expected
    flat = tree.flatten(params)
    problems = []
    missing = [k for k in expected if k not in flat]
    unexpected = [k for k in flat if k not in expected]
    if missing:
        problems.append(f"missing {missing}")
    if unexpected:
        problems.append(f"unexpected {unexpected}")
    for key, shape in expected.items():
        value = flat.get(key)
        if value is None:
            continue
        if not isinstance(value, torch.Tensor):
            problems.append(f"{key} is a {type(value).__name__}, not a tensor")
        elif value.shape != shape:
            problems.append(f"{key} has shape {list(value.shape)}, expected {list(shape)}")
        elif not value.is_floating_point():
            problems.append(f"{key} has dtype {value.dtype}, expected a floating dtype")
    if problems:
        raise ValueError(f"{what} do not match the config: " + "; ".join(problems))


# ---------------------------------------------------------------------------------------
# petfunc's own file format


def save_params(path: PathLike, config: PETConfig, params) -> None:
    """Write ``config`` and ``params`` to ``path`` (atomically; overwrites).

    The file is a ``torch.save`` of ``{"format", "format_version", "config" (JSON),
    "params" ({dotted.name: tensor})}``: plain data that
    ``torch.load(path, weights_only=True)`` reads without running pickled code.
    Tensors are stored on the CPU with their own dtype.
    """
    if not isinstance(config, PETConfig):
        raise TypeError(f"config must be a PETConfig, got {type(config).__name__}")
    check_params(config, params)
    flat = {k: v.detach().to("cpu").clone().contiguous() for k, v in tree.flatten(params).items()}
    payload = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "config": json.dumps(config.to_hypers(), sort_keys=True),
        "params": flat,
    }
    atomic_save(payload, path)


def atomic_save(payload, path: PathLike) -> None:
    """``torch.save`` to a temporary file in the same folder, fsync, rename over ``path``:
    a crash or kill leaves either the old file or the new one, never a partial one."""
    atomic_write(path, lambda handle: torch.save(payload, handle))


def load_params(path: PathLike, dtype: torch.dtype | None = None, device=None) -> tuple[PETConfig, Any]:
    """Read a file written by :func:`save_params`.

    Args:
        path: the file.
        dtype: cast every tensor to this dtype (default: keep the stored dtypes).
        device: put every tensor there (default: CPU).

    Returns:
        ``(config, params)``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file is unreadable, corrupt, not a petfunc parameter file, or
            its parameters do not match its config.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(not_a_file(path, "petfunc parameter file"))
    if is_petfunc_export(path):
        raise ValueError(
            f"{str(path)!r} is a model written by petfunc export, not a parameter file: "
            "load it with petfunc.ase.PETCalculator.from_exported(path)"
        )
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as error:  # corrupt archives and pickles raise many types
        hint = ""
        if "weights_only" in str(error) or "Unsupported global" in str(error):
            hint = (
                " It holds Python objects, not plain tensors; for a metatrain "
                "checkpoint use petfunc.from_metatrain."
            )
        raise ValueError(
            f"{str(path)!r} is not a readable petfunc parameter file "
            f"({type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}).{hint}"
        ) from error
    return params_from_payload(payload, path, dtype, device)


def params_from_payload(payload, path: PathLike, dtype: torch.dtype | None = None, device=None):
    """:func:`load_params` of an already loaded file ``payload`` (read from ``path``,
    which the errors name)."""
    if isinstance(payload, dict) and payload.get("format") == "petfunc.checkpoint":
        raise ValueError(
            f"{str(path)!r} is a petfunc training checkpoint, not a parameter file: read it with "
            "petfunc.load_model(path, which='best' or 'last'), or load the run's best_params.pt"
        )
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise ValueError(f"{str(path)!r} is not a petfunc parameter file (no '{FORMAT}' format tag)")
    version = payload.get("format_version")
    if version != FORMAT_VERSION:
        raise ValueError(
            f"{str(path)!r} has petfunc parameter format version {version!r}; this "
            f"petfunc reads version {FORMAT_VERSION}"
        )
    try:
        hypers = json.loads(payload["config"])
        config = PETConfig.from_hypers(hypers)
    except (KeyError, TypeError, json.JSONDecodeError) as error:
        raise ValueError(f"{str(path)!r}: unreadable config ({error})") from error
    except ValueError as error:
        raise ValueError(f"{str(path)!r}: invalid config: {error}") from error
    flat = payload.get("params")
    if not isinstance(flat, dict) or not all(isinstance(v, torch.Tensor) for v in flat.values()):
        raise ValueError(f"{str(path)!r}: 'params' is not a dict of tensors")
    params = tree.unflatten(flat)
    check_params(config, params, what=f"the parameters in {str(path)!r}")
    if dtype is not None or device is not None:
        params = tree.tree_map(lambda t: t.to(dtype=dtype or t.dtype, device=device), params)
    return config, params


# ---------------------------------------------------------------------------------------
# metatrain


def _require_metatrain():
    try:
        import metatensor.torch  # noqa: F401  (registers TorchScript classes)
        import metatomic.torch  # noqa: F401
        from metatrain.pet import PET as MetatrainPET
    except ImportError as error:
        raise ImportError(
            "reading metatrain checkpoints needs metatrain, an optional dependency: "
            "install it with `pip install 'petfunc[metatrain]'`"
        ) from error
    return MetatrainPET


def _read_bytes(path: Path) -> bytes:
    if not path.is_file():
        raise FileNotFoundError(not_a_file(path, "metatrain checkpoint"))
    if is_petfunc_export(path):
        raise ValueError(
            f"{str(path)!r} is a model written by petfunc export, not a metatrain checkpoint: "
            "load it with petfunc.ase.PETCalculator.from_exported(path)"
        )
    data = path.read_bytes()
    if data[:2] == b"\x1f\x8b":  # gzip magic, whatever the extension
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError) as error:
            raise ValueError(f"{str(path)!r}: corrupt gzip file ({error})") from error
    return data


#: Environment variable that lets :func:`_unpickle_checkpoint` fall back to a full
#: unpickling (which can run code) for a trusted checkpoint holding other objects.
TRUST_ENV = "PETFUNC_TRUST_CHECKPOINTS"


def _checkpoint_globals():
    """The only non-tensor objects metatrain checkpoints hold (every shipped version,
    model v1 to v16 and LLPR): its dataset and target descriptions, and metatensor
    ``TensorMap`` layouts, which unpickle as TorchScript objects of a registered C++
    class (built from their serialized buffer, not by running pickled code)."""
    import importlib

    allowed = [torch.ScriptObject]
    for module, name in (
        ("metatrain.utils.data.dataset", "DatasetInfo"),
        ("metatrain.utils.data.target_info", "TargetInfo"),
    ):
        try:  # a metatrain that moved them: the refusal names them instead
            allowed.append(getattr(importlib.import_module(module), name))
        except (ImportError, AttributeError):
            pass
    return allowed


class UnreadableCheckpointError(ValueError):
    """A metatrain checkpoint file that cannot be read at all (a damaged archive or
    pickle), as opposed to one that reads but holds something petfunc refuses."""


def _unpickle_checkpoint(data: bytes, label: str):
    """A metatrain checkpoint's dict, read with ``torch.load(weights_only=True)`` and
    :func:`_checkpoint_globals` allowed, so no pickled code runs. A checkpoint with
    any other object is refused with its names, unless ``PETFUNC_TRUST_CHECKPOINTS=1``
    allows a full unpickling."""
    import pickle

    try:
        with torch.serialization.safe_globals(_checkpoint_globals()):
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as error:
        if os.environ.get(TRUST_ENV, "") not in ("", "0"):
            try:
                return torch.load(io.BytesIO(data), map_location="cpu", weights_only=False)
            except Exception as error2:
                raise UnreadableCheckpointError(
                    f"{label} is not a readable metatrain checkpoint ({type(error2).__name__}: {error2})"
                ) from error2
        names = _unsafe_globals(data)
        if not names:  # a damaged pickle, not a refused object
            raise UnreadableCheckpointError(
                f"{label} is not a readable metatrain checkpoint (UnpicklingError: "
                f"{str(error).splitlines()[0]})"
            ) from error
        raise ValueError(
            f"{label} holds pickled objects that petfunc does not unpickle ({', '.join(names)}): "
            f"loading them could run code. If you trust this file, set {TRUST_ENV}=1"
        ) from None
    except Exception as error:  # corrupt archives raise many types
        raise UnreadableCheckpointError(
            f"{label} is not a readable metatrain checkpoint ({type(error).__name__}: {error})"
        ) from error


def _unsafe_globals(data: bytes):
    """Names of the objects in a ``torch.save`` archive that :func:`_unpickle_checkpoint`
    does not allow (empty if the archive cannot be read)."""
    with torch.serialization.safe_globals(_checkpoint_globals()):
        try:
            return sorted(set(torch.serialization.get_unsafe_globals_in_checkpoint(io.BytesIO(data))))
        except Exception:
            return []


def is_petfunc_export(path: PathLike) -> bool:
    """Whether ``path`` is a PT2 archive written by ``petfunc export`` (it holds
    ``petfunc.json``; see :mod:`petfunc.export`)."""
    try:
        if not zipfile.is_zipfile(path):
            return False
        with zipfile.ZipFile(path) as archive:
            return any(name.endswith("extra/petfunc.json") for name in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        return False


def _is_torchscript(source) -> bool:
    """Whether ``source`` (the bytes or the path of a file) is a TorchScript archive,
    such as an exported metatomic model."""
    if isinstance(source, (bytes, bytearray)):
        source = io.BytesIO(source)
    if not zipfile.is_zipfile(source):
        return False
    try:
        with zipfile.ZipFile(source) as archive:
            return any("/code/" in name for name in archive.namelist())
    except (zipfile.BadZipFile, OSError):
        # found an end record, but a damaged directory: the loader that reads it
        # next says which file is unreadable
        return False


def _copy_checkpoint(checkpoint: Mapping) -> dict:
    """Copy what :meth:`PET.upgrade_checkpoint` mutates, sharing the tensors."""
    out = {k: v for k, v in checkpoint.items() if "optimizer" not in k and "scheduler" not in k}
    for key in ("model_data", "train_hypers"):
        if key in out:
            out[key] = copy.deepcopy(out[key])
    for key in ("model_state_dict", "best_model_state_dict"):
        state = out.get(key)
        if state is not None:
            out[key] = {
                k: (copy.deepcopy(v) if not isinstance(v, torch.Tensor) else v) for k, v in state.items()
            }
    return out


def _choose_target(dataset_info, target: str | None) -> str:
    targets = dict(dataset_info.targets)
    if target is not None:
        if target not in targets:
            raise ValueError(f"the checkpoint has no target {target!r}; it has {sorted(targets)}")
        return target
    if TARGET in targets:
        return TARGET
    energies = [name for name, info in targets.items() if getattr(info, "quantity", None) == "energy"]
    if len(energies) == 1:
        return energies[0]
    raise ValueError(
        f"cannot tell which target of the checkpoint is the energy (targets: "
        f"{sorted(targets)}); pass target=..."
    )


def _split_lora(state: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(state with every LoRA-wrapped linear's X.linear.* renamed X.*, the adapters
    X.lora_A/B.weight)``: the base weights and the adapters kept apart."""
    out, adapters = {}, {}
    wrapped = {k[: -len(".lora_A.weight")] for k in state if k.endswith(".lora_A.weight")}
    for key, value in state.items():
        if ".lora_A." in key or ".lora_B." in key:
            adapters[key] = value
            continue
        for prefix in wrapped:
            if key.startswith(prefix + ".linear."):
                key = prefix + "." + key[len(prefix + ".linear.") :]
                break
        out[key] = value
    return out, adapters


def _merge_lora(state: dict[str, torch.Tensor], scaling_of) -> dict[str, torch.Tensor]:
    """Replace every LoRA-wrapped linear (``X.linear.*``, ``X.lora_A/B.weight``) by a
    plain ``X.weight = W + s * B @ A`` and ``X.bias``; ``s = scaling_of(X, rank)``."""
    out, adapters = _split_lora(state)
    for key, a in adapters.items():
        if not key.endswith(".lora_A.weight"):
            continue
        prefix = key[: -len(".lora_A.weight")]
        b = adapters[f"{prefix}.lora_B.weight"]
        w = out[f"{prefix}.weight"]
        scaling = float(scaling_of(prefix, a.shape[0]))
        out[f"{prefix}.weight"] = (w.double() + scaling * (b.double() @ a.double())).to(w.dtype)
    return out


def _network_params(state: Mapping[str, torch.Tensor], target: str) -> dict[str, torch.Tensor]:
    """``backend.*`` weights without prefix, the chosen target's heads renamed to
    petfunc's ``energy`` / ``energy___0``, other targets' heads dropped."""
    heads = ("node_heads.", "edge_heads.", "node_last_layers.", "edge_last_layers.")
    prefix = "backend."
    out = {}
    for key, value in state.items():
        if key.startswith(LONG_RANGE_WEIGHTS):
            out[key] = value  # not under backend. in metatrain's PET
            continue
        if not key.startswith(prefix):
            continue
        name = key[len(prefix) :]
        if name == "species_to_species_index":
            continue
        if name.startswith(heads):
            group, rest = name.split(".", 1)
            if not rest.startswith(f"{target}."):
                continue  # another target's head
            rest = rest[len(target) + 1 :]
            if group.endswith("last_layers"):
                layer, block, leaf = rest.split(".", 2)
                if block != f"{target}___0":
                    raise ValueError(
                        f"target {target!r} has a last-layer block {block!r}; petfunc "
                        "supports a single scalar energy block"
                    )
                rest = f"{layer}.{BLOCK}.{leaf}"
            name = f"{group}.{TARGET}.{rest}"
        out[name] = value
    return out


def _composition_and_scale(state, target: str, atomic_types):
    import metatensor.torch as mts

    comp_keys = [
        k for k in state if k.startswith("additive_models.") and k.endswith(f".{target}_composition_buffer")
    ]
    if len(comp_keys) != 1:
        raise ValueError(f"expected one composition buffer for target {target!r}, found {comp_keys}")
    block = mts.load_buffer(state[comp_keys[0]]).block()
    values = block.values.detach().to(torch.float64).reshape(-1)
    if values.shape[0] != len(block.samples):
        raise ValueError("the composition block does not hold one weight per atomic type")
    column = block.samples.names.index("center_type")
    by_type = {int(s[column]): values[n] for n, s in enumerate(block.samples.values)}
    weights = torch.stack([by_type.get(int(t), torch.zeros((), dtype=torch.float64)) for t in atomic_types])

    scale_key = f"scaler.{target}_scaler_buffer"
    if scale_key not in state:
        raise ValueError(f"the checkpoint has no scaler buffer {scale_key!r}")
    scale_values = mts.load_buffer(state[scale_key]).block().values.detach()
    if scale_values.numel() != 1:
        raise ValueError(
            f"the energy scale of target {target!r} has {scale_values.numel()} entries; "
            "petfunc supports one scale per target"
        )
    return weights, scale_values.reshape(()).to(torch.float64)


def _assemble(config, network, weights, scale, dtype, source):
    if dtype is None:
        floats = [v.dtype for v in network.values() if v.is_floating_point()]
        dtype = floats[0] if floats else torch.float32
    flat = {k: v.detach().to(dtype) for k, v in network.items()}
    params = tree.unflatten(flat)
    params["composition_weights"] = weights
    params["energy_scale"] = scale
    expected = _expected_shapes(config)
    check_params(config, params, what=f"the weights of {source}", expected=expected)
    # reorder like init(), so that flatten() gives metatrain's state-dict order
    flat = tree.flatten(params)
    return tree.unflatten({k: flat[k] for k in expected})


def _unit_factor(from_unit: str, to_unit: str, label: str) -> float:
    """metatomic's conversion factor (what its ASE calculator multiplies by), so that
    a converted model agrees with metatomic's to round-off."""
    from metatomic.torch import unit_conversion_factor

    try:
        return float(unit_conversion_factor(from_unit, to_unit))
    except Exception as error:  # noqa: BLE001 - metatomic raises RuntimeError or ValueError
        raise ValueError(f"{label}: cannot convert its unit {from_unit!r} to {to_unit}: {error}") from None


def _in_angstrom_and_ev(
    config: PETConfig,
    params,
    length_unit: str,
    energy_unit: str,
    label: str,
    uncertainty: dict | None = None,
):
    """``(config, params, uncertainty)`` of a metatrain model made to take Å and give eV.

    A metatrain model works in the units of its training data (its ``length_unit``
    and its energy target's ``unit``), and metatomic's calculator converts at the
    boundary. petfunc works in Å and eV throughout, so a model in other units is
    converted once, here, exactly (to round-off):

    * energy: E_eV = f E_model. The energy is ``c sum eps_i + sum w_Z``, so the scale c
      and the composition weights w are multiplied by f (and the LLPR multiplier and
      ensemble weights, which give energies too).
    * length: the model sees x_model = k x_Å. Lengths enter PET as the edge vectors
      and distances fed to each GNN layer's linear ``edge_embedder`` (whose weight is
      multiplied by k), and as distances compared with ``cutoff``, ``cutoff_width``
      and ``cutoff_width_adaptive`` (divided by k) in switching functions and the
      adaptive solver, which depend on ratios of lengths only. The ``grid`` adaptive
      method probes radii from a fixed 0.5 length units, and the long-range features
      are Coulomb potentials in the model's units, so those two are refused in
      lengths other than Å.
    """
    f = _unit_factor(energy_unit, "eV", label) if energy_unit not in ("", "eV") else 1.0
    k = _unit_factor("angstrom", length_unit, label) if length_unit not in ("", "angstrom") else 1.0
    if k != 1.0:
        where = f"{label} works in lengths of {length_unit!r}"
        if config.adaptive and config.adaptive_cutoff_method == "grid":
            raise ValueError(f"{where}; petfunc converts only Å models with the 'grid' adaptive cutoff")
        if config.long_range.enable:
            raise ValueError(f"{where}; petfunc converts only Å models with long-range features")
        config = dataclasses.replace(
            config,
            cutoff=config.cutoff / k,
            cutoff_width=config.cutoff_width / k,
            cutoff_width_adaptive=config.cutoff_width_adaptive / k,
        )
        flat = tree.flatten(params)
        for name, value in flat.items():
            # the geometric embedding [V_x, V_y, V_z, D] -> d_pet of every GNN layer,
            # and a LoRA adapter of it (W + s B A: A takes the input)
            if name.startswith(("gnn_layers.", "lora.gnn_layers.")) and name.endswith(
                (".edge_embedder.weight", ".edge_embedder.lora_A.weight")
            ):
                flat[name] = value * k
        params = tree.unflatten(flat)
    if f != 1.0:
        params = {
            **params,
            "composition_weights": params["composition_weights"] * f,
            "energy_scale": params["energy_scale"] * f,
        }
        if uncertainty is not None:
            uncertainty = {**uncertainty, "multiplier": uncertainty["multiplier"] * f}
            if "ensemble_weights" in uncertainty:
                uncertainty["ensemble_weights"] = uncertainty["ensemble_weights"] * f
    return config, params, uncertainty


def _config_from_hypers(hypers: Mapping, atomic_types, source: str) -> PETConfig:
    hypers = dict(hypers)
    try:
        return PETConfig.from_hypers(hypers, atomic_types=[int(t) for t in atomic_types])
    except ValueError as error:
        raise ValueError(f"{source}: hypers petfunc cannot use: {error}") from error


def read_metatrain_baseline(
    path: PathLike,
    kind: str,
    atomic_types,
    unit: str,
    additive_models: tuple[str, ...] = ("CompositionModel",),
) -> np.ndarray:
    """Energy weights of a metatrain ``composition`` or ``scaler`` model checkpoint.

    These are what metatrain's ``atomic_baseline: path`` and ``fixed_scaling_weights:
    path`` options load (checkpoints of ``mtt train`` with ``architecture.name:
    composition`` or ``scaler``). The checks are metatrain's: the model kind, the
    atomic types (equal, in order) and the targets (exactly ``energy``, an energy).

    Args:
        kind: ``"composition"`` or ``"scaler"``.
        atomic_types: of the PET being trained.
        unit: the energy unit of the training data (petfunc's name, e.g. ``"eV"``).
            A checkpoint trained on data of another unit is an error; one that
            names no unit (metatrain's default) is taken to share the data's.
        additive_models: class names of metatrain's additive models of the PET
            being trained (``CompositionModel``, then ``ZBL`` with ``zbl``): a scaler
            must have been fitted after subtracting the same ones (metatrain's check).
    Returns:
        float64, in eV: ``[n_types]`` per-type energies (composition), or the energy
        scale as a 0-d array (scaler).
    """
    from petfunc.units import energy_unit_factor

    if kind not in ("composition", "scaler"):
        raise ValueError(f"kind must be 'composition' or 'scaler', got {kind!r}")
    # a missing file is named as such, with or without metatrain installed
    if not Path(path).is_file():
        raise FileNotFoundError(f"no {kind} checkpoint at {str(path)!r}")
    _require_metatrain()
    import metatensor.torch as mts
    from metatrain.composition import CompositionModel
    from metatrain.scaler import Scaler
    from metatrain.utils.io import load_model as metatrain_load_model
    from metatrain.utils.io import model_from_checkpoint

    classes = {"composition": CompositionModel, "scaler": Scaler}
    label = f"the {kind} checkpoint {str(path)!r}"
    data = _read_bytes(Path(path))
    # a checkpoint is unpickled safely here (metatrain's load_model would run its pickle)
    checkpoint = None if _is_torchscript(data) else _unpickle_checkpoint(data, label)
    try:
        model = (
            metatrain_load_model(str(path))
            if checkpoint is None
            else model_from_checkpoint(checkpoint, context="export")
        )
    except Exception as error:  # metatrain's own message names what it could not read
        raise ValueError(f"{label} could not be read by metatrain: {error}") from error
    if not isinstance(model, classes[kind]):
        raise ValueError(f"{label} holds a {type(model).__name__}, not a metatrain {classes[kind].__name__}")
    if [int(t) for t in model.atomic_types] != [int(t) for t in atomic_types]:
        raise ValueError(
            f"{label} has atomic types {list(model.atomic_types)}, the model "
            f"{list(atomic_types)}: they must be equal"
        )
    targets = model.dataset_info.targets
    if set(targets) != {"energy"}:
        raise ValueError(f"{label} has targets {sorted(targets)}; petfunc trains the target 'energy' only")
    info = targets["energy"]
    if info.quantity not in ("energy", ""):
        raise ValueError(f"{label}: its target 'energy' is a {info.quantity!r}, not an energy")
    factor = energy_unit_factor(unit)
    if info.unit and energy_unit_factor(info.unit) != factor:
        raise ValueError(
            f"{label} was fitted on energies in {info.unit!r}, the training data are in {unit!r}"
        )
    if kind == "scaler":
        trained = list(getattr(model, "training_additive_models", []))
        if trained != list(additive_models):
            raise ValueError(
                f"{label} was fitted after subtracting the additive models {trained}, but this PET "
                f"has {list(additive_models)}: fit the scaler with the composition checkpoint as an "
                "additive model (metatrain's scaler option additive_models)"
            )
    state = model.state_dict()
    key = "energy_composition_buffer" if kind == "composition" else "energy_scaler_buffer"
    if key not in state:
        raise ValueError(f"{label} has no buffer {key!r}")
    block = mts.load_buffer(state[key]).block()
    values = block.values.detach().to(torch.float64).reshape(-1)
    if kind == "scaler":
        if values.numel() != 1:
            raise ValueError(f"{label} holds {values.numel()} energy scales; petfunc supports one")
        return np.asarray(float(values[0]) * factor)
    column = block.samples.names.index("center_type")
    by_type = {int(sample[column]): float(values[n]) for n, sample in enumerate(block.samples.values)}
    return np.array([by_type.get(int(t), 0.0) * factor for t in atomic_types])


def from_metatrain(
    source: PathLike | Mapping[str, Any],
    dtype: torch.dtype | None = None,
    target: str | None = None,
) -> tuple[PETConfig, Any]:
    """Config and parameters of a metatrain PET.

    Args:
        source: a checkpoint path (``.ckpt``, or gzip-compressed ``.ckpt.gz``), a
            checkpoint dict as returned by ``torch.load`` (not modified), or the path
            of an exported metatomic model (``model.pt``).
        dtype: dtype of the network weights (default: the checkpoint's). The
            composition weights and the energy scale stay float64.
        target: which energy target to read (default: ``"energy"``, or the only
            target whose quantity is energy).

    An LLPR uncertainty checkpoint (``architecture_name: llpr``, as PET-MAD's are)
    gives the PET it wraps (see :mod:`petfunc.llpr` for its uncertainties).
    Checkpoints of every PET model version (1 to 16) are upgraded with metatrain's
    own ``PET.upgrade_checkpoint``. As metatrain's ``"export"`` context does, this
    reads ``best_model_state_dict`` (``model_state_dict`` if that is missing), and
    merges LoRA finetuning weights into the plain weights. A model trained in other
    units than Å and eV is converted to them (see :func:`_in_angstrom_and_ev`).

    Raises:
        ImportError: metatrain is not installed (``pip install 'petfunc[metatrain]'``).
        ValueError: not a PET checkpoint, weights that do not fit the hypers, or a
            checkpoint holding pickled objects other than metatrain's own (named in the
            message; ``PETFUNC_TRUST_CHECKPOINTS=1`` loads them from a file you trust).
    """
    config, params, _ = _read_metatrain(source, dtype, target)
    return config, params


def _read_metatrain(
    source,
    dtype=None,
    target=None,
    llpr: str | None = None,
    lora_out: dict | None = None,
    which: str = "best",
):
    """``(config, params, uncertainty)`` of a metatrain checkpoint or exported model,
    read once. ``llpr``: ``None`` (``uncertainty`` is ``None``), ``"if present"``
    (an LLPR checkpoint's uncertainty quantities, see :mod:`petfunc.llpr`) or
    ``"required"`` (anything else is an error).

    LoRA adapters of a checkpoint fine-tuned with ``method: lora`` are merged into
    the weights, unless ``lora_out`` is a dict: the adapters then stay apart, in
    ``params["lora"]`` (:mod:`petfunc.lora`'s layout), and ``lora_out`` receives the
    source's ``{"rank", "alpha", "targets"}``. ``which``: ``"best"`` reads a
    checkpoint's ``best_model_state_dict`` (as metatrain's export), ``"last"`` its
    ``model_state_dict``; an exported model has only one set of weights."""
    metatrain_pet = _require_metatrain()
    if isinstance(source, Mapping):
        label = "the checkpoint"
        checkpoint = _copy_checkpoint(source)
    else:
        label = repr(str(source))
        data = _read_bytes(Path(source))
        if _is_torchscript(data):
            if llpr == "required":
                raise ValueError(f"{label} is an exported model, not an LLPR checkpoint")
            if which != "best":
                raise ValueError(
                    f"{label} is an exported model, with one set of weights: there is no "
                    f"{which!r} one to choose (the training checkpoint has both)"
                )
            return (*_from_exported(data, dtype, target, label), None)
        checkpoint = _unpickle_checkpoint(data, label)
        if not isinstance(checkpoint, dict):
            raise ValueError(f"{label} is not a metatrain checkpoint (a {type(checkpoint).__name__})")

    name = checkpoint.get("architecture_name")
    if llpr == "required" and name != "llpr":
        raise ValueError(
            f"{label} is not an LLPR checkpoint (architecture_name={name!r}); "
            "petfunc.from_metatrain reads plain PET checkpoints"
        )
    wrapper = None
    if name == "llpr":
        wrapper = checkpoint
        checkpoint = _llpr_wrapped_checkpoint(checkpoint, label)
        name = checkpoint.get("architecture_name")
    if name != "pet":
        if str(checkpoint.get("format", "")).startswith("petfunc."):
            raise ValueError(
                f"{label} is a petfunc file ({checkpoint['format']}), not a metatrain checkpoint: "
                "read it with petfunc.load_model(path) or PETCalculator.from_checkpoint(path)"
            )
        raise ValueError(f"{label} is not a PET checkpoint (architecture_name={name!r})")
    version = checkpoint.get("model_ckpt_version") or 1
    latest = metatrain_pet.__checkpoint_version__
    if version > latest:
        raise ValueError(
            f"{label} has PET model version {version}; the installed metatrain reads up "
            f"to version {latest}: upgrade metatrain"
        )
    checkpoint["model_ckpt_version"] = version
    if version < latest:
        checkpoint = metatrain_pet.upgrade_checkpoint(checkpoint)

    model_data = checkpoint["model_data"]
    dataset_info = model_data["dataset_info"]
    config = _config_from_hypers(model_data["model_hypers"], dataset_info.atomic_types, label)
    target = _choose_target(dataset_info, target)

    latest_state = checkpoint.get("model_state_dict") or {}
    if which not in ("best", "last"):
        raise ValueError(f"which must be 'best' or 'last', got {which!r}")
    state = dict(latest_state if which == "last" else checkpoint.get("best_model_state_dict") or latest_state)
    if not state:
        raise ValueError(f"{label} holds no model weights (no model_state_dict)")
    finetune = state.pop("finetune_config", None) or latest_state.get("finetune_config") or {}
    adapters = {}
    if finetune.get("method") == "lora":
        lora_config = dict(finetune.get("config") or {})
        alpha = float(lora_config.get("alpha", 8))  # metatrain's default
        if lora_out is None:
            state = _merge_lora(state, lambda prefix, rank: alpha / rank)
        else:
            state, adapters = _split_lora(state)
    elif any(k.endswith(".lora_A.weight") for k in state):
        raise ValueError(f"{label} has LoRA weights but its finetune_config is not 'lora'")

    network = _network_params(state, target)
    weights, scale = _composition_and_scale(state, target, config.atomic_types)
    params = _assemble(config, network, weights, scale, dtype, label)
    if adapters:
        from petfunc import lora

        adapters = _network_params(adapters, target)
        reference = tree.flatten(params)
        params[lora.KEY] = tree.unflatten(
            {
                k: v.detach().to(dtype=reference[k.rsplit(".lora_", 1)[0] + ".weight"].dtype)
                for k, v in adapters.items()
            }
        )
        lora_out.update(
            rank=int(next(v for k, v in adapters.items() if k.endswith(".lora_A.weight")).shape[0]),
            alpha=alpha,
            targets=tuple(lora_config.get("target_modules", lora.DEFAULT_TARGETS)),
        )
    uncertainty = None
    if llpr is not None and wrapper is not None:
        from petfunc.llpr import _uncertainty_of

        uncertainty = _uncertainty_of(wrapper, config, params, dtype, target, label)
    energy_unit = str(getattr(dataset_info.targets[target], "unit", "") or "")
    return _in_angstrom_and_ev(
        _zbl_as_metatrain(config, energy_unit),
        params,
        str(dataset_info.length_unit or ""),
        energy_unit,
        label,
        uncertainty,
    )


def is_llpr_checkpoint(path: PathLike) -> bool:
    """Whether ``path`` is a metatrain LLPR checkpoint (``architecture_name: llpr``);
    ``False`` for anything else, unreadable files and without metatrain installed."""
    try:
        data = _read_bytes(Path(path))
        if _is_torchscript(data):
            return False
        _require_metatrain()
        checkpoint = _unpickle_checkpoint(data, repr(str(path)))
    except (ImportError, OSError, ValueError):
        return False
    return isinstance(checkpoint, Mapping) and checkpoint.get("architecture_name") == "llpr"


def metatrain_units(source: PathLike, target: str | None = None) -> tuple[str, str]:
    """``(length unit, energy unit)`` of the data a metatrain checkpoint or exported
    model was trained on (metatomic's names; ``""`` where it names none)."""
    label = repr(str(source))
    data = _read_bytes(Path(source))
    if _is_torchscript(data):
        _require_metatrain()  # registers metatomic's TorchScript classes
        capabilities = torch.jit.load(io.BytesIO(data), map_location="cpu").capabilities()
        outputs = dict(capabilities.outputs)
        name = target or (TARGET if TARGET in outputs else None)
        if name not in outputs:
            raise ValueError(f"{label}: cannot pick the energy target among {sorted(outputs)}")
        return str(capabilities.length_unit or ""), str(outputs[name].unit or "")
    checkpoint = _unpickle_checkpoint(data, label)
    if checkpoint.get("architecture_name") == "llpr":
        checkpoint = _llpr_wrapped_checkpoint(checkpoint, label)
    info = checkpoint["model_data"]["dataset_info"]
    name = _choose_target(info, target)
    return str(info.length_unit or ""), str(getattr(info.targets[name], "unit", "") or "")


def _zbl_as_metatrain(config: PETConfig, energy_unit: str) -> PETConfig:
    """metatrain adds its ZBL repulsion only to energy targets whose unit is exactly
    ``"eV"`` (``ZBL.supports_target``); with any other unit, the empty default
    included, its PET has no ZBL term, whatever ``zbl`` says."""
    if config.zbl and energy_unit != "eV":
        return dataclasses.replace(config, zbl=False)
    return config


def _llpr_state(checkpoint: Mapping) -> dict[str, torch.Tensor]:
    """The LLPR wrapper's own weights, as metatrain's ``"export"`` context picks them
    (``best_model_state_dict``, else ``model_state_dict``; ``state_dict`` before v3)."""
    for key in ("best_model_state_dict", "model_state_dict", "state_dict"):
        if checkpoint.get(key):
            return dict(checkpoint[key])
    return {}


def _llpr_wrapped_checkpoint(checkpoint: Mapping, label: str) -> dict:
    """The PET checkpoint an LLPR uncertainty checkpoint (PET-MAD's kind) wraps.

    The wrapper's weights override the wrapped model's where they name them
    (``model.*``: metatrain loads them over the wrapped model, non-strictly)."""
    wrapped = checkpoint.get("wrapped_model_checkpoint")
    if not isinstance(wrapped, Mapping):
        raise ValueError(f"{label} is an LLPR checkpoint without a wrapped model checkpoint")
    inner = wrapped.get("architecture_name")
    if inner != "pet":
        raise ValueError(f"{label} is an LLPR checkpoint wrapping a {inner!r} model, not a PET")
    wrapped = _copy_checkpoint(wrapped)
    overrides = {k[len("model.") :]: v for k, v in _llpr_state(checkpoint).items() if k.startswith("model.")}
    if overrides:
        for key in ("best_model_state_dict", "model_state_dict"):
            if wrapped.get(key):
                wrapped[key] = {**wrapped[key], **overrides}
    return wrapped


def _as_written(value) -> float:
    """A hyperparameter an exported model keeps as a tensor: a float32 one reads back
    as the decimal it was written as (1.1, not 1.100000023841858), so that its config
    equals the checkpoint's."""
    if isinstance(value, torch.Tensor) and value.dtype == torch.float32:
        return float(np.format_float_positional(np.float32(value.item()), unique=True))
    return float(value)


def _from_exported(data: bytes, dtype, target, label):
    """An exported metatomic ``AtomisticModel`` wrapping a metatrain PET."""
    module = torch.jit.load(io.BytesIO(data), map_location="cpu")
    pet = getattr(module, "module", module)
    try:
        backend = pet.backend
    except AttributeError:
        if hasattr(pet, "model") and hasattr(pet.model, "backend"):
            # metatrain's LLPR wraps the PET; its exported form keeps no checkpoint data
            raise ValueError(
                f"{label} is an exported LLPR model (a PET inside metatrain's uncertainty "
                "wrapper): petfunc reads those from the LLPR checkpoint (.ckpt), "
                "petfunc.llpr.from_metatrain"
            ) from None
        raise ValueError(f"{label} is a TorchScript file but not an exported PET") from None
    names = (
        "cutoff",
        "cutoff_function",
        "cutoff_width",
        "num_neighbors_adaptive",
        "adaptive_cutoff_method",
        "d_pet",
        "d_node",
        "d_head",
        "d_feedforward",
        "num_heads",
        "num_gnn_layers",
        "num_attention_layers",
        "normalization",
        "activation",
        "attention_temperature",
        "transformer_type",
        "featurizer_type",
    )
    try:
        hypers = {n: getattr(backend, n) for n in names}
        hypers["cutoff_width_adaptive"] = pet.cutoff_width_adaptive
        atomic_types = list(pet.atomic_types)
    except AttributeError as error:
        raise ValueError(f"{label}: not an exported PET of a known version ({error})") from None
    conditioning = getattr(backend, "system_conditioning", None)
    hypers["system_conditioning"] = conditioning is not None
    if conditioning is not None:
        hypers["max_charge"] = int(conditioning.max_charge)
        hypers["max_spin_multiplicity"] = int(conditioning.max_spin_multiplicity)
    hypers["long_range"] = {"enable": bool(getattr(pet, "long_range", False))}
    if hypers["long_range"]["enable"]:
        try:
            featurizer = pet.long_range_featurizer
            p3m = featurizer.p3m_calculator
            hypers["long_range"].update(
                use_ewald=bool(featurizer.use_ewald),
                smearing=_as_written(p3m.potential.smearing),
                kspace_resolution=_as_written(p3m.mesh_spacing),
                interpolation_nodes=int(p3m.interpolation_nodes),
            )
        except AttributeError as error:
            raise ValueError(f"{label}: cannot read the long-range settings ({error})") from None
    state = {k[len("module.") :] if k.startswith("module.") else k: v for k, v in module.state_dict().items()}
    # PET's additive models are [composition] or [composition, ZBL]
    hypers["zbl"] = any(k.startswith("additive_models.1.") for k in state)
    config = _config_from_hypers(hypers, atomic_types, label)

    # the exported LoRA modules carry their own alpha / rank
    def scaling(prefix, rank):
        module = pet
        for part in prefix.split("."):  # ScriptModules have no get_submodule
            module = getattr(module, part)
        return module.scaling

    state = _merge_lora(state, scaling)

    outputs = [k.split(".")[2] for k in state if k.startswith("backend.node_heads.")]
    targets = sorted(set(outputs))
    if target is None:
        target = TARGET if TARGET in targets else (targets[0] if len(targets) == 1 else None)
    if target not in targets:
        raise ValueError(f"{label}: cannot pick the energy target among {targets}; pass target=...")
    network = _network_params(state, target)
    weights, scale = _composition_and_scale(state, target, config.atomic_types)
    params = _assemble(config, network, weights, scale, dtype, label)
    try:
        capabilities = module.capabilities()
        length_unit, energy_unit = str(capabilities.length_unit), str(capabilities.outputs[target].unit)
    except Exception as error:  # noqa: BLE001 - a TorchScript error of an unknown export
        raise ValueError(f"{label}: cannot read the units of the exported model ({error})") from None
    config, params, _ = _in_angstrom_and_ev(
        _zbl_as_metatrain(config, energy_unit), params, length_unit, energy_unit, label
    )
    return config, params


def to_metatrain_state_dict(params, config: PETConfig | None = None) -> dict[str, torch.Tensor]:
    """metatrain's ``backend.*`` state-dict entries for ``params`` (network weights only).

    With ``config`` the ``backend.species_to_species_index`` buffer is included too.
    The conditioning weights appear twice, as ``backend.system_conditioning.*`` and
    ``system_conditioning.*``: metatrain's PET aliases that module. The long-range
    weights keep metatrain's names, ``long_range_featurizer.*``. The composition
    weights and energy scale live in metatensor buffers (``additive_models.0.*``,
    ``scaler.*``); they are not part of this dict.
    """
    flat = tree.flatten(params)
    out: dict[str, torch.Tensor] = {}
    if config is not None:
        index = torch.full((max(config.atomic_types) + 1,), -1, dtype=torch.long)
        for i, t in enumerate(config.atomic_types):
            index[t] = i
        out["backend.species_to_species_index"] = index
    out.update(
        {
            k if k.startswith(LONG_RANGE_WEIGHTS) else f"backend.{k}": v
            for k, v in flat.items()
            if k not in EXTRA_KEYS
        }
    )
    out.update({k: v for k, v in flat.items() if k.startswith("system_conditioning.")})
    return out
