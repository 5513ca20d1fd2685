"""Benchmark loaders: the hub datasets of each paper's Table 1, `hf:` specs and local JSONL files,
each row mapped to {"question", "answer", "choices"?}."""
import ast
import difflib
import functools
import hashlib
import os
import random
import re
import typing
from itertools import islice

from infra.errors import BenchmarkUnavailable
from infra.runfolder import iter_jsonl


OPTION_LETTERS = "ABCDEFGHIJ"  # 2 to 10 options (MMLU-Pro and SuperGPQA have 10)


class HubBenchmark(typing.NamedTuple):
    """A hub dataset and how a row becomes {"question", "answer", "choices"?} ("answer" is then the
    gold letter): row(example, question field, answer field), or None to leave the row out."""
    hub_id: str
    config: str | None
    split: str
    question: str  # the question field; missing from a row: a clear error, not a silent skip
    answer: str  # the answer field (MC: the gold letter, or the correct option's text)
    row: typing.Callable | None = None  # None: the two fields as they are
    gated: bool = False  # the hub wants a login and the dataset's terms accepted


def qa_row(ex, q, a):
    """A free-form row: a float gold 27.0 is "27"; GSM8K's gold is the number after "####"."""
    a = ex[a]
    a = str(int(a)) if isinstance(a, float) and a.is_integer() else str(a).strip()
    return {"question": str(ex[q]),
            "answer": a.split("####")[-1].strip().replace(",", "") if "####" in a else a}


def mc_problem(question, options, gold):
    """A multiple-choice problem; `gold` is the index of the right option in `options`."""
    opts, L = [str(o).strip() for o in options], OPTION_LETTERS
    if not 2 <= len(opts) <= len(L) or not 0 <= gold < len(opts):
        raise ValueError(f"{len(opts)} options with the gold at index {gold}: expected 2-{len(L)} "
                         f"options (letters A-{L[-1]}) with the gold among them")
    return {"question": str(question).strip(), "answer": L[gold], "choices": opts}


def options_row(ex, q, a):
    """`options` and a gold letter (MMLU-Pro, SuperGPQA). "N/A" padding options are dropped, as
    TIGER-Lab/MMLU-Pro's evaluate_from_*.py do; MMLU-Pro's answer_index must agree."""
    opts = ex["options"]
    opts = list(ast.literal_eval(opts) if isinstance(opts, str) else opts)  # some copies: a repr
    s = str(ex[a]).strip().upper()
    if len(s) != 1 or s not in OPTION_LETTERS[:len(opts)]:
        raise ValueError(f"gold letter {ex[a]!r} is not one of the {len(opts)} options' letters")
    gold = OPTION_LETTERS.index(s)
    if ex.get("answer_index") is not None and int(ex["answer_index"]) != gold:
        raise ValueError(f"answer {ex[a]!r} and answer_index {ex['answer_index']} disagree")
    keep = [i for i, o in enumerate(opts) if str(o).strip() != "N/A" or i == gold]
    return mc_problem(ex[q], [opts[i] for i in keep], keep.index(gold))


def gpqa_option_order(question):
    """GPQA's fixed order of [correct, incorrect 1-3] for a question: random.Random seeded with the
    first 8 bytes of SHA-256(stripped question), the same on every machine and spread over A-D."""
    seed = int.from_bytes(hashlib.sha256(str(question).strip().encode("utf-8")).digest()[:8], "big")
    order = [0, 1, 2, 3]
    random.Random(seed).shuffle(order)
    return order


def gpqa_row(ex, q, a):
    answers = [ex[a]] + [ex[f"Incorrect Answer {i}"] for i in (1, 2, 3)]
    order = gpqa_option_order(ex[q])
    return mc_problem(ex[q], [answers[i] for i in order], order.index(0))


