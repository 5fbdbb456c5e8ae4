"""The gpu/ scripts are stdlib scripts, not a package: tests load them by path."""
import importlib.util
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def load_gpu_script(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "gpu" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def modules_named(top):
    """The names in sys.modules of a top-level module and its submodules (for a test that imports a
    stand-in under a real package's name and must leave no trace of it)."""
    import sys

    return [name for name in sys.modules if name == top or name.startswith(top + ".")]


async def on_loopback_server(routes, fn):
    """fn(session, srv) against an aiohttp app of `routes` ([(method, path, handler)]) listening on
    127.0.0.1 (a free port), srv having the `name` and `base` URL the drivers read; the app is
    stopped after."""
    import types

    import aiohttp
    from aiohttp import web

    app = web.Application()
    for method, path, handler in routes:
        app.router.add_route(method, path, handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    srv = types.SimpleNamespace(name="s", base=f"http://127.0.0.1:{port}")
    try:
        async with aiohttp.ClientSession() as s:
            return await fn(s, srv)
    finally:
        await runner.cleanup()
