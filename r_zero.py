"""R-Zero: Self-Evolving Reasoning LLM from Zero Data (Huang et al., arXiv:2508.05004).

Two roles of one base model, no data: a Challenger asks questions; the Solver's vote labels them.
For iteration k = 1 .. K (paper §3; train() runs the steps in this order):
  1. challenger_step x 5: challenger_rollouts (G = 4 outputs of one fixed prompt), solver_votes (the
     frozen Solver answers each question m = 10 times), vote_statistics (majority label y~ and its
     share p^), challenger_rewards (max(0, r_unc - r_rep)), grpo_update (KL to the phase start).
  2. build_dataset: N = 8,000 questions, m = 10 votes each, keep |p^ - 1/2| <= 0.25 labelled y~.
  3. solver_step x 15: GRPO on the Solver, solver_rewards 1 iff its boxed answer equals y~.
  4. evaluate_solver: greedy accuracy after every iteration (paper Table 1 reports each); with dev
     sets, also the iteration they choose (choose_iteration). The test never chooses.
Run: python r_zero.py --model Qwen/Qwen3-4B-Base (a GPU; torchrun for several; --model tiny: CPU);
--eval-only evaluates --model under this protocol and exits (e.g. a run's final/solver).
Deviations from the official code (github.com/Chengsong-Huang/R-Zero), and what we add:
  - unparsable Solver answers count in m but never win the vote (the code lets "None" win)
  - the Challenger's own boxed answer is never used (the code compared one character of it)
  - answers are compared by math-verify (common.math_equal, hard timeouts), not grade_answer
  - the Challenger's reward is the paper's; --challenger-reward official is caller_penalty.py's:
    min(p^, 1 - p^) - r_rep, unclipped, -1 - r_rep for an invalid output (a cluster of its own)
  - the Solver's reward is the paper's; --solver-reward official is math.py's 0.9 match + 0.1 for
    the <think>..</think>..\\boxed{} format that our Solver prompt never asks for
  - rollouts use top-p 1.0 (code: 0.99): the trainer does not model truncation
  - a question whose Solver prompt exceeds --max-prompt-tokens fails the format check
  - questions sharing a 13-gram with an eval set never reach the Solver (--no-decontaminate)
  - one trainer, one vLLM engine: the parked role and the KL reference wait in file-backed memory
  - prompts in our words (PROMPTS, or --prompts FILE); without a chat template one ends "assistant:"
  - general sets: the Solver prompt and math-verify (--eval-protocol official: eval_*.py's rules)
  - no GPT-4o re-check of the answers graded wrong, as evaluation/ has (R-Zero issue #31)
  - a best iteration is chosen only on dev sets, never on the test (the paper reports every one):
    --dev-benchmarks, or --dev-fraction of each test set held out (then the rest is the test)
  - --label-check FILE: gold-answer questions through step 2's vote and band (label accuracy)
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import json
import os
import pathlib
import random
import re
import shutil
import tempfile
import typing
from collections import Counter

import numpy as np

import common

MATH_SETS = "math500,gsm8k,amc23,minerva,olympiadbench,aime24,aime25"
GENERAL = ("supergpqa", "mmlu_pro", "bbeh", "gpqa_diamond")  # general reasoning; the rest is math
EVAL_SETS = MATH_SETS + ",supergpqa,mmlu_pro,bbeh"  # paper §4: 7 math and 3 general sets


@dataclasses.dataclass
class Config(common.RunConfig):
    """R-Zero: a Challenger and a Solver trained in turn from one base model, with no data."""
    # the intervals of this Config's number flags (RunConfig declares the shared ones)
    RANGES: typing.ClassVar[dict] = {
        "challenger_minibatch": "[0, inf)", "solver_minibatch": "[0, inf)",
        "vote_temperature": "(0, inf)", "vote_top_p": "(0, 1]", "vote_top_k": "[-1, inf)",
        "question_pool": "[1, inf)", "pool_temperature": "(0, inf)", "pool_top_p": "(0, 1]",
        "band_low": "[0, 1]", "band_high": "[0, 1]", "temperature": "(0, inf)", "top_p": "(0, 1]",
        "rep_lambda": "[0, inf)", "bleu_threshold": "[0, 1]", "clip_low": "[0, 1)",
        "clip_high": "[0, inf)", "dual_clip": "[0, inf)", "kl_coef": "[0, inf)",
        "adv_eps": "(0, inf)", "dev_fraction": "[0, 1)"}
    model: str = "Qwen/Qwen3-4B-Base"  # both roles start from it (paper §4; also Qwen3-8B-Base)
    iterations: int = 3  # K, rounds of Challenger then Solver training (paper §4; main.sh: 5)
    challenger_steps: int = 5  # Challenger's GRPO steps (paper §3; questioner_train_penalty.sh)
    solver_steps: int = 15  # Solver's GRPO steps (paper §3; scripts/solver_train.sh keeps step 15)
    challenger_group: int = 4  # G, Challenger outputs per prompt copy (examples/config.yaml)
    solver_group: int = 5  # G, Solver answers per question in training (examples/config.yaml)
    challenger_batch: int = 512  # prompt copies per Challenger step (examples/config.yaml)
    solver_batch: int = 512  # questions per Solver step (examples/config.yaml)
    challenger_minibatch: int = 16  # prompt copies per update, 0 = all (scripts; R-Zero #23)
    solver_minibatch: int = 128  # questions per update, 0 = all (paper: batch 128)
    votes: int = 10  # m, Solver answers that label a question (paper §3; evaluate.py: 9)
    vote_temperature: float = 1.0  # temperature of the votes (start_vllm_server.py)
    vote_top_p: float = 1.0  # top-p of the votes (start_vllm_server.py)
    vote_top_k: int = 40  # top-k of the votes (start_vllm_server.py)
    vote_max_tokens: int = 4096  # max new tokens of a vote (start_vllm_server.py)
    question_pool: int = 8000  # N, questions written for the Solver's dataset (paper §3)
    pool_temperature: float = 1.0  # temperature of the pool (question_generate.py)
    pool_top_p: float = 0.95  # top-p of the pool, not trained on (question_generate.py)
    band_low: float = 0.25  # keep band_low <= p^ <= band_high (paper §3; upload.py: 0.3)
    band_high: float = 0.75  # the keep band's top (paper §3; question_evaluate/upload.py: 0.8)
    temperature: float = 1.0  # rollout temperature of both roles (examples/config.yaml)
    top_p: float = 1.0  # rollout top-p of both roles (config.yaml: 0.99; see the deviations)
    max_prompt_tokens: int = 2048  # a longer Solver prompt fails the format check (config.yaml)
    max_tokens: int = 4096  # max new tokens of a rollout, both roles (examples/config.yaml)
    rep_lambda: float = 1.0  # lambda, the weight of the repetition penalty (paper §3)
    bleu_threshold: float = 0.5  # tau_BLEU, where average linkage on 1 - BLEU stops (paper §3)
    challenger_reward: str = "paper"  # Challenger reward: paper §3 | official (caller_penalty.py)
    solver_reward: str = "paper"  # Solver reward: paper §3 | official (reward_function/math.py)
    verify_timeout: float = 10.0  # s per answer check: votes, rewards, eval (start_vllm_server.py)
    lr: float = 1e-6  # AdamW learning rate, constant (paper; examples/config.yaml)
    weight_decay: float = 1e-2  # AdamW weight decay (examples/config.yaml)
    grad_clip: float = 1.0  # max global grad norm (examples/config.yaml)
    clip_low: float = 0.2  # PPO epsilon below 1 (examples/config.yaml)
    clip_high: float = 0.3  # PPO epsilon above 1, clip-higher (examples/config.yaml)
    dual_clip: float = 3.0  # ratio bound for A < 0, dual clip (verl/trainer/core_algos.py)
    kl_coef: float = 0.01  # beta of the k3 KL to the phase start (paper; config.yaml low_var_kl)
    adv_eps: float = 1e-6  # eps of GRPO's (r - mean) / (std + eps) (verl/trainer/core_algos.py)
    aggregation: str = "seq-mean-token-mean"  # the loss's average over tokens (EasyR1, as run)
    eval_base: bool = True  # also evaluate the base model (paper Table 1, "Base Model")
    eval_every: int = 0  # unused: the Solver is evaluated after every iteration (paper §5)
    eval_benchmarks: str = EVAL_SETS  # test sets: names, JSONL files or name@N (paper §4)
    eval_max_tokens: int = 4096  # max new tokens of a greedy test answer (evaluation/generate.py)
    eval_protocol: str = "ours"  # general sets graded: ours | official (evaluation/eval_*.py)
    eval_general_max_tokens: int = 8192  # general sets' budget, official protocol (eval_mmlupro.py)
    dev_benchmarks: str = ""  # sets that choose the best iteration; "" = --dev-fraction (ours)
    dev_fraction: float = 0.0  # share of each test set held out as dev; 0 = whole sets (ours)
    label_check: str = ""  # gold-answer set put through step 2's vote and band; "" = off (ours)
    label_check_limit: int = 200  # problems of --label-check per iteration (ours)
    decontaminate: bool = True  # drop questions sharing a 13-gram with a test or dev set (ours)
    max_model_len: int = 8192  # vLLM tokens per sequence: prompt 2,048 + answer 4,096 (config.yaml)


CHALLENGER, SOLVER = "challenger", "solver"
OTHER = {CHALLENGER: SOLVER, SOLVER: CHALLENGER}

# --model tiny: a smoke run of one step per phase (a flag given still wins)
TINY = {
    "iterations": 1, "challenger_steps": 1, "solver_steps": 1,
    "challenger_batch": 2, "challenger_group": 2, "solver_batch": 2, "solver_group": 2,
    "votes": 4, "question_pool": 4,
    "max_tokens": 16, "vote_max_tokens": 8, "max_model_len": 1024, "max_prompt_tokens": 400,
    "eval_benchmarks": f"{common.TINY_DATA}/rzero_eval.jsonl", "eval_max_tokens": 8,
    "dev_benchmarks": f"{common.TINY_DATA}/rzero_dev.jsonl",
}


def validate_config(cfg: Config) -> None:
    """One-line ValueErrors beyond parse_config's (sizes >= 1), before anything loads."""
    if min(cfg.challenger_group, cfg.solver_group) < 2:
        raise ValueError("--challenger-group and --solver-group must be >= 2 (GRPO's baseline)")
    if not 0.0 <= cfg.band_low <= cfg.band_high <= 1.0:
        raise ValueError(f"need 0 <= --band-low <= --band-high <= 1, got {cfg.band_low}, "
                         f"{cfg.band_high}")
    choices = {"eval_protocol": ("ours", "official"), "challenger_reward": ("paper", "official"),
               "solver_reward": ("paper", "official")}
    for name, allowed in choices.items():
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"--{name.replace('_', '-')} must be {' or '.join(allowed)}, not "
                             f"{getattr(cfg, name)!r}")
    if not 0.0 <= cfg.dev_fraction < 1.0:
        raise ValueError(f"--dev-fraction must be in [0, 1), got {cfg.dev_fraction} (0: no dev "
                         "share, no best iteration chosen)")
    if cfg.eval_only and not eval_sets(cfg.eval_benchmarks):
        raise ValueError("--eval-only needs sets to evaluate: pass --eval-benchmarks")
    if cfg.eval_only and cfg.resume:
        raise ValueError("--eval-only evaluates --model into a new folder, it does not --resume: "
                         "pass --model RUN_DIR/final/solver")
    common.check_benchmark_names(cfg.eval_benchmarks)
    common.check_benchmark_names(cfg.dev_benchmarks, "--dev-benchmarks")
    common.check_benchmark_names(cfg.label_check, "--label-check")
    need = cfg.eval_general_max_tokens + cfg.max_prompt_tokens
    evaluated = eval_sets(cfg.eval_benchmarks) + eval_sets(cfg.dev_benchmarks)
    general = [b for b in evaluated if is_general(b)]
    if cfg.eval_protocol == "official" and general and cfg.max_model_len < need:
        raise ValueError(f"--eval-protocol official: --max-model-len {cfg.max_model_len} cannot "
                         f"hold --eval-general-max-tokens {cfg.eval_general_max_tokens} after a "
                         f"--max-prompt-tokens {cfg.max_prompt_tokens} prompt: pass "
                         f"--max-model-len {need}")
    common.load_prompts(cfg.prompts, PROMPTS)  # a bad --prompts file: a usage error, nothing loaded


