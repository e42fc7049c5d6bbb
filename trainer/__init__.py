"""trainq's built-in trainer (see __main__.py for how to run it)."""

import logging as _logging


class _NoKernelsHint(_logging.Filter):
    """bitsandbytes on AVX512-BF16 CPUs suggests `pip install kernels` at import; trainq must not install it (it
    fetches code from a model hub at run time) and works without it, so the hint is dropped."""

    def filter(self, record: _logging.LogRecord) -> bool:
        return "pip install kernels" not in str(record.msg)


_logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_NoKernelsHint())
