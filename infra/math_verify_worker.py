"""The math-verify worker: run by infra/verifier.py as `python -I math_verify_worker.py`. It reads
`[pred, gold, timeout, expression]` lines and writes one verdict per line. It imports neither torch
nor the project, and never runs in the trainer."""


# The math-verify worker: surely_differ and main run in a clean interpreter that gets
# their source (`python -I -c`, _Worker), never in the trainer. It imports neither torch
# nor this module, and a pair that hangs inside C code (huge integer powers) is ended by a kill.
def surely_differ(g, p, raw):
    """Two plain expressions with different values at one point surely differ (well under 1 ms,
    where verify() simplifies for tens of ms); %, degrees, sets, relations go to verify()."""
    from sympy import Expr, Rational
    a, b = g[0], p[0]
    if not (isinstance(a, Expr) and isinstance(b, Expr)) or "%" in raw or "circ" in raw \
            or "deg" in raw or len(a.free_symbols | b.free_symbols) > 6:
        return False
    at = {s: Rational(13 + 7 * i, 10)
          for i, s in enumerate(sorted(a.free_symbols | b.free_symbols, key=str))}
    try:
        va, vb = complex(a.evalf(30, subs=at)), complex(b.evalf(30, subs=at))
    except Exception:
        return False
    return (all(abs(v) < 1e300 for v in (va, vb))  # NaN fails this too
            and abs(va - vb) > 1e-5 * max(1.0, abs(va), abs(vb)))


def main():
    """`[pred, gold, timeout, expression]` lines in, 0 unequal / 1 equal / 2 timeout / 3 error out,
    after `{"ready": 1}` (`{"fatal": ...}`: math-verify is missing)."""
    import contextlib, json, logging, resource, signal, sys
    logging.disable(logging.CRITICAL)
    with contextlib.suppress(Exception):  # a LaTeX bomb's gigabytes: MemoryError, not the machine
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))
    try:
        from latex2sympy2_extended import NormalizationConfig
        from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
        # an expression gold is parsed without unit stripping, which drops a trailing h, t, c or l
        # (hours, tons): "m \cdot g \cdot h" would parse as "m \cdot g \cdot"
        no_units = NormalizationConfig(basic_latex=True, units=False, malformed_operators=True,
                                       nits=True, boxed="all", equations=False)
        extraction = [[LatexExtractionConfig(**kw), ExprExtractionConfig()]  # [expression]
                      for kw in ({}, {"normalization_config": no_units})]
    except Exception as e:
        print(json.dumps({"fatal": repr(e)}), flush=True)
        sys.exit(3)
    # the CPU-time alarm raises KeyboardInterrupt, which math-verify's `except Exception` lets by
    signal.signal(signal.SIGPROF, signal.default_int_handler)
    print('{"ready": 1}', flush=True)
    for line in sys.stdin:
        try:
            try:
                pred, gold, t, expression = json.loads(line)
                signal.setitimer(signal.ITIMER_PROF, t)  # CPU time: verdicts do not depend on load
                g, p = (parse(s if ("$" in s or "\\(" in s or "\\[" in s) else f"${s}$",
                              extraction[bool(expression)], parsing_timeout=None)
                        for s in (gold, pred))
                r = int(bool(g and p) and not surely_differ(g, p, pred + gold)
                        and bool(verify(g, p, timeout_seconds=None)))
            finally:
                signal.setitimer(signal.ITIMER_PROF, 0)
        except KeyboardInterrupt:
            r = 2
        except Exception:
            r = 3
        print(r, flush=True)


if __name__ == "__main__":
    main()
