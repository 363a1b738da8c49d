import sys

from asyncgrpo.cli import main

sys.exit(main())
