"""What a restart checks and takes from the checkpoint it continues: the same run
(the epochs asked for, the fine-tuning method), the options that changed, the
learning-rate schedule's length, and where the run stood (optimizer state, steps,
best epoch, history)."""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping

from petfunc import lora, tree
from petfunc.devices import device_type
from petfunc.io.checkpoint import state_from_plain
from petfunc.trainer.checkpoints import Progress


def check_restart(options: Mapping, ckpt: Mapping, restart, log: Callable[[str], None]) -> None:
    """Raise unless resolved ``options`` continue the run of the checkpoint ``ckpt``
    (read from ``restart``): at least its epochs, the same fine-tuning. A restart at
    its last epoch is said to train nothing."""
    training = options["architecture"]["training"]
    if training["num_epochs"] < int(ckpt["epoch"]):
        raise ValueError(
            f"the restart checkpoint is at epoch {int(ckpt['epoch'])} and num_epochs is "
            f"{training['num_epochs']}: ask for at least as many epochs "
            "(--epochs N, or architecture.training.num_epochs)"
        )
    if training["num_epochs"] == int(ckpt["epoch"]):
        # a run killed after its last epoch's checkpoint: finish it (the best
        # parameters file, the plots, the test set); nothing is trained
        log(
            f"the restart checkpoint is at the last epoch ({int(ckpt['epoch'])}): nothing to train, writing "
            "the end-of-run files (ask for more epochs with --epochs N)"
        )
    check_restart_finetune(
        json.loads(ckpt["options"])["architecture"]["training"]["finetune"],
        training["finetune"],
        restart,
        log,
    )


def check_restart_finetune(stored: Mapping, given: dict, restart, log: Callable[[str], None]) -> None:
    """A restart continues the same fine-tuning (``stored``: the checkpoint's
    ``finetune`` section, ``given``: this run's). Another method is an error (the
    optimizer state would not fit); LoRA adapters keep the checkpoint's rank, alpha
    and layers, set in ``given``, with a note when ``given`` asked for others (the
    adapters would stay, and their scaling alpha / rank take the new numbers, which
    changes the model)."""

    def method_of(finetune):
        if not finetune.get("read_from") and finetune.get("method", "full") == "full":
            return "no fine-tuning"
        return f"fine-tuning method {finetune.get('method', 'full')!r}"

    def heads_of(finetune):
        return dict(finetune.get("config") or {}) if finetune.get("method") == "heads" else None

    if method_of(stored) != method_of(given) or heads_of(stored) != heads_of(given):
        raise ValueError(
            f"the restart checkpoint {str(restart)!r} is of a run with {method_of(stored)}"
            + (f" (config {heads_of(stored)})" if heads_of(stored) is not None else "")
            + f", the options ask for {method_of(given)}"
            + (f" (config {heads_of(given)})" if heads_of(given) is not None else "")
            + ": a restart continues the same run. Give that run's options, or fine-tune anew from its "
            "model with 'architecture.training.finetune.read_from'"
        )
    kept, asked = lora.config_of(stored), lora.config_of(given)
    if kept is not None and kept != asked:
        log(
            f"the restart checkpoint has LoRA adapters of rank {kept['rank']} "
            f"(alpha {kept['alpha']:g}, layers {list(kept['targets'])}): training them on, "
            f"instead of finetune.config {dict(given.get('config') or {})}"
        )
        given["config"] = {
            "rank": kept["rank"],
            "alpha": kept["alpha"],
            "target_modules": list(kept["targets"]),
        }


def effective(options: Mapping) -> dict:
    """``options`` with the defaults that depend on the run filled in (``deterministic:
    null`` means true on the CPU), so that a restart names real changes only."""
    options = json.loads(json.dumps(options))
    training = options["architecture"]["training"]
    if training.get("deterministic") is None:
        training["deterministic"] = device_type(options.get("device") or "cpu") == "cpu"
    return options


