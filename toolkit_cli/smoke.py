"""`invoke smoke [--host NAME] [--json] [--url URL]`: check that the running server really works."""
from __future__ import annotations

from rich.markup import escape

from toolkit.core import report
from toolkit.server import server
from toolkit.check import smoke as engine
from toolkit.check.client import base_url_of
from toolkit.bench.hosts import simulated_accept_length
from toolkit.core.inventory import Host

from toolkit_cli.common import HOST_HELP, fail, finish, run_on_hosts
from toolkit_cli.parsing import command


class SmokeSetupError(RuntimeError):
    pass


def smoke_host(host: Host, burst: int | None = None,
               max_tokens: int = engine.CHAT_MAX_TOKENS) -> tuple[engine.SmokeResult, dict]:
    try:
        state = server.status(host)
    except server.ServerError as exc:
        raise SmokeSetupError(f"cannot read the server state: {exc}") from exc
    if state is None:
        raise SmokeSetupError(f"no server is recorded as running on {host.name}; "
                              f"start one: invoke server start PROFILE --host {host.name}")
    if state.status == "dead":
        raise SmokeSetupError(f"the {state.profile} server on {host.name} is recorded but its process is gone; "
                              f"see: invoke server logs --host {host.name}, then start it again")
    about = {"host": host.name, "profile": state.profile, "kind": state.kind,
             "dyn_threshold": state.dyn_threshold}
    size = burst or engine.burst_size(state.dyn_threshold)
    simulated = simulated_accept_length(host, state, state.overrides or None)
    with server.endpoint(host, state) as url:
        result = engine.run_smoke(url, read_log=lambda: server.read_log(host, since_start=True), burst=size,
                                  chat_max_tokens=max_tokens, simulated_accept_length=simulated)
    return result, about


def print_result(result: engine.SmokeResult, about: dict) -> None:
    where = about.get("host") or "?"
    title = f"smoke: {where} ({about.get('profile') or 'server'}, model {result.model})"
    if where != result.base_url:
        title += f" at {result.base_url}"
    rows = [(check.name, check.status, f"{check.seconds:.2f}", escape(check.detail)) for check in result.checks]
    report.table(escape(title), ["check", "status", "s", "detail"], rows, status_column=1)
    if result.rejected_fields:
        report.note(f"the server rejects {', '.join(result.rejected_fields)}: sent without them")
    failed = [check.name for check in result.checks if check.status == "fail"]
    report.line(f"FAILED: {', '.join(failed)}" if failed else "all checks passed")


@command(positional=[], help={
    "host": HOST_HELP,
    "json_": "print one JSON object (host -> checks) instead of tables",
    "url": "smoke an OpenAI-compatible server at this base URL instead of a host's recorded server "
           "(no log check); e.g. http://127.0.0.1:8000",
    "burst": "concurrent requests in the burst check (default: 2 x the profile's dyn-disable "
             f"threshold + 2, or {engine.DEFAULT_BURST})",
    "max_tokens": f"max_tokens of the chat, determinism and stream checks (default {engine.CHAT_MAX_TOKENS})",
})
def smoke(c, host=None, json_=False, url=None, burst=None, max_tokens=None):
    """Check the running server: models, chat + usage, determinism, streaming, a burst, health, log."""
    try:
        burst = int(burst) if burst else None
        max_tokens = int(max_tokens) if max_tokens else engine.CHAT_MAX_TOKENS
    except ValueError:
        fail("--burst and --max-tokens take integers", code=2)
    if (burst is not None and burst < 1) or max_tokens < 1:
        fail("--burst and --max-tokens must be >= 1", code=2)
    if url:
        if host:
            fail("give either --url or --host, not both", code=2)
        try:
            base_url_of(url)
        except ValueError as exc:
            fail(f"--url: {exc}", code=2)
        result = engine.run_smoke(url, burst=burst or engine.DEFAULT_BURST, chat_max_tokens=max_tokens)
        about = {"host": url, "profile": None}
        if json_:
            report.emit_json({url: {**result.to_dict(), **about}})
        else:
            print_result(result, about)
        if not result.ok:
            fail("smoke failed")
        return

    outcomes = run_on_hosts(host, lambda h: smoke_host(h, burst, max_tokens))
    if json_:
        report.emit_json({o.host.name: ({**o.value[0].to_dict(), **o.value[1]} if o.error is None
                                        else {"ok": False, "error": str(o.error)}) for o in outcomes})
    else:
        for outcome in outcomes:
            if outcome.error is None:
                print_result(*outcome.value)
    finish(outcomes, failed=lambda value: not value[0].ok)
