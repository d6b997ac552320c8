"""The converter's script path, kept working: ``python convert/convert.py ...`` runs ``kvjax-convert``
(``kvjax/cli/convert.py``)."""

import sys

from kvjax.cli.convert import main

if __name__ == "__main__":
    sys.exit(main())
