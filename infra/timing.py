"""Phase timers: seconds spent sampling, verifying, training and syncing, per logged step."""
import contextlib
import time


PHASES = ("sample", "verify", "train", "sync")  # timed in samplers, verifiers and train steps


_STACK: list = []  # seconds in inner phases, per phase running now (innermost last)
_sink = None  # the active Run's Counter of seconds per phase (None: no run is being written)


def record_into(counter) -> None:
    """Phases add their seconds to `counter` from now on (a Run's own); None stops recording."""
    global _sink
    _sink = counter


@contextlib.contextmanager
def phase(name: str):
    """`with phase("verify"):` adds the seconds to time/<name> of the active Run's next log().
    Exclusive: an inner phase's seconds are its own only (a sync in a train step counts as sync)."""
    start = time.perf_counter()
    _STACK.append(0.0)
    try:
        yield
    finally:
        seconds, inner = time.perf_counter() - start, _STACK.pop()
        if _STACK:
            _STACK[-1] += seconds
        if _sink is not None:
            _sink[name] += seconds - inner


timed = phase  # @timed("sync") on a function: a contextmanager is also a ContextDecorator
