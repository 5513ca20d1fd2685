"""R-Zero: Self-Evolving Reasoning LLM from Zero Data (Huang et al., arXiv:2508.05004, ICLR 2026).

Two copies of one base model co-evolve and never share weights: a Challenger that writes math questions and a
Solver that answers them. There is no verifier and no data: a question's label is the Solver's own majority vote.

The loop (paper §3; one function per step below, in this order; train() runs it), for iteration k = 1 .. K = 3:
  1. challenger_step x 5  GRPO on the Challenger, Solver frozen:
       challenger_rollouts    G = 4 outputs per copy of one fixed prompt; the question is the last <question> block
       solver_votes           the frozen Solver answers every valid question m = 10 times at T = 1.0
                              (its weights are swapped into the ONE vLLM engine, then the Challenger's swapped back)
       vote_statistics        label y~ = largest class of equivalent boxed answers, p^ = |class| / m
       challenger_rewards     r = max(0, r_unc - r_rep), r_unc = 1 - 2|p^ - 1/2|, r_rep = |C_k| / B from BLEU
                              clustering of the batch's questions; an output without a <question> block gets 0
       grpo_update            GRPO advantages, PPO clip 0.2/0.3, dual clip 3, k3 KL (beta 0.01) to the phase start
  2. build_dataset        N = 8,000 questions from the trained Challenger, m = 10 Solver votes each; keep
                          |p^ - 1/2| <= 0.25 (3..7 of 10 agree) labelled with y~, minus questions sharing a 13-gram
                          with the eval sets. The Challenger's own boxed answer is never used.
  3. solver_step x 15     GRPO on the Solver, Challenger frozen: G = 5 answers per kept question, solver_reward
                          1 iff math_equal(boxed answer, y~); KL to the phase start.
  4. evaluate_solver      greedy accuracy on the eval benchmarks after every iteration (and of the base model),
                          math-verify only (no LLM judge). Report the best and the last iteration: R-Zero degrades
                          after about 3 iterations. --eval-protocol official: the general
                          sets as the released scripts grade them (below).

Run it:      python r_zero.py --model Qwen/Qwen3-4B-Base
Small run:   python r_zero.py --model Qwen/Qwen3-0.6B-Base --question-pool 512 --challenger-batch 32 \
                 --solver-batch 32 --challenger-minibatch 8 --solver-minibatch 32
CPU smoke:   python r_zero.py --model tiny --iterations 2 --challenger-steps 1 --solver-steps 1 ...  (see README)
Pseudo-label decay (paper: 79% -> 69% -> 63%): --oracle-model M (share of kept labels that agree with M's own
majority answer) and/or --label-check BENCH (the vote-and-filter step on questions with known gold answers).

Paper vs official code (github.com/Chengsong-Huang/R-Zero). Defaults follow the paper; the flags
give the code's variants where they matter:
  * iterations 3 (code: 5)                                   --iterations 5
  * dataset votes m = 10 (code: 9)                           --votes 9 (also used for the reward votes)
  * keep-band |p^ - 1/2| <= 0.25, i.e. 0.25 <= p^ <= 0.75    --band-low 0.3 --band-high 0.8 (code)
  * Challenger reward max(0, r_unc - r_rep), invalid 0       --reward-variant code: min(p^, 1 - p^) - r_rep,
                                                             unclipped; --invalid-reward -1 for its invalid value
  * repetition penalty |C_k| / B (floor 1/B)                 --rep-penalty excess: (|C_k| - 1) / B (not from the
                                                             paper; removes the 1/B floor at small B)
  * unparsable Solver answers count in m but never win the vote (the code lets the string "None" win; fixed here)
  * the Challenger's own answer is discarded (the code compared one character of it; fixed here)
  * Solver reward 1 iff the answer matches y~               --solver-reward code: 0.9 accuracy + 0.1 format
                                                             (examples/reward_function/math.py, from EasyR1; format
                                                             = the reply is <think>..</think> .. \\boxed{..})
  * the code's string filters (drop questions containing "box" or "证明", labels containing "text"): --code-filters
  * math-verify equivalence (common.math_equal, hard timeouts), not mathruler's grade_answer
  * not in the paper: generated questions sharing a 13-gram with an evaluation set are dropped from the Solver's
    dataset (analysis §7.3), --no-decontaminate turns it off; questions whose Solver prompt would exceed
    --max-prompt-tokens count as format failures
  * rollouts use top-p 1.0 (code: 0.99) because the trainer does not model truncation (rl_core §4); votes use
    the code's top-k 40, and the question pool top-p 0.95 (not trained on).
  * As in the code, each rollout batch is split into optimizer minibatches (Challenger 16 prompts ->
    32 updates per step, Solver 128 -> 4; --challenger-minibatch, --solver-minibatch) that all keep
    the rollout policy as pi_old (common.pg_step), so the clip and dual clip act from the second on.
  * Loss aggregation seq-mean-token-mean (EasyR1 with one sequence per micro-batch, rl_core §3, §8).
Engineering: ONE trainer model and ONE vLLM engine. The role being trained lives in the trainer (with AdamW state,
reset at every phase start); the other role is a CPU state dict that is swapped into the engine only to sample.

Evaluation of the general sets (SuperGPQA, MMLU-Pro, BBEH), ours (--eval-protocol ours, the default)
vs the released scripts (evaluation/eval_supergpqa.py, eval_mmlupro.py, eval_bbeh.py;
--eval-protocol official):
  * prompt: the Solver's system prompt + the question with "A) ..." options | one user message, no
    system prompt, options as "(A): ..." lines, then "only the letter in \\boxed{}"
    (official_eval_prompt)
  * budget: --eval-max-tokens 4,096 | --eval-general-max-tokens 8,192 (needs --max-model-len 10240)
  * letter: common.option_letter, the letter the boxed answer starts with | official_letter, the
    first of A..J found anywhere in the boxed answer (or a "Final Answer:" line)
  * nothing parses: wrong | a random letter A-J, seeded by (--seed, question, completion)
  * BBEH: math_equal on the boxed answer | bbeh_match, the scripts' fuzzy match ("(a)" = "a",
    numbers, quotes, brackets, a trailing "?") after their answer clean-up
  * the same under both: greedy decoding; the math sets with the Solver prompt at 4,096 tokens,
    math_equal on the last boxed answer; the scripts' GPT-4o re-check of the math sets
    (evaluation/results_recheck.py) is left out of both.
  * not reproduced: the scripts read BBEH from MrLight/bbeh-eval (pass
    hf:MrLight/bbeh-eval:train:question:answer); they show MMLU-Pro's "N/A" padding options (our
    loader drops them); BBEH's no-chat-template prompt also asks for a boxed letter;
    evaluation/datasets_loader.py grades math by the first \\boxed{...} of a line up to its last
    "}".

Prompts (PROMPTS; --prompts FILE replaces any of them) are our own words with every instruction of
the official prompts: the Challenger's (expert setter, private step-by-step scratch-pad, a new
non-trivial problem from any field, fewer than 30% of advanced high-school students solving it, no
textbook or famous contest problems, exactly a <question> block and a \\boxed{} answer, nothing
else) and the Solver's (reason step by step, final answer in \\boxed{}). Where ours differ:
  * without a chat template the prompt ends in "assistant:" (the code's ends after the user line)
  * the Solver's multiple-choice prompt ("ours" protocol) adds "Box the letter of the correct
    option."
"""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import pathlib
import random
import re
import shutil
import sys
import warnings
from dataclasses import dataclass

