"""The math-verify worker: run by infra/verifier.py as `python -I math_verify_worker.py`. It reads
`[pred, gold, timeout, expression]` lines and writes one verdict per line. It imports neither torch
nor the project, and never runs in the trainer."""


def surely_differ(g, p, raw):
    """Two plain expressions with different values at one point surely differ (well under 1 ms,
    where verify() simplifies for tens of ms); %, degrees, sets, relations go to verify()."""
    from sympy import Expr, Rational
    gold, pred = g[0], p[0]
    if not isinstance(gold, Expr) or not isinstance(pred, Expr):
        return False
    if "%" in raw or "circ" in raw or "deg" in raw:
        return False
    symbols = sorted(gold.free_symbols | pred.free_symbols, key=str)
    if len(symbols) > 6:
        return False
    point = {}  # 1.3, 2.0, 2.7, ...: no 0 or 1, which would hide a term
    for i, symbol in enumerate(symbols):
        point[symbol] = Rational(13 + 7 * i, 10)
    try:
        gold_value = complex(gold.evalf(30, subs=point))
        pred_value = complex(pred.evalf(30, subs=point))
    except Exception:
        return False
    if not (abs(gold_value) < 1e300 and abs(pred_value) < 1e300):  # NaN fails this too
        return False
    scale = max(1.0, abs(gold_value), abs(pred_value))
    return abs(gold_value - pred_value) > 1e-5 * scale


def math_delimited(s):
    """s as math-verify should parse it: $-wrapped unless it holds a math delimiter already."""
    if "$" in s or "\\(" in s or "\\[" in s:
        return s
    return f"${s}$"


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
        extraction = {False: [LatexExtractionConfig(), ExprExtractionConfig()],
                      True: [LatexExtractionConfig(normalization_config=no_units),
                             ExprExtractionConfig()]}  # by `expression`
    except Exception as e:
        print(json.dumps({"fatal": repr(e)}), flush=True)
        sys.exit(3)
    # the CPU-time alarm raises KeyboardInterrupt, which math-verify's `except Exception` lets by
    signal.signal(signal.SIGPROF, signal.default_int_handler)
    print('{"ready": 1}', flush=True)
    for line in sys.stdin:
        try:
            try:
                pred, gold, cpu_seconds, expression = json.loads(line)
                # CPU time, so that verdicts do not depend on the machine's load
                signal.setitimer(signal.ITIMER_PROF, cpu_seconds)
                config = extraction[bool(expression)]
                gold_parsed = parse(math_delimited(gold), config, parsing_timeout=None)
                pred_parsed = parse(math_delimited(pred), config, parsing_timeout=None)
                if not gold_parsed or not pred_parsed:
                    verdict = 0
                elif surely_differ(gold_parsed, pred_parsed, pred + gold):
                    verdict = 0
                else:
                    verdict = int(bool(verify(gold_parsed, pred_parsed, timeout_seconds=None)))
            finally:
                signal.setitimer(signal.ITIMER_PROF, 0)
        except KeyboardInterrupt:
            verdict = 2
        except Exception:
            verdict = 3
        print(verdict, flush=True)


if __name__ == "__main__":
    main()
