"""The ``petfunc`` command: ``petfunc train``, ``petfunc eval`` and ``petfunc export``
(``python -m petfunc`` is the same; ``petfunc COMMAND --help`` lists the flags).

``docs/options.md`` documents the options and flags of ``petfunc train``, and
``docs/training.md`` what a run writes, restarts and fine-tuning.
"""

from petfunc.cli.commands import main as main
from petfunc.cli.demo import DEMO_OPTIONS as DEMO_OPTIONS
from petfunc.cli.demo import DEMO_STRUCTURES as DEMO_STRUCTURES
from petfunc.cli.demo import make_default_dataset as make_default_dataset
