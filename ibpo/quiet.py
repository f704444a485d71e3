"""Known, harmless third-party noise, silenced by message and origin so that ibpo's output reads.

* transformers' FutureWarning "`is_gradient_checkpointing` is deprecated" (module
  transformers.modeling_utils): PEFT reads the old property name when it wraps a model.
* bitsandbytes' log line "Failed to load CPU gemm_4bit_forward from kernels-community" (logger
  bitsandbytes.backends.cpu.ops): an optional kernel fetched from the Hub at import; offline it
  cannot be, and bitsandbytes' built-in CPU kernel runs instead.
* transformers' "Loading weights" progress bar (a local model loads in a second or two); download
  bars from the Hub stay.

`quiet_third_party()` installs these filters unless the user asked for warnings (`python -W ...`
or PYTHONWARNINGS: then everything shows, these included). ibpo's own warnings and messages are
never filtered, nor any other third-party warning.

Not here: ibpo's own messages (printed where they arise), logging configuration.
"""

from __future__ import annotations

import logging
import sys
import warnings

_WARNINGS = (
    # (message regex, category, module regex)
    (r"`is_gradient_checkpointing` is deprecated", FutureWarning, r"transformers\.modeling_utils"),
)
_LOG_LINES = {
    # logger name -> the start of its message
    "bitsandbytes.backends.cpu.ops": "Failed to load CPU gemm_4bit_forward from kernels-community",
}
_QUIET_BARS = ("Loading weights",)


class _DropPrefix(logging.Filter):
    def __init__(self, prefix: str):
        super().__init__()
        self.prefix = prefix

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.prefix)


def _quiet_bar(factory, args, kwargs):
    if kwargs.get("desc") in _QUIET_BARS:
        kwargs = {**kwargs, "disable": True}
    return factory(*args, **kwargs)


_installed = False


def quiet_third_party() -> bool:
    """Install the filters once (before bitsandbytes is imported, for its log line); -> whether
    they are in force (False when the user set -W or PYTHONWARNINGS)."""
    global _installed
    if sys.warnoptions:
        return False
    if _installed:
        return True
    for message, category, module in _WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name, prefix in _LOG_LINES.items():
        logging.getLogger(name).addFilter(_DropPrefix(prefix))
    _installed = True
    return True


def quiet_loading_bars() -> None:
    """transformers' weight-loading bar off, once `quiet_third_party()` is in force (a tqdm hook,
    where this transformers has one); model loading calls it just before from_pretrained."""
    if not _installed:
        return
    from transformers.utils import logging as hf_logging

    if hasattr(hf_logging, "set_tqdm_hook"):
        hf_logging.set_tqdm_hook(_quiet_bar)
