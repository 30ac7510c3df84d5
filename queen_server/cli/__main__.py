import sys

from queen_server.cli.main import main

sys.exit(main())
