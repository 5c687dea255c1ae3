import sys

from parallel.cli.main import main

sys.exit(main())
