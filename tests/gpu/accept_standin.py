"""A stand-in for SGLang's native /generate, for driving gpu/accept_device.py on the CPU.

It "decodes" a deterministic toy model step by step (asyncio sleeps), counts verify steps as an
EAGLE server does (completion_tokens / spec_verify_ct = accept length), and with a threshold
stops and resumes drafting by the number of running requests, writing the dyn-disable patch's
log lines (switch lines and the Decode batch counters). Streamed events carry meta_info with the
cumulative completion_tokens, one event per step; spec_verify_ct only comes in the last one, as in
SGLang 0.5.11. Knobs model what the harness must see: a stale draft (the negative control: a
request that decoded through plain steps accepts nothing for its next `collapse_steps` steps after
the resume; a request prefilled after it is not hurt; with `arrival_collapse_steps`, one that
arrives while drafting is off, as SGLANG_SPEC_DISABLE_PLAIN_DRAFT_KV=defer leaves it), a one-off stall at the first crossing,
plain steps that flip a near-tie token, a server whose steps are slower once it has crossed
(slow_after_cross_s) and noise common to several stand-ins (Noise: their steps slow down alike).
Decode batch lines carry SGLang's stamp ("[%Y-%m-%d %H:%M:%S TP0]", local time) and gen throughput
(the step's tokens over its duration), also on a plain server (without accept len).
"""
import asyncio
import json
import time

from aiohttp import web


def next_token(ctx):
    return (ctx[-1] * 31 + ctx[-2] * 7 + len(ctx)) % 300 + 10


class Noise:
    """A slowdown shared by the stand-ins given it: every step of theirs lasts `factor` times its
    own; the first crossing of any of them sets factor to `after_crossing` (the kind of shift between
    phases that identical work showed on stock servers on the GPU)."""

    def __init__(self, after_crossing=1.6):
        self.factor, self.after_crossing = 1.0, after_crossing

    def crossed(self):
        self.factor = self.after_crossing


