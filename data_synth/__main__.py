"""``python -m data_synth ...`` (see ``data_synth.cli``)."""
import sys

from .cli import main

sys.exit(main())
