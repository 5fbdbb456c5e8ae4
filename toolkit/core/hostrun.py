"""Run a host-side script in one round trip and get its JSON answer back.

Host-side work is done by small standard-library-only scripts in `toolkit/hostside/`.
Each defines `main(args: dict) -> dict`. `run_script` sends `_lib.py`, the shared
host-side modules the script names in a `# hostrun-uses: a, b` line of its leading
comment block, the script itself and a bootstrap on stdin to the host's Python
(`python3 -`), with the arguments embedded as base64 JSON, and reads back one marked
JSON line from stdout. This is the only way host scripts are assembled and sent. Nothing
is installed on the host for this, and one step costs exactly one round trip.
"""
from __future__ import annotations

import base64
import json
from importlib import resources

from toolkit.core.transport import CommandResult, Transport

RESULT_MARKER = "@@TOOLKIT-RESULT@@"
USES_PREFIX = "# hostrun-uses:"
BOOTSTRAP_START = "\n\nif __name__ == '__main__':\n"


class HostScriptError(RuntimeError):
    """The host-side script failed or answered nothing readable."""

    def __init__(self, message: str, result: CommandResult | None = None):
        super().__init__(message)
        self.result = result


def _read(name: str) -> str:
    return resources.files("toolkit.hostside").joinpath(f"{name}.py").read_text()


def uses(source: str) -> list[str]:
    """The shared host-side modules a script names in its leading comment block."""
    for line in source.splitlines():
        if line.startswith(USES_PREFIX):
            return [n.strip() for n in line[len(USES_PREFIX):].split(",") if n.strip()]
        if line.strip() and not line.startswith("#"):
            break
    return []


def script_source(name: str) -> str:
    """`_lib.py`, the modules NAME uses (each once, in order), then NAME itself."""
    order: list[str] = []

    def visit(module: str, path: tuple) -> None:
        if module in path:
            raise ValueError(f"host-side modules use each other in a cycle: {' -> '.join(path + (module,))}")
        for dep in uses(_read(module)):
            visit(dep, path + (module,))
        if module not in order:
            order.append(module)

    visit(name, ())
    return "\n\n".join(_read(module) for module in ["_lib"] + order)


def build_payload(name: str, args: dict) -> str:
    encoded = base64.b64encode(json.dumps(args).encode()).decode()
    bootstrap = BOOTSTRAP_START + f"    _run_main(main, {encoded!r}, {RESULT_MARKER!r})\n"
    return script_source(name) + bootstrap


def parse_result(result: CommandResult, name: str) -> dict:
    for line in reversed(result.stdout.splitlines()):
        if line.startswith(RESULT_MARKER):
            answer = json.loads(line[len(RESULT_MARKER):])
            if isinstance(answer, dict) and answer.get("_error"):
                raise HostScriptError(f"host-side {name} failed: {answer['_error']}", result)
            return answer
    raise HostScriptError(
        f"host-side {name} answered nothing (exit {result.exit_code}):\n{result.tail()}", result)


def run_script(transport: Transport, name: str, args: dict | None = None, *,
               python: str = "python3", timeout: float | None = None,
               env: dict[str, str] | None = None) -> dict:
    """Run `toolkit/hostside/<name>.py` on the host with `args`; return its dict."""
    payload = build_payload(name, args or {})
    result = transport.run(f"{python} -", stdin=payload, timeout=timeout, env=env)
    return parse_result(result, name)
