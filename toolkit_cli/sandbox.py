"""`invoke sandbox up|down|status`: the embedded SSH host on loopback."""
from __future__ import annotations

from toolkit import report, sandbox as engine

from .common import fail, wants_help
from .parsing import command

ACTIONS = ("up", "down", "status")


@command(positional=["action"], help={
    "action": "up (start sshd on 127.0.0.1, idempotent) | down | status",
    "port": "port for sshd (default 2222, or TOOLKIT_SANDBOX_PORT)",
})
def sandbox(c, action, port=None):
    """Manage the sandbox host: a real sshd on 127.0.0.1 with its own keys (the default --host)."""
    if wants_help(action) or action not in ACTIONS:
        fail(f"usage: invoke sandbox {'|'.join(ACTIONS)} [--port N]", code=2)
    port = int(port) if port else None
    try:
        state = {"up": engine.up, "down": engine.down}.get(action, engine.status)
        result = state(port=port) if action != "down" else state()
    except engine.SandboxError as exc:
        fail(str(exc))
    report.line(result.line())