class StandIn:
    def __init__(self, log_path, accept=None, threshold=None, hysteresis=2, step_s=0.002,
                 collapse_steps=0, first_off_stall_s=0.0, plain_flip=False, margin=0.004, batch_flip=None,
                 slow_after_cross_s=0.0, noise=None, arrival_collapse_steps=0):
        self.log_path, self.accept, self.threshold, self.hyst = log_path, accept, threshold, hysteresis
        self.step_s, self.collapse_steps, self.first_off_stall_s = step_s, collapse_steps, first_off_stall_s
        # a request that arrives while drafting is off accepts nothing for this many steps after the
        # resume (defer: the draft's KV of its prompt never written)
        self.arrival_collapse_steps = arrival_collapse_steps
        self.plain_flip, self.margin, self.batch_flip = plain_flip, margin, batch_flip
        self.running, self.off, self.switches, self.stalled = 0, False, [0, 0], False
        self.stall_until = 0.0
        self.slow_after_cross_s, self.noise = slow_after_cross_s, noise
        self.profiles = []   # (body, requests running, the longest stream's tokens so far) per /start_profile
        self.streamed = 0    # the most tokens any request has streamed
        self.log = open(log_path, "w")
        self.log.write("Dynamic speculation disable enabled\n" if threshold else "ready\n")
        self.log.flush()

    def write(self, line):
        self.log.write(line + "\n")
        self.log.flush()

    def decode_line(self, n, dt, accept):
        stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
        acc = f"accept len: {n:.2f}, accept rate: 0.50, " if accept else ""
        counters = f"spec off/on switches: {self.switches[0]}/{self.switches[1]}, " if self.threshold else ""
        self.write(f"[{stamp} TP0] Decode batch, #running-req: {self.running}, #token: 9, {acc}{counters}"
                   f"cuda graph: True, gen throughput (token/s): {n / dt:.2f}, #queue-req: 0")

    async def step(self, k, req):
        """One decode step of one request (its k-th verify so far; req: its state): how many
        tokens it yields and whether it was a verify step."""
        if self.threshold is not None:
            if not self.off and self.running > self.threshold:
                self.off = True
                self.switches[0] += 1
                self.write(f"[TP0] Dynamic speculation disable: drafting stopped at {self.running} "
                           f"running decode requests (x)")
                if self.noise is not None:
                    self.noise.crossed()
                if not self.stalled and self.first_off_stall_s:
                    # the batch's step stalls: every running request waits
                    self.stalled = True
                    self.stall_until = asyncio.get_running_loop().time() + self.first_off_stall_s
            elif self.off and self.running <= self.threshold - self.hyst:
                self.off = False
                self.switches[1] += 1
                self.write(f"[TP0] Dynamic speculation disable: drafting resumed at {self.running} "
                           f"running decode requests (x)")
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        step = self.step_s * (self.noise.factor if self.noise is not None else 1.0)
        if self.switches[0]:
            step += self.slow_after_cross_s
        await asyncio.sleep(max(step, self.stall_until - t0))
        dt = max(loop.time() - t0, 1e-6)
        if self.accept is None:
            self.decode_line(1, dt, False)
            return 1, False
        if self.off:
            n = 1
            req["stale"] = max(req.get("stale", 0), self.collapse_steps)
        elif req.get("stale", 0) > 0:
            req["stale"] -= 1
            n = 1
        else:  # a fixed pattern averaging `accept` tokens per verify
            n = int((k + 1) * self.accept) - int(k * self.accept)
        self.decode_line(n, dt, True)
        return n, True

    async def generate(self, request):
        j = await request.json()
        ids = list(j["input_ids"])
        sp = j["sampling_params"]
        if j.get("return_logprob"):
            tok = next_token(ids)
            top = [[-0.5, tok, "a"], [-0.5 - self.margin, tok + 1, "b"]]
            return web.json_response({"output_ids": [tok], "meta_info": {
                "completion_tokens": 1, "output_top_logprobs": [top[: j.get("top_logprobs_num", 2)]]}})
        stream = j.get("stream", False)
        resp = None
        if stream:
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
        out, ctx, verify = [], list(ids), 0
        state = {"stale": self.arrival_collapse_steps} if self.off else {}
        self.running += 1
        try:
            while len(out) < sp["max_new_tokens"]:
                n, is_verify = await self.step(verify, state)
                verify += is_verify
                for _ in range(min(n, sp["max_new_tokens"] - len(out))):
                    t = next_token(ctx)
                    if self.plain_flip and self.off and len(out) == 5 and ids[0] % 4 == 0:
                        t += 1
                    # any engine: a bigger batch flips a near tie (another reduction order)
                    if self.batch_flip is not None and self.running > self.batch_flip and len(out) == 7 \
                            and ids[0] % 5 == 0:
                        t += 2
                    ctx.append(t)
                    out.append(t)
                self.streamed = max(self.streamed, len(out))
                if stream:
                    chunk = {"output_ids": out, "meta_info": {"completion_tokens": len(out)}}
                    await resp.write(f"data: {json.dumps(chunk)}\n\n".encode())
        finally:
            self.running -= 1
        meta = {"completion_tokens": len(out)}
        if verify:
            meta["spec_verify_ct"] = verify
        if not stream:
            return web.json_response({"output_ids": out, "meta_info": meta})
        await resp.write(f"data: {json.dumps({'output_ids': out, 'meta_info': meta})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def health(self, request):
        return web.Response(text="ok")

    async def start_profile(self, request):
        self.profiles.append((await request.json(), self.running, self.streamed))
        return web.Response(text="Start profiling.")

    def app(self):
        a = web.Application()
        a.router.add_post("/generate", self.generate)
        a.router.add_get("/health_generate", self.health)
        a.router.add_post("/start_profile", self.start_profile)
        return a


class Handle:
    """What accept_device needs of a server: label, base URL, alive(), read_log(), triton_dir."""

    def __init__(self, label, standin, runner, port, triton_dir):
        self.label, self.name, self.standin, self.runner = label, label, standin, runner
        self.base = f"http://127.0.0.1:{port}"
        self.triton_dir = triton_dir

    def alive(self):
        return True

    def read_log(self):
        with open(self.standin.log_path) as f:
            return f.read()


async def serve(label, standin, triton_dir):
    runner = web.AppRunner(standin.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]
    return Handle(label, standin, runner, port, triton_dir)
