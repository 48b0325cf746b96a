"""`python -m towers.train`: the command line, which lives in towers/cli/train.py."""

from towers.cli.train import main, run  # noqa: F401

if __name__ == "__main__":
    run()
