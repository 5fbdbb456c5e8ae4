"""Stand-in for FlashMLA (the sgl-flash-mla wheel) in the lab's SGLang 0.5.23 site.

gpu/run_dyn.sh puts it in the site's _stubs only where `import flash_mla` fails. 0.5.23's v2 EAGLE
worker imports `layers/attention/flashmla_backend.py` while it captures its draft graphs, only to
ask `isinstance(draft_backend, FlashMLABackend)`; that module imports `flash_mla` at module level.
The lab's servers run triton attention, so nothing calls into FlashMLA. Every name imports; called,
or read for a kernel, it raises: a FlashMLA kernel never runs as a no-op.
"""


def _unavailable(name):
    raise RuntimeError(f"flash_mla.{name} used, but this site's flash_mla is the lab's stand-in "
                       "(gpu/stand_ins/flash_mla): sgl-flash-mla is not installed")


class _Kernels:
    """A kernel (`get_mla_metadata`) or a namespace of kernels (`fused_norm_rope_attn_rope_cast`):
    called, or a kernel read from it, it raises."""

    def __init__(self, name):
        self._name = name

    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        _unavailable(f"{self._name}.{attr}")

    def __call__(self, *args, **kwargs):
        _unavailable(self._name)


def __getattr__(name):
    if name.startswith("__"):
        raise AttributeError(name)
    return _Kernels(name)
