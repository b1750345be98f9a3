"""Processes started by SLURM's ``srun`` without torchrun, as metatrain reads them.

``srun`` gives each task ``SLURM_PROCID`` (its rank), ``SLURM_NTASKS`` (the number
of tasks), ``SLURM_LOCALID`` (its rank on its node) and ``SLURM_JOB_NODELIST``
(the job's nodes, in SLURM's compressed form). :func:`slurm_environment` turns them
into torchrun's variables (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``,
``MASTER_ADDR``, ``MASTER_PORT``), which :func:`petfunc.distributed.init_from_env`
reads: the first node of the list is the rendezvous host, and the port is
metatrain's ``distributed_port`` option.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping


#: metatrain's default of ``architecture.training.distributed_port``
DEFAULT_PORT = 39591


def in_slurm_job(environ: Mapping[str, str] | None = None) -> bool:
    """Whether this process is a task of a SLURM job (``SLURM_JOB_ID`` and
    ``SLURM_PROCID`` set), as metatrain's ``is_slurm`` tells."""
    environ = os.environ if environ is None else environ
    return "SLURM_JOB_ID" in environ and "SLURM_PROCID" in environ


def slurm_distributed(distributed: bool | None, environ: Mapping[str, str] | None = None) -> bool:
    """metatrain's rule for the ``distributed`` option: ``null`` means several
    processes exactly when this is a SLURM job of more than one task; ``true`` or
    ``false`` decide."""
    environ = os.environ if environ is None else environ
    if distributed is None:
        return in_slurm_job(environ) and int(environ.get("SLURM_NTASKS", "1")) > 1
    return bool(distributed)


def first_host(nodelist: str) -> str:
    """The first host of a SLURM node list: ``"node[007-009,12],gpu3"`` gives
    ``"node007"`` (what ``scontrol show hostnames`` prints first)."""
    text = nodelist.strip()
    if not text:
        raise ValueError("the SLURM node list is empty")
    # the first entry: up to the first comma outside brackets
    depth, end = 0, len(text)
    for i, char in enumerate(text):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if char == "," and depth == 0:
            end = i
            break
    entry = text[:end]
    # each bracket group stands for its first number, zero padding kept
    host = re.sub(r"\[([^\]]*)\]", lambda m: re.split(r"[-,]", m.group(1))[0], entry)
    if not host or "[" in host or "]" in host:
        raise ValueError(f"cannot read the SLURM node list {nodelist!r}")
    return host


def slurm_environment(port: int = DEFAULT_PORT, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """torchrun's variables of this SLURM task (see the module docstring).

    ``MASTER_ADDR`` and ``MASTER_PORT`` already in the environment are kept (a job
    script may choose them); otherwise the first node of ``SLURM_JOB_NODELIST`` (or
    ``SLURM_NODELIST``) and ``port``.

    Raises:
        ValueError: a SLURM variable is missing or not a number (named).
    """
    environ = os.environ if environ is None else environ
    missing = [name for name in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID") if name not in environ]
    nodelist = environ.get("SLURM_JOB_NODELIST") or environ.get("SLURM_NODELIST")
    if nodelist is None and "MASTER_ADDR" not in environ:
        missing.append("SLURM_JOB_NODELIST")
    if missing:
        raise ValueError(
            f"a SLURM job of several tasks, but {', '.join(missing)} not set: start the tasks with srun "
            "(or set 'architecture.training.distributed: false' for one process)"
        )
    for name in ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID"):
        if not environ[name].strip().isdigit():
            raise ValueError(f"the SLURM variable {name} is {environ[name]!r}, not a number")
    return {
        "RANK": environ["SLURM_PROCID"].strip(),
        "WORLD_SIZE": environ["SLURM_NTASKS"].strip(),
        "LOCAL_RANK": environ["SLURM_LOCALID"].strip(),
        "MASTER_ADDR": environ.get("MASTER_ADDR") or first_host(nodelist),
        "MASTER_PORT": environ.get("MASTER_PORT") or str(port),
    }