# -- Prompts -------------------------------------------------------------------------------------
# Our words for every instruction of question_generate.py's, start_vllm_server.py's and
# evaluation/eval_*.py's prompts: str.format templates (literal braces doubled) that a
# --prompts FILE replaces by name.
PROMPTS = {
    "challenger_system": (
        "You are an expert who writes competition mathematics problems.\n"
        "First, in a private scratch-pad, work step by step towards a new problem that is not "
        "trivial. It may come from any part of mathematics: algebra, prealgebra, geometry, number "
        "theory, combinatorics, probability, statistics, calculus or another field. Make it hard "
        "enough that fewer than 30% of advanced high-school students would solve it, and do not "
        "reuse textbook staples or well-known contest problems.\n"
        "Then, keeping your scratch-pad to yourself, write exactly these two blocks:\n\n"
        "<question>\nthe complete problem statement, on one or more lines\n</question>\n\n"
        "\\boxed{{the final answer}}\n\nWrite nothing else: no explanation, no other markup."),
    "challenger_user": ("Write one new, challenging reasoning problem now, in exactly the format "
                        "you were given."),
    "solver_system": "Reason step by step, and put your final answer in \\boxed{{}}.",
    # --eval-protocol ours: a multiple-choice question for the Solver (its user turn)
    "solver_choices": "{question}\n\n{options}\n\nBox the letter of the correct option.",
    # --eval-protocol official, the only (user) message (evaluation/eval_mmlupro.py)
    "official_choices": ("{question}\nOptions:\n{options}\n\n\nReason step by step. Exactly one "
                         "option is correct: put only its letter in \\boxed{{}}, e.g. "
                         "\\boxed{{A}}."),
    # --eval-protocol official, BBEH: the only (user) message (evaluation/eval_bbeh.py)
    "official_open": ("{question}\n\nReason step by step, and put your final answer in "
                      "\\boxed{{}}."),
}


def render(tokenizer, system: str, user: str):
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return f"system: {system}\nuser: {user}\nassistant:"  # a model without a chat template


def challenger_prompt(tokenizer, prompts: dict = PROMPTS):
    system = prompts["challenger_system"].format()
    return render(tokenizer, system, prompts["challenger_user"].format())


def solver_prompt(question: str, tokenizer, prompts: dict = PROMPTS):
    return render(tokenizer, prompts["solver_system"].format(), question)