import numpy as np

import common


# --------------------------------------------------------------------------------------------------------------
# Config: the paper's defaults (sources in the comments). Every field is a --flag (common.parse_config).
# --------------------------------------------------------------------------------------------------------------
@dataclass
class Config(common.RunConfig):
    model: str = "Qwen/Qwen3-4B-Base"  # paper §4 (also Qwen3-8B-Base, OctoThinker-3B/8B)
    iterations: int = 3  # co-evolution iterations K (paper §4; code scripts/main.sh: 5)
    challenger_steps: int = 5  # GRPO steps per Challenger phase (paper; questioner_train_penalty.sh uses step 5)
    solver_steps: int = 15  # GRPO steps per Solver phase (paper; solver_train.sh uses step 15)
    challenger_group: int = 4  # G, Challenger samples per prompt copy (examples/config.yaml + scripts)
    solver_group: int = 5  # G, Solver answers per question in training (examples/config.yaml + scripts)
    challenger_batch: int = 512  # prompt copies per Challenger step (config.yaml: 512 x 4 = 2,048 samples)
    solver_batch: int = 512  # questions per Solver step (config.yaml: 512 x 5 = 2,560 samples)
    challenger_minibatch: int = 16  # prompt copies per optimizer update, 0 = whole batch (scripts; R-Zero issue #23)
    solver_minibatch: int = 128  # questions per optimizer update, 0 = whole batch (paper: Solver batch 128)
    updates_per_batch: int = 1  # passes over a batch, a step per minibatch each (EasyR1 ppo_epochs)
    votes: int = 10  # m, Solver samples per question for p^ and the label (paper; code labels use 9)
    vote_temperature: float = 1.0  # vote sampling (start_vllm_server.py, evaluate.py)
    vote_top_p: float = 1.0  # vote sampling (start_vllm_server.py)
    vote_top_k: int = 40  # vote sampling (start_vllm_server.py)
    vote_max_tokens: int = 4096  # vote length limit (start_vllm_server.py)
    question_pool: int = 8000  # N, questions generated per dataset phase (paper; question_generate.py)
    pool_temperature: float = 1.0  # question-pool sampling (question_generate.py)
    pool_top_p: float = 0.95  # question-pool sampling (question_generate.py; not trained on)
    band_low: float = 0.25  # keep a question when band_low <= p^ <= band_high (paper: |p^ - 1/2| <= 0.25; code 0.3)
    band_high: float = 0.75  # upper end of the keep-band (paper; code upload.py: 0.8)
    temperature: float = 1.0  # rollout temperature of both roles (examples/config.yaml)
    top_p: float = 1.0  # rollout top-p (code 0.99; 1.0 because the trainer does not model truncation, rl_core §4)
    max_prompt_tokens: int = 2048  # a question whose Solver prompt is longer is invalid (config.yaml max_prompt_length)
    max_tokens: int = 4096  # generation limit of both roles in training (config.yaml max_response_length)
    reward_variant: str = "paper"  # paper: max(0, r_unc - r_rep) | code: min(p^, 1 - p^) - r_rep (caller_penalty.py)
    invalid_reward: float = 0.0  # Challenger reward of an output without a <question> block (paper 0; code -1)
    rep_penalty: str = "size"  # size: lambda |C_k| / B (paper) | excess: lambda (|C_k| - 1) / B (option, no 1/B floor)
    rep_lambda: float = 1.0  # lambda of the repetition penalty (paper §3)
    bleu_threshold: float = 0.5  # tau_BLEU, average-linkage distance threshold on 1 - BLEU (paper §3)
    solver_reward: str = "paper"  # paper: 1 iff math_equal(boxed, y~) | code: 0.9 acc + 0.1 format (<think>..</think> then \boxed{}, math.py)
    code_filters: bool = False  # code-only: drop questions containing "box"/"证明" and labels containing "text"
    lr: float = 1e-6  # AdamW, constant (paper; config.yaml)
    weight_decay: float = 1e-2  # AdamW weight decay (config.yaml)
    grad_clip: float = 1.0  # max grad norm (config.yaml)
    clip_low: float = 0.2  # PPO epsilon below 1 (config.yaml)
    clip_high: float = 0.3  # PPO epsilon above 1, clip-higher (config.yaml)
    dual_clip: float = 3.0  # dual-clip constant for A < 0 (EasyR1 core_algos; rl_core §2)
    kl_coef: float = 0.01  # beta of the k3 KL to the weights the phase started from (paper; config.yaml low_var_kl)
    adv_eps: float = 1e-6  # epsilon of GRPO's (r - mean) / (std + eps), unbiased std (EasyR1)
    aggregation: str = "seq-mean-token-mean"  # loss aggregation (rl_core §3, §8: EasyR1 as run by R-Zero)
    decontaminate: bool = True  # drop generated questions sharing a 13-gram with the eval sets (analysis §7.3)
    decontaminate_n: int = 13  # n of the n-gram overlap filter
    eval_base: bool = True  # also evaluate the base model before iteration 1
    eval_every: int = 0  # unused: R-Zero evaluates the Solver after every iteration (paper §5; spec §6)
    eval_benchmarks: str = "math500,gsm8k,amc23,minerva,olympiadbench,aime24,aime25,supergpqa,mmlu_pro,bbeh"  # paper §4: 7 math + 3 general (option letter boxed); --eval-limit N for a quick look
    eval_max_tokens: int = 4096  # greedy, 4,096 tokens (evaluation/generate.py)
    eval_protocol: str = "ours"  # ours | official: general sets as evaluation/eval_bbeh.py etc. do
    eval_general_max_tokens: int = 8192  # official protocol: general sets (eval_mmlupro.py)
    oracle_model: str = ""  # model whose majority answer judges the kept pseudo-labels (analysis §7.1 a); "" = off
    oracle_votes: int = 10  # oracle samples per question (1 = one greedy answer)
    oracle_limit: int = 200  # kept questions checked against the oracle per iteration
    oracle_gpu_memory_utilization: float = 0.2  # GPU share of the oracle's own engine (only if it cannot be swapped in)
    label_check: str = ""  # benchmark with gold answers to run the vote-and-filter step on (analysis §7.1 b); "" = off
    label_check_limit: int = 200  # problems of --label-check used per iteration
    max_model_len: int = 8192  # prompt 2,048 + response 4,096 fit (config.yaml)


