"""Writing a deployment artifact: :func:`export` (see :mod:`petfunc.export`)."""

from __future__ import annotations

import inspect
import json
import os
import tempfile
from pathlib import Path

import torch

from petfunc.config import PETConfig
from petfunc.devices import resolve_device
from petfunc.export.inputs import OUTPUTS, input_names, method_of
from petfunc.export.program import trace
from petfunc.export.trust import record
from petfunc.model.long_range import P3M_AOTI_CORRECT


FORMAT = "petfunc.exported"
# 2: Neighbors gained charge and spin_multiplicity; 3: long-range inputs. Models
# without long-range features are still written as version 2, which older petfunc reads.
VERSION = 3
READABLE_VERSIONS = (2, 3)
METADATA = "petfunc.json"


def export(
    config: PETConfig,
    params,
    path,
    dtype: torch.dtype = torch.float32,
    device="cpu",
    aoti: bool | None = None,
    inductor_configs: dict | None = None,
    long_range: str | None = None,
) -> Path:
    """Write the deployment artifact of ``(config, params)`` to ``path`` (``.pt2``).

    Args:
        config, params: the model (weights are cast to ``dtype``; composition
            weights and energy scale keep float64 as in evaluation).
        path: output file; must end in ``.pt2``. Written atomically.
        dtype: computation dtype, ``torch.float32`` or ``torch.float64``.
        device: ``"cpu"`` or ``"cuda"``; an AOTInductor artifact runs on this device
            only, the exported program on any.
        aoti: also compile the program with AOTInductor (minutes on a CPU).
            Default (None): on the CPU only (see the module docstring for GPUs).
        inductor_configs: options for AOTInductor.
        long_range: for a model with long-range features, ``"p3m"`` (default:
            metatrain's evaluation; only the first structure of a call may be
            periodic) or ``"ewald"`` (metatrain's training; batches of crystals). See
            the module docstring.
    Returns:
        the path written.
    """
    # imports torch._dynamo: too slow for every petfunc import
    from torch.export.pt2_archive._package import package_pt2

    method = method_of(config, long_range)
    path = Path(path)
    if path.suffix != ".pt2":
        raise ValueError(f"the exported model's file name must end in .pt2, got {str(path)!r}")
    if dtype not in (torch.float32, torch.float64):
        raise ValueError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    device = resolve_device(device)
    if aoti and method == "p3m" and not P3M_AOTI_CORRECT:
        raise ValueError(
            "AOTInductor of torch < 2.13 miscompiles the strain derivative of P3M "
            "long-range features (torch 2.11: wrong by about 100 %): export with "
            "aoti=False (--no-aoti), long_range='ewald', or torch >= 2.13"
        )
    aoti = default_aoti(device, config, long_range) if aoti is None else bool(aoti)
    program, example = trace(config, params, dtype, device, method)
    metadata = _metadata(config, dtype, device, aoti, method)
    path.parent.mkdir(parents=True, exist_ok=True)
    # built next to the target and renamed into place: a failed export leaves no file
    with tempfile.TemporaryDirectory(dir=path.parent, prefix=".petfunc-export-") as scratch:
        aoti_files = None
        if aoti:
            options = dict(inductor_configs or {})
            options["aot_inductor.package"] = True
            module = program.module(check_guards=False) if _has_check_guards() else program.module()
            with torch.no_grad():
                aoti_files = {"model": torch._inductor.aot_compile(module, example, options=options)}
        partial = Path(scratch) / path.name  # the archive's root folder is its stem
        package_pt2(
            str(partial),
            exported_programs={"model": program},
            aoti_files=aoti_files,
            extra_files={METADATA: json.dumps(metadata)},
        )
        os.replace(partial, path)
    if aoti:  # its library is native code: loaded by default only where it was built
        record(path)
    return path


def _metadata(config: PETConfig, dtype: torch.dtype, device: torch.device, aoti: bool, method) -> dict:
    """The artifact's ``petfunc.json``: what :func:`petfunc.export.load` needs to run it."""
    metadata = {
        "format": FORMAT,
        "version": VERSION if method else 2,
        "hypers": config.to_hypers(),
        "dtype": str(dtype).replace("torch.", ""),
        "device": device.type,
        "aoti": bool(aoti),
        "inputs": list(input_names(method)),
        "outputs": list(OUTPUTS),
        "torch": torch.__version__,
    }
    if method:
        metadata["long_range"] = method
    return metadata


def default_aoti(device, config: PETConfig | None = None, long_range: str | None = None) -> bool:
    """Whether :func:`export` builds the AOTInductor library when not told: on the CPU
    yes; on a GPU no (its one build tried so far crashed the loading process: see
    the module docstring); for a P3M long-range model on torch < 2.13 no (its
    AOTInductor miscompiles the strain derivative: :data:`petfunc.model.long_range.P3M_AOTI_CORRECT`)."""
    if config is not None and method_of(config, long_range) == "p3m" and not P3M_AOTI_CORRECT:
        return False
    return torch.device(device).type == "cpu"


def _has_check_guards() -> bool:
    return "check_guards" in inspect.signature(torch.export.ExportedProgram.module).parameters
