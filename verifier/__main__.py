"""Entry point for ``python -m verifier`` (see verifier/cli.py for the commands)."""
import sys

from .cli import main

if __name__ == "__main__":  # spawned farm workers re-import this module: never re-run the CLI there
    sys.exit(main())
