"""`python -m pagefleet` runs the CLI."""

import sys

from pagefleet.cli import main

sys.exit(main())
