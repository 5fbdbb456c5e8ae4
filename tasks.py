"""`invoke ARGS` from this folder: Invoke's own program loads this file to find the tasks; it
hands the command line to the toolkit's program (toolkit_cli/program.py, an Invoke `Program`
subclass), which knows the commands' shape. `invoke --list` shows the commands; each lives in
toolkit_cli/. Thin by design: tasks parse arguments, call the `toolkit` engine and print.
"""
from toolkit_cli.program import hand_over, ns  # noqa: F401  (ns: the collection, for Invoke's loader)

hand_over()