# -- Votes and rewards (paper §3) -----------------------------------------------------------------
def vote_statistics(groups: list[list[str | None]],
                    timeout: float = Config.verify_timeout) -> list[dict]:
    """Per question: label y~ (the largest class of answers math_equal either way to its first),
    its votes `agree`, p^ = agree / m (unparsable answers count in m, never win), and m."""
    counts = []  # per question: its distinct non-empty answers, first seen first, and their votes
    pairs = set()  # two distinct answers to one question, both ways round
    for answers in groups:
        stripped = [str(a).strip() for a in answers if a is not None]
        count = Counter(a for a in stripped if a)
        counts.append(count)
        pairs.update(itertools.permutations(count, 2))
    pairs = list(pairs)
    equal = dict(zip(pairs, common.math_equal_many(pairs, timeout=timeout)))  # one parallel batch
    out = []
    for answers, count in zip(groups, counts):
        classes = []  # lists of distinct answers, the head first
        for a in count:  # join the OLDEST class whose head matches, else open a new one
            for c in classes:
                if equal[(a, c[0])] or equal[(c[0], a)]:
                    c.append(a)
                    break
            else:
                classes.append([a])
        sizes = [sum(count[a] for a in c) for c in classes]
        agree, label = max(sizes, default=0), None
        if classes:
            best = classes[sizes.index(agree)]  # the earliest class wins a tie
            label = max(best, key=lambda a: count[a])  # the class's commonest spelling
        m = len(answers)
        out.append({"label": label, "p_hat": agree / max(m, 1), "agree": agree, "m": m})
    return out


def extract_question(text: str) -> str | None:
    return common.extract_tag(text, "question", last=True) or None


def parse_questions(completions, tokenizer, cfg: Config, prompts: dict) -> list[str | None]:
    """Each output's question, or None: the format check (no block, empty, or too long)."""
    questions = []
    for completion in completions:
        question = extract_question(completion.text)
        if question is not None:
            prompt = solver_prompt(question, tokenizer, prompts)
            if len(common.encode_prompt(tokenizer, prompt)) > cfg.max_prompt_tokens:
                question = None
        questions.append(question)
    return questions


def in_band(s: dict, cfg: Config) -> bool:
    """band_low <= agree / m <= band_high (3..7 of 10 with the paper's band); agree 0 never is."""
    agree, m = s["agree"], s["m"]
    low = cfg.band_low * m - 1e-9  # the slack keeps 0.3 * 10 = 3 in
    high = cfg.band_high * m + 1e-9
    return agree >= 1 and low <= agree <= high


def challenger_rewards(questions: list[str | None], p_hats: list[float], cfg: Config) -> dict:
    """Paper §3: max(0, r_unc - r_rep), r_rep = lambda |C_k| / B, C_k the valid questions' BLEU
    clusters (average linkage cut at tau_BLEU), B the batch; a failed format check gets 0.
    --challenger-reward official (caller_penalty.py): min(p^, 1 - p^) - r_rep, unclipped; an
    invalid output is a cluster of its own (the code's empty question is BLEU-distant from all)
    and gets -1 - r_rep."""
    batch_size = len(questions)  # B, the invalid outputs included
    valid = np.array([q is not None for q in questions], dtype=bool)
    distances = common.bleu_distance_matrix([q for q in questions if q is not None])
    cluster_ids = common.average_linkage_clusters(distances, cfg.bleu_threshold)
    cluster_size = np.bincount(cluster_ids)[cluster_ids]  # |C_k| of each valid question
    r_rep = np.zeros(batch_size)
    r_rep[valid] = cfg.rep_lambda * cluster_size / batch_size
    p_hat = np.array(p_hats, dtype=float)
    r_unc = common.uncertainty_reward(p_hat)
    r_unc[~valid] = 0.0
    if cfg.challenger_reward == "official":
        r_rep[~valid] = cfg.rep_lambda / batch_size
        reward = np.minimum(p_hat, 1.0 - p_hat) - r_rep
        reward[~valid] = -1.0 - r_rep[~valid]
    else:
        reward = np.maximum(0.0, r_unc - r_rep)
        reward[~valid] = 0.0
    return {
        "reward": reward,
        "r_unc": r_unc,
        "r_rep": r_rep,
        "valid": valid,
        "n_clusters": len(set(cluster_ids)),
    }


def filter_dataset(questions: list[str], stats: list[dict], cfg: Config) -> list[dict]:
    """Paper §3: the questions whose share p^ lies in the band, with their label y~ and votes."""
    kept = []
    for question, s in zip(questions, stats):
        if in_band(s, cfg):
            kept.append({"question": question, **s})
    return kept


def solver_rewards(preds: list[str | None], labels: list[str],
                   timeout: float = Config.verify_timeout) -> list[float]:
    """Paper §3: 1 iff the Solver's boxed answer is math_equal to the pseudo-label y~, else 0."""
    pairs = list(zip(preds, labels))
    return [float(correct) for correct in common.math_equal_many(pairs, timeout=timeout)]


def official_solver_rewards(matches: list[float], completions: list[str]) -> list[float]:
    """--solver-reward official (examples/reward_function/math.py): 0.9 match + 0.1 format."""
    format_weight = 0.1  # compute_score's default
    rewards = []
    for match, text in zip(matches, completions):
        rewards.append((1 - format_weight) * match + format_weight * official_format(text))
    return rewards


def official_format(text: str) -> float:
    """math.py's format_reward: 1.0 iff the completion, less the whitespace around '<', '/' and
    '>', is <think>...</think>...\\boxed{...}..., else 0.0. In linear time: the code's regular
    expressions take seconds (its whitespace rule) to minutes (its format) on hostile outputs."""
    pieces = re.split(r"(\s+)", text)  # words at even indices, the whitespace runs between them
    squeezed = []
    for i, piece in enumerate(pieces):
        is_space = i % 2 == 1
        neighbours = set(pieces[i - 1][-1:] + pieces[i + 1][:1]) if is_space else set()
        if not neighbours & {"<", "/", ">"}:
            squeezed.append(piece)
    text = "".join(squeezed)
    if not text.startswith("<think>"):
        return 0.0
    close = text.find("</think>", len("<think>"))  # the earliest match leaves the most room
    if close < 0:
        return 0.0
    box = text.find("\\boxed{", close + len("</think>"))
    return float(box >= 0 and "}" in text[box + len("\\boxed{"):])


# -- Shared by the steps: the Solver's votes, the GRPO update, rollouts and their metrics --------
def solver_votes(sampler, questions: list[str], cfg: Config,
                 prompts: dict) -> list[list[str | None]]:
    """m sampled answers of the Solver to each question (paper §3): boxed answers, or None."""
    if not questions:
        return []
    groups = sampler.generate(
        [solver_prompt(q, sampler.tokenizer, prompts) for q in questions],
        n=cfg.votes,
        temperature=cfg.vote_temperature,
        top_p=cfg.vote_top_p,
        top_k=cfg.vote_top_k,
        max_tokens=cfg.vote_max_tokens,
    )
    return [[common.extract_boxed(c.text) for c in group] for group in groups]


def grpo_update(policy, trajs: list, group_ids: list, cfg: Config, ref_weights: dict,
                minibatch: int) -> dict:
    """GRPO advantages, then common.pg_step: a step per `minibatch` groups (0 = all), adjacent."""
    rewards = [t.reward for t in trajs]
    advantages = common.group_advantages(rewards, group_ids, scale="std", eps=cfg.adv_eps)
    for traj, advantage in zip(trajs, advantages.tolist()):
        traj.advantage = advantage
    per_group = len(trajs) // len(set(group_ids))
    pg = common.PGConfig(
        clip_low=cfg.clip_low,
        clip_high=cfg.clip_high,
        dual_clip=cfg.dual_clip,
        kl_coef=cfg.kl_coef,
        aggregation=cfg.aggregation,
        temperature=cfg.temperature,
        mini_batch=minibatch * per_group,
    )
    kl_reference = ref_weights if cfg.kl_coef > 0 else None
    return common.pg_step(policy, trajs, pg, ref_weights=kl_reference)


class Rollouts(typing.NamedTuple):
    """Sampled groups, flattened: every completion, and the group (prompt) each one answers."""
    completions: list
    group_ids: list[int]


def flatten(groups: list[list]) -> Rollouts:
    completions, group_ids = [], []
    for g, group in enumerate(groups):
        completions += group
        group_ids += [g] * len(group)
    return Rollouts(completions, group_ids)


