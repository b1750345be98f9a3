"""The device a command or an option asks for, checked before any work starts.

``torch.device("cuda")`` is accepted by every torch build; the first tensor put
there fails, on a build without CUDA with ``AssertionError: Torch not compiled
with CUDA enabled``, which names neither the option nor the way out.
:func:`resolve_device` says what is wrong in the terms of the option that asked.
"""

from __future__ import annotations

import torch


#: metatrain's names of several GPUs in one process, which petfunc does not train on
MULTI_GPU = ("multi-gpu", "multi-cuda", "multi_gpu")


def auto_device() -> torch.device:
    """The device of ``device: auto``: the first CUDA device when one is visible,
    else the CPU (metatrain's choice for PET, which prefers CUDA)."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def device_type(requested) -> str:
    """``"cpu"`` or ``"cuda"``: the kind of device ``requested`` names, without
    checking that this process has it (``auto`` is what :func:`auto_device` picks
    here; ``gpu`` is CUDA)."""
    text = str(requested).lower()
    if text == "auto":
        return auto_device().type
    if text == "gpu":
        return "cuda"
    return torch.device(text).type


def resolve_device(requested, where: str = "device") -> torch.device:
    """The torch device ``requested`` (``"auto"``, ``"cpu"``, ``"cuda"``, ``"gpu"``,
    ``"cuda:N"`` or a ``torch.device``), checked against this process.

    ``auto`` is :func:`auto_device` (CUDA when visible, else the CPU); ``gpu`` is
    metatrain's name of ``cuda``. Names are read in any case, as metatrain reads them.

    Args:
        requested: the device asked for.
        where: what asked for it, as errors name it: a flag (``"--device"``) or an
            option (``"option 'device'"``).

    Raises:
        ValueError: not a CPU or CUDA device (``multi-gpu`` included: petfunc trains
            on one device per process); a CUDA device with a torch built without
            CUDA (its version is named), with no CUDA device visible, or with an
            index past the visible devices.
    """
    text = str(requested)
    # "--device cuda: ..." for a flag, "option 'device' is 'cuda': ..." for an option
    asked = f"{where} {text}" if where.startswith("-") else f"{where} is {text!r}"
    text = text.lower()
    if text == "auto":
        return auto_device()
    if text in MULTI_GPU:
        raise ValueError(
            f"{asked}: petfunc trains on one device per process; for several GPUs start one "
            "process per GPU with torchrun or SLURM's srun and device 'cuda' (docs/training.md, "
            "'Several processes and GPUs')"
        )
    if text == "gpu":
        text = "cuda"
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        raise ValueError(f"{asked}: not a device; use auto, cpu, cuda (or gpu) or cuda:N") from None
    if device.type == "cpu":
        return device
    if device.type != "cuda":
        raise ValueError(f"{asked}: petfunc runs on cpu or cuda[:N], not {device.type}")
    # a ROCm build runs HIP devices through torch.cuda
    if torch.version.cuda is None and getattr(torch.version, "hip", None) is None:
        raise ValueError(
            f"{asked}: this torch has no CUDA (torch {torch.__version__}); install a CUDA "
            "build of torch (https://pytorch.org/get-started/locally/), or run on cpu"
        )
    if not torch.cuda.is_available():
        raise ValueError(
            f"{asked}: no CUDA device is visible (torch {torch.__version__}; check the "
            "driver with nvidia-smi and CUDA_VISIBLE_DEVICES), or run on cpu"
        )
    count = torch.cuda.device_count()
    if device.index is not None and device.index >= count:
        raise ValueError(f"{asked}: {count} CUDA device(s) are visible (cuda:0 to cuda:{count - 1})")
    return device
