"""`python -m lra_core.configs`: every config file under configs/ and the args it accepts."""

from lra_core import cli

if __name__ == "__main__":
  cli.run(lambda: print(cli.list_configs()))
