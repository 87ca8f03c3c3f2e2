"""`python -m spekit ...` is the `spekit` command."""
import sys

from .commands import main

sys.exit(main())
