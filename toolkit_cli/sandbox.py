"""`invoke sandbox up|down|status`: the embedded SSH host on loopback."""
from __future__ import annotations

from toolkit.core import report, sandbox as engine

from toolkit_cli.common import fail, help_or_bad_action, int_option
from toolkit_cli.parsing import command

ACTIONS = ("up", "down", "status")
USAGE = """usage: invoke sandbox ACTION [options]
  up [--port N] [--dry-run]   start sshd on 127.0.0.1 (idempotent); installs openssh-server through apt
                              when missing, naming the packages first; refuses another --port while up
  down [--dry-run]            stop the sandbox host's model server (as `server stop`), then the sshd this
                              checkout's .sandbox/ started
  status                      running?, pid, port, folder"""


@command(positional=["action"], checked=["action"], usage=USAGE, help={
    "action": "up (start sshd on 127.0.0.1, idempotent) | down | status",
    "port": f"up: port for sshd (default {engine.DEFAULT_PORT}, or TOOLKIT_SANDBOX_PORT)",
    "dry_run": "up: say what it would install, write and start; down: what it would stop; do nothing",
})
def sandbox(c, action=None, port=None, dry_run=False):
    """Manage the sandbox host: a real sshd on 127.0.0.1 with its own keys (the default --host)."""
    if help_or_bad_action(sandbox, action, ACTIONS):
        return
    port = int_option(port, "--port")
    if port is not None and action != "up":
        fail(f"`invoke sandbox {action}` takes no --port: it finds the sandbox by its folder, whatever its port",
             code=2)
    try:
        if action == "up":
            result = engine.up(port=port, dry_run=dry_run, note=report.note)
        elif action == "down":
            result = engine.down(dry_run=dry_run)
        else:
            result = engine.status()
    except engine.SandboxError as exc:
        fail(str(exc))
    report.line(result.line())