def _role_metrics(role: str, metrics: dict, update: dict) -> dict:
    """<role>/<name>: ours, pg_step's, and its entropies of this role's own samples, named as in
    every method: entropy (Eq. 1 of "Towards Understanding Self-play for LLM Reasoning") and
    entropy_exact (the exact entropy); pg_step's own entropy names are dropped."""
    merged = dict(metrics)
    for key, value in update.items():
        if "/" not in key and "entropy" not in key:  # pg_step's own, e.g. loss
            merged[key] = value
        elif key.endswith(f"/{role}"):  # entropy/challenger, entropy_exact/challenger
            merged[key.split("/")[0]] = value
    return {f"{role}/{key}": value for key, value in merged.items()}


# -- 1. Challenger phase (Solver frozen) -----------------------------------------------------------
def challenger_rollouts(policy, cfg: Config, prompts: dict) -> Rollouts:
    """G outputs for each copy of the one fixed Challenger prompt."""
    groups = policy.generate(
        [challenger_prompt(policy.tokenizer, prompts)] * cfg.challenger_batch,
        n=cfg.challenger_group,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_tokens=cfg.max_tokens,
    )
    return flatten(groups)


def challenger_step(policy, roles: Roles, cfg: Config, ref: dict, step: int, run,
                    prompts: dict) -> dict:
    """One GRPO step of the Challenger, rewarded by the frozen Solver's votes (paper §3)."""
    rollouts = challenger_rollouts(policy, cfg, prompts)
    completions = rollouts.completions
    questions = parse_questions(completions, policy.tokenizer, cfg, prompts)
    valid_questions = [q for q in questions if q is not None]
    with roles.sampling(SOLVER):
        answers = solver_votes(policy, valid_questions, cfg, prompts)
    valid_stats = iter(vote_statistics(answers, cfg.verify_timeout))
    stats = [next(valid_stats) if q is not None else None for q in questions]  # None: no question
    p_hats = [s["p_hat"] if s else 0.0 for s in stats]
    rewards = challenger_rewards(questions, p_hats, cfg)
    trajs, samples = [], []
    for i, completion in enumerate(completions):
        reward = float(rewards["reward"][i])
        trajs.append(common.Trajectory.from_completion(completion, reward=reward, role=CHALLENGER))
        samples.append({
            "completion": completion.text,
            "question": questions[i],
            **(stats[i] or {}),  # the votes' label, p_hat, agree and m
            "reward": reward,
            "r_rep": float(rewards["r_rep"][i]),
        })
    update = grpo_update(policy, trajs, rollouts.group_ids, cfg, ref, cfg.challenger_minibatch)
    run.log_samples(step, CHALLENGER, samples)

    valid = rewards["valid"]
    metrics = {
        "reward": float(rewards["reward"].mean()),
        "format_fail": float(1.0 - valid.mean()),
        "n_valid": int(valid.sum()),
        "n_clusters": rewards["n_clusters"],
    }
    for key in ("r_unc", "r_rep"):  # means over the valid questions
        metrics[key] = float(rewards[key][valid].mean()) if valid.any() else 0.0
    return _role_metrics(CHALLENGER, metrics, update)


# -- 2. The Solver's dataset: questions filtered by the Solver's agreement -------------------------
def build_dataset(policy, roles: Roles, cfg: Config, step: int, run, iteration: int,
                  prompts: dict, decon=None) -> tuple[list, dict]:
    """N questions, m votes each, the band filter (paper §3); every voted row goes to
    dataset_iter<k>.jsonl."""
    with roles.sampling(CHALLENGER):
        groups = policy.generate(
            [challenger_prompt(policy.tokenizer, prompts)] * cfg.question_pool,
            n=1,
            temperature=cfg.pool_temperature,
            top_p=cfg.pool_top_p,
            max_tokens=cfg.max_tokens,
        )
    completions = [group[0] for group in groups]  # one each
    questions = parse_questions(completions, policy.tokenizer, cfg, prompts)
    parsed = [q for q in questions if q is not None]
    clean = [q for q in parsed if not (decon and decon.contaminated(q))]
    with roles.sampling(SOLVER):
        answers = solver_votes(policy, clean, cfg, prompts)
    stats = vote_statistics(answers, cfg.verify_timeout)
    kept = filter_dataset(clean, stats, cfg)
    if common.is_main_process():
        lines = []
        for question, s, votes in zip(clean, stats, answers):
            row = {"question": question, **s, "kept": in_band(s, cfg), "answers": votes}
            lines.append(json.dumps(row, ensure_ascii=False) + "\n")
        common.atomic_write_text(run.dir / f"dataset_iter{iteration}.jsonl", "".join(lines))
    run.log_samples(step, "dataset", kept)
    agree_hist = np.bincount([s["agree"] for s in stats], minlength=cfg.votes + 1)
    metrics = {
        "dataset/generated": len(questions),
        "dataset/voted": len(clean),
        "dataset/contaminated": len(parsed) - len(clean),
        "dataset/kept": len(kept),
        "dataset/agree_hist": agree_hist.tolist(),
    }
    return kept, metrics


def label_check(policy, roles: Roles, problems: list[dict], cfg: Config, prompts: dict) -> dict:
    """--label-check (ours; the paper reports its labels' accuracy, 79% -> 69% -> 63%): questions
    with gold answers through step 2's vote and band, by the current Solver."""
    questions = [p["question"] for p in problems]
    with roles.sampling(SOLVER):
        answers = solver_votes(policy, questions, cfg, prompts)
    golds = [p["answer"] for p in problems]
    return label_accuracy(vote_statistics(answers, cfg.verify_timeout), golds, cfg)


def label_accuracy(stats: list[dict], golds: list[str], cfg: Config) -> dict:
    """The labels' accuracy against `golds`: over all, over the kept (None if none), and per
    number of agreeing votes; the share kept."""
    pairs = [(s["label"], gold) for s, gold in zip(stats, golds)]
    correct = np.array(common.math_equal_many(pairs, timeout=cfg.verify_timeout), dtype=float)
    kept = np.array([in_band(s, cfg) for s in stats], dtype=bool)
    agree = np.array([s["agree"] for s in stats])
    by_agree = {}
    for votes in sorted(set(agree.tolist())):
        by_agree[str(votes)] = float(correct[agree == votes].mean())
    return {
        "label_check/acc_all": float(correct.mean()),
        "label_check/acc_kept": float(correct[kept].mean()) if kept.any() else None,
        "label_check/kept_frac": float(kept.mean()),
        "label_check/acc_by_agree": by_agree,
    }


# -- 3. Solver phase (Challenger frozen) -----------------------------------------------------------
def solver_step(policy, dataset: list[dict], cfg: Config, ref: dict, step: int, run,
                prompts: dict) -> dict:
    """One GRPO step of the Solver on the kept questions against their pseudo-labels (paper §3)."""
    rng = np.random.default_rng([cfg.seed, step])  # per-step stream: a resume draws the same rows
    batch_size = min(cfg.solver_batch, len(dataset))
    rows = [dataset[i] for i in rng.choice(len(dataset), size=batch_size, replace=False)]
    questions = [row["question"] for row in rows]
    groups = policy.generate(
        [solver_prompt(q, policy.tokenizer, prompts) for q in questions],
        n=cfg.solver_group,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        max_tokens=cfg.max_tokens,
    )
    rollouts = flatten(groups)
    preds = [common.extract_boxed(c.text) for c in rollouts.completions]
    labels = [rows[g]["label"] for g in rollouts.group_ids]
    matches = solver_rewards(preds, labels, cfg.verify_timeout)  # the paper's reward
    rewards = matches
    if cfg.solver_reward == "official":
        rewards = official_solver_rewards(matches, [c.text for c in rollouts.completions])
    trajs, samples = [], []
    for i, completion in enumerate(rollouts.completions):
        trajs.append(common.Trajectory.from_completion(completion, reward=rewards[i], role=SOLVER))
        samples.append({
            **rows[rollouts.group_ids[i]],  # the question, its label and votes
            "completion": completion.text,
            "pred": preds[i],
            "reward": rewards[i],
        })
    update = grpo_update(policy, trajs, rollouts.group_ids, cfg, ref, cfg.solver_minibatch)
    run.log_samples(step, SOLVER, samples)
    no_answer = float(np.mean([p is None for p in preds]))
    metrics = {"acc_vs_pseudo": float(np.mean(matches)), "reward": float(np.mean(rewards)),
               "no_answer": no_answer}
    return _role_metrics(SOLVER, metrics, update)


