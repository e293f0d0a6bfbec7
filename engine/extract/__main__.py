import sys

from engine.extract.job import main

sys.exit(main())
