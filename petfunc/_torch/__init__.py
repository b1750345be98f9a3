"""petfunc's patches of torch's internals (private): each a :class:`Patch`, listed in
:func:`patches`, gated on the torch version (:mod:`petfunc._torch.versions`) and
switched by the ``PETFUNC_*`` settings (:mod:`petfunc._torch.settings`). The public
way to them is ``patches()`` of :mod:`petfunc.compile`."""

from petfunc._torch.patch import Patch as Patch
from petfunc._torch.patch import PatchWarning as PatchWarning
from petfunc._torch.registry import patches as patches
from petfunc._torch.vmap_rules import PatchUnavailableError as PatchUnavailableError
from petfunc._torch.vmap_rules import symbolic_vmap_rules as symbolic_vmap_rules