# -- 4. Evaluation; --eval-protocol official follows evaluation/eval_*.py rule by rule ------------
LETTERS = "ABCDEFGHIJ"  # option letters (MMLU-Pro and SuperGPQA have up to 10 options)
_OFFICIAL_STOPS = ("</s>", "<|im_end|>", "<|endoftext|>")
_OFFICIAL_LINES = (re.compile(r"Final Answer:([^\n]*)\n"), re.compile(r"The answer is:([^\n]*)\n"))
OFFICIAL_LETTER_GRADING = "official_letter, else a seeded random letter A-J"
_BBEH_PREFIXES = ("The answer is:", "The final answer is ", "The final answer is: ",
                  "The answer is ")


def eval_sets(benchmarks: str) -> list[str]:
    """A comma-separated list of benchmarks (--eval-benchmarks) as a list, each set once."""
    names = [b.strip() for b in benchmarks.split(",")]
    return list(dict.fromkeys(name for name in names if name))


def is_general(bench: str) -> bool:
    """A general-reasoning set by name, a local file by its stem (BBEH also as a copy, e.g.
    hf:MrLight/bbeh-eval)."""
    name, _ = common.parse_benchmark_spec(bench)
    if name.endswith((".jsonl", ".json")):
        name = pathlib.Path(name).stem
    return name.lower() in GENERAL or "bbeh" in name.lower()


def _solver_eval_prompt(problem: dict, tokenizer=None, prompts: dict = PROMPTS):
    """--eval-protocol ours: the Solver's own prompt; options "A) ..." under the question."""
    question = problem["question"].strip()
    if problem.get("choices"):
        options = [f"{letter}) {c}" for letter, c in zip(LETTERS, problem["choices"])]
        template = prompts["solver_choices"]
        question = template.format(question=question, options="\n".join(options))
    return solver_prompt(question, tokenizer, prompts)


def official_eval_prompt(problem: dict, tokenizer=None, prompts: dict = PROMPTS):
    """One user message, no system prompt: the question, "(A): ..." option lines and the ask to box
    only the letter (BBEH: a boxed answer). Without a chat template, that text after "user: "."""
    if problem.get("choices"):
        options = [f"({letter}): {c}" for letter, c in zip(LETTERS, problem["choices"])]
        template = prompts["official_choices"]
        content = template.format(question=problem["question"], options="\n".join(options))
    else:
        content = prompts["official_open"].format(question=problem["question"])
    return common.chat_or_text(tokenizer, content, f"user: {content}")


def _with_prompts(prompt_fn, prompts: dict):
    """prompt_fn(problem, tokenizer) on `prompts`, under its own name (the eval's settings)."""
    return functools.update_wrapper(functools.partial(prompt_fn, prompts=prompts), prompt_fn)


def _last_shallow_box(text: str, max_depth: int = 2, tries: int = 64) -> str | None:
    """The last \\boxed{...} whose braces close within max_depth levels (the scripts' regex); only
    the last `tries` boxes are tried, so hostile text stays cheap."""
    starts = [match.end() for match in re.finditer(r"\\boxed\{", text)]
    for start in reversed(starts[-tries:]):
        depth = 0
        for j in range(start, len(text)):
            if text[j] == "{":
                depth += 1
                if depth > max_depth:
                    break
            elif text[j] == "}":
                if depth == 0:
                    return text[start:j]
                depth -= 1
    return None


def official_solution(text: str) -> str | None:
    """extract_solution: the reply after a chat-turn marker, cut at a stop word; its last non-empty
    shallow \\boxed{}, else the last 'Final Answer:' / 'The answer is:' line (newline-ended)."""
    if "<|im_start|>user" in text:
        text = re.sub(r"^.*?<\|im_start\|>assistant", "<|im_start|>assistant", text, count=1,
                      flags=re.DOTALL)
    elif "Assistant:" in text:
        text = text.split("Assistant:")[-1].strip()
    for stop in _OFFICIAL_STOPS:
        if stop in text:
            text = text.split(stop)[0].strip()
    boxed = _last_shallow_box(text)
    if boxed:
        return boxed
    for pattern in _OFFICIAL_LINES:
        lines = pattern.findall(text)
        if lines:
            return lines[-1]
    return None


def official_letter(solution: str | None) -> str | None:
    """get_prediction: the first of A..J (in that order, not by position) found in the solution."""
    if solution is None:
        return None
    return next((letter for letter in LETTERS if letter in solution), None)


def official_random_letter(seed: int, question: str, text: str) -> str:
    """The scripts' random.choice(A..J), seeded by (seed, question, completion): reruns agree."""
    key = f"{seed}\0{question}\0{text}".encode("utf-8", "replace")
    digest = hashlib.sha256(key).digest()
    rng = random.Random(int.from_bytes(digest[:8], "big"))
    return rng.choice(LETTERS)


def bbeh_prediction(solution: str | None) -> str:
    """preprocess_sample of eval_bbeh.py: after the answer prefixes, unwrapped ($, boxed, text,
    texttt), lowercased, ', ' -> ',', no '**', the first line, no trailing '.'."""
    answer = (solution or "").strip()
    for prefix in _BBEH_PREFIXES:
        if prefix in answer:
            answer = answer.split(prefix)[-1].strip()
    answer = answer.removesuffix(".")
    if answer.startswith("$") and answer.endswith("$"):
        answer = answer[1:-1]
    for command in ("boxed{", "text{", "texttt{"):
        if command in answer and answer.endswith("}"):
            answer = answer[:-1].split(command)[1]
    answer = answer.lower().replace(", ", ",").replace("**", "")
    return answer.split("\n")[0].removesuffix(".")


def bbeh_match(pred: str, reference: str) -> bool:
    """fuzzy_match of eval_bbeh.py: equal; "(a)" vs "a" (deciding alone); equal floats; equal
    without quotes; one in [brackets] of the other; or the reference plus '?'."""
    ref = str(reference).strip().lower().replace(", ", ",")
    if pred == ref:
        return True
    for option, other in ((pred, ref), (ref, pred)):
        if len(option) == 3 and option[0] == "(" and option[-1] == ")":
            return option[1] == other
    try:
        if float(pred) == float(ref):
            return True
    except ValueError:
        pass
    unquoted = pred.replace("'", "") == ref.replace("'", "")
    bracketed = f"[{ref}]" == pred or f"[{pred}]" == ref
    return unquoted or bracketed or (pred.endswith("?") and pred[:-1] == ref)


def official_judge(seed: int, fuzzy: bool, timeout: float = Config.verify_timeout):
    """common.evaluate's judge_fn for the official protocol: multiple choice by official_letter or
    the seeded random letter (pred None, yet right one time in ten); BBEH (fuzzy) by bbeh_match;
    anything else by the last \\boxed{} through common.math_equal within `timeout` seconds."""
    def judge(problem: dict, text: str):
        solution = official_solution(text)
        if problem.get("choices"):
            letter = official_letter(solution)
            guess = letter or official_random_letter(seed, problem["question"], text)
            return letter, guess == common.gold_option_letter(problem)
        if fuzzy:
            pred = bbeh_prediction(solution)
            return pred or None, bbeh_match(pred, problem["answer"])
        pred = common.extract_boxed(text)
        correct = pred is not None and common.math_equal(pred, problem["answer"], timeout)
        return pred, correct
    return judge


