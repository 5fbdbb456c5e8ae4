"""Regenerate the synthetic test patchsets in tests/patch/data/patchsets/ with edit/refresh.

    TOOLKIT_CACHE=/tmp/x python tests/patch/data/make_synthetic.py

They patch real files of the SGLang 0.5.11 wheel in harmless ways (comments and
constants), so the engine is tested on real release files without the real patchsets.
"""
from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[2]))

from toolkit.patch import authoring  # noqa: E402

TWENTY = [
    "sglang/srt/utils/aio_rwlock.py", "sglang/srt/utils/bench_utils.py", "sglang/srt/utils/custom_op.py",
    "sglang/srt/utils/device_timer.py", "sglang/srt/utils/gauge_histogram.py",
    "sglang/srt/utils/hf_transformers_patches.py", "sglang/srt/utils/host_shared_memory.py",
    "sglang/srt/utils/http_middleware_patch.py", "sglang/srt/utils/log_utils.py",
    "sglang/srt/utils/model_file_verifier.py", "sglang/srt/utils/multi_stream_utils.py",
    "sglang/srt/utils/network.py", "sglang/srt/utils/numa_utils.py", "sglang/srt/utils/nvtx_pytorch_hooks.py",
    "sglang/srt/utils/offloader.py", "sglang/srt/utils/patch_tokenizer.py", "sglang/srt/utils/patch_torch.py",
    "sglang/srt/utils/poll_based_barrier.py", "sglang/srt/utils/profile_merger.py",
    "sglang/srt/utils/profile_utils.py",
]
THREE = ["sglang/srt/utils/request_logger.py", "sglang/srt/utils/runai_utils.py",
         "sglang/srt/utils/scheduler_status_logger.py"]
AUTH = "sglang/srt/utils/auth.py"
JSON = "sglang/srt/utils/json_response.py"
RPD = "sglang/srt/utils/rpd_utils.py"


def replace(tree: Path, rel: str, old: str, new: str) -> None:
    text = (tree / rel).read_text()
    assert old in text, (rel, old)
    (tree / rel).write_text(text.replace(old, new, 1))


def make(name: str, change, requires=(), summary="") -> None:
    result = authoring.edit(name, requires=list(requires))
    change(result.tree)
    authoring.refresh(name)
    toml = Path(os.environ["TOOLKIT_PATCHSETS"]) / name / "patchset.toml"
    toml.write_text(toml.read_text().replace("TODO: one line for `invoke patch list`", summary)
                    .replace("TODO: what it changes and why", "Synthetic test patchset: " + summary))


def build(out: Path) -> None:
    """Make every synthetic patchset afresh (edit trees in the cache) and copy them into `out`."""
    saved = os.environ.get("TOOLKIT_PATCHSETS")
    with tempfile.TemporaryDirectory() as tmp:
        os.environ["TOOLKIT_PATCHSETS"] = tmp
        try:
            make("one-file", lambda t: replace(t, AUTH, "error_status_code: int = 401",
                                               "error_status_code: int = 403  # synthetic one-file"),
                 summary="one file, one hunk")
            make("pair-base", lambda t: replace(t, JSON, "def dumps_json(",
                                                "PAIR_LEVEL = 'base'\n\n\ndef dumps_json("),
                 summary="bottom of a stacked pair")
            make("pair-top", lambda t: (replace(t, JSON, "PAIR_LEVEL = 'base'", "PAIR_LEVEL = 'top'"),
                                        replace(t, RPD, "\n", "\n# synthetic pair-top\n")),
                 requires=["pair-base"], summary="top of a stacked pair (requires pair-base)")

            def twenty(tree):
                for rel in TWENTY:
                    with open(tree / rel, "a") as f:
                        f.write("\n# synthetic twenty: %s\n" % rel.rsplit("/", 1)[1])
            make("twenty", twenty, summary="one line added to each of 20 files")
            make("clash", lambda t: replace(t, AUTH, "error_status_code: int = 401",
                                            "error_status_code: int = 418  # synthetic clash"),
                 summary="changes the line one-file changes: conflicts when stacked")
            make("three", lambda t: [replace(t, rel, "\n", "\n# synthetic three\n") for rel in THREE],
                 summary="one line added to each of 3 files (every cut point is tested on it)")
            for name in os.listdir(tmp):
                shutil.rmtree(out / name, ignore_errors=True)
                shutil.copytree(Path(tmp) / name, out / name)
            for name in os.listdir(tmp):
                shutil.rmtree(authoring.edit_dir(name), ignore_errors=True)
        finally:
            if saved is None:
                os.environ.pop("TOOLKIT_PATCHSETS", None)
            else:
                os.environ["TOOLKIT_PATCHSETS"] = saved


def main() -> None:
    build(HERE / "patchsets")


if __name__ == "__main__":
    main()
