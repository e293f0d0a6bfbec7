import sys

from eagle3_console.cli import main

sys.exit(main())