def evaluate_official(policy, cfg: Config, prompts: dict) -> dict:
    """--eval-protocol official: general sets (by name, or any set with options) as the scripts run
    them; math sets as evaluation/generate.py, i.e. our Solver prompt and math-verify."""
    result = {"benchmarks": {}, "settings": {}, "time_s": 0.0}
    plan = {}  # per benchmark: its token budget, prompt and grading
    for bench in eval_sets(cfg.eval_benchmarks):
        general = is_general(bench)
        if not general:  # a set with options is graded as the general sets are
            problems = common.load_benchmark(bench, cfg.eval_limit)
            general = any(p.get("choices") for p in problems)
        if general:
            fuzzy = "bbeh" in bench.lower()
            budget = cfg.eval_general_max_tokens
            plan[bench] = {
                "max_tokens": budget,
                "prompt": "official_eval_prompt",
                "grading": "bbeh_match" if fuzzy else OFFICIAL_LETTER_GRADING,
            }
            one = common.evaluate_config(
                policy,
                dataclasses.replace(cfg, eval_benchmarks=bench, eval_max_tokens=budget),
                prompt_fn=_with_prompts(official_eval_prompt, prompts),
                judge_fn=official_judge(cfg.seed, fuzzy, cfg.verify_timeout),
            )
        else:
            plan[bench] = {
                "max_tokens": cfg.eval_max_tokens,
                "prompt": "_solver_eval_prompt",
                "grading": "last \\boxed{} -> math_equal",
            }
            one = common.evaluate_config(
                policy,
                dataclasses.replace(cfg, eval_benchmarks=bench),
                prompt_fn=_with_prompts(_solver_eval_prompt, prompts),
                timeout=cfg.verify_timeout,
            )
        result["benchmarks"].update(one["benchmarks"])
        result["settings"] = {**one["settings"], "eval_protocol": "official", "per_benchmark": plan}
        result["verifier_failures"] = one["verifier_failures"]
        result["time_s"] += one["time_s"]
    return result


def evaluate_benchmarks(policy, cfg: Config, prompts: dict, benchmarks: str) -> dict:
    """`benchmarks` under --eval-protocol, every math-verify check within --verify-timeout."""
    cfg = dataclasses.replace(cfg, eval_benchmarks=benchmarks)
    if cfg.eval_protocol == "official":
        return evaluate_official(policy, cfg, prompts)
    prompt_fn = _with_prompts(_solver_eval_prompt, prompts)
    result = common.evaluate_config(policy, cfg, prompt_fn=prompt_fn, timeout=cfg.verify_timeout)
    result["settings"]["eval_protocol"] = "ours"
    return result


def solver_metrics(result: dict, prefix: str = "eval") -> dict:
    """common.eval_metrics, and <prefix>/overall = mean(math_avg, general sets) (paper Table 1)."""
    metrics = common.eval_metrics(result, prefix)
    math, general = [], []
    for bench, scores in result["benchmarks"].items():
        if is_general(bench):
            general.append(scores["score"])
        else:
            math.append(scores["score"])
    overall = general
    if math:
        metrics[f"{prefix}/math_avg"] = float(np.mean(math))
        overall = [metrics[f"{prefix}/math_avg"]] + general
    metrics[f"{prefix}/overall"] = float(np.mean(overall))
    return metrics


def evaluate_solver(policy, roles: Roles, cfg: Config, run, name: str, prompts: dict,
                    benchmarks: str | None = None, prefix: str = "eval") -> dict:
    """The Solver's greedy accuracy on `benchmarks` (default --eval-benchmarks), in run/<name>."""
    if benchmarks is None:
        benchmarks = cfg.eval_benchmarks
    if not eval_sets(benchmarks):
        return {}
    with roles.sampling(SOLVER):
        result = evaluate_benchmarks(policy, cfg, prompts, benchmarks)
    run.write_eval(result, name)
    return solver_metrics(result, prefix)


# -- Which iteration is the best: chosen on dev sets, never on the test ---------------------------
class EvalSplits(typing.NamedTuple):
    """The sets each iteration is tested on, the dev sets that choose the best one, and how."""
    test: str  # comma-separated, as --eval-benchmarks
    dev: str
    how: str


def carve_dev(problems: list[dict], fraction: float) -> dict:
    """{"dev", "test"}: round(fraction * n) problems (1 .. n - 1) held out as dev, those whose
    questions hash lowest, so the split depends on the set alone (not --seed, not the order)."""
    n_dev = min(len(problems) - 1, max(1, round(fraction * len(problems))))

    def question_hash(i: int) -> str:
        return hashlib.sha256(problems[i]["question"].encode("utf-8", "replace")).hexdigest()
    dev_ids = set(sorted(range(len(problems)), key=question_hash)[:n_dev])
    split = {"dev": [], "test": []}
    for i, problem in enumerate(problems):
        split["dev" if i in dev_ids else "test"].append(problem)
    return split


def eval_splits(cfg: Config, folder: pathlib.Path) -> EvalSplits:
    """--dev-benchmarks as given; else each test set split by carve_dev into folder/splits/dev/
    and folder/splits/test/ (JSONL, "@N" kept); --dev-fraction 0: no dev, no choice."""
    if cfg.dev_benchmarks:
        how = f"the best dev/overall on --dev-benchmarks {cfg.dev_benchmarks}; whole test sets"
        return EvalSplits(cfg.eval_benchmarks, cfg.dev_benchmarks, how)
    if not cfg.dev_fraction or not eval_sets(cfg.eval_benchmarks):
        how = "none chosen (no --dev-benchmarks, and --dev-fraction 0 or no test sets)"
        return EvalSplits(cfg.eval_benchmarks, "", how)
    names = {"dev": [], "test": []}
    stems = set()
    for bench in eval_sets(cfg.eval_benchmarks):
        name, n_samples = common.parse_benchmark_spec(bench)
        problems = common.load_benchmark(bench, cfg.eval_limit)
        if len(problems) < 2:
            raise common.InputError(f"--eval-benchmarks {bench}: one problem, too few to hold out "
                                    "a dev share; pass --dev-benchmarks or --dev-fraction 0")
        if name.endswith((".jsonl", ".json")):
            name = pathlib.Path(name).stem
        stem = re.sub(r"[^\w.-]+", "_", name)
        if stem in stems:  # two files of one name: the second gets its position
            stem += f"_{len(stems)}"
        stems.add(stem)
        for part, rows in carve_dev(problems, cfg.dev_fraction).items():
            path = folder / "splits" / part / f"{stem}.jsonl"
            lines = [json.dumps(row, ensure_ascii=False) + "\n" for row in rows]
            common.atomic_write_text(path, "".join(lines))  # every rank: the same bytes
            suffix = f"@{n_samples}" if n_samples else ""
            names[part].append(f"{path}{suffix}")
    how = (f"the best dev/overall on {cfg.dev_fraction:g} of each test set (splits/dev/, chosen "
           "by question hash); the test scores are on the rest (splits/test/)")
    return EvalSplits(",".join(names["test"]), ",".join(names["dev"]), how)


def choose_iteration(best: dict | None, iteration: int, metrics: dict) -> dict | None:
    """The iteration with the highest dev/overall so far (the earliest of equals), with its test
    eval/overall; the test score never takes part in the choice."""
    dev = metrics.get("dev/overall")
    if dev is None:
        return best
    # a tie keeps the earlier iteration; a best saved before dev sets chose (no dev/overall) goes
    if best is not None and dev <= best.get("dev/overall", float("-inf")):
        return best
    return {"iteration": iteration, "dev/overall": dev, "eval/overall": metrics.get("eval/overall")}


