import sys

from kvasir.cli import main

sys.exit(main())
