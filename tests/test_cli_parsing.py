"""The command shape the user types: `invoke patch apply NAME` and `invoke patch verify`, parsed
by the toolkit's Program (toolkit_cli/program.py)."""
from invoke import Collection, Program

from toolkit_cli.parsing import command
from toolkit_cli.program import Toolkit, started_by_invoke

seen = []


@command(positional=["action", "name"], optional=["name"])
def patch(c, action, name=None, host=None, json=False):
    seen.append((action, name or None, host, json))


@command(positional=["action"])
def other(c, action):
    seen.append(("other", action))


def run(argv):
    seen.clear()
    Toolkit(namespace=Collection(patch, other)).run(["invoke", *argv], exit=False)
    return list(seen)


def test_action_and_name():
    assert run(["patch", "apply", "dyn-disable", "--host", "a,b"]) == [("apply", "dyn-disable", "a,b", False)]


def test_name_may_be_omitted_at_the_end_or_before_flags():
    assert run(["patch", "verify"]) == [("verify", None, None, False)]
    assert run(["patch", "verify", "--json"]) == [("verify", None, None, True)]


def test_two_tasks_in_one_line():
    assert run(["patch", "revert", "sm120", "other", "x"]) == [("revert", "sm120", None, False), ("other", "x")]


def test_required_positional_still_required(capsys):
    assert run(["other"]) == []
    assert "did not receive required positional arguments: 'action'" in capsys.readouterr().err


def test_dash_h_is_help_and_dash_capital_h_is_the_host(capsys):
    assert run(["patch", "verify", "-H", "gpu1"]) == [("verify", None, "gpu1", False)]
    # -h is not a task flag any more: where a positional is still open Invoke hands it to that
    # positional (the commands show their help for it, see common.wants_help) ...
    assert run(["patch", "-h"]) == [("-h", None, None, False)]
    assert run(["patch", "verify", "-h"]) == [("verify", "-h", None, False)]
    # ... and where none is open it is Invoke's help for the task, drawn by parsing.render_help
    assert run(["other", "x", "-h"]) == []
    out = capsys.readouterr().out
    assert out.startswith("Usage: invoke other ACTION [options]\n")


def test_every_host_option_takes_dash_capital_h():
    from toolkit_cli.program import ns
    for name in ("patch", "server", "smoke", "bench", "facts", "provision", "wheelhouse", "demo", "rollout"):
        task = ns[name]
        names = {arg.name: arg.names for arg in task.get_arguments()}
        assert names["host"] == ("host", "H"), name


def test_invoke_itself_is_left_as_it_is(capsys):
    """Only the toolkit's Program lets a positional be left out; Invoke's own still requires it."""
    seen.clear()
    Program(namespace=Collection(patch, other)).run(["invoke", "patch", "verify"], exit=False)
    assert seen == []
    assert "did not receive required positional arguments: 'name'" in capsys.readouterr().err


def test_tasks_py_hands_over_only_under_invokes_own_program():
    for argv0 in ("/venv/bin/invoke", "inv", "/venv/lib/python3.11/site-packages/invoke/__main__.py"):
        assert started_by_invoke(argv0), argv0
    for argv0 in ("/venv/bin/pytest", "-c", "/repo/toolkit_cli/__main__.py", "/venv/bin/invoker"):
        assert not started_by_invoke(argv0), argv0


def test_no_option_is_cast_by_invoke_itself():
    """Invoke casts an option whose default is an int and shows a traceback for `--x abc`; every
    toolkit option takes text (checked where it is used, exit 2 naming it) or is a flag."""
    from toolkit_cli.program import ns
    for name in ns.task_names:
        for arg in ns[name].get_arguments():
            assert arg.kind in (str, bool, list), (name, arg.name, arg.kind)
