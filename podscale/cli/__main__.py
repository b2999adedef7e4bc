"""``python -m podscale.cli``: the ``podscale`` command, as ``podscale launch`` and each process's
supervisor start their children (no venv need be on PATH)."""

import sys

from podscale.cli import main

if __name__ == "__main__":
    sys.exit(main())
