#!/bin/bash
# The trained pair in /tmp/models: gpu/train_pair.py on the site's packages and the image's
# standard library (Python sources only), seeded, on the GPU. Shared by run_accept.sh and
# run_auto.sh, after they have sourced device_env.sh and set PYTHONPATH.
# usage: bash gpu/make_trained_pair.sh SECONDS WORK   (SECONDS: the training's timeout; WORK:
#        where train.log goes). Env: TARGET_S / DRAFT_S (default 70 / 35), CORPUS_BYTES,
#        PAIR_ARCH (default llama; mla: a small DeepseekV3 target, train_pair.py --arch mla).
# Exit 0 only when the draft's weights are there.
set -u
seconds=$1
work=$2
STDLIB=$(python3 -c 'import sysconfig; print(sysconfig.get_paths()["stdlib"])')
timeout "$seconds" python3 gpu/train_pair.py /tmp/models --corpus /tmp/site --corpus "$STDLIB" \
  --size small --arch ${PAIR_ARCH:-llama} --bytes ${CORPUS_BYTES:-40000000} --target-s ${TARGET_S:-70} --draft-s ${DRAFT_S:-35} \
  --seed 0 --device cuda 2>&1 | grep -v "UserWarning\|warnings.warn" | tee "$work/train.log"
[ -f /tmp/models/draft-trained/model.safetensors ]
