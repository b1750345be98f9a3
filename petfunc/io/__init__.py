"""Files: petfunc's parameter files and training checkpoints, and metatrain's models.

- :mod:`petfunc.io.params`: :func:`save_params` / :func:`load_params`, and checks of
  a parameter tree against a config.
- :mod:`petfunc.io.checkpoint`: the training checkpoint of ``petfunc train``.
- :mod:`petfunc.io.load`: :func:`load_model`, ``(config, params)`` of any model file.
- :mod:`petfunc.io.metatrain`: metatrain checkpoints and exported models
  (:func:`from_metatrain`), and metatrain checkpoints of petfunc's models
  (:func:`to_metatrain`, :func:`save_metatrain`).

Every file is read with ``torch.load(weights_only=True)`` (metatrain's with only
its own objects allowed) and written atomically (:func:`atomic_write`, which raises
:class:`NoSpaceError` on a full disk and leaves the file as it was); petfunc's own
files carry a digest of their content, checked on reading (:mod:`petfunc.io.digest`).
"""

from petfunc._files import NoSpaceError as NoSpaceError
from petfunc._files import atomic_write as atomic_write
from petfunc.io.checkpoint import CHECKPOINT_FORMAT as CHECKPOINT_FORMAT
from petfunc.io.checkpoint import read_checkpoint as read_checkpoint
from petfunc.io.checkpoint import write_checkpoint as write_checkpoint
from petfunc.io.formats import is_petfunc_export as is_petfunc_export
from petfunc.io.load import load_model as load_model
from petfunc.io.metatrain import TRUST_ENV as TRUST_ENV
from petfunc.io.metatrain import UnreadableCheckpointError as UnreadableCheckpointError
from petfunc.io.metatrain import from_metatrain as from_metatrain
from petfunc.io.metatrain import is_llpr_checkpoint as is_llpr_checkpoint
from petfunc.io.metatrain import metatrain_units as metatrain_units
from petfunc.io.metatrain import read_metatrain_baseline as read_metatrain_baseline
from petfunc.io.metatrain import save_metatrain as save_metatrain
from petfunc.io.metatrain import to_metatrain as to_metatrain
from petfunc.io.metatrain import to_metatrain_state_dict as to_metatrain_state_dict
from petfunc.io.params import EXTRA_KEYS as EXTRA_KEYS
from petfunc.io.params import FORMAT as FORMAT
from petfunc.io.params import FORMAT_VERSION as FORMAT_VERSION
from petfunc.io.params import LONG_RANGE_WEIGHTS as LONG_RANGE_WEIGHTS
from petfunc.io.params import cast_params as cast_params
from petfunc.io.params import check_params as check_params
from petfunc.io.params import load_params as load_params
from petfunc.io.params import network_dtype as network_dtype
from petfunc.io.params import params_from_payload as params_from_payload
from petfunc.io.params import save_params as save_params
