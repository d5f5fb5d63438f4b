"""``python -m ckptmgr``: the ``ckptmgr`` command line (see :mod:`ckptmgr.cli`)."""

import sys

from ckptmgr.cli import main

sys.exit(main())
