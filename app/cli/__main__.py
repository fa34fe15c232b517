"""`python -m localchat.cli`: the `localchat` command."""

import sys

from localchat.cli import main

sys.exit(main())