CHALLENGER, SOLVER = "challenger", "solver"

# --model tiny: a one-minute smoke run, one iteration of one step per phase (flags still override)
TINY = {"iterations": 1, "challenger_steps": 1, "solver_steps": 1, "challenger_batch": 2,
        "challenger_group": 2, "solver_batch": 2, "solver_group": 2, "votes": 4, "question_pool": 4,
        "max_tokens": 16, "vote_max_tokens": 8, "max_model_len": 1024, "max_prompt_tokens": 400,
        "eval_benchmarks": f"{common.TINY_DATA}/rzero_eval.jsonl", "eval_max_tokens": 8}


def validate_config(cfg: Config) -> None:
    at_least = {**dict.fromkeys(("iterations", "challenger_steps", "solver_steps", "challenger_batch", "solver_batch",
                                 "votes", "question_pool", "max_tokens", "vote_max_tokens", "max_prompt_tokens",
                                 "updates_per_batch", "oracle_votes"), 1),
                "challenger_group": 2, "solver_group": 2,  # GRPO needs a group to form a baseline
                "challenger_minibatch": 0, "solver_minibatch": 0}  # 0 = the whole batch
    for name, low in at_least.items():
        if getattr(cfg, name) < low:
            raise ValueError(f"--{name.replace('_', '-')} must be >= {low}, got {getattr(cfg, name)}")
    for name, allowed in {"reward_variant": ("paper", "code"), "solver_reward": ("paper", "code"),
                          "rep_penalty": ("size", "excess")}.items():
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"--{name.replace('_', '-')} must be {' or '.join(allowed)}, not {getattr(cfg, name)!r}")
    if not 0.0 <= cfg.band_low <= cfg.band_high <= 1.0:
        raise ValueError(f"need 0 <= --band-low <= --band-high <= 1, got {cfg.band_low}, {cfg.band_high}")
    common.check_benchmark_names(cfg.eval_benchmarks)
    common.check_benchmark_names(cfg.label_check, "--label-check")
    if cfg.eval_protocol not in ("ours", "official"):
        raise ValueError(f"--eval-protocol must be ours or official, not {cfg.eval_protocol!r}")
    if cfg.eval_general_max_tokens < 1:
        raise ValueError(f"--eval-general-max-tokens {cfg.eval_general_max_tokens}: need >= 1")
    need = cfg.eval_general_max_tokens + cfg.max_prompt_tokens
    if (cfg.eval_protocol == "official" and cfg.max_model_len < need
            and any(_general_name(b) for b in cfg.eval_benchmarks.split(",") if b.strip())):
        raise ValueError(f"--eval-protocol official lets general-benchmark answers run to "
                         f"--eval-general-max-tokens {cfg.eval_general_max_tokens}, which "
                         f"--max-model-len {cfg.max_model_len} cannot hold after a prompt of up "
                         f"to --max-prompt-tokens {cfg.max_prompt_tokens}: pass "
                         f"--max-model-len {need}")
    use_prompts(cfg.prompts)  # a bad --prompts file: a usage error before anything loads