# -- Two roles, one trainer, one engine ------------------------------------------------------------
class Shards(dict):
    """This rank's part of a weight set in file-backed shared memory (page cache, one per node)."""
    local_shards = True


def _trainer_parts(policy):
    """(HF name, trainer tensor, this rank's part) once per storage, in one order on all ranks."""
    storages = set()
    for name, tensor in policy.state_dict().items():
        storage = tensor.to_local() if hasattr(tensor, "to_local") else tensor
        if storage.numel() == 0 or storage.data_ptr() not in storages:  # empty shards share none
            storages.add(storage.data_ptr())
            yield name, tensor, common.local_part(tensor)


def full_weights(policy, shards: Shards):
    """(HF name, full tensor) of `shards`, one at a time (a collective: every rank iterates)."""
    for name, tensor, _ in _trainer_parts(policy):
        yield name, common.full_from_part(shards[name], tensor)


class Roles:
    """The trained role lives in policy.model; the other one waits in `parked` (Shards)."""

    def __init__(self, policy, active: str, other=None, folder=None):
        self.policy, self.active = policy, active
        self.folder = folder  # of the shards' files; None: the temp dir
        self.parked = {OTHER[active]: self.park(other)}

    def park(self, weights=None) -> Shards:
        """Shards of `weights` (full tensors or a save_pretrained folder), else of the trainer's."""
        import torch
        if isinstance(weights, (str, pathlib.Path)):  # a folder: read one tensor at a time
            from safetensors import safe_open
            files = [safe_open(str(f), "pt") for f in pathlib.Path(weights).glob("*.safetensors")]
            weights = {name: f for f in files for name in f.keys()}
        shards = Shards()
        for name, tensor, part in _trainer_parts(self.policy):
            source = part
            if weights is not None:  # this rank's part of the full tensor, no collective
                full = weights[name]
                if not hasattr(full, "shape"):  # an open safetensors file
                    full = full.get_tensor(name)
                source = common.local_part(tensor, full)
            # the mapping outlives the file's name: nothing is left behind
            with tempfile.NamedTemporaryFile(dir=self.folder, prefix=".weights-") as f:
                mapped = torch.from_file(f.name, shared=True, size=part.numel(), dtype=part.dtype)
            shards[name] = mapped.view(part.shape)
            shards[name].copy_(source)
        return shards

    def activate(self, role: str) -> None:
        if role != self.active:  # exchanged in place: no third copy
            self.parked[self.active] = self.policy.exchange_weights(self.parked.pop(role))
            self.policy.reset_optimizer()
            self.policy.sync()
            self.active = role

    def sampling(self, role: str):
        """A context in which the engine samples `role`; the trainer keeps its weights."""
        if role == self.active:
            return self.policy.sampling_from(None)
        return self.policy.sampling_from(full_weights(self.policy, self.parked[role]))


# -- Checkpoints and the run's outputs -------------------------------------------------------------
def _save_model(policy, weights, path: pathlib.Path) -> None:
    """(name, tensor) pairs as a save_pretrained folder: a collective, the main process writes."""
    is_main = common.is_main_process()
    state_dict = {}
    for name, tensor in weights:  # every rank iterates: the full tensors are gathered
        if is_main:
            state_dict[name] = tensor.cpu()
    if is_main:
        policy.model.save_pretrained(str(path), state_dict=state_dict, safe_serialization=True)
        policy.tokenizer.save_pretrained(str(path))


def save_state(run, policy, roles: Roles, state: dict, step: int, ref: dict | None) -> None:
    """The trained role in checkpoints/step_<k>/, after the parked one (and ref) in roles/."""
    tag = f"step_{step}"
    parked = OTHER[roles.active]
    roles_dir = run.dir / "roles"
    tmp = roles_dir / f".tmp-{tag}"
    shutil.rmtree(tmp, ignore_errors=True)
    _save_model(policy, full_weights(policy, roles.parked[parked]), tmp / parked)
    if ref is not None:  # inside a phase: its KL reference too (one set at a time)
        _save_model(policy, full_weights(policy, ref), tmp / "ref")
    if common.is_main_process():
        shutil.rmtree(roles_dir / tag, ignore_errors=True)
        os.replace(tmp, roles_dir / tag)
    checkpoint_state = {**state, "active": roles.active, "roles_dir": tag}
    run.save_checkpoint(step, policy, checkpoint_state)
    if common.is_main_process():  # a pruned checkpoint's role folder goes with it
        for folder in roles_dir.iterdir():
            if not (run.dir / "checkpoints" / folder.name).is_dir():
                shutil.rmtree(folder, ignore_errors=True)


def finish(run, policy, roles: Roles, cfg: Config, best: dict | None, splits: EvalSplits) -> None:
    """final/challenger, final/solver, and eval.json: the base, every iteration's test and dev
    results, and the iteration the dev sets chose with its test score."""
    for role in (CHALLENGER, SOLVER):
        if role == roles.active:
            weights = policy.iter_full_weights()
        else:
            weights = full_weights(policy, roles.parked[role])
        _save_model(policy, weights, run.dir / "final" / role)
    results = {"eval": {}, "dev": {}}
    for k in range(1, cfg.iterations + 1):
        for prefix, per_iteration in results.items():
            path = run.dir / f"{prefix}_iter{k}.json"
            if path.is_file():
                per_iteration[str(k)] = json.loads(path.read_text())
    base = run.dir / "eval_base.json"
    base_eval = json.loads(base.read_text()) if base.is_file() else None
    settings = {"selection": splits.how, "test_sets": splits.test, "dev_sets": splits.dev}
    run.write_eval({"base": base_eval, "best": best, "iterations": results["eval"],
                    "dev": results["dev"], "settings": settings})


def evaluate_only(cfg: Config, policy, prompts: dict) -> pathlib.Path:
    """--eval-only: --model evaluated as R-Zero evaluates its Solver (its prompts, --eval-protocol,
    budgets, --eval-n/--eval-k) on the whole --eval-benchmarks; eval.json, and nothing trained."""
    run = common.Run(cfg, "r_zero")
    policy = policy or common.Policy.load(cfg)
    result = evaluate_benchmarks(policy, cfg, prompts, cfg.eval_benchmarks)
    run.write_eval(result)
    run.log(0, solver_metrics(result))
    run.note(f"--eval-only: {cfg.model} evaluated, nothing trained")
    run.close()
    return run.dir


# -- The loop --------------------------------------------------------------------------------------
class Position(typing.NamedTuple):
    """A step of the schedule: step `phase_step` of `phase` in `iteration`."""
    iteration: int
    phase: str
    phase_step: int


def phase_steps(cfg: Config) -> dict[str, int]:
    """The steps of each phase of an iteration, in order."""
    return {CHALLENGER: cfg.challenger_steps, "dataset": 1, SOLVER: cfg.solver_steps, "eval": 1}


def build_schedule(cfg: Config) -> list[Position]:
    """R-Zero's nested loop, flattened into one list so that a checkpoint can name the next step:
      for iteration in 1 .. K:
          for phase_step in range(challenger_steps): challenger_step  (1.)
          build_dataset, then label_check with --label-check          (2.)
          for phase_step in range(solver_steps): solver_step          (3.)
          evaluate_solver on the test and the dev sets                (4.)
    and last, the position of a finished run."""
    schedule = []
    for iteration in range(1, cfg.iterations + 1):
        for phase, n_steps in phase_steps(cfg).items():
            schedule += [Position(iteration, phase, j) for j in range(n_steps)]
    schedule.append(Position(cfg.iterations + 1, CHALLENGER, 0))
    return schedule


