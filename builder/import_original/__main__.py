"""`python -m cube.builder.import_original`: cube-import."""

import sys

from cube.builder.import_original.command import main

sys.exit(main())
