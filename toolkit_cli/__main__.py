"""`python -m toolkit_cli ARGS`: the toolkit's program (toolkit_cli/program.py)."""
from toolkit_cli.program import program

program.run()