def log_changed_options(options: Mapping, ckpt: Mapping, log: Callable[[str], None]) -> None:
    """Name the options that differ from those of the run ``ckpt`` continues."""
    changed = tree.differences(effective(json.loads(ckpt["options"])), effective(options))
    if changed:
        log(
            "options changed since the checkpoint, this run takes the new values: "
            + "; ".join(changed)
            + (
                " (the learning-rate schedule is fitted to end with the new last epoch)"
                if any(c.startswith("architecture.training.num_epochs") for c in changed)
                and options["architecture"]["training"]["num_epochs"] > int(ckpt["epoch"])
                else ""
            )
        )


def schedule_steps(
    ckpt: Mapping | None,
    num_epochs: int,
    steps_per_epoch: int,
    batch_size: int,
    world_size: int,
    log: Callable[[str], None],
) -> int:
    """The learning-rate schedule's length in steps: those a restart's checkpoint took,
    and ``steps_per_epoch`` for each epoch left. A restart with another number of
    processes (or batch packing) may take another number of steps per epoch: the
    schedule then ends with this run's last epoch, with a warning."""
    done_epochs, done_steps = (int(ckpt["epoch"]), int(ckpt["step"])) if ckpt is not None else (0, 0)
    total_steps = max(1, done_steps + max(0, num_epochs - done_epochs) * steps_per_epoch)
    if done_steps != done_epochs * steps_per_epoch:
        log(
            f"warning: the run this restart continues took {done_steps} steps in {done_epochs} epochs, "
            f"this one takes {steps_per_epoch} per epoch (another batch size, number of processes or "
            f"batch packing): the learning-rate schedule is fitted to end with epoch {num_epochs}, "
            "so it differs from an uninterrupted run's" + same_batches_hint(ckpt, batch_size, world_size)
        )
    return total_steps


def same_batches_hint(ckpt: Mapping, batch_size: int, world_size: int) -> str:
    """For a restart with another number of processes: the per-process batch size
    that gives the checkpoint's global batches (from the checkpoint's
    ``world_size``; none in checkpoints that do not store it)."""
    before = ckpt.get("world_size")
    stored = json.loads(ckpt["options"])["architecture"]["training"]["batch_size"]
    if not before or int(before) == world_size:
        return ""
    total = int(before) * int(stored)
    who = f"the checkpoint's {before} process{'es' if int(before) > 1 else ''}"
    if total % world_size:
        return f" ({who} took batches of {total} structures in all)"
    return (
        f" ({who} took batches of {total} structures in all: "
        f"--batch-size {total // world_size} gives the same with {world_size})"
        if total // world_size != batch_size
        else ""
    )


def restored(ckpt: Mapping | None, opt_state, device) -> tuple[object, int, Progress]:
    """``(opt_state, start_epoch, progress)`` where the run of ``ckpt`` stood (its
    optimizer state in the structure of ``opt_state``, tensors on ``device``), or a
    fresh run's (``ckpt`` ``None``)."""
    if ckpt is None:
        return opt_state, 0, Progress()
    opt_state = state_from_plain(ckpt["opt_state"], opt_state)
    start_epoch = int(ckpt["epoch"])
    best_params = None
    if ckpt.get("best_params"):
        best_params = tree.tree_map(lambda t: t.to(device), tree.unflatten(dict(ckpt["best_params"])))
    history = [dict(row) for row in ckpt.get("history") or [] if int(row["epoch"]) <= start_epoch]
    # older checkpoints name the selection_metric column best_metric
    history = [
        {("selection_metric" if k == "best_metric" else k): v for k, v in row.items()} for row in history
    ]
    progress = Progress(
        step=int(ckpt["step"]),
        best_epoch=int(ckpt.get("best_epoch") or 0),
        best_metric=float(ckpt["best_metric"]) if ckpt.get("best_metric") is not None else math.inf,
        best_params=best_params,
        history=history,
    )
    return opt_state, start_epoch, progress
