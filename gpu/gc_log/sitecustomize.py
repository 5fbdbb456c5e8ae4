"""Lab only (gpu/run_accept.sh with GC_LOG_MS=N): log every garbage collection of this process that
takes N ms or more, with its start in epoch seconds, so that gpu/gc_pauses.py can set the pauses
against the stream gaps a run measured (the accept harness's clock is time.time() too).

Python imports sitecustomize in every interpreter it starts when this folder is on PYTHONPATH, so the
scheduler SGLang spawns logs its own collections; its stderr goes to the server's log. Every server of
a run gets it alike: a callback per collection, two clock reads."""
import gc
import os
import sys
import time

_THRESHOLD_MS = float(os.environ.get("LAB_GC_LOG_MS") or 0)


def _make_hook(threshold_ms, write=sys.stderr.write, clock=time.time):
    started = [0.0]

    def hook(phase, info):
        if phase == "start":
            started[0] = clock()
            return
        ms = 1000 * (clock() - started[0])
        if ms >= threshold_ms:
            write(f"[lab-gc] pid={os.getpid()} gen={info.get('generation')} start={started[0]:.4f} "
                  f"ms={ms:.1f} collected={info.get('collected')}\n")

    return hook


if _THRESHOLD_MS > 0:
    gc.callbacks.append(_make_hook(_THRESHOLD_MS))