def olympiad_row(ex, q, a):
    """`final_answer` is a list: its entries without an outer $...$, joined by ", "."""
    answers = [s[1:-1].strip() if s[:1] == s[-1:] == "$" and s.count("$") == 2 else s
               for s in (str(x).strip() for x in ex[a] or [])]
    q, ctx = str(ex[q]).strip(), str(ex.get("context") or "").strip()
    return {"question": f"{ctx}\n\n{q}" if ctx else q,
            "answer": ", ".join(s for s in answers if s)} if any(answers) else None


# name -> hub dataset; an old-style 5-tuple (hub id, config, split, question, answer) works too, as
# does any "hf:<id>[:<config>]:<split>:<question field>:<answer field>" name. Rows as on the hub.
BENCHMARKS = {
    "gsm8k": HubBenchmark("openai/gsm8k", "main", "test", "question", "answer"),  # 1,319
    "math500": HubBenchmark("HuggingFaceH4/MATH-500", None, "test", "problem", "answer"),  # 500
    "aime24": HubBenchmark("HuggingFaceH4/aime_2024", None, "train", "problem", "answer"),  # 30
    "aime25": HubBenchmark("MathArena/aime_2025", None, "train", "problem", "answer"),  # 30, int
    "amc23": HubBenchmark("math-ai/amc23", None, "test", "question", "answer"),  # 40, float
    "minerva": HubBenchmark("math-ai/minervamath", None, "test", "question", "answer"),  # 272
    "olympiadbench": HubBenchmark("Hothan/OlympiadBench", "OE_TO_maths_en_COMP", "train",
                                  "question", "final_answer", olympiad_row),  # 674, text only
    "mmlu_pro": HubBenchmark("TIGER-Lab/MMLU-Pro", None, "test", "question", "answer",
                             options_row),  # 12,032, up to 10 options
    "gpqa_diamond": HubBenchmark("Idavidrein/gpqa", "gpqa_diamond", "train", "Question",
                                 "Correct Answer", gpqa_row, gated=True),  # 198, shuffled
    "supergpqa": HubBenchmark("m-a-p/SuperGPQA", None, "train", "question", "answer_letter",
                              options_row),  # 26,529, up to 10 options
    "bbeh": HubBenchmark("BBEH/bbeh", None, "train", "input", "target"),  # 4,520, 23 tasks
}


def load_rows(what, name, limit, row, shape, hub=None):
    """row(line or row number, record) -> problem or None (left out), over the JSONL file `name`
    or the hub dataset hub = (id, config, split, gated); `limit` > 0 keeps the first N."""
    if hub is None:
        if not os.path.isfile(name):
            raise FileNotFoundError(f"{what} file {name} does not exist")
        rows = iter_jsonl(name, shape=shape)
    else:
        hub_id, config, split, gated = hub
        fix = f"or pass a local JSONL file ({shape})"
        gated = (f" {hub_id} is gated: log in (`huggingface-cli login`, or set HF_TOKEN) and "
                 f"accept its terms at https://huggingface.co/datasets/{hub_id} first." if gated
                 else "")
        try:
            import datasets
        except ImportError:
            raise BenchmarkUnavailable(
                f"{what} {name!r} is loaded from the Hugging Face hub with the `datasets` package, "
                f"which is not installed. Fix: `pip install datasets`, {fix}.{gated}") from None
        try:
            rows = enumerate(datasets.load_dataset(hub_id, config, split=split))
        except Exception as e:
            raise BenchmarkUnavailable(
                f"could not load {what} {name!r} ({hub_id}{f', config {config}' if config else ''}"
                f", split {split}) from the Hugging Face hub: {type(e).__name__}: {str(e)[:300]}."
                f"{gated} Fix: check the network (or HF_HUB_OFFLINE=1 with a populated cache), log "
                f"in for gated sets, {fix}.") from None
    out = list(islice(filter(None, (row(i, ex) for i, ex in rows)), limit or None))
    if not out:
        raise ValueError(f"{what} {name!r}{f' ({hub[0]}, split {hub[2]})' if hub else ''} has no "
                         "problems (an empty file?)")
    return out


