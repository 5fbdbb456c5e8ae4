#!/bin/bash
# /tmp/noisy/sglang: a copy of /tmp/site's sglang whose greedy sampler adds noise to the logits,
# a regression that changes outputs at temperature 0 (the smoke's determinism check must fail
# on it). Servers run it with PYTHONPATH=/tmp/noisy:/tmp/site. Device, after gpu/run_dyn.sh setup.
set -eu
rm -rf /tmp/noisy && mkdir -p /tmp/noisy && cp -r /tmp/site/sglang /tmp/noisy/
SAMPLER=/tmp/noisy/sglang/srt/layers/sampler.py
sed -i 's/batch_next_token_ids = torch.argmax(logits, -1)$/batch_next_token_ids = torch.argmax(logits + torch.randn_like(logits) * logits.std(-1, keepdim=True), -1)/' $SAMPLER
n=$(grep -c "torch.randn_like(logits)" $SAMPLER || true)
echo "noisy greedy sampler lines: $n"
[ "$n" -ge 1 ]
