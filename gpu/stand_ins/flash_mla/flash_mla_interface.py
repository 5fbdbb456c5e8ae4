"""flash_mla.flash_mla_interface of the lab's FlashMLA stand-in (see the package's docstring)."""


class FlashMLASchedMeta:
    """The type SGLang's wrapper tests with isinstance; made, it raises."""

    def __init__(self, *args, **kwargs):
        raise RuntimeError("FlashMLASchedMeta made, but this site's flash_mla is the lab's stand-in "
                           "(gpu/stand_ins/flash_mla): sgl-flash-mla is not installed")
