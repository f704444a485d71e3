"""Launch a recipe: `accelerate launch recipes/train.py recipes/<model>/<recipe>.yaml [k=v ...]`."""

import sys

from ibpo.cli import main

if __name__ == "__main__":
    sys.exit(main(["train", *sys.argv[1:]]))
