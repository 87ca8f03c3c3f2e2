"""`python -m spekit ...` is the `spekit` command."""
import sys

from .cli import main

sys.exit(main())
