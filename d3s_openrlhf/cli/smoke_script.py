"""``python -m d3s_openrlhf.cli.smoke_script <script.sh ...> | --all``: see :mod:`d3s_openrlhf.testbed.smoke`."""

import sys

from d3s_openrlhf.testbed.smoke import main

if __name__ == "__main__":
    sys.exit(main())
