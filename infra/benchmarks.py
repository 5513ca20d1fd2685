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
    answer = ex[a]
    if isinstance(answer, float) and answer.is_integer():
        answer = str(int(answer))
    else:
        answer = str(answer).strip()
    if "####" in answer:  # GSM8K: the worked solution, then "#### 1,234"
        answer = answer.split("####")[-1].strip().replace(",", "")
    return {"question": str(ex[q]), "answer": answer}


def mc_problem(question, options, gold):
    """A multiple-choice problem; `gold` is the index of the right option in `options`."""
    options = [str(o).strip() for o in options]
    n_letters = len(OPTION_LETTERS)
    if not 2 <= len(options) <= n_letters or not 0 <= gold < len(options):
        raise ValueError(f"{len(options)} options with the gold at index {gold}: expected "
                         f"2-{n_letters} options (letters A-{OPTION_LETTERS[-1]}) with the gold "
                         "among them")
    return {"question": str(question).strip(),
            "answer": OPTION_LETTERS[gold],
            "choices": options}


def options_row(ex, q, a):
    """`options` and a gold letter (MMLU-Pro, SuperGPQA). "N/A" padding options are dropped, as
    TIGER-Lab/MMLU-Pro's evaluate_from_*.py do; MMLU-Pro's answer_index must agree."""
    options = ex["options"]
    if isinstance(options, str):  # some copies store the list's repr
        options = ast.literal_eval(options)
    options = list(options)
    letter = str(ex[a]).strip().upper()
    letters = OPTION_LETTERS[:len(options)]
    if len(letter) != 1 or letter not in letters:
        raise ValueError(f"gold letter {ex[a]!r} is not one of the {len(options)} options' letters")
    gold = OPTION_LETTERS.index(letter)
    answer_index = ex.get("answer_index")
    if answer_index is not None and int(answer_index) != gold:
        raise ValueError(f"answer {ex[a]!r} and answer_index {ex['answer_index']} disagree")
    kept = []  # the options that are not "N/A" padding, and the gold
    for i, option in enumerate(options):
        if str(option).strip() != "N/A" or i == gold:
            kept.append(i)
    return mc_problem(ex[q], [options[i] for i in kept], kept.index(gold))


def gpqa_option_order(question):
    """GPQA's fixed order of [correct, incorrect 1-3] for a question: random.Random seeded with the
    first 8 bytes of SHA-256(stripped question), the same on every machine and spread over A-D."""
    digest = hashlib.sha256(str(question).strip().encode("utf-8")).digest()
    seed = int.from_bytes(digest[:8], "big")
    order = [0, 1, 2, 3]
    random.Random(seed).shuffle(order)
    return order


def gpqa_row(ex, q, a):
    """GPQA's correct answer and three incorrect ones, in gpqa_option_order."""
    correct_first = [ex[a], ex["Incorrect Answer 1"], ex["Incorrect Answer 2"],
                     ex["Incorrect Answer 3"]]
    order = gpqa_option_order(ex[q])
    options = [correct_first[i] for i in order]
    return mc_problem(ex[q], options, order.index(0))


def olympiad_row(ex, q, a):
    """`final_answer` is a list: its entries without an outer $...$, joined by ", "; a row
    without one is left out."""
    answers = []
    for entry in ex[a] or []:
        answer = str(entry).strip()
        if answer[:1] == answer[-1:] == "$" and answer.count("$") == 2:
            answer = answer[1:-1].strip()
        if answer:
            answers.append(answer)
    question = str(ex[q]).strip()
    context = str(ex.get("context") or "").strip()
    if not answers:
        return None
    if context:
        question = f"{context}\n\n{question}"
    return {"question": question, "answer": ", ".join(answers)}


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


def hub_rows(what, name, hub, shape):
    """(row number, row) of the hub dataset hub = (id, config, split, gated), or
    BenchmarkUnavailable naming the fix."""
    hub_id, config, split, gated = hub
    fix = f"or pass a local JSONL file ({shape})"
    gated_note = ""
    if gated:
        gated_note = (f" {hub_id} is gated: log in (`huggingface-cli login`, or set HF_TOKEN) and "
                      f"accept its terms at https://huggingface.co/datasets/{hub_id} first.")
    try:
        import datasets
    except ImportError:
        raise BenchmarkUnavailable(
            f"{what} {name!r} is loaded from the Hugging Face hub with the `datasets` package, "
            f"which is not installed. Fix: `pip install datasets`, {fix}.{gated_note}") from None
    source = f"{hub_id}, config {config}" if config else hub_id
    try:
        return enumerate(datasets.load_dataset(hub_id, config, split=split))
    except Exception as e:
        raise BenchmarkUnavailable(
            f"could not load {what} {name!r} ({source}, split {split}) from the Hugging Face hub: "
            f"{type(e).__name__}: {str(e)[:300]}.{gated_note} Fix: check the network (or "
            f"HF_HUB_OFFLINE=1 with a populated cache), log in for gated sets, {fix}.") from None


