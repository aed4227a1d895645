"""The `umbp` console command: runs the Rust command-line tool inside this package."""

import logging
import sys


def main() -> None:
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from umbp._native import cli_main

    sys.exit(cli_main(["umbp", *sys.argv[1:]]))


if __name__ == "__main__":
    main()
