"""The ``architecture.training.loss`` option: metatrain's loss layout, as its
``expand_loss_config`` expands it, to :class:`petfunc.train.LossWeights`."""

from __future__ import annotations

from collections.abc import Mapping

from petfunc.train import LossTerm, LossWeights
from petfunc.trainer.options.checks import check_keys, number


#: names of the gradient terms (metatrain's, and the shorthands under the energy
#: target) -> the loss term they set
TERM_ALIASES = {
    "positions": "forces",
    "forces": "forces",
    "strain": "stress",
    "stress": "stress",
    "virial": "stress",
}

#: keys of the energy target's loss section
ENERGY_LOSS_KEYS = (
    "type",
    "weight",
    "reduction",
    "delta",
    "gradients",
    "forces",
    "positions",
    "stress",
    "strain",
    "virial",
)


def loss_term(spec, where: str, default_type: str) -> LossTerm:
    """One term from a type (weight 1), a weight (``default_type``) or a mapping
    ``{type, weight, reduction, delta}``; ``where`` names the option in errors."""
    if isinstance(spec, str):
        return LossTerm(1.0, spec)
    if isinstance(spec, (int, float)) and not isinstance(spec, bool):
        return LossTerm(number(spec, where, minimum=0.0), default_type)
    if not isinstance(spec, Mapping):
        raise ValueError(f"option '{where}' must be a loss type, a weight or a mapping, got {spec!r}")
    check_keys(spec, ("type", "weight", "reduction", "delta"), where)
    if "delta" in spec and spec.get("type", default_type) != "huber":
        # metatrain's mse and mae losses take no delta (they fail on it)
        raise ValueError(
            f"option '{where}.delta' is the threshold of the 'huber' loss; this term is "
            f"{spec.get('type', default_type)!r}"
        )
    if spec.get("reduction", "mean") not in ("mean", "sum"):
        raise ValueError(f"option '{where}.reduction' must be 'mean' or 'sum', got {spec['reduction']!r}")
    weight = number(spec.get("weight", 1.0), f"{where}.weight", minimum=0.0)
    delta = number(spec.get("delta", 1.0), f"{where}.delta", positive=True)
    try:
        return LossTerm(weight, spec.get("type", default_type), delta, spec.get("reduction", "mean"))
    except ValueError as error:
        raise ValueError(f"option '{where}': {error}") from None


def parse_loss(spec) -> tuple:
    """``(LossWeights, explicit)`` from the ``loss`` option.

    Accepted forms: a type (``"mse"``, ``"mae"``, ``"huber"``) for every term, or
    ``{energy: {type, weight, delta, gradients: {positions: {...}, strain: {...}}}}``
    (metatrain's layout; ``forces``/``stress``/``virial`` may also sit directly under
    ``energy``; :func:`resolve_loss` renames the energy target's own name,
    ``mtt::NAME``, to ``energy``; a term may be a type, a weight or a mapping). As in
    metatrain's ``expand_loss_config``, only the global string form sets the type of every term:
    the energy term's type does not carry over to the force and stress terms, which
    are ``mse`` with weight 1 unless configured. ``delta`` is the Huber threshold
    (default 1). ``explicit`` is the set of gradient terms the user configured with a
    weight > 0, whose labels are then required.
    """
    where = "architecture.training.loss"
    if isinstance(spec, str):
        term = loss_term(spec, where, "mse")
        return LossWeights(term, term, term), set()
    if not isinstance(spec, Mapping):
        raise ValueError(f"option '{where}' must be a loss type or a mapping, got {spec!r}")
    for key in spec:
        if key in TERM_ALIASES:  # a natural guess; metatrain keeps them under the energy target
            raise ValueError(
                f"unknown option '{where}.{key}': the {TERM_ALIASES[key]} loss is set "
                "under the energy target, "
                f"as '{where}.energy.gradients.{'positions' if TERM_ALIASES[key] == 'forces' else 'strain'}' "
                f"(or '{where}.energy.{key if key in ('forces', 'stress', 'virial') else TERM_ALIASES[key]}')"
            )
    check_keys(spec, ("energy",), where)
    energy = spec.get("energy", {})
    if isinstance(energy, str):
        # as in metatrain, a target's type is not its gradients' type: those stay mse
        return LossWeights(loss_term(energy, f"{where}.energy", "mse"), LossTerm(), LossTerm()), set()
    if not isinstance(energy, Mapping):
        raise ValueError(f"option '{where}.energy' must be a loss type or a mapping")
    where_e = f"{where}.energy"
    check_keys(energy, ENERGY_LOSS_KEYS, where_e)
    base = {k: v for k, v in energy.items() if k in ("type", "weight", "reduction", "delta")}
    energy_term = loss_term(base, where_e, "mse")
    terms, explicit = gradient_terms(energy, where_e)
    return LossWeights(energy_term, terms["forces"], terms["stress"]), explicit


def gradient_terms(energy: Mapping, where_e: str) -> tuple[dict, set]:
    """``({"forces": LossTerm, "stress": LossTerm}, explicit)`` of the energy target's
    loss section ``energy`` (option ``where_e``): its ``gradients`` and the shorthands
    beside them."""
    gradients = dict(energy.get("gradients") or {})
    if not isinstance(gradients, Mapping):
        raise ValueError(f"option '{where_e}.gradients' must be a mapping")
    for key in gradients:
        if key in ("forces", "stress", "virial"):
            # metatrain reads only these two names there, and ignores others silently
            raise ValueError(
                f"option '{where_e}.gradients.{key}': metatrain names gradients 'positions' (forces) and "
                "'strain' (stress, virial); write "
                f"'{where_e}.gradients.{'positions' if key == 'forces' else 'strain'}'"
                f" or the shorthand '{where_e}.{key}'"
            )
    check_keys(gradients, ("positions", "strain"), f"{where_e}.gradients")
    entries = [(f"{where_e}.gradients.{k}", k, v) for k, v in gradients.items()]
    entries += [(f"{where_e}.{k}", k, energy[k]) for k in TERM_ALIASES if k in energy]
    # metatrain (expand_loss_config): gradient terms default to mse with weight 1,
    # whatever the energy term's type; only a global loss type applies to all terms
    terms = {"forces": LossTerm(), "stress": LossTerm()}
    seen = {}
    explicit = set()
    for name, key, value in entries:
        target = TERM_ALIASES[key]
        if target in seen:
            raise ValueError(f"options '{seen[target]}' and '{name}' both set the {target} loss")
        seen[target] = name
        terms[target] = loss_term(value, name, "mse")
        if terms[target].weight > 0:
            explicit.add(target)
    return terms, explicit


def resolve_loss(loss, target: str):
    """The ``loss`` option with the energy target's own name (``target``, e.g.
    ``mtt::U0``, as metatrain keys a target's loss) renamed to ``energy``; checked
    by :func:`parse_loss`."""
    t = "architecture.training"
    if target != "energy" and isinstance(loss, Mapping) and target in loss:
        if "energy" in loss:
            raise ValueError(
                f"options '{t}.loss.energy' and '{t}.loss.{target}' both set the loss of the "
                f"energy target {target!r}"
            )
        loss = {("energy" if k == target else k): v for k, v in loss.items()}
    parse_loss(loss)  # validate now
    return loss