def load_rows(what, name, limit, row, shape, hub=None):
    """row(line or row number, record) -> problem or None (left out), over the JSONL file `name`
    or the hub dataset hub = (id, config, split, gated); `limit` > 0 keeps the first N."""
    if hub is not None:
        rows = hub_rows(what, name, hub, shape)
    elif os.path.isfile(name):
        rows = iter_jsonl(name, shape=shape)
    else:
        raise FileNotFoundError(f"{what} file {name} does not exist")
    problems = (row(i, ex) for i, ex in rows)
    kept = list(islice(filter(None, problems), limit or None))  # rows are read up to the limit
    if not kept:
        source = f" ({hub[0]}, split {hub[2]})" if hub else ""
        raise ValueError(f"{what} {name!r}{source} has no problems (an empty file?)")
    return kept


def parse_benchmark_spec(spec) -> tuple[str, int | None]:
    """"aime24@32" -> ("aime24", 32): mean@32, as SPICE's AIME; an existing file is never split."""
    name = str(spec).strip()
    m = re.fullmatch(r"(.+)@(\d+)", name)
    if m is None or os.path.isfile(name):
        return name, None
    n_samples = int(m[2])
    if n_samples < 1:
        raise ValueError(f"benchmark {name!r}: the number of samples after '@' must be >= 1")
    return m[1], n_samples


def hub_spec(b, flag=""):
    """The HubBenchmark of a BENCHMARKS name or an hf: spec, else ValueError naming the fix."""
    if b.startswith("hf:"):
        parts = b[3:].split(":")
        if len(parts) == 4:  # no config
            parts.insert(1, None)
        if len(parts) != 5:
            raise ValueError(f"{flag}{b}: expected hf:<id>[:<config>]:<split>:<question field>:"
                             "<answer field>")
        return HubBenchmark(*parts)
    if b.lower() in BENCHMARKS:
        return HubBenchmark(*BENCHMARKS[b.lower()])
    close = difflib.get_close_matches(b.lower(), BENCHMARKS, n=1)
    hint = f" (did you mean {close[0]}?)" if close else ""
    raise ValueError(f"{flag}unknown benchmark {b!r}{hint}; use one of {sorted(BENCHMARKS)}, a "
                     "local .jsonl file or hf:<id>[:<config>]:<split>:<question field>:<answer "
                     "field>, optionally with @N samples")


def check_benchmark_names(names: str, flag: str = "--eval-benchmarks") -> None:
    """A method's up-front check of a benchmark list: ValueError naming the entry and the fix."""
    for entry in str(names).split(","):
        b, _ = parse_benchmark_spec(entry)
        looks_like_file = b.endswith((".jsonl", ".json")) or os.path.isfile(b)
        if looks_like_file:
            if not os.path.isfile(b):
                raise ValueError(f"{flag}: file {b} does not exist")
        elif b:
            hub_spec(b, f"{flag}: ")


JSONL_SHAPE = ('each line must be one object like {"question": "...", "answer": "..."} '
               '(optional "choices": [..])')


def jsonl_problem(path, ln, obj):
    """The problem of line `ln` of a local JSONL benchmark, checked."""
    if "question" not in obj or "answer" not in obj:
        raise ValueError(f"{path}:{ln}: {JSONL_SHAPE}; got {str(obj)[:120]}")
    problem = {"question": str(obj["question"]),
               "answer": str(obj["answer"])}
    choices = obj.get("choices")
    if choices is None:
        return problem
    if not isinstance(choices, list) or not 1 <= len(choices) <= len(OPTION_LETTERS):
        raise ValueError(f'{path}:{ln}: "choices" must be a non-empty list of at most '
                         f"{len(OPTION_LETTERS)} strings (letters A-J)")
    problem["choices"] = [str(c) for c in choices]
    return problem


def load_benchmark(name_or_path, limit=0):
    """Problems [{"question", "answer", "choices"?}] of a JSONL file, a BENCHMARKS or hf: name."""
    name, _ = parse_benchmark_spec(name_or_path)
    if os.path.isfile(name) or name.endswith((".jsonl", ".json")):
        problem = functools.partial(jsonl_problem, name)
        return load_rows("benchmark", name, limit, problem, JSONL_SHAPE)
    spec = hub_spec(name)
    to_problem = spec.row or qa_row

    def problem(i, ex):
        missing = [c for c in (spec.question, spec.answer) if c not in ex]
        if missing:
            raise KeyError(f"{spec.hub_id} has no column(s) {missing}; its columns are {list(ex)}. "
                           "Edit BENCHMARKS or use an hf: name.")
        try:
            return to_problem(ex, spec.question, spec.answer)
        except (KeyError, ValueError, TypeError, IndexError, SyntaxError) as e:
            raise ValueError(f"benchmark {name!r} ({spec.hub_id}) row {i} does not map to a "
                             f"problem: {type(e).__name__}: {e}. The hub copy may have changed: "
                             "edit BENCHMARKS.") from None
    hub = (spec.hub_id, spec.config or None, spec.split, spec.gated)
    return load_rows("benchmark", name, limit, problem, JSONL_SHAPE, hub)
