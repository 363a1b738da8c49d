"""`python -m asyncgrpo ...`: the same command line as the `asyncgrpo` script.

Launchers start ranks this way (`accelerate launch -m asyncgrpo train ...`, `torchrun -m asyncgrpo train ...`), so
this module only hands over to `asyncgrpo.cli.main` and exits with its status.
"""

import sys

from asyncgrpo.cli import main

sys.exit(main())
