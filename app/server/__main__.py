"""`python -m localchat.server`: the same as `localchat serve`."""

from __future__ import annotations

import sys

from localchat.server.cli import main

sys.exit(main())
