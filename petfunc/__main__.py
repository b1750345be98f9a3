"""``python -m petfunc``: the ``petfunc`` command (see :mod:`petfunc.cli`)."""

import sys

from petfunc.cli import main


sys.exit(main())
