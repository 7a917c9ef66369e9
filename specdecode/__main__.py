"""`python -m specdecode ...`: the `specdecode` command (cli.py)."""
import sys

from .cli import main

sys.exit(main())
