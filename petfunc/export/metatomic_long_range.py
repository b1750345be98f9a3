"""metatrain's long-range featurizer with each pair's distance taken from its own row.

metatrain's PET hands its ``LongRangeFeaturizer`` the edge distances in the order of
its neighbour-format tensors (grouped by centre atom, adaptive-cutoff edges only),
while the featurizer pairs them with the rows of the neighbour list in the order the
engine gave them. Where the two differ (metatomic's ASE calculator and the other
engines take vesin's list, which is not grouped by centre; any model with an
adaptive cutoff), distances land on the wrong pairs and the real-space part of the
periodic Coulomb potential is wrong. This featurizer computes
each row's distance from the positions, the cell and the row's cell shift, as
metatrain's PET computes its edge distances, so the result does not depend on the
order of the list: it equals metatrain's own where the list is grouped by centre,
and petfunc's for any list.

Imported only where metatrain is installed (:func:`petfunc.export.export_metatomic`).
"""

from __future__ import annotations

import torch
from metatomic.torch import System  # noqa: TID253 - this module is imported with metatrain only
from metatrain.utils.long_range import LongRangeFeaturizer  # noqa: TID253 - as above


class RowAlignedLongRangeFeaturizer(LongRangeFeaturizer):
    """``LongRangeFeaturizer`` whose periodic real-space distances are those of the
    neighbour-list rows they go with (TorchScript-compatible)."""

    def forward(
        self,
        systems: list[System],
        features: torch.Tensor,
        neighbor_distances: torch.Tensor,
    ) -> torch.Tensor:
        """Long-range features ``[n_atoms, d_node]`` of ``features`` ``[n_atoms, d_node]``;
        ``neighbor_distances`` is not used (the rows give their own)."""
        charges = self.charges_map(features)
        start = 0
        long_range_features = []
        for system in systems:
            system_charges = charges[start : start + len(system)]
            start += len(system)
            if system.pbc.any():
                if system.pbc.sum() == 1:
                    raise NotImplementedError("Long-range featurizer does not support 1D systems.")
                neighbor_list = system.get_neighbor_list(self.neighbor_list_options)
                first = neighbor_list.samples.column("first_atom")
                second = neighbor_list.samples.column("second_atom")
                shifts = torch.stack(
                    [
                        neighbor_list.samples.column("cell_shift_a"),
                        neighbor_list.samples.column("cell_shift_b"),
                        neighbor_list.samples.column("cell_shift_c"),
                    ],
                    dim=-1,
                )
                # as metatrain's PET computes its edge vectors and distances
                vectors = (
                    system.positions[second]
                    - system.positions[first]
                    + shifts.to(system.cell.dtype) @ system.cell
                )
                distances = torch.sqrt(torch.sum(vectors**2, dim=1) + 1e-15)
                indices = torch.stack([first, second], dim=-1)
                if self.use_ewald and self.training:  # Ewald while training, as metatrain
                    potential = self.ewald_calculator.forward(
                        charges=system_charges,
                        cell=system.cell,
                        positions=system.positions,
                        neighbor_indices=indices,
                        neighbor_distances=distances,
                        periodic=system.pbc,
                    )
                else:
                    potential = self.p3m_calculator.forward(
                        charges=system_charges,
                        cell=system.cell,
                        positions=system.positions,
                        neighbor_indices=indices,
                        neighbor_distances=distances,
                        periodic=system.pbc,
                    )
            else:  # every pair of atoms, as metatrain
                indices = torch.combinations(torch.arange(len(system), device=system.positions.device), 2)
                distances = torch.sqrt(
                    torch.sum((system.positions[indices[:, 1]] - system.positions[indices[:, 0]]) ** 2, dim=1)
                )
                potential = self.direct_calculator.forward(
                    charges=system_charges,
                    cell=system.cell,
                    positions=system.positions,
                    neighbor_indices=indices,
                    neighbor_distances=distances,
                )
            long_range_features.append(self.out_projection(potential))
        return torch.concatenate(long_range_features)
