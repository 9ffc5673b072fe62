"""``python -m nemo_like.environments``: the environments available here and their config keys
(see :mod:`nemo_like.environments.catalog`)."""

import sys

from nemo_like.environments.catalog import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
