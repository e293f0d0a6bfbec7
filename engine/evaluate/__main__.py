import sys

from engine.evaluate.job import main

sys.exit(main())
