"""Helpers every task module uses: resolve --host, run per host, turn failures into exit codes."""
from __future__ import annotations

import math
from typing import Any, Callable

from invoke.exceptions import Exit

from toolkit.core import report
from toolkit.core.inventory import Host, InventoryError, resolve_hosts
from toolkit.core.parallel import HostOutcome, for_each_host
from toolkit.server.profiles import AUTO_THRESHOLD

from toolkit_cli.parsing import Command, command_line, render_help, usage_body

HOST_HELP = "host name(s) from hosts/*.toml, comma-separated, or @label; default: sandbox"


def hosts_or_exit(spec: str | None) -> list[Host]:
    try:
        return resolve_hosts(spec)
    except InventoryError as exc:
        raise Exit(f"error: {exc}", code=2)


def run_on_hosts(spec: str | None, action: Callable[[Host], Any]) -> list[HostOutcome]:
    return for_each_host(hosts_or_exit(spec), action)


def fail(message: str, code: int = 1):
    raise Exit(f"error: {message}", code=code)


def int_option(value, option: str, default: int | None = None, takes: str = "an integer",
               minimum: int | None = None) -> int | None:
    """An integer option as typed (`default` when not given); exit 2 naming the option and what
    it `takes` otherwise, or when it is below `minimum`. Ranges that depend on more than the
    option itself are checked where the value is used (profiles, BenchOptions)."""
    if value in (None, ""):
        return default
    try:
        number = int(value)
    except (TypeError, ValueError):
        fail(f"{option} takes {takes}, got {value!r}", code=2)
    if minimum is not None and number < minimum:
        fail(f"{option} must be >= {minimum}, got {number}", code=2)
    return number


def int_list_option(text: str, what: str) -> list[int]:
    """Comma-separated integers >= 1 as typed (`1,4,16`); exit 2 naming the option otherwise."""
    parts = [part.strip() for part in str(text).split(",")]
    if "" in parts:
        fail(f"{what} has an empty item in {text!r}: give integers separated by single commas", code=2)
    try:
        values = [int(part) for part in parts]
    except ValueError:
        fail(f"{what} takes comma-separated integers, got {text!r}", code=2)
    if not values or any(v < 1 for v in values):
        fail(f"{what} needs integers >= 1, got {text!r}", code=2)
    return values


def seconds_option(value, option: str, default: float | None = None, positive: bool = False) -> float | None:
    """A number of seconds as typed (`default` when not given); exit 2 naming the option when it
    is not a number, is negative, or (`positive`) is 0."""
    if value in (None, ""):
        return default
    try:
        seconds = float(value)
    except (TypeError, ValueError):
        fail(f"{option} takes a number of seconds, got {value!r}", code=2)
    if not math.isfinite(seconds) or seconds < 0 or (positive and seconds == 0):
        fail(f"{option} must be {'> 0' if positive else '>= 0'} seconds, got {value}", code=2)
    return seconds


def host_message(host: Host, error: BaseException) -> str:
    """The error as `HOST: message`, the host named once (engine errors such as the server's name it
    themselves, so that rollout and bench can pass them on as they are)."""
    text = str(error)
    return text if text.startswith(f"{host.name}: ") else f"{host.name}: {text}"


def finish(outcomes: list[HostOutcome], failed: Callable[[Any], bool] = lambda value: False,
           show: Callable[[Any], None] | None = None) -> None:
    """Print per-host errors (and, with `show`, each good result); exit non-zero when any host
    failed or `failed(value)` says so."""
    bad = 0
    for outcome in outcomes:
        if outcome.error is not None:
            report.error(host_message(outcome.host, outcome.error))
            bad += 1
            continue
        if show is not None:
            show(outcome.value)
        if failed(outcome.value):
            bad += 1
    if bad:
        raise Exit(code=1)


def wants_help(*positionals: str | None) -> bool:
    # Invoke hands a --help typed where a positional is still open to that positional
    # (`invoke patch -h`, `invoke patch verify -h`); show the task's help instead.
    return any(value in ("--help", "-h", "help") for value in positionals)


def short_usage(task: Command) -> str:
    body = usage_body(task)
    if not (body and body[0].lower().startswith("usage:")):
        body = [f"usage: {command_line(task, task.name)}", *body]
    return "\n".join([*body, f"all options: invoke --help {task.name}"])


def help_or_bad_action(task: Command, action: str | None, actions, *positionals: str | None) -> bool:
    """True after printing the task's help for a help request; exit 2 with its usage when the
    action is missing or not one of `actions`."""
    if wants_help(action, *positionals):
        report.line(render_help(task, task.name))
        return True
    if not action:
        fail(f"`invoke {task.name}` needs an action: {' | '.join(actions)}\n{short_usage(task)}", code=2)
    if action not in actions:
        fail(f"unknown action {action!r}; one of: {' | '.join(actions)}\n{short_usage(task)}", code=2)
    return False


def threshold_option(value):
    """--threshold N, or --threshold auto (the dyn-disable patch finds the crossover itself)."""
    if value == AUTO_THRESHOLD:
        return value
    return int_option(value, "--threshold", takes="an integer or auto")
