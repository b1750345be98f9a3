"""Reading metatrain's checkpoints and exported models, and writing its checkpoints.

Needs the optional ``metatrain`` extra (``pip install 'petfunc[metatrain]'``), except
:func:`to_metatrain_state_dict`. :func:`from_metatrain` reads a checkpoint or an
exported model; :func:`to_metatrain` is its inverse, the checkpoint metatrain's
trainer writes (:func:`save_metatrain` writes it to a file, :func:`metatrain_model`
builds metatrain's PET from it).
"""

from petfunc.io.metatrain.baseline import read_metatrain_baseline as read_metatrain_baseline
from petfunc.io.metatrain.checkpoint import from_metatrain as from_metatrain
from petfunc.io.metatrain.checkpoint import is_llpr_checkpoint as is_llpr_checkpoint
from petfunc.io.metatrain.checkpoint import metatrain_units as metatrain_units
from petfunc.io.metatrain.checkpoint import read_metatrain as read_metatrain
from petfunc.io.metatrain.convert import to_metatrain_state_dict as to_metatrain_state_dict
from petfunc.io.metatrain.unpickle import TRUST_ENV as TRUST_ENV
from petfunc.io.metatrain.unpickle import UnreadableCheckpointError as UnreadableCheckpointError
from petfunc.io.metatrain.write import metatrain_model as metatrain_model
from petfunc.io.metatrain.write import save_metatrain as save_metatrain
from petfunc.io.metatrain.write import to_metatrain as to_metatrain
