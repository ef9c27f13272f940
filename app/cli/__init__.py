"""The `shoal` command line. `main` is the console script (`shoal = "app.cli:main"`).

Note: `main` here is the function; the module is app/cli/main.py (`from app.cli.main import
build_parser` reaches it; `import app.cli.main as m` would give the function)."""
from app.cli.main import main

__all__ = ["main"]
