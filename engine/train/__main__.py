import sys

from engine.train.job import main

sys.exit(main())
