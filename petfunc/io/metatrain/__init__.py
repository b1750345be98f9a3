"""Reading metatrain's checkpoints and exported models, and writing its state dicts.

Needs the optional ``metatrain`` extra (``pip install 'petfunc[metatrain]'``) for
reading; :func:`to_metatrain_state_dict` needs nothing.
"""

from petfunc.io.metatrain.baseline import read_metatrain_baseline as read_metatrain_baseline
from petfunc.io.metatrain.checkpoint import from_metatrain as from_metatrain
from petfunc.io.metatrain.checkpoint import is_llpr_checkpoint as is_llpr_checkpoint
from petfunc.io.metatrain.checkpoint import metatrain_units as metatrain_units
from petfunc.io.metatrain.checkpoint import read_metatrain as read_metatrain
from petfunc.io.metatrain.convert import to_metatrain_state_dict as to_metatrain_state_dict
from petfunc.io.metatrain.unpickle import TRUST_ENV as TRUST_ENV
from petfunc.io.metatrain.unpickle import UnreadableCheckpointError as UnreadableCheckpointError
