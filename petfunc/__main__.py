"""``python -m petfunc``: the ``petfunc`` command (see :mod:`petfunc.cli`)."""

import sys

from petfunc.cli.main import main


sys.exit(main())
