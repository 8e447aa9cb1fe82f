import sys

from launch.cli.commands import main

sys.exit(main())
