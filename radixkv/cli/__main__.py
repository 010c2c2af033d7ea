"""`python -m radixkv.cli ...`: the `radixkv` command without its console script (tests, the demo)."""

import sys

from radixkv.cli import main

sys.exit(main())
