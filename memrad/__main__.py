import sys

from memrad.cli import main

sys.exit(main())
