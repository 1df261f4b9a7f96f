import sys

from raydeploy.cli import main

sys.exit(main())
