import sys

from .cli import main

if __name__ == "__main__":  # not when a spawned child process re-imports it as `__mp_main__`
    sys.exit(main())
