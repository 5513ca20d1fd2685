"""Shared machinery for the four self-play methods (development shim: merged into one file before release)."""
try:
    from _c_core import *  # noqa: F401,F403
except ImportError as e:
    if "_c_core" not in str(e): raise
try:
    from _c_rl import *  # noqa: F401,F403
except ImportError as e:  # part not written yet
    if "_c_rl" not in str(e): raise
try:
    from _c_verify import *  # noqa: F401,F403
except ImportError as e:
    if "_c_verify" not in str(e): raise
try:
    from _c_sandbox import *  # noqa: F401,F403
except ImportError as e:
    if "_c_sandbox" not in str(e): raise