# --------------------------------------------------------------------------------------------------------------
# Prompts: our own words, carrying every instruction of the paper's prompts (the Challenger's as in
# question_generate/question_generate.py, the Solver's as in vllm_service_init/
# start_vllm_server.py). str.format templates, literal braces doubled; --prompts FILE replaces any
# of them (validate_config).
# --------------------------------------------------------------------------------------------------------------
PROMPTS = {
    "challenger_system": (
        "You are an expert who writes competition mathematics problems.\n"
        "First, in a private scratch-pad, work step by step towards a new problem that is not "
        "trivial. It may come from any part of mathematics: algebra, prealgebra, geometry, number "
        "theory, combinatorics, probability, statistics, calculus or another field. Make it hard "
        "enough that fewer than 30% of advanced high-school students would solve it, and do not "
        "reuse textbook staples or well-known contest problems.\n"
        "Then, keeping your scratch-pad to yourself, write exactly these two blocks:\n\n"
        "<question>\n"
        "the complete problem statement, on one or more lines\n"
        "</question>\n\n"
        "\\boxed{{the final answer}}\n\n"
        "Write nothing else: no explanation, no other markup."),
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
_prompts = dict(PROMPTS)  # the templates in use: PROMPTS, or those of --prompts FILE (use_prompts)


def use_prompts(path: str) -> None:
    """Load --prompts FILE over PROMPTS (a bad file: ValueError naming the template and the fix) and
    make the result the templates every prompt below is filled from."""
    loaded = common.load_prompts(path, PROMPTS)
    _prompts.clear()
    _prompts.update(loaded)


def render(tokenizer, system: str, user: str):
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return f"system: {system}\nuser: {user}\nassistant:"  # a model without a chat template


def challenger_prompt(tokenizer):
    system, user = _prompts["challenger_system"].format(), _prompts["challenger_user"].format()
    return render(tokenizer, system, user)


def solver_prompt(question: str, tokenizer):
    return render(tokenizer, _prompts["solver_system"].format(), question)


# --------------------------------------------------------------------------------------------------------------
# Parsing, votes and rewards (spec §2)
# --------------------------------------------------------------------------------------------------------------
def extract_question(text: str) -> str | None:
    return common.extract_tag(text, "question", last=True) or None


def parse_questions(completions, tokenizer, cfg: Config) -> list[str | None]:
    """The question of each Challenger output, or None (no block, empty, code-filtered, or too long)."""
    out = []
    for c in completions:
        q = extract_question(c.text)
        if q is not None and cfg.code_filters and ("证明" in q or "box" in q):  # the code's question_generate filter
            q = None
        if q is not None and len(common.encode_prompt(tokenizer, solver_prompt(q, tokenizer))) > cfg.max_prompt_tokens:
            q = None
        out.append(q)
    return out


def vote_statistics(answer_groups: list[list[str | None]]) -> list[dict]:
    """Per question: majority label y~, p^ = |class(y~)| / m and the number of agreeing votes. Unparsable answers
    (None) count in m but never form a class, so they can never be the label (spec worked example 1)."""
    return [{"label": label, "p_hat": float(share), "agree": int(round(share * len(g))), "m": len(g)}
            for g, (label, share) in zip(answer_groups, common.majority_vote_many(answer_groups))]


def in_band(agree: int, m: int, low: float, high: float) -> bool:
    """low <= agree / m <= high; with the paper's band and m = 10, 3..7 votes. agree = 0 is never kept."""
    return agree >= 1 and low * m - 1e-9 <= agree <= high * m + 1e-9


def challenger_rewards(questions: list[str | None], p_hats: list[float], cfg: Config) -> dict:
    """paper: max(0, r_unc - r_rep); code: min(p^, 1 - p^) - r_rep, unclipped (caller_penalty.py). r_rep =
    lambda |C_k| / B with C_k the BLEU-4 cluster (average linkage at tau_BLEU) of the valid questions and B the
    whole batch; an output without a question has nothing to cluster and gets invalid_reward (the code: -1 - r_rep
    of the cluster of empty strings; here exactly --invalid-reward)."""
    valid = np.array([q is not None for q in questions], dtype=bool)
    p = np.asarray(p_hats, dtype=np.float64)
    vidx = np.flatnonzero(valid)
    r_rep, n_clusters = np.zeros(len(questions)), 0
    if len(vidx):
        ids = np.asarray(common.bleu_clusters([questions[i] for i in vidx], cfg.bleu_threshold))
        sizes = np.bincount(ids)[ids] - (1.0 if cfg.rep_penalty == "excess" else 0.0)
        r_rep[vidx] = cfg.rep_lambda * sizes / len(questions)  # / B, the whole batch (spec §2, caller_penalty.py)
        n_clusters = int(ids.max()) + 1
    r_unc = np.where(valid, common.uncertainty_reward(p), 0.0)
    reward = np.maximum(0.0, r_unc - r_rep) if cfg.reward_variant == "paper" else np.minimum(p, 1.0 - p) - r_rep
    reward = np.where(valid, reward, float(cfg.invalid_reward))
    return {"reward": reward, "r_unc": r_unc, "r_rep": r_rep, "valid": valid, "n_clusters": n_clusters}


def keep_question(s: dict, cfg: Config) -> bool:
    return (s["label"] is not None and in_band(s["agree"], s["m"], cfg.band_low, cfg.band_high)
            and not (cfg.code_filters and "text" in s["label"]))


def filter_dataset(questions: list[str], stats: list[dict], cfg: Config) -> list[dict]:
    return [{"question": q, "label": s["label"], "p_hat": s["p_hat"], "agree": s["agree"]}
            for q, s in zip(questions, stats) if keep_question(s, cfg)]


# The official code's format term: the reply, with blanks around <, > and / removed, must START with <think> and
# close it before a \boxed{}. Nothing in the Solver prompt asks for <think>, so it pays a chat-template habit.
CODE_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def solver_reward(text: str, correct: bool, cfg: Config) -> float:
    """paper: 1 iff the boxed answer equals y~. code (examples/reward_function/math.py): 0.9 that + 0.1 format."""
    if cfg.solver_reward == "paper":
        return float(correct)
    formatted = CODE_FORMAT.fullmatch(re.sub(r"\s*(<|>|/)\s*", r"\1", text)) is not None
    return 0.9 * float(correct) + 0.1 * float(formatted)


# --------------------------------------------------------------------------------------------------------------
# Two roles, one trainer, one engine
# --------------------------------------------------------------------------------------------------------------
class Roles:
    """The trained role lives in policy.model; the other one waits in `cpu` as a CPU state dict."""

    def __init__(self, policy, active: str, other_weights: dict):
        self.policy = policy
        self.active = active
        self.cpu = {self.other(active): other_weights}

    @staticmethod
    def other(role: str) -> str:
        return SOLVER if role == CHALLENGER else CHALLENGER

    def activate(self, role: str) -> None:
        if role != self.active:
            # exchanged in place: the role's dict now holds the parked one, no third copy
            self.cpu[self.active] = self.policy.exchange_weights(self.cpu.pop(role))
            self.policy.reset_optimizer()
            self.policy.sync()
            self.active = role

    def sampling(self, role: str):
        return self.policy.sampling_from(None if role == self.active else self.cpu[role])


def solver_votes(sampler, questions: list[str], cfg: Config) -> list[list[str | None]]:
    if not questions:
        return []
    outs = sampler.generate([solver_prompt(q, sampler.tokenizer) for q in questions], n=cfg.votes,
                            temperature=cfg.vote_temperature, top_p=cfg.vote_top_p, top_k=cfg.vote_top_k,
                            max_tokens=cfg.vote_max_tokens)
    return [[common.extract_boxed(c.text) for c in g] for g in outs]


def grpo_update(policy, trajs: list, group_ids: list, cfg: Config, ref_weights: dict, minibatch: int) -> dict:
    """GRPO advantages per group, then common.pg_step: one optimizer step per `minibatch` groups
    (0 = all), pi_old the rollout policy for every step; a group's samples are adjacent in trajs."""
    adv = common.group_advantages([t.reward for t in trajs], group_ids, scale="std", eps=cfg.adv_eps)
    for t, a in zip(trajs, adv.tolist()):
        t.advantage = a
    per_group = len(trajs) // len(set(group_ids))
    pg = common.PGConfig(clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
                         kl_coef=cfg.kl_coef, aggregation=cfg.aggregation, temperature=cfg.temperature,
                         updates_per_batch=cfg.updates_per_batch, mini_batch=minibatch * per_group)
    return common.pg_step(policy, trajs, pg, ref_weights=ref_weights if cfg.kl_coef > 0 else None)


def _role_metrics(role: str, metrics: dict, upd: dict) -> dict:
    out = {**metrics, **{k: v for k, v in upd.items() if "/" not in k}}
    if f"entropy/{role}" in upd:  # analysis §3: Eq. 1 estimate (NLL of own T=1 samples) and exact entropy
        out.update(entropy=upd[f"entropy/{role}"], entropy_exact=upd.get(f"entropy_exact/{role}"))
    return {f"{role}/{k}": v for k, v in out.items()}


def _mean(xs) -> float:
    return float(np.mean(xs)) if len(xs) else 0.0


# --------------------------------------------------------------------------------------------------------------
# 1. Challenger phase
# --------------------------------------------------------------------------------------------------------------
def challenger_rollouts(policy, cfg: Config):
    outs = policy.generate([challenger_prompt(policy.tokenizer)] * cfg.challenger_batch, n=cfg.challenger_group,
                           temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens)
    return [(g, c) for g, group in enumerate(outs) for c in group]


def challenger_step(policy, roles: Roles, cfg: Config, ref: dict, step: int, run) -> dict:
    """One GRPO step of the Challenger with the Solver frozen (paper §3, step 1)."""
    with run.timer("challenger_rollout"):
        rollouts = challenger_rollouts(policy, cfg)
        questions = parse_questions([c for _, c in rollouts], policy.tokenizer, cfg)
    vidx = [i for i, q in enumerate(questions) if q is not None]
    with run.timer("solver_votes"), roles.sampling(SOLVER):
        answers = solver_votes(policy, [questions[i] for i in vidx], cfg)
    by_idx = dict(zip(vidx, vote_statistics(answers)))
    stats = [by_idx.get(i) for i in range(len(questions))]  # None for an output without a question
    r = challenger_rewards(questions, [s["p_hat"] if s else 0.0 for s in stats], cfg)
    trajs = [common.Trajectory.from_completion(c, reward=float(rw), role=CHALLENGER)
             for (_, c), rw in zip(rollouts, r["reward"])]
    with run.timer("challenger_update"):
        upd = grpo_update(policy, trajs, [g for g, _ in rollouts], cfg, ref, cfg.challenger_minibatch)
    valid = r["valid"]
    voted = list(by_idx.values())
    m = {"reward": float(r["reward"].mean()), "r_unc": _mean(r["r_unc"][valid]), "r_rep": _mean(r["r_rep"][valid]),
         "format_fail": float(1.0 - valid.mean()), "n_valid": int(valid.sum()), "n_clusters": r["n_clusters"],
         "truncated": _mean([c.finish_reason == "length" for _, c in rollouts]),
         "p_hat_mean": _mean([s["p_hat"] for s in voted]),
         "in_band": _mean([in_band(s["agree"], s["m"], cfg.band_low, cfg.band_high) for s in voted])}
    if vidx:  # analysis §7.2 (the clusters are the penalty's, above: common.diversity_metrics would redo them)
        qs = [questions[i] for i in vidx]
        m.update(distinct_frac=common.distinct_fraction(qs), distinct4=common.distinct_ngram_ratio(qs, 4),
                 self_bleu=common.self_bleu(qs))
    run.log_samples(step, CHALLENGER, [
        {"completion": c.text, "question": q, "label": s and s["label"], "p_hat": s and s["p_hat"],
         "reward": float(rw), "r_rep": float(rr)}
        for (_, c), q, s, rw, rr in zip(rollouts, questions, stats, r["reward"], r["r_rep"])])
    return _role_metrics(CHALLENGER, m, upd)


# --------------------------------------------------------------------------------------------------------------
# 2. Dataset phase
# --------------------------------------------------------------------------------------------------------------
def build_dataset(policy, roles: Roles, cfg: Config, decon, step: int, run, iteration: int) -> tuple[list, dict]:
    """Step 2 of the loop; every voted question, kept or not, is written to dataset_iter<k>.jsonl."""
    with roles.sampling(CHALLENGER), run.timer("question_pool"):
        outs = policy.generate([challenger_prompt(policy.tokenizer)] * cfg.question_pool, n=1,
                               temperature=cfg.pool_temperature, top_p=cfg.pool_top_p, max_tokens=cfg.max_tokens)
    questions = parse_questions([g[0] for g in outs], policy.tokenizer, cfg)
    valid = [q for q in questions if q is not None]
    flags = decon.flags(valid) if decon is not None else [False] * len(valid)
    clean = [q for q, f in zip(valid, flags) if not f]
    with run.timer("dataset_votes"), roles.sampling(SOLVER):
        answers = solver_votes(policy, clean, cfg)
    stats = vote_statistics(answers)
    kept = filter_dataset(clean, stats, cfg)
    if common.is_main_process():
        rows = [{"question": q, **s, "kept": keep_question(s, cfg), "answers": a}
                for q, s, a in zip(clean, stats, answers)]
        common.atomic_write_text(run.dir / f"dataset_iter{iteration}.jsonl",
                                 "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    run.log_samples(step, "dataset", kept)
    return kept, {"dataset/generated": len(questions), "dataset/valid": len(valid),
                  "dataset/contaminated": int(sum(flags)), "dataset/voted": len(clean), "dataset/kept": len(kept),
                  "dataset/kept_frac": len(kept) / max(1, len(clean)),
                  "dataset/distinct_frac": common.distinct_fraction(valid),
                  "dataset/agree_hist": np.bincount([s["agree"] for s in stats], minlength=cfg.votes + 1).tolist()}


def pseudo_label_accuracy(roles: Roles, oracle, kept: list[dict], cfg: Config) -> dict:
    """analysis §7.1 (a): the share of kept pseudo-labels equal (math_equal) to the oracle model's own majority
    answer on the same question. Not answered by the oracle = disagreement (also reported separately)."""
    rows = kept[:cfg.oracle_limit]
    if not rows:
        return {}
    ocfg = dataclasses.replace(cfg, votes=cfg.oracle_votes,  # --oracle-votes 1: one greedy answer
                               vote_temperature=0.0 if cfg.oracle_votes == 1 else cfg.vote_temperature)
    with oracle.sampling(roles.policy) as sampler:
        answers = solver_votes(sampler, [r["question"] for r in rows], ocfg)
    ref = [s["label"] for s in vote_statistics(answers)]
    ok = common.math_equal_many([(r["label"], a) for r, a in zip(rows, ref)])
    return {"pseudo_label/acc": float(np.mean(ok)), "pseudo_label/n": len(rows),
            "pseudo_label/oracle_answered": float(np.mean([a is not None for a in ref]))}


def label_check(roles: Roles, problems: list[dict], cfg: Config) -> dict:
    """analysis §7.1 (b): R-Zero's labelling step (same m, same band) on questions with gold answers, with the
    current Solver. Label accuracy over all questions, over the kept ones, and per number of agreeing votes."""
    with roles.sampling(SOLVER):
        answers = solver_votes(roles.policy, [p["question"] for p in problems], cfg)
    stats = vote_statistics(answers)
    ok = common.math_equal_many([(s["label"], p["answer"]) for s, p in zip(stats, problems)])
    keep = [in_band(s["agree"], s["m"], cfg.band_low, cfg.band_high) for s in stats]
    agree = [s["agree"] for s in stats]
    return {"label_check/acc_all": float(np.mean(ok)),
            "label_check/acc_kept": float(np.mean([o for o, k in zip(ok, keep) if k])) if any(keep) else None,
            "label_check/kept_frac": float(np.mean(keep)),
            "label_check/acc_by_agree": {str(a): float(np.mean([o for o, b in zip(ok, agree) if b == a]))
                                         for a in sorted(set(agree))}}


# --------------------------------------------------------------------------------------------------------------
# 3. Solver phase
# --------------------------------------------------------------------------------------------------------------
def solver_step(policy, dataset: list[dict], cfg: Config, ref: dict, step: int, run) -> dict:
    """One GRPO step of the Solver on the kept questions, rewarded against the pseudo-labels (paper §3, step 3)."""
    rng = np.random.default_rng([cfg.seed, step])  # per-step stream: a resumed run draws the same questions
    b = min(cfg.solver_batch, len(dataset))
    rows = [dataset[i] for i in rng.choice(len(dataset), size=b, replace=False)]
    with run.timer("solver_rollout"):
        outs = policy.generate([solver_prompt(r["question"], policy.tokenizer) for r in rows], n=cfg.solver_group,
                               temperature=cfg.temperature, top_p=cfg.top_p, max_tokens=cfg.max_tokens)
    flat = [(g, c) for g, group in enumerate(outs) for c in group]
    preds = [common.extract_boxed(c.text) for _, c in flat]
    ok = common.math_equal_many([(p, rows[g]["label"]) for p, (g, _) in zip(preds, flat)])
    rewards = [solver_reward(c.text, o, cfg) for (_, c), o in zip(flat, ok)]
    trajs = [common.Trajectory.from_completion(c, reward=r, role=SOLVER) for (_, c), r in zip(flat, rewards)]
    with run.timer("solver_update"):
        upd = grpo_update(policy, trajs, [g for g, _ in flat], cfg, ref, cfg.solver_minibatch)
    run.log_samples(step, SOLVER, [{"question": rows[g]["question"], "label": rows[g]["label"], "completion": c.text,
                                    "pred": p, "reward": r} for (g, c), p, r in zip(flat, preds, rewards)])
    return _role_metrics(SOLVER, {"acc_vs_pseudo": float(np.mean(ok)), "reward": float(np.mean(rewards)),
                                  "no_answer": float(np.mean([p is None for p in preds])),
                                  "truncated": float(np.mean([c.finish_reason == "length" for _, c in flat])),
                                  "batch": b}, upd)


# --------------------------------------------------------------------------------------------------------------
# 4. Evaluation
# --------------------------------------------------------------------------------------------------------------
LETTERS = "ABCDEFGHIJ"  # option letters of the multiple-choice sets (MMLU-Pro, SuperGPQA: up to 10)


def _solver_eval_prompt(problem: dict, tokenizer=None):
    """--eval-protocol ours: the Solver's own prompt; options listed "A) ..." under the question."""
    q = problem["question"].strip()
    if problem.get("choices"):
        opts = "\n".join(f"{LETTERS[i]}) {c}" for i, c in enumerate(problem["choices"]))
        q = _prompts["solver_choices"].format(question=q, options=opts)
    return solver_prompt(q, tokenizer)


GENERAL = ("supergpqa", "mmlu_pro", "bbeh", "gpqa_diamond")  # the general-reasoning sets; any other set is math


# --eval-protocol official: evaluation/eval_mmlupro.py, eval_supergpqa.py, eval_bbeh.py, rule by
# rule.
def official_eval_prompt(problem: dict, tokenizer=None):
    """One user message and no system prompt: the question, its options as "(A): ..." lines, then
    the instruction to box only the letter; BBEH gets the question and a boxed-answer instruction.
    Without a chat template, the same text after "user: "."""
    if problem.get("choices"):
        opts = "\n".join(f"({LETTERS[i]}): {c}" for i, c in enumerate(problem["choices"]))
        content = _prompts["official_choices"].format(question=problem["question"], options=opts)
    else:
        content = _prompts["official_open"].format(question=problem["question"])
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return [{"role": "user", "content": content}]
    return f"user: {content}"


_OFFICIAL_STOPS = ("</s>", "<|im_end|>", "<|endoftext|>")
_OFFICIAL_LINES = (re.compile(r"Final Answer:([^\n]*)\n"), re.compile(r"The answer is:([^\n]*)\n"))


def _last_shallow_box(text: str, max_depth: int = 2, tries: int = 64) -> str | None:
    """Content of the last \\boxed{...} whose braces close within max_depth levels of nesting (the
    scripts' regex); a deeper or unclosed box does not count. Only the last `tries` boxes are tried,
    so hostile text stays cheap."""
    for start in reversed([m.end() for m in re.finditer(r"\\boxed\{", text)][-tries:]):
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
    """extract_solution of the scripts: the text after a chat-turn marker and before a stop word,
    then the last (shallow) non-empty \\boxed{}; else the last 'Final Answer: ...' line, else the
    last 'The answer is: ...' line (each must end in a newline); else None."""
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
        found = pattern.findall(text)
        if found:
            return found[-1]
    return None


def official_letter(solution: str | None) -> str | None:
    """get_prediction without its fallback: the first of A..J (alphabetical order, not position)
    that occurs anywhere in the solution; None when there is none."""
    return next((x for x in LETTERS if x in solution), None) if solution is not None else None


def official_random_letter(seed: int, question: str, text: str) -> str:
    """The scripts' random.choice(A..J) when no letter parses, seeded by (seed, question,
    completion) so that a run, a resume and a rerun draw the same letter for the same completion."""
    key = hashlib.sha256(f"{seed}\0{question}\0{text}".encode("utf-8", "replace")).digest()
    return random.Random(int.from_bytes(key[:8], "big")).choice(LETTERS)


_BBEH_PREFIXES = ("The answer is:", "The final answer is ", "The final answer is: ",
                  "The answer is ")


def bbeh_prediction(solution: str | None) -> str:
    """preprocess_sample of eval_bbeh.py: after the last 'The answer is:' (and the other prefixes,
    in the script's order), a trailing '.' dropped, $...$, boxed{}, text{}, texttt{} unwrapped,
    lowercased, ', ' -> ',', '**' removed, the first line, a trailing '.' dropped."""
    a = (solution or "").strip()
    for prefix in _BBEH_PREFIXES:
        if prefix in a:
            a = a.split(prefix)[-1].strip()
    a = a[:-1] if a.endswith(".") else a
    if a.startswith("$") and a.endswith("$"):
        a = a[1:-1]
    for command in ("boxed{", "text{", "texttt{"):
        if command in a and a.endswith("}"):
            a = a[:-1].split(command)[1]
    a = a.lower().replace(", ", ",").replace("**", "").split("\n")[0]
    return a[:-1] if a.endswith(".") else a


def bbeh_match(pred: str, reference: str) -> bool:
    """fuzzy_match of eval_bbeh.py on the preprocessed answer: equal; "(a)" against "a" (either
    side, deciding alone); equal as floats; equal without quotes; one is the other in [brackets]; or
    the prediction is the reference plus '?'."""
    ref = str(reference).strip().lower().replace(", ", ",")
    if pred == ref:
        return True
    if len(pred) == 3 and pred[0] == "(" and pred[-1] == ")":
        return pred[1] == ref
    if len(ref) == 3 and ref[0] == "(" and ref[-1] == ")":
        return ref[1] == pred
    try:
        if float(pred) == float(ref):
            return True
    except ValueError:
        pass
    return (pred.replace("'", "") == ref.replace("'", "") or f"[{ref}]" == pred
            or f"[{pred}]" == ref or (pred.endswith("?") and pred[:-1] == ref))


def official_judge(seed: int, fuzzy: bool):
    """common.evaluate's judge_fn for the official protocol. Multiple choice: official_letter, or
    the seeded random letter when none parses (pred None: no answer, yet right one time in ten).
    fuzzy (BBEH): bbeh_match. Anything else: the last \\boxed{} through common.math_equal."""
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
        return pred, pred is not None and common.math_equal(pred, problem["answer"])
    return judge


def _general_name(bench: str) -> bool:
    """SuperGPQA, MMLU-Pro, BBEH or GPQA-Diamond by name; BBEH also as a copy
    (hf:MrLight/bbeh-eval)."""
    name = common.parse_benchmark_spec(bench)[0].lower()
    return name in GENERAL or "bbeh" in name


def _is_general(bench: str, limit: int) -> bool:
    """A general-reasoning set for the official protocol: SuperGPQA, MMLU-Pro, BBEH, GPQA-Diamond
    (by name, BBEH also as a copy such as hf:MrLight/bbeh-eval:...), or any set with options."""
    if _general_name(bench):
        return True
    return any(p.get("choices") for p in common.load_benchmark(bench, limit))


def evaluate_official(policy, cfg: Config) -> dict:
    """--eval-protocol official: the general sets as the released scripts run them
    (official_eval_prompt, greedy, --eval-general-max-tokens new tokens, official_judge); the math
    sets as evaluation/generate.py does, which is our Solver prompt at --eval-max-tokens, graded by
    math-verify (no GPT-4o re-check)."""
    res = {"benchmarks": {}, "settings": {}, "time_s": 0.0}
    plan = {}
    for b in dict.fromkeys(b.strip() for b in cfg.eval_benchmarks.split(",") if b.strip()):
        name = common.parse_benchmark_spec(b)[0]
        if _is_general(b, cfg.eval_limit):
            fuzzy = "bbeh" in name.lower()
            budget = cfg.eval_general_max_tokens
            one = common.evaluate_config(
                policy, dataclasses.replace(cfg, eval_benchmarks=b, eval_max_tokens=budget),
                prompt_fn=official_eval_prompt, judge_fn=official_judge(cfg.seed, fuzzy))
            grading = "bbeh_match" if fuzzy else "official_letter, else a seeded random letter A-J"
            plan[b] = {"max_tokens": budget, "prompt": "official_eval_prompt", "grading": grading}
        else:
            one = common.evaluate_config(policy, dataclasses.replace(cfg, eval_benchmarks=b),
                                         prompt_fn=_solver_eval_prompt)
            plan[b] = {"max_tokens": cfg.eval_max_tokens, "prompt": "_solver_eval_prompt",
                       "grading": "last \\boxed{} -> math_equal"}
        res["benchmarks"].update(one["benchmarks"])
        res["settings"] = {**one["settings"], "eval_protocol": "official", "per_benchmark": plan}
        res["verifier_failures"] = one["verifier_failures"]
        res["time_s"] += one["time_s"]
    return res


def evaluate_solver(policy, roles: Roles, cfg: Config, run, name: str) -> dict:
    """Greedy accuracy (and pass@k if --eval-n > 1) of the Solver with its own prompt
    (--eval-protocol ours) or the released scripts' (official); math-verify only. Logs the paper's
    two summaries: eval/math_avg over the math sets and eval/overall = mean(math_avg, SuperGPQA,
    MMLU-Pro, BBEH) (the paper's "Overall" column), by which the best iteration is chosen."""
    if not any(b.strip() for b in cfg.eval_benchmarks.split(",")):
        return {}
    with roles.sampling(SOLVER):
        if cfg.eval_protocol == "official":
            res = evaluate_official(policy, cfg)
        else:
            res = common.evaluate_config(policy, cfg, prompt_fn=_solver_eval_prompt)
            res["settings"]["eval_protocol"] = "ours"
    run.write_eval(res, name)
    m = common.eval_metrics(res)
    math = [r["score"] for b, r in res["benchmarks"].items() if not _general_name(b)]
    general = [r["score"] for b, r in res["benchmarks"].items() if _general_name(b)]
    if math:
        m["eval/math_avg"] = float(np.mean(math))
    m["eval/overall"] = float(np.mean(([m["eval/math_avg"]] if math else []) + general))
    return m


# --------------------------------------------------------------------------------------------------------------
# Checkpoints: the trained role through Run.save_checkpoint; the parked role (and, mid-phase, the KL reference)
# as save_pretrained folders under roles/<tag>/, written before the checkpoint that names them.
# --------------------------------------------------------------------------------------------------------------
def _save_model(policy, weights: dict, path: pathlib.Path) -> None:
    policy.module.save_pretrained(str(path), state_dict=weights, safe_serialization=True)
    policy.tokenizer.save_pretrained(str(path))


def save_state(run, policy, roles: Roles, state: dict, step: int, ref: dict | None) -> None:
    tag = f"step_{step}-{state['phase']}-{state['phase_step']}"
    root = run.dir / "roles"
    if common.is_main_process():
        tmp = root / f".tmp-{tag}-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        parked = roles.other(roles.active)
        _save_model(policy, roles.cpu[parked], tmp / parked)
        if ref is not None:
            _save_model(policy, ref, tmp / "ref")
        shutil.rmtree(root / tag, ignore_errors=True)
        os.replace(tmp, root / tag)
    parked = roles.other(roles.active)  # "holds": which role the checkpoint's model files are
    holds = {"model": roles.active, parked: f"roles/{tag}/{parked}"}
    run.save_checkpoint(step, policy,
                        {**state, "active": roles.active, "roles_dir": tag, "holds": holds})
    if common.is_main_process():  # drop role folders no remaining checkpoint refers to
        used = {json.loads(ts.read_text()).get("state", {}).get("roles_dir")
                for ts in (run.dir / "checkpoints").glob("step_*/trainer_state.json")}
        for d in root.iterdir():
            if d.name not in used and not d.name.startswith(".tmp-"):
                shutil.rmtree(d, ignore_errors=True)


def write_eval_summary(run, cfg: Config, best: dict | None) -> None:
    """eval.json: the base model's, every iteration's and the best iteration's evaluation."""
    def read(name):
        p = run.dir / name
        return json.loads(p.read_text()) if p.is_file() else None
    iters = {str(k): read(f"eval_iter{k}.json") for k in range(1, cfg.iterations + 1)}
    run.write_eval({"base": read("eval_base.json"), "best": best,
                    "iterations": {k: v for k, v in iters.items() if v}})


def headline(run_dir) -> dict:
    """The best iteration for the summary table (the last one's figures are logged)."""
    best = json.loads((pathlib.Path(run_dir) / "eval.json").read_text()).get("best") or {}
    if not best:
        return {}
    return {"best iteration": best["iteration"], "best eval/overall": best["eval/overall"]}


def export_roles(run, policy, roles: Roles) -> None:
    """final/challenger and final/solver: both trained models, loadable by from_pretrained and vLLM."""
    trained = policy.get_weights()  # gathers the shards under torchrun (a collective): every rank calls it
    if common.is_main_process():
        for role in (CHALLENGER, SOLVER):
            _save_model(policy, trained if role == roles.active else roles.cpu[role], run.dir / "final" / role)


# --------------------------------------------------------------------------------------------------------------
# The loop
# --------------------------------------------------------------------------------------------------------------
def _load_decontaminator(cfg: Config):
    if not cfg.decontaminate:
        return None
    refs = []
    for b in filter(None, (b.strip() for b in cfg.eval_benchmarks.split(","))):
        try:
            refs += [p["question"] for p in common.load_benchmark(b)]
        except Exception as e:
            raise RuntimeError(f"decontamination needs the eval set {b!r} ({e}). Fix its name/path in "
                               "--eval-benchmarks, or pass --no-decontaminate.") from None
    return common.Decontaminator(refs, cfg.decontaminate_n) if refs else None


def train(cfg: Config, policy=None) -> pathlib.Path:
    """The whole R-Zero run; `policy` may be passed in (tests share one vLLM engine), else loaded from cfg."""
    validate_config(cfg)
    common.seed_everything(cfg.seed)
    run = common.Run(cfg, "r_zero")
    policy = policy or common.Policy.load(cfg)
    decon = _load_decontaminator(cfg)
    checks = common.load_benchmark(cfg.label_check, cfg.label_check_limit) if cfg.label_check else None
    oracle = None
    if cfg.oracle_model:
        oracle = common.FrozenModel(cfg.oracle_model, policy, cfg, cfg.oracle_gpu_memory_utilization)
        print(f"[r_zero] oracle {cfg.oracle_model}: {oracle.route}", file=sys.stderr)

    # `state` names the next step to run (step `phase_step` of `phase` in `iteration`) and what it needs
    state = {"iteration": 1, "phase": CHALLENGER, "phase_step": 0, "dataset": [], "best": None}
    ref = None  # the KL reference: the trained role's weights at the start of its phase
    loaded = run.load_checkpoint(policy) if cfg.resume else None
    if loaded is not None:
        saved = loaded[1]
        state.update({k: v for k, v in saved.items() if k in state})
        rdir = run.dir / "roles" / saved["roles_dir"]
        roles = Roles(policy, saved["active"], common.load_safetensors_dir(rdir / Roles.other(saved["active"])))
        ref = common.load_safetensors_dir(rdir / "ref") if (rdir / "ref").is_dir() else None
        print(f"[r_zero] resumed at iteration {state['iteration']}, {state['phase']} step {state['phase_step']}",
              file=sys.stderr)
    else:
        roles = Roles(policy, CHALLENGER, policy.get_weights())  # iteration 1: both roles = the base model
        if cfg.eval_base:
            run.log(0, evaluate_solver(policy, roles, cfg, run, "eval_base.json"))

    sizes = {CHALLENGER: cfg.challenger_steps, "dataset": 1, SOLVER: cfg.solver_steps, "eval": 1}  # paper order
    schedule = [(k, ph, j) for k in range(1, cfg.iterations + 1) for ph, n in sizes.items() for j in range(n)]
    position = (state["iteration"], state["phase"], state["phase_step"])
    if position not in schedule and position != (cfg.iterations + 1, CHALLENGER, 0):  # the finished run's end
        raise ValueError(f"--resume: the run stopped before {position[1]} step {position[2] + 1} of iteration "
                         f"{position[0]}, which the current --iterations/--challenger-steps/--solver-steps do not "
                         "have; resume with the values it was started with")
    done = schedule.index(position) if position in schedule else len(schedule)
    pbar = run.progress(len(schedule), initial=done)
    for step, (k, phase, j) in enumerate(schedule[done:], start=done + 1):
        m = {"iteration": k}
        if phase in (CHALLENGER, SOLVER) and j == 0:  # a phase starts: its role in the trainer, fresh AdamW
            roles.activate(phase)
            policy.reset_optimizer()
            ref = policy.get_weights()
        if phase == CHALLENGER:  # 1. Challenger phase (Solver frozen)
            m.update(challenger_step(policy, roles, cfg, ref, step, run))
        elif phase == "dataset":  # 2. build the Solver's dataset
            kept, dm = build_dataset(policy, roles, cfg, decon, step, run, k)
            m.update(dm)
            if oracle is not None:
                m.update(pseudo_label_accuracy(roles, oracle, kept, cfg))
            if checks is not None:
                m.update(label_check(roles, checks, cfg))
            if not kept:
                warnings.warn(f"iteration {k}: no question survived the filter; skipping the Solver phase")
            elif len(kept) < cfg.solver_batch:
                warnings.warn(f"iteration {k}: only {len(kept)} questions kept (< --solver-batch "
                              f"{cfg.solver_batch}); the Solver trains on batches of {len(kept)}. Raise "
                              "--question-pool or widen the band.")
            state["dataset"] = kept
        elif phase == SOLVER:  # 3. Solver phase (Challenger frozen)
            m.update(solver_step(policy, state["dataset"], cfg, ref, step, run) if state["dataset"]
                     else {"solver/skipped": 1})
        else:  # 4. evaluate the Solver after every iteration
            m.update(evaluate_solver(policy, roles, cfg, run, f"eval_iter{k}.json"))
            acc = m.get("eval/overall")
            if acc is not None and (state["best"] is None or acc > state["best"]["eval/overall"]):
                state["best"] = {"iteration": k, "eval/overall": acc}
            state["dataset"] = []
        run.log(step, m)
        pbar.update(1)
        k_next, phase_next, j_next = schedule[step] if step < len(schedule) else (cfg.iterations + 1, CHALLENGER, 0)
        state.update(iteration=k_next, phase=phase_next, phase_step=j_next)
        last = j + 1 == sizes[phase]
        if last:
            ref = None
        # a phase's end is saved (the Solver's by the evaluation right after it); --save-every also saves mid-phase
        if (last and phase != SOLVER) or (not last and cfg.save_every and step % cfg.save_every == 0):
            save_state(run, policy, roles, state, step, ref)
    pbar.close()
    if state["best"] is not None:
        print(f"[r_zero] best iteration {state['best']['iteration']} (overall "
              f"{state['best']['eval/overall']:.4f}); last iteration {cfg.iterations}", file=sys.stderr)
    export_roles(run, policy, roles)
    write_eval_summary(run, cfg, state["best"])
    run.close()
    return run.dir


def main(argv: list[str] | None = None) -> None:
    common.run_cli(Config, train, argv, check=validate_config, tiny=TINY, headline=headline)


if __name__ == "__main__":
    main()
