"""`python -m app.cli ARGS`: the `shoal` command without the console script."""
import sys

from app.cli import main

sys.exit(main())
