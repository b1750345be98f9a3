"""LLPR uncertainties in the ASE calculator: metatrain's last-layer prediction
rigidity (PET-MAD's uncertainties, see :mod:`petfunc.llpr`) for one structure."""

from __future__ import annotations

from petfunc import llpr as llpr_functions
from petfunc.compile import compile as compile_function
from petfunc.config import PETConfig


#: the results that need the LLPR members' forces (one pullback per member)
MEMBER_GRADIENTS = {"forces_ensemble", "forces_uncertainty", "stress_uncertainty"}


class LLPRResults:
    """The LLPR results of a calculator's model: the calibrated energy uncertainty,
    and with ensemble weights the members' energies, forces and strain derivatives.

    Args:
        config: the architecture.
        llpr: the LLPR quantities (:func:`petfunc.llpr.from_metatrain`), in the
            calculator's dtype and device.
        compile: evaluate through :func:`petfunc.compile` (one graph per function,
            compiled at first use), with ``backend``.
    """

    def __init__(self, config: PETConfig, llpr: dict, compile: bool, backend):
        self.config, self.llpr, self.compile, self.backend = config, llpr, compile, backend
        self._functions = {
            "offsets": llpr_functions.ensemble_offsets(config, stress=True),
            "features": llpr_functions.structure_features(config),
        }
        self._compiled = {}

    def __call__(self, params, inputs, n_atoms, results, energy, forces, strain, properties):
        """Add the LLPR uncertainty (and the member energies) to ``results``; compute
        the members' forces and strain derivatives (K pullbacks) only when
        ``properties`` asks for one of :data:`MEMBER_GRADIENTS`, then return them in
        a committee's form ``(energies, forces, strain, None)`` (else ``None``)."""
        weights = self.llpr.get("ensemble_weights")
        if weights is not None and MEMBER_GRADIENTS & set(properties):
            features, d_energy, d_forces, d_strain = self._call("offsets", params, inputs)
            results["energy_uncertainty"] = float(llpr_functions.uncertainty(self.llpr, features)[0])
            return (
                energy + d_energy[0].double().cpu().numpy(),
                forces[None] + d_forces[:, :n_atoms].double().cpu().numpy(),
                strain[None] + d_strain[:, 0].double().cpu().numpy(),
                None,
            )
        features = self._call("features", params, inputs)
        results["energy_uncertainty"] = float(llpr_functions.uncertainty(self.llpr, features)[0])
        if weights is not None:
            delta = weights - weights.mean(dim=0, keepdim=True)
            results["energy_ensemble"] = energy + (features[0] @ delta.T).double().cpu().numpy()
        return None

    def _call(self, name: str, params, inputs):
        """The LLPR function ``name`` on ``inputs``, eager or compiled."""
        positions, cell, neighbors = inputs
        fn = self._functions[name]
        if name == "features":
            args, static = (params, positions, cell, neighbors), (0,)
        else:
            args, static = (params, self.llpr, positions, cell, neighbors), (0, 1)
        if not self.compile:
            return fn(*args)
        if name not in self._compiled:
            members = self.llpr["ensemble_weights"].shape[0] if "ensemble_weights" in self.llpr else 0
            self._compiled[name] = compile_function(
                fn,
                *args,
                backend=self.backend,
                static_argnums=static,
                cache_key=f"PETCalculator LLPR {name} {self.config!r} members={members}",
                keep_freed_memory=False,  # decided by the calculator's own option
                aot_autograd=True,  # AOTAutograd's cache: calculators mostly start warm
            )
        return self._compiled[name](*args)
