"""The toolkit's command-line program: Invoke's `Program`, subclassed as Fabric subclasses it
for `fab` (fabric/main.py), with the command shape of toolkit_cli/parsing.py.

- Optional positionals: the parser's end-of-task check lets an argument marked by
  `command(optional=[...])` stay empty (it reaches the task as ""), where Invoke would
  stop with "did not receive required positional arguments".
- Help: `invoke --help TASK`, `invoke TASK --help` and `invoke TASK -h` print the command's
  own help (parsing.render_help).

`python -m toolkit_cli ARGS` runs it; so does `invoke ARGS` from the project folder, where
Invoke's own program loads tasks.py, which hands the command line over (`hand_over`).
"""
from __future__ import annotations

import os
import sys
import types

from invoke import Collection, Program
from invoke.parser import Parser, ParseMachine

import toolkit

from toolkit_cli.bench import bench
from toolkit_cli.demo import demo
from toolkit_cli.parsing import OPTIONAL, Command, render_help
from toolkit_cli.patch import patch
from toolkit_cli.provision import facts, provision, wheelhouse
from toolkit_cli.rollout import rollout
from toolkit_cli.sandbox import sandbox
from toolkit_cli.server import server_task
from toolkit_cli.smoke import smoke

ns = Collection(bench, demo, facts, patch, provision, rollout, sandbox, server_task, smoke, wheelhouse)


class OptionalPositionalMachine(ParseMachine):
    def complete_context(self) -> None:
        if self.context is not None:
            for argument in self.context.positional_args:
                if argument.value is None and getattr(argument, OPTIONAL, False):
                    argument._value = ""   # "given, empty": satisfies the required-positional check
        super().complete_context()


# Invoke's vendored state machine keeps each class's own states and transitions: take the parent's
OptionalPositionalMachine._class_states = dict(ParseMachine._class_states)
OptionalPositionalMachine._class_transitions = list(ParseMachine._class_transitions)


class ToolkitParser(Parser):
    # Parser.parse_argv builds its ParseMachine by name and offers no hook for another class:
    # the same function, run with that name bound to ours (Invoke itself is left as it is).
    parse_argv = types.FunctionType(Parser.parse_argv.__code__,
                                    {**Parser.parse_argv.__globals__, "ParseMachine": OptionalPositionalMachine},
                                    "parse_argv", Parser.parse_argv.__defaults__)


class Toolkit(Program):
    def _make_parser(self) -> Parser:
        return ToolkitParser(initial=self.initial_context,
                             contexts=self.collection.to_contexts(
                                 ignore_unknown_help=self.config.tasks.ignore_unknown_help))

    def load_collection(self) -> None:
        self.collection = ns   # the toolkit's commands, wherever it is run from

    def print_task_help(self, name: str) -> None:
        task = self.collection[name]
        if isinstance(task, Command):
            print(render_help(task, name))
            return
        super().print_task_help(name)


program = Toolkit(name="toolkit", binary="invoke", binary_names=["invoke", "inv"], version=toolkit.__version__)


def started_by_invoke(argv0: str) -> bool:
    """Invoke's own program is running (`invoke ...`, `inv ...`, `python -m invoke ...`)."""
    return (os.path.basename(argv0) in ("invoke", "inv")
            or argv0.endswith(os.path.join("invoke", "__main__.py")))


def hand_over() -> None:
    """Called by tasks.py: under Invoke's own program, run the command line with ours and exit."""
    if started_by_invoke(sys.argv[0]):
        program.run(sys.argv)
        sys.exit(0)
