"""`python -m sglang.launch_server ...` as the firstcross driver starts it, served by the
accept stand-in (tests/gpu/accept_standin.py): the dyn-disable threshold from the environment;
on the "before-fix" sglang (site-r8 first on PYTHONPATH) the first crossing stalls 1 s and
leaves a kernel in TVM_FFI_CACHE_DIR, on the current one that kernel is there at start."""
import asyncio
import logging
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", ".."))
from tests.gpu import accept_standin as sa  # noqa: E402

KERNEL = os.path.join(os.environ.get("TVM_FFI_CACHE_DIR", "/nonexistent"), "clamp_position_0", "clamp_position.so")


def put_kernel():
    os.makedirs(os.path.dirname(KERNEL), exist_ok=True)
    with open(KERNEL, "w") as f:
        f.write("so")


class StandIn(sa.StandIn):
    async def step(self, *args):  # the stand-in's own arguments, whichever they are
        out = await super().step(*args)
        if self.off and not os.path.exists(KERNEL):
            put_kernel()
        return out


async def main():
    # the stand-in writes the log through its own handle on the log file: aiohttp's tracebacks
    # for requests it does not serve (the smoke's text prompts) would overwrite its lines
    logging.disable(logging.CRITICAL)
    argv = sys.argv
    port = int(argv[argv.index("--port") + 1])
    threshold = os.environ.get("SGLANG_SPEC_DISABLE_THRESHOLD")
    old = "site-r8" in os.environ["PYTHONPATH"].split(":")[0]
    if old and os.environ.get("FAKE_SGLANG_OLD_DIES"):
        sys.exit("RuntimeError: Not enough memory")
    s = StandIn("/dev/stdout", accept=2.5 if "--speculative-algorithm" in argv else None,
                threshold=int(threshold) if threshold else None, first_off_stall_s=1.0 if old else 0.0)
    if threshold and not old:
        put_kernel()
        s.write("Dynamic speculation disable enabled: threshold=3; extra GPU memory 0.31 GiB")
    elif threshold:
        s.write("Dynamic speculation disable enabled: threshold=3; extra GPU memory 0.12 GiB")
    from aiohttp import web
    runner = web.AppRunner(s.app())
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    await asyncio.Event().wait()


asyncio.run(main())
