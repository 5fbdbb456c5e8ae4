"""Make the 'naive batch-size bypass' (the hand-made patch that crashed) in a copy of sglang.

Usage: python3 naive_bypass.py SGLANG_PACKAGE_DIR

Above NAIVE_BYPASS_THRESHOLD running requests, the v1 EAGLE worker hands the
speculative batch straight to the target worker as a plain decode. With a
speculative algorithm set, ScheduleBatch.prepare_for_decode returns early, so
input_ids/out_cache_loc still have the speculative layout (bs x draft tokens):
this is the failure the dyn-disable patchset avoids. Used only to reproduce it.
"""
import sys
from pathlib import Path

path = Path(sys.argv[1]) / "srt" / "speculative" / "eagle_worker.py"
src = path.read_text()
anchor = """        else:
            set_time_batch(batch.reqs, "set_spec_draft_start_time", trace_only=True)
"""
bypass = """        else:
            if batch.batch_size() > int(__import__("os").environ.get("NAIVE_BYPASS_THRESHOLD", "1000000")):
                # naive bypass: plain target forward of the speculative batch
                model_worker_batch = batch.get_model_worker_batch()
                return self.target_worker.forward_batch_generation(model_worker_batch)
            set_time_batch(batch.reqs, "set_spec_draft_start_time", trace_only=True)
"""
assert src.count(anchor) == 1, "anchor not found: not sglang 0.5.11?"
path.write_text(src.replace(anchor, bypass))
print("naive bypass written to", path)