def no_question_note(iteration: int, dataset_metrics: dict) -> str:
    """The summary's line for an iteration whose dataset kept no question."""
    voted = dataset_metrics["dataset/voted"]
    why = f"0 of {voted} voted questions in the band"
    if not voted:
        why = (f"no valid, uncontaminated question in {dataset_metrics['dataset/generated']} "
               f"outputs: dataset_iter{iteration}.jsonl is empty")
    return f"iteration {iteration}: no question kept ({why}): the Solver was not trained"


def train(cfg: Config, policy=None) -> pathlib.Path:
    """The whole run; `policy` may be passed in (tests share one vLLM engine), else loaded."""
    validate_config(cfg)
    prompts = common.load_prompts(cfg.prompts, PROMPTS)
    if cfg.eval_only:
        return evaluate_only(cfg, policy, prompts)
    decon = common.eval_decontaminator(f"{cfg.eval_benchmarks},{cfg.dev_benchmarks}",
                                       cfg.decontaminate)
    label_checks = []
    if cfg.label_check:
        label_checks = common.load_benchmark(cfg.label_check, cfg.label_check_limit)
    common.seed_everything(cfg.seed)
    run = common.Run(cfg, "r_zero")
    splits = eval_splits(cfg, run.dir)  # the test sets, and the dev sets that choose
    policy = policy or common.Policy.load(cfg)
    schedule = build_schedule(cfg)
    n_steps = phase_steps(cfg)

    # `state` names the next step to run, and carries the dataset, the chosen iteration, the
    # Challenger phase's count of valid questions and the summary's notes
    state = {"iteration": 1, "phase": CHALLENGER, "phase_step": 0, "dataset": [], "best": None,
             "valid_questions": 0, "notes": []}
    ref = None  # the KL reference: the trained role's weights at the start of its phase
    checkpoint = run.load_checkpoint(policy) if cfg.resume else None
    if checkpoint is None:
        roles = Roles(policy, CHALLENGER, folder=run.dir)  # iteration 1: both are the base model
        if cfg.eval_base:
            base_metrics = evaluate_solver(policy, roles, cfg, run, "eval_base.json", prompts,
                                           splits.test)
            run.log(0, base_metrics)
    else:
        _, saved = checkpoint
        state.update({k: v for k, v in saved.items() if k in state})
        roles_dir = run.dir / "roles" / saved["roles_dir"]
        active = saved["active"]
        roles = Roles(policy, active, roles_dir / OTHER[active], run.dir)
        if (roles_dir / "ref").is_dir():  # saved inside a phase
            ref = roles.park(roles_dir / "ref")
    position = Position(state["iteration"], state["phase"], state["phase_step"])
    if position not in schedule:
        raise ValueError(f"--resume: the run stopped at {tuple(position)}, beyond this "
                         "--iterations, --challenger-steps or --solver-steps; resume with the "
                         "run's own values")
    done = schedule.index(position)
    pbar = run.progress(len(schedule) - 1, initial=done, unit="schedule positions")
    for step in range(done + 1, len(schedule)):
        iteration, phase, phase_step = schedule[step - 1]
        pbar.set_description(f"r_zero iteration {iteration}/{cfg.iterations}, {phase} "
                             f"{phase_step + 1}/{n_steps[phase]}", refresh=False)
        metrics = {"iteration": iteration}
        if phase in (CHALLENGER, SOLVER) and phase_step == 0:  # its role, a fresh AdamW
            roles.activate(phase)
            ref = None  # the previous one's file-backed pages go first
            ref = roles.park()
        phase_end = phase_step + 1 == n_steps[phase]
        if phase == CHALLENGER:  # 1. GRPO on the Challenger, the Solver frozen
            metrics.update(challenger_step(policy, roles, cfg, ref, step, run, prompts))
            if phase_step == 0:
                state["valid_questions"] = 0
            state["valid_questions"] += metrics["challenger/n_valid"]
            if phase_end and not state["valid_questions"]:
                state["notes"].append(f"iteration {iteration}: the Challenger wrote no valid "
                                      f"question in {n_steps[phase]} step(s): its rewards were "
                                      "all equal, so no advantage trained it")
        elif phase == "dataset":  # 2. the Solver's dataset, filtered by its agreement
            state["dataset"], dataset_metrics = build_dataset(policy, roles, cfg, step, run,
                                                              iteration, prompts, decon)
            metrics.update(dataset_metrics)
            if not state["dataset"]:
                state["notes"].append(no_question_note(iteration, dataset_metrics))
            if label_checks:
                metrics.update(label_check(policy, roles, label_checks, cfg, prompts))
        elif phase == SOLVER and state["dataset"]:  # 3. GRPO on the Solver, the Challenger frozen
            metrics.update(solver_step(policy, state["dataset"], cfg, ref, step, run, prompts))
        elif phase == SOLVER:
            metrics["solver/skipped"] = 1  # no question was kept
        else:  # 4. evaluate the Solver after every iteration: the dev sets choose the best
            test_name, dev_name = f"eval_iter{iteration}.json", f"dev_iter{iteration}.json"
            metrics.update(evaluate_solver(policy, roles, cfg, run, test_name, prompts,
                                           splits.test))
            metrics.update(evaluate_solver(policy, roles, cfg, run, dev_name, prompts,
                                           splits.dev, "dev"))
            state["best"] = choose_iteration(state["best"], iteration, metrics)
            state["dataset"] = []
        run.log(step, metrics)
        pbar.update(1)
        state.update(schedule[step]._asdict())  # the next step to run
        if phase_end:
            ref = None  # the next phase parks its own
        # a phase's end is saved (the Solver's by the evaluation after it); --save-every N also
        # saves inside a phase, with its KL reference
        periodic = cfg.save_every and step % cfg.save_every == 0
        if (phase_end and phase != SOLVER) or (periodic and not phase_end):
            save_state(run, policy, roles, state, step, ref)
    finish(run, policy, roles, cfg, state["best"], splits)
    run.note(f"schedule positions: {sum(n_steps.values())} an iteration, {cfg.challenger_steps} "
             f"Challenger step(s), the dataset, {cfg.solver_steps} Solver step(s), the evaluation")
    for text in state["notes"]:
        run.note(text)
    run.close()
    return run.dir


def headline(run_dir) -> dict:
    """The summary's R-Zero figures: the iterations and each role's steps run, and the iteration
    the dev sets chose, with its test score."""
    run_dir = pathlib.Path(run_dir)
    saved = json.loads((run_dir / "config.json").read_text())
    fields = {field.name for field in dataclasses.fields(Config)}
    cfg = Config(**{name: value for name, value in saved.items() if name in fields})
    if cfg.eval_only:
        return {}
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    records = [json.loads(line) for line in lines]
    last_step = max([record["step"] for record in records], default=0)
    done = Counter(position.phase for position in build_schedule(cfg)[:last_step])
    skipped = sum("solver/skipped" in record for record in records)
    figures = {
        "iterations": f"{done['eval']} of {cfg.iterations}",
        "challenger steps": f"{done[CHALLENGER]} of {cfg.iterations * cfg.challenger_steps}",
        "solver steps": f"{done[SOLVER] - skipped} of {cfg.iterations * cfg.solver_steps}",
    }
    if skipped:
        figures["solver steps"] += f" ({skipped} skipped: no question kept)"
    best = json.loads((run_dir / "eval.json").read_text()).get("best")
    if best:
        figures["chosen iteration (by dev)"] = best["iteration"]
        figures["its test eval/overall"] = best["eval/overall"]
    return figures


def main(argv: list[str] | None = None) -> None:
    common.run_cli(Config, train, argv, check=validate_config, tiny=TINY, headline=headline)


if __name__ == "__main__":
    main()
