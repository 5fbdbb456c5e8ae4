"""Optional positional arguments for Invoke tasks.

The user types `invoke patch apply dyn-disable` and also `invoke patch verify`: the
action is a positional argument and the patchset name a positional that may be left
out. Invoke 2.x requires every positional (pyinvoke/invoke#159), so tasks made with
`command(optional=[...])` mark those arguments, and the parser's end-of-task check is
taught to let a marked one stay empty (it then reaches the task as None). The parser
still eats the next bare word into it, exactly like a required positional.
"""
from __future__ import annotations

from invoke import Task
from invoke.parser.parser import ParseMachine

_OPTIONAL = "_toolkit_optional_positional"


class Command(Task):
    def __init__(self, body, optional_positional=(), **kwargs):
        super().__init__(body, **kwargs)
        self.optional_positional = tuple(optional_positional)

    def get_arguments(self, ignore_unknown_help=None):
        arguments = super().get_arguments(ignore_unknown_help=ignore_unknown_help)
        taken = {name for argument in arguments for name in argument.names}
        for argument in arguments:
            if argument.name in self.optional_positional:
                setattr(argument, _OPTIONAL, True)
            # Invoke would give --host the short flag -h, which then hides -h for help
            # (`invoke patch apply -h` must print help): --host gets -H instead.
            if argument.name == "host" and "h" in argument.names and "H" not in taken:
                argument.names = tuple("H" if name == "h" else name for name in argument.names)
        return arguments


def command(*, positional, optional=(), help=None, name=None):
    """`@task` for the commands: `positional` in order, the trailing ones in `optional` may be omitted."""
    def decorate(body):
        return Command(body, optional_positional=optional, positional=list(positional),
                       help=help or {}, name=name)
    return decorate


def _complete_context(self):
    context = self.context
    if context is not None:
        for argument in context.positional_args:
            if argument.value is None and getattr(argument, _OPTIONAL, False):
                argument._value = ""  # "given, empty": satisfies the required-positional check
    return _original_complete_context(self)


_original_complete_context = ParseMachine.complete_context
if not getattr(ParseMachine.complete_context, "_toolkit", False):
    _complete_context._toolkit = True
    ParseMachine.complete_context = _complete_context
