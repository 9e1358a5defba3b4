"""`python -m kpx_operator`: the same as `proxy-operator`."""

import sys

from .cli import main

sys.exit(main())
