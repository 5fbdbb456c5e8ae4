#!/usr/bin/env bash
# Launch script for server profile eagle3-v2-dyn on host lab, rendered by the toolkit
# (`invoke server start eagle3-v2-dyn`) from profiles/eagle3-v2-dyn.toml and templates/launch.sh.j2.
# SGLang EAGLE-3 v2 worker (topk 1, 4 draft tokens) with dynamic disable
#
# The toolkit runs it detached in its own process group with output to a log of its own under
# logs/ beside it (server.log points at the newest).
# To run it by hand in the foreground (Ctrl-C stops it): bash /tmp/lab-state/server/eagle3-v2-dyn/launch.sh
set -eu
export CUDA_VISIBLE_DEVICES=0
export PYTHONPATH=/tmp/site:/tmp/site/_stubs
export SGLANG_ENABLE_SPEC_V2=1
export SGLANG_SPEC_DISABLE_HYSTERESIS=2
export SGLANG_SPEC_DISABLE_THRESHOLD=8
cd /tmp/lab-state/server/eagle3-v2-dyn
echo "launch.sh: starting profile eagle3-v2-dyn (pid $$) at $(date -u +%Y-%m-%dT%H:%M:%SZ)"
exec /opt/torch/.venv/bin/python3 \
    -m sglang.launch_server \
    --model-path /tmp/models/target-sharp \
    --tp-size 1 \
    --host 127.0.0.1 \
    --port 30020 \
    --speculative-algorithm EAGLE3 \
    --speculative-draft-model-path /tmp/models/draft-sharp \
    --speculative-num-steps 3 \
    --speculative-eagle-topk 1 \
    --speculative-num-draft-tokens 4 \
    --max-running-requests 4096 \
    --nccl-port 35020 \
    --attention-backend triton \
    --sampling-backend pytorch \
    --grammar-backend none \
    --cuda-graph-backend-prefill disabled \
    --random-seed 0 \
    --max-running-requests 64 \
    --cuda-graph-max-bs-decode 64 \
    --mem-fraction-static 0.08 \
    --max-total-tokens 65536 \
    --log-level info \
    --decode-log-interval 100 \
    --trust-remote-code