def parse_benchmark_spec(spec) -> tuple[str, int | None]:
    """"aime24@32" -> ("aime24", 32): mean@32, as SPICE's AIME; an existing file is never split."""
    name = str(spec).strip()
    m = re.fullmatch(r"(.+)@(\d+)", name)
    if m is None or os.path.isfile(name):
        return name, None
    if int(m[2]) < 1:
        raise ValueError(f"benchmark {name!r}: the number of samples after '@' must be >= 1")
    return m[1], int(m[2])


def hub_spec(b, flag=""):
    """The HubBenchmark of a BENCHMARKS name or an hf: spec, else ValueError naming the fix."""
    if b.startswith("hf:"):
        parts = b[3:].split(":")
        parts[1:1] = [None] if len(parts) == 4 else []
        if len(parts) != 5:
            raise ValueError(f"{flag}{b}: expected hf:<id>[:<config>]:<split>:<question field>:"
                             "<answer field>")
        return HubBenchmark(*parts)
    if b.lower() in BENCHMARKS:
        return HubBenchmark(*BENCHMARKS[b.lower()])
    hint = "".join(f" (did you mean {c}?)" for c in
                   difflib.get_close_matches(b.lower(), BENCHMARKS, n=1))
    raise ValueError(f"{flag}unknown benchmark {b!r}{hint}; use one of {sorted(BENCHMARKS)}, a "
                     "local .jsonl file or hf:<id>[:<config>]:<split>:<question field>:<answer "
                     "field>, optionally with @N samples")


def check_benchmark_names(names: str, flag: str = "--eval-benchmarks") -> None:
    """A method's up-front check of a benchmark list: ValueError naming the entry and the fix."""
    for b in (parse_benchmark_spec(entry)[0] for entry in str(names).split(",")):
        if b.endswith((".jsonl", ".json")) or os.path.isfile(b):
            if not os.path.isfile(b):
                raise ValueError(f"{flag}: file {b} does not exist")
        elif b:
            hub_spec(b, f"{flag}: ")


JSONL_SHAPE = ('each line must be one object like {"question": "...", "answer": "..."} '
                   '(optional "choices": [..])')


def jsonl_problem(path, ln, obj):
    if "question" not in obj or "answer" not in obj:
        raise ValueError(f"{path}:{ln}: {JSONL_SHAPE}; got {str(obj)[:120]}")
    row, ch = {"question": str(obj["question"]), "answer": str(obj["answer"])}, obj.get("choices")
    if ch is not None:
        if not isinstance(ch, list) or not 1 <= len(ch) <= len(OPTION_LETTERS):
            raise ValueError(f'{path}:{ln}: "choices" must be a non-empty list of at most '
                             f"{len(OPTION_LETTERS)} strings (letters A-J)")
        row["choices"] = [str(c) for c in ch]
    return row


def load_benchmark(name_or_path, limit=0):
    """Problems [{"question", "answer", "choices"?}] of a JSONL file, a BENCHMARKS or hf: name."""
    name = parse_benchmark_spec(name_or_path)[0]
    if os.path.isfile(name) or name.endswith((".jsonl", ".json")):
        return load_rows("benchmark", name, limit, functools.partial(jsonl_problem, name),
                        JSONL_SHAPE)
    spec = hub_spec(name)

    def problem(i, ex):
        missing = [c for c in (spec.question, spec.answer) if c not in ex]
        if missing:
            raise KeyError(f"{spec.hub_id} has no column(s) {missing}; its columns are {list(ex)}. "
                           "Edit BENCHMARKS or use an hf: name.")
        try:
            return (spec.row or qa_row)(ex, spec.question, spec.answer)
        except (KeyError, ValueError, TypeError, IndexError, SyntaxError) as e:
            raise ValueError(f"benchmark {name!r} ({spec.hub_id}) row {i} does not map to a "
                             f"problem: {type(e).__name__}: {e}. The hub copy may have changed: "
                             "edit BENCHMARKS.") from None
    return load_rows("benchmark", name, limit, problem, JSONL_SHAPE,
                    (spec.hub_id, spec.config or None, spec.split, spec.gated))
