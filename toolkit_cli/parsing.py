"""Positional arguments, short flags and help text for the Invoke tasks.

The user types `invoke patch apply dyn-disable` and also `invoke patch verify`: the
action is a positional argument and the patchset name a positional that may be left
out. Invoke 2.x requires every positional (pyinvoke/invoke#159), so tasks made with
`command(optional=[...])` mark those arguments, and the toolkit's Program
(toolkit_cli/program.py) parses with an end-of-task check that lets a marked one stay
empty (it then reaches the task as ""). The parser still eats the next bare word into it,
exactly like a required positional.

Short flags: Invoke would give every option the first free letter of its name, so `-d`
meant --dry-run in one command and --model in another. Here only SHORT_FLAGS get one,
with the same meaning in every command; everything else is long-only.

Help: Invoke lists positionals as options (`--action=STRING`). `invoke --help TASK`,
`invoke TASK --help` and `invoke TASK -h` all print `render_help`: the command line as
typed (`invoke patch ACTION [NAME] [options]`), the command's usage text and its options.
"""
from __future__ import annotations

import inspect
import shutil
import textwrap

from invoke import Task

OPTIONAL = "_toolkit_optional_positional"   # marks an Argument that may be left out

# One meaning per letter, in every command. -h is help (Invoke's own).
SHORT_FLAGS = {"host": "H", "dry-run": "n", "json": "j", "follow": "f"}


class Command(Task):
    def __init__(self, body, optional_positional=(), checked_positional=(), usage: str = "", **kwargs):
        self.help_texts = dict(kwargs.get("help") or {})  # Invoke pops its copy while parsing
        super().__init__(body, auto_shortflags=False, **kwargs)
        self.optional_positional = tuple(optional_positional) + tuple(checked_positional)
        self.shown_optional = tuple(optional_positional)
        self.usage = usage

    def get_arguments(self, ignore_unknown_help=None):
        self.help = dict(self.help_texts)
        arguments = super().get_arguments(ignore_unknown_help=ignore_unknown_help)
        for argument in arguments:
            if argument.name in self.optional_positional:
                setattr(argument, OPTIONAL, True)
            long_name = argument.names[0]
            if long_name in SHORT_FLAGS and not argument.positional:
                argument.names = (long_name, SHORT_FLAGS[long_name])
        return arguments


def command(*, positional, optional=(), checked=(), help=None, name=None, usage=""):
    """`@task` for the commands: `positional` in order, those in `optional` may be omitted.

    `checked`: positionals the command needs but checks itself (they reach it as "" when left
    out, so it can print its own usage instead of Invoke's bare parse error). `usage` is the
    command's own usage text (actions and what they take), shown by its help."""
    def decorate(body):
        return Command(body, optional_positional=optional, checked_positional=checked,
                       positional=list(positional), help=help or {}, name=name, usage=usage)
    return decorate


def _metavar(argument) -> str:
    return argument.names[0].rsplit("-", 1)[-1].upper()    # --memory-wait=WAIT, --draft-model=MODEL


def command_line(task: Command, name: str) -> str:
    """`invoke patch ACTION [NAME] [options]`: the positionals as the user types them."""
    words = ["invoke", name]
    for argument in task.get_arguments():
        if argument.positional:
            word = argument.names[0].upper()
            words.append(f"[{word}]" if argument.name in task.shown_optional else word)
    return " ".join(words + ["[options]"])


def usage_body(task: Command) -> list[str]:
    """The command's usage text without a first `usage:` line that only repeats `command_line`."""
    body = task.usage.strip("\n").splitlines()
    if body and body[0].lower().startswith("usage:") and \
            body[0].split(":", 1)[1].strip() == command_line(task, task.name):
        body = body[1:]
    return body


def render_help(task: Command, name: str) -> str:
    width = max(60, min(120, shutil.get_terminal_size((100, 24)).columns))
    lines = [f"Usage: {command_line(task, name)}", ""]
    doc = inspect.getdoc(task.body) or ""
    if doc:
        lines += [doc, ""]
    body = usage_body(task)
    if body:
        lines += body + [""]
    positionals = [a for a in task.get_arguments() if a.positional]
    if positionals:
        lines.append("Arguments:")
        lines += [f"  {a.names[0].upper():10s}{a.help or ''}" for a in positionals] + [""]
    rows = []
    for argument in sorted((a for a in task.get_arguments() if not a.positional), key=lambda a: a.names[0]):
        flags = []
        takes_value = argument.kind is not bool
        for flag in sorted(argument.names, key=len):
            if len(flag) == 1:
                flags.append(f"-{flag}" + (f" {_metavar(argument)}" if takes_value else ""))
            else:
                flags.append(f"--{flag}" + (f"={_metavar(argument)}" if takes_value else ""))
        rows.append((", ".join(flags), argument.help or ""))
    rows.append(("-h, --help", "this help"))
    column = min(34, max(len(flags) for flags, _ in rows) + 2)
    lines.append("Options:")
    for flags, text in rows:
        wrapped = textwrap.wrap(text, width=width - column - 2) or [""]
        if len(flags) + 2 > column:
            lines.append(f"  {flags}")
            lines += [" " * (column + 2) + part for part in wrapped]
        else:
            lines.append(f"  {flags.ljust(column)}{wrapped[0]}")
            lines += [" " * (column + 2) + part for part in wrapped[1:]]
    return "\n".join(lines)
