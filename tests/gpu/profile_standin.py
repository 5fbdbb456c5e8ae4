"""A stand-in for an SGLang server's batch loop and torch profiler, for gpu/profile_load.py.

One scheduler loop, as SGLang's: each step either prefills waiting requests (an EXTEND batch of
whole prompts up to `chunk` tokens) or, with none waiting, decodes one token for every running
request. POST /start_profile {"output_dir", "num_steps"} answers at once; the next num_steps
steps are recorded and written as a gzipped chrome trace the way SGLang 0.5.11 writes one: per
step a `step[EXTEND bs=N toks=T]` / `step[DECODE bs=N]` span with a kernel launched inside it
(`_fwd_kernel` for an extend, the decode's `_fwd_grouped_kernel_stage1`), so
gpu/trace_steps.py reads it. /generate takes input_ids, /v1/completions a prompt (counted as a
dozen tokens). Prompts longer than `context` are refused with 400, as SGLang refuses them.
Served on loopback by tests/gpu/accept_standin.serve.
"""
import asyncio
import gzip
import json
import os
import time

from aiohttp import web


class ProfileStandIn:
    def __init__(self, step_s=0.002, chunk=256, context=4096, refuse_profile=False):
        self.step_s, self.chunk, self.context, self.refuse_profile = step_s, chunk, context, refuse_profile
        self.waiting, self.running = [], []
        self.wake = asyncio.Event()
        self.prompts = []  # every prompt's token ids (or its text), in arrival order
        self.arrived = []  # time.monotonic() of each, in the same order
        self.profile_started = None  # time.monotonic() of the (last) accepted /start_profile
        self.steps = []  # (mode, bs, toks) of every step
        self.profile = None  # {"out": dir, "left": steps, "events": [...]} while profiling
        self.loop_task = None

    async def scheduler(self):
        while True:
            if not self.waiting and not self.running:
                self.wake.clear()
                await self.wake.wait()
            t0 = time.time()
            if self.waiting:
                batch, toks = [], 0
                while self.waiting and (not batch or toks + self.waiting[0]["len"] <= self.chunk):
                    req = self.waiting.pop(0)
                    batch.append(req)
                    toks += req["len"]
                await asyncio.sleep(self.step_s * (1 + toks / self.chunk))
                self.running += batch
                step = ("EXTEND", len(batch), toks)
            else:
                batch = list(self.running)
                await asyncio.sleep(self.step_s)
                for req in batch:
                    req["out"] += 1
                    if req["out"] >= req["max"]:
                        self.running.remove(req)
                        req["done"].set_result(req["out"])
                step = ("DECODE", len(batch), None)
            self.steps.append(step)
            self.record(step, t0, time.time())

    def record(self, step, t0, t1):
        if self.profile is None:
            return
        mode, bs, toks = step
        n = len(self.steps)
        ts, dur = t0 * 1e6, (t1 - t0) * 1e6
        name = f"step[{mode} bs={bs}" + (f" toks={toks}]" if mode == "EXTEND" else "]")
        kernel = "_fwd_kernel" if mode == "EXTEND" else "_fwd_grouped_kernel_stage1"
        self.profile["events"] += [
            {"ph": "X", "cat": "user_annotation", "name": name, "pid": 1, "tid": 1, "ts": ts, "dur": dur},
            {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "pid": 1, "tid": 1, "ts": ts + 1,
             "dur": 1, "args": {"correlation": n}},
            {"ph": "X", "cat": "kernel", "name": kernel, "pid": 0, "tid": 7, "ts": ts + 2, "dur": dur / 2,
             "args": {"correlation": n}}]
        self.profile["left"] -= 1
        if self.profile["left"] == 0:
            os.makedirs(self.profile["out"], exist_ok=True)
            path = os.path.join(self.profile["out"], f"{time.time()}-TP-0.trace.json.gz")
            with gzip.open(path + ".part", "wt") as f:
                json.dump({"traceEvents": self.profile["events"]}, f)
            os.rename(path + ".part", path)
            self.profile = None

    async def admit(self, prompt, length, max_tokens):
        if self.loop_task is None:
            self.loop_task = asyncio.create_task(self.scheduler())
        if length > self.context:
            raise web.HTTPBadRequest(text=json.dumps({"error": "input longer than the context"}))
        self.prompts.append(prompt)
        self.arrived.append(time.monotonic())
        req = {"len": length, "max": max_tokens, "out": 0, "done": asyncio.get_running_loop().create_future()}
        self.waiting.append(req)
        self.wake.set()
        return await req["done"]

    async def generate(self, request):
        j = await request.json()
        sp = j["sampling_params"]
        n = await self.admit(list(j["input_ids"]), len(j["input_ids"]), sp["max_new_tokens"])
        return web.json_response({"output_ids": [11] * n, "meta_info": {"completion_tokens": n}})

    async def completions(self, request):
        j = await request.json()
        n = await self.admit(j["prompt"], 12, j["max_tokens"])
        return web.json_response({"choices": [{"text": "x" * n}], "usage": {"completion_tokens": n}})

    async def start_profile(self, request):
        j = await request.json()
        if self.refuse_profile:
            raise web.HTTPServiceUnavailable(text="profiler busy")
        self.profile = {"out": j["output_dir"], "left": j["num_steps"], "events": []}
        self.profile_started = time.monotonic()
        return web.json_response({"success": True})

    def app(self):
        a = web.Application()
        a.router.add_post("/generate", self.generate)
        a.router.add_post("/v1/completions", self.completions)
        a.router.add_post("/start_profile", self.start_profile)
        return a
