"""R-Zero: Self-Evolving Reasoning LLM from Zero Data (Huang et al., arXiv:2508.05004).

Two roles of one base model, no data: a Challenger asks questions; the Solver's vote labels them.
For iteration k = 1 .. K (paper §3; train() runs the steps in this order):
  1. challenger_step x 5: challenger_rollouts (G = 4 outputs of one fixed prompt), solver_votes (the
     frozen Solver answers each question m = 10 times), vote_statistics (majority label y~ and its
     share p^), challenger_rewards (max(0, r_unc - r_rep)), grpo_update (KL to the phase start).
  2. build_dataset: N = 8,000 questions, m = 10 votes each, keep |p^ - 1/2| <= 0.25 labelled y~.
  3. solver_step x 15: GRPO on the Solver, solver_rewards 1 iff its boxed answer equals y~.
  4. evaluate_solver: greedy accuracy after every iteration; report the best and the last.
Run: python r_zero.py --model Qwen/Qwen3-4B-Base (a GPU; torchrun for several; --model tiny: CPU)
Deviations from the official code (github.com/Chengsong-Huang/R-Zero):
  - unparsable Solver answers count in m but never win the vote (the code lets "None" win)
  - the Challenger's own boxed answer is never used (the code compared one character of it)
  - answers are compared by math-verify (common.math_equal, hard timeouts), not grade_answer
  - rollouts use top-p 1.0 (code: 0.99): the trainer does not model truncation
  - a question whose Solver prompt exceeds --max-prompt-tokens fails the format check
  - questions sharing a 13-gram with an eval set never reach the Solver (--no-decontaminate)
  - one trainer, one vLLM engine: the parked role and the KL reference wait in file-backed memory
  - general sets get the Solver prompt and our grading, not evaluation/eval_*.py's rules or GPT-4o
"""
from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import shutil
import tempfile
from collections import Counter

import numpy as np

import common

MATH_SETS = "math500,gsm8k,amc23,minerva,olympiadbench,aime24,aime25"
GENERAL = ("supergpqa", "mmlu_pro", "bbeh", "gpqa_diamond")  # general reasoning; the rest is math


@dataclasses.dataclass
class Config(common.RunConfig):
    model: str = "Qwen/Qwen3-4B-Base"  # paper §4 (also Qwen3-8B-Base, OctoThinker-3B/8B)
    iterations: int = 3  # K (paper §4; scripts/main.sh: 5)
    challenger_steps: int = 5  # paper §3; scripts/questioner_train_penalty.sh keeps step 5
    solver_steps: int = 15  # paper §3; scripts/solver_train.sh keeps step 15
    challenger_group: int = 4  # G, samples per prompt copy (examples/config.yaml)
    solver_group: int = 5  # G, answers per question (examples/config.yaml)
    challenger_batch: int = 512  # prompt copies per step (examples/config.yaml)
    solver_batch: int = 512  # questions per step (examples/config.yaml)
    challenger_minibatch: int = 16  # prompts per update, 0 = all (scripts; R-Zero issue #23)
    solver_minibatch: int = 128  # questions per update, 0 = all (paper: batch 128)
    votes: int = 10  # m (paper §3; question_evaluate/evaluate.py: 9)
    vote_temperature: float = 1.0  # vllm_service_init/start_vllm_server.py
    vote_top_p: float = 1.0  # vllm_service_init/start_vllm_server.py
    vote_top_k: int = 40  # vllm_service_init/start_vllm_server.py
    vote_max_tokens: int = 4096  # vllm_service_init/start_vllm_server.py
    question_pool: int = 8000  # N (paper §3; question_generate/question_generate.py)
    pool_temperature: float = 1.0  # question_generate/question_generate.py
    pool_top_p: float = 0.95  # question_generate/question_generate.py (not trained on)
    band_low: float = 0.25  # keep band_low <= p^ <= band_high (paper §3; upload.py: 0.3)
    band_high: float = 0.75  # paper §3 (question_evaluate/upload.py: 0.8)
    temperature: float = 1.0  # rollouts of both roles (examples/config.yaml)
    top_p: float = 1.0  # rollouts (examples/config.yaml: 0.99; see the deviations)
    max_prompt_tokens: int = 2048  # longer Solver prompts are invalid (max_prompt_length)
    max_tokens: int = 4096  # both roles in training (examples/config.yaml max_response_length)
    rep_lambda: float = 1.0  # lambda of the repetition penalty (paper §3)
    bleu_threshold: float = 0.5  # tau_BLEU, average-linkage threshold on 1 - BLEU (paper §3)
    lr: float = 1e-6  # AdamW, constant (paper; examples/config.yaml)
    weight_decay: float = 1e-2  # examples/config.yaml
    grad_clip: float = 1.0  # max grad norm (examples/config.yaml)
    clip_low: float = 0.2  # PPO epsilon below 1 (examples/config.yaml)
    clip_high: float = 0.3  # PPO epsilon above 1, clip-higher (examples/config.yaml)
    dual_clip: float = 3.0  # dual clip for A < 0 (verl/trainer/core_algos.py)
    kl_coef: float = 0.01  # beta of the k3 KL to the phase start (paper; config.yaml low_var_kl)
    adv_eps: float = 1e-6  # GRPO (r - mean) / (std + eps) (verl/trainer/core_algos.py)
    aggregation: str = "seq-mean-token-mean"  # EasyR1's loss average as R-Zero runs it
    eval_base: bool = True  # also evaluate the base model (paper Table 1, "Base Model")
    eval_every: int = 0  # unused: the Solver is evaluated after every iteration (paper §5)
    eval_benchmarks: str = MATH_SETS + ",supergpqa,mmlu_pro,bbeh"  # paper §4: 7 math + 3 general
    eval_max_tokens: int = 4096  # greedy (evaluation/generate.py)
    decontaminate: bool = True  # drop questions sharing a 13-gram with an eval set (ours)
    max_model_len: int = 8192  # prompt 2,048 + response 4,096 (examples/config.yaml)


CHALLENGER, SOLVER = "challenger", "solver"
OTHER = {CHALLENGER: SOLVER, SOLVER: CHALLENGER}

TINY = {"iterations": 1, "challenger_steps": 1, "solver_steps": 1, "challenger_batch": 2,
        "challenger_group": 2, "solver_batch": 2, "solver_group": 2, "votes": 4, "question_pool": 4,
        "max_tokens": 16, "vote_max_tokens": 8, "max_model_len": 1024, "max_prompt_tokens": 400,
        "eval_benchmarks": f"{common.TINY_DATA}/rzero_eval.jsonl", "eval_max_tokens": 8}


def validate_config(cfg: Config) -> None:
    """One-line ValueErrors beyond parse_config's (sizes >= 1); loads --prompts FILE."""
    if min(cfg.challenger_group, cfg.solver_group) < 2:
        raise ValueError("--challenger-group and --solver-group must be >= 2 (GRPO's baseline)")
    if not 0.0 <= cfg.band_low <= cfg.band_high <= 1.0:
        raise ValueError(f"need 0 <= --band-low <= --band-high <= 1, got {cfg.band_low}, "
                         f"{cfg.band_high}")
    common.check_benchmark_names(cfg.eval_benchmarks)
    _prompts.update(common.load_prompts(cfg.prompts, PROMPTS))  # a bad file: a usage error


# Our words for every instruction of question_generate.py's and start_vllm_server.py's prompts
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
    "solver_choices": "{question}\n\n{options}\n\nBox the letter of the correct option.",
}
_prompts = dict(PROMPTS)  # the templates in use: PROMPTS, or those of --prompts FILE


def render(tokenizer, system: str, user: str):
    if tokenizer is not None and getattr(tokenizer, "chat_template", None):
        return [{"role": "system", "content": system}, {"role": "user", "content": user}]
    return f"system: {system}\nuser: {user}\nassistant:"  # a model without a chat template


def challenger_prompt(tokenizer):
    return render(tokenizer, _prompts["challenger_system"].format(),
                  _prompts["challenger_user"].format())


def solver_prompt(question: str, tokenizer):
    return render(tokenizer, _prompts["solver_system"].format(), question)


# -- Votes and rewards (paper §3) -----------------------------------------------------------------
def vote_statistics(groups: list[list[str | None]]) -> list[dict]:
    """Per question: label y~ (the largest class of answers math_equal either way to its first),
    its votes `agree`, p^ = agree / m (unparsable answers count in m, never win), and m."""
    counts = [Counter(s for a in g if a is not None and (s := str(a).strip())) for g in groups]
    pairs = list({(a, b) for n in counts for a in n for b in n if a != b})  # both ways
    eq = dict(zip(pairs, common.math_equal_many(pairs)))  # one parallel batch
    out = []
    for g, n in zip(groups, counts):
        classes = []  # lists of distinct answers, the head first
        for a in n:  # join the OLDEST class whose head matches, else open a new one
            c = next((c for c in classes if eq[(a, c[0])] or eq[(c[0], a)]), [])
            if not c:
                classes.append(c)
            c.append(a)
        size = [sum(n[s] for s in c) for c in classes]
        best = classes[size.index(max(size))] if classes else [None]  # the earliest wins a tie
        agree = max(size, default=0)
        out.append({"label": max(best, key=lambda s: n[s]),  # the class's commonest spelling
                    "p_hat": agree / max(len(g), 1), "agree": agree, "m": len(g)})
    return out


def extract_question(text: str) -> str | None:
    return common.extract_tag(text, "question", last=True) or None


def parse_questions(completions, tokenizer, cfg: Config) -> list[str | None]:
    """Each output's question, or None: the format check (no block, empty, or too long)."""
    qs = [extract_question(c.text) for c in completions]
    sizes = [q and len(common.encode_prompt(tokenizer, solver_prompt(q, tokenizer))) for q in qs]
    return [q if q is not None and n <= cfg.max_prompt_tokens else None for q, n in zip(qs, sizes)]


def in_band(s: dict, cfg: Config) -> bool:
    """band_low <= agree / m <= band_high (3..7 of 10 with the paper's band); agree 0 never is."""
    m = s["m"]
    return s["agree"] >= 1 and cfg.band_low * m - 1e-9 <= s["agree"] <= cfg.band_high * m + 1e-9


def challenger_rewards(questions: list[str | None], p_hats: list[float], cfg: Config) -> dict:
    """Paper §3: max(0, r_unc - r_rep), r_rep = lambda |C_k| / B, C_k the valid questions' BLEU
    clusters (average linkage cut at tau_BLEU), B the batch; a failed format check gets 0."""
    valid = np.array([q is not None for q in questions], dtype=bool)
    dist = common.bleu_distance_matrix([q for q in questions if q is not None])
    ids = np.asarray(common.average_linkage_clusters(dist, cfg.bleu_threshold), dtype=int)
    r_rep = np.zeros(len(questions))
    r_rep[valid] = cfg.rep_lambda * np.bincount(ids)[ids] / len(questions)
    r_unc = np.where(valid, common.uncertainty_reward(np.asarray(p_hats, dtype=np.float64)), 0.0)
    return {"reward": np.where(valid, np.maximum(0.0, r_unc - r_rep), 0.0), "r_unc": r_unc,
            "r_rep": r_rep, "valid": valid, "n_clusters": int(ids.max(initial=-1)) + 1}


def filter_dataset(questions: list[str], stats: list[dict], cfg: Config) -> list[dict]:
    return [{"question": q, **s} for q, s in zip(questions, stats) if in_band(s, cfg)]


def solver_rewards(preds: list[str | None], labels: list[str]) -> list[float]:
    """Paper §3: 1 iff the Solver's boxed answer is math_equal to the pseudo-label y~, else 0."""
    return [float(ok) for ok in common.math_equal_many(list(zip(preds, labels)))]


# -- Two roles, one trainer, one engine ------------------------------------------------------------
class Shards(dict):
    """This rank's part of a weight set in file-backed shared memory (page cache, one per node)."""
    local_shards = True


def _trainer_parts(policy):
    """(HF name, trainer tensor, this rank's part) once per storage, in one order on all ranks."""
    seen = set()
    for k, v in policy.state_dict().items():
        storage = v.to_local() if hasattr(v, "to_local") else v
        if storage.numel() == 0 or storage.data_ptr() not in seen:  # empty shards share nothing
            seen.add(storage.data_ptr())
            yield k, v, common.local_part(v)


def full_weights(policy, shards: Shards):
    """(HF name, full tensor) of `shards`, one at a time (a collective: every rank iterates)."""
    for k, v, _ in _trainer_parts(policy):
        yield k, common.full_from_part(shards[k], v)


class Roles:
    """The trained role lives in policy.model; the other one waits in `parked` (Shards)."""

    def __init__(self, policy, active: str, other=None, folder=None):
        self.policy, self.active, self.folder = policy, active, folder  # None: the temp dir
        self.parked = {OTHER[active]: self.park(other)}

    def park(self, weights=None) -> Shards:
        """Shards of `weights` (full tensors or a save_pretrained folder), else of the trainer's."""
        import torch
        if isinstance(weights, (str, pathlib.Path)):  # a folder: read one tensor at a time
            from safetensors import safe_open
            opened = [safe_open(str(f), "pt") for f in pathlib.Path(weights).glob("*.safetensors")]
            weights = {k: f for f in opened for k in f.keys()}
        out = Shards()
        for k, v, part in _trainer_parts(self.policy):
            src = part if weights is None else common.local_part(  # this rank's part, no collective
                v, weights[k] if hasattr(weights[k], "shape") else weights[k].get_tensor(k))
            # the mapping outlives the file's name: nothing is left behind
            with tempfile.NamedTemporaryFile(dir=self.folder, prefix=".weights-") as f:
                out[k] = torch.from_file(f.name, shared=True, size=part.numel(),
                                         dtype=part.dtype).view(part.shape)
            out[k].copy_(src)
        return out

    def activate(self, role: str) -> None:
        if role != self.active:  # exchanged in place: no third copy
            self.parked[self.active] = self.policy.exchange_weights(self.parked.pop(role))
            self.policy.reset_optimizer()
            self.policy.sync()
            self.active = role

    def sampling(self, role: str):
        return self.policy.sampling_from(
            None if role == self.active else full_weights(self.policy, self.parked[role]))


def solver_votes(sampler, questions: list[str], cfg: Config) -> list[list[str | None]]:
    if not questions:
        return []
    outs = sampler.generate([solver_prompt(q, sampler.tokenizer) for q in questions], n=cfg.votes,
                            temperature=cfg.vote_temperature, top_p=cfg.vote_top_p,
                            top_k=cfg.vote_top_k, max_tokens=cfg.vote_max_tokens)
    return [[common.extract_boxed(c.text) for c in g] for g in outs]


def grpo_update(policy, trajs: list, group_ids: list, cfg: Config, ref_weights: dict,
                minibatch: int) -> dict:
    """GRPO advantages, then common.pg_step: a step per `minibatch` groups (0 = all), adjacent."""
    adv = common.group_advantages([t.reward for t in trajs], group_ids, scale="std",
                                  eps=cfg.adv_eps)
    for t, a in zip(trajs, adv.tolist()):
        t.advantage = a
    per_group = len(trajs) // len(set(group_ids))
    pg = common.PGConfig(clip_low=cfg.clip_low, clip_high=cfg.clip_high, dual_clip=cfg.dual_clip,
                         kl_coef=cfg.kl_coef, aggregation=cfg.aggregation,
                         temperature=cfg.temperature, mini_batch=minibatch * per_group)
    return common.pg_step(policy, trajs, pg, ref_weights=ref_weights if cfg.kl_coef > 0 else None)


def _role_metrics(role: str, metrics: dict, upd: dict) -> dict:
    """<role>/<name>: ours, pg_step's, and its entropies of this role's own samples."""
    own = {k.split("/")[0]: v for k, v in upd.items() if k.endswith(f"/{role}")}
    out = {**metrics, **{k: v for k, v in upd.items() if "/" not in k}, **own}
    return {f"{role}/{k}": v for k, v in out.items()}


# -- 1. Challenger phase (Solver frozen) -----------------------------------------------------------
def challenger_rollouts(policy, cfg: Config):
    outs = policy.generate([challenger_prompt(policy.tokenizer)] * cfg.challenger_batch,
                           n=cfg.challenger_group, temperature=cfg.temperature, top_p=cfg.top_p,
                           max_tokens=cfg.max_tokens)
    return [(g, c) for g, group in enumerate(outs) for c in group]


def challenger_step(policy, roles: Roles, cfg: Config, ref: dict, step: int, run) -> dict:
    """One GRPO step of the Challenger, rewarded by the frozen Solver's votes (paper §3)."""
    rollouts = challenger_rollouts(policy, cfg)
    questions = parse_questions([c for _, c in rollouts], policy.tokenizer, cfg)
    with roles.sampling(SOLVER):
        answers = solver_votes(policy, [q for q in questions if q is not None], cfg)
    it = iter(vote_statistics(answers))
    stats = [next(it) if q is not None else None for q in questions]  # None: no question
    r = challenger_rewards(questions, [s["p_hat"] if s else 0.0 for s in stats], cfg)
    trajs = [common.Trajectory.from_completion(c, reward=float(rw), role=CHALLENGER)
             for (_, c), rw in zip(rollouts, r["reward"])]
    upd = grpo_update(policy, trajs, [g for g, _ in rollouts], cfg, ref, cfg.challenger_minibatch)
    valid = r["valid"]
    m = {"reward": float(r["reward"].mean()), "format_fail": float(1.0 - valid.mean()),
         "n_valid": int(valid.sum()), "n_clusters": r["n_clusters"],  # r_unc, r_rep: of the valid
         **{k: float(r[k][valid].mean()) if valid.any() else 0.0 for k in ("r_unc", "r_rep")}}
    run.log_samples(step, CHALLENGER, [
        {"completion": c.text, "question": q, **(s or {}), "reward": float(rw), "r_rep": float(rr)}
        for (_, c), q, s, rw, rr in zip(rollouts, questions, stats, r["reward"], r["r_rep"])])
    return _role_metrics(CHALLENGER, m, upd)


# -- 2. The Solver's dataset: questions filtered by the Solver's agreement -------------------------
def build_dataset(policy, roles: Roles, cfg: Config, step: int, run, iteration: int,
                  decon=None) -> tuple[list, dict]:
    """N questions, m votes each, the band filter; all voted rows go to dataset_iter<k>.jsonl."""
    with roles.sampling(CHALLENGER):
        outs = policy.generate([challenger_prompt(policy.tokenizer)] * cfg.question_pool, n=1,
                               temperature=cfg.pool_temperature, top_p=cfg.pool_top_p,
                               max_tokens=cfg.max_tokens)
    questions = parse_questions([g[0] for g in outs], policy.tokenizer, cfg)
    clean = [q for q in questions if q is not None and not (decon and decon.contaminated(q))]
    with roles.sampling(SOLVER):
        answers = solver_votes(policy, clean, cfg)
    stats = vote_statistics(answers)
    kept = filter_dataset(clean, stats, cfg)
    if common.is_main_process():
        rows = [{"question": q, **s, "kept": in_band(s, cfg), "answers": a}
                for q, s, a in zip(clean, stats, answers)]
        common.atomic_write_text(run.dir / f"dataset_iter{iteration}.jsonl",
                                 "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    run.log_samples(step, "dataset", kept)
    hist = np.bincount([s["agree"] for s in stats], minlength=cfg.votes + 1).tolist()
    return kept, {"dataset/generated": len(questions), "dataset/voted": len(clean),
                  "dataset/contaminated": sum(q is not None for q in questions) - len(clean),
                  "dataset/kept": len(kept), "dataset/agree_hist": hist}


# -- 3. Solver phase (Challenger frozen) -----------------------------------------------------------
def solver_step(policy, dataset: list[dict], cfg: Config, ref: dict, step: int, run) -> dict:
    """One GRPO step of the Solver on the kept questions against their pseudo-labels (paper §3)."""
    rng = np.random.default_rng([cfg.seed, step])  # per-step stream: a resume draws the same rows
    pick = rng.choice(len(dataset), size=min(cfg.solver_batch, len(dataset)), replace=False)
    rows = [dataset[i] for i in pick]
    outs = policy.generate([solver_prompt(r["question"], policy.tokenizer) for r in rows],
                           n=cfg.solver_group, temperature=cfg.temperature, top_p=cfg.top_p,
                           max_tokens=cfg.max_tokens)
    flat = [(g, c) for g, group in enumerate(outs) for c in group]
    preds = [common.extract_boxed(c.text) for _, c in flat]
    rewards = solver_rewards(preds, [rows[g]["label"] for g, _ in flat])
    trajs = [common.Trajectory.from_completion(c, reward=r, role=SOLVER)
             for (_, c), r in zip(flat, rewards)]
    upd = grpo_update(policy, trajs, [g for g, _ in flat], cfg, ref, cfg.solver_minibatch)
    run.log_samples(step, SOLVER, [{**rows[g], "completion": c.text, "pred": p, "reward": r}
                                   for (g, c), p, r in zip(flat, preds, rewards)])
    return _role_metrics(SOLVER, {
        "acc_vs_pseudo": float(np.mean(rewards)), "reward": float(np.mean(rewards)),
        "no_answer": float(np.mean([p is None for p in preds]))}, upd)


# -- 4. Evaluation ---------------------------------------------------------------------------------
def _solver_eval_prompt(problem: dict, tokenizer=None):
    q = problem["question"].strip()
    if problem.get("choices"):
        opts = "\n".join(f"{'ABCDEFGHIJ'[i]}) {c}" for i, c in enumerate(problem["choices"]))
        q = _prompts["solver_choices"].format(question=q, options=opts)
    return solver_prompt(q, tokenizer)


def evaluate_solver(policy, roles: Roles, cfg: Config, run, name: str) -> dict:
    """The Solver's greedy accuracy; eval/overall = mean(math_avg, general sets) (paper Table 1)."""
    if not any(b.strip() for b in cfg.eval_benchmarks.split(",")):
        return {}
    with roles.sampling(SOLVER):
        res = common.evaluate_config(policy, cfg, prompt_fn=_solver_eval_prompt)
    run.write_eval(res, name)
    m = common.eval_metrics(res)
    gen = {b for b in res["benchmarks"]  # BBEH also as a copy, e.g. hf:MrLight/bbeh-eval
           if common.parse_benchmark_spec(b)[0].lower() in GENERAL or "bbeh" in b.lower()}
    math = [r["score"] for b, r in res["benchmarks"].items() if b not in gen]
    general = [r["score"] for b, r in res["benchmarks"].items() if b in gen]
    m.update({"eval/math_avg": float(np.mean(math))} if math else {})
    m["eval/overall"] = float(np.mean(([m["eval/math_avg"]] if math else []) + general))
    return m


def _save_model(policy, weights, path: pathlib.Path) -> None:
    """(name, tensor) pairs as a save_pretrained folder: a collective, the main process writes."""
    weights = {k: v.cpu() for k, v in weights if common.is_main_process()}  # all ranks iterate
    if common.is_main_process():
        policy.model.save_pretrained(str(path), state_dict=weights, safe_serialization=True)
        policy.tokenizer.save_pretrained(str(path))


def save_state(run, policy, roles: Roles, state: dict, step: int, ref: dict | None) -> None:
    """The trained role in checkpoints/step_<k>/, after the parked one (and ref) in roles/."""
    tag, parked = f"step_{step}", OTHER[roles.active]
    tmp = run.dir / "roles" / f".tmp-{tag}"
    shutil.rmtree(tmp, ignore_errors=True)
    for name, shards in ((parked, roles.parked[parked]), ("ref", ref)):
        if shards:  # one set at a time
            _save_model(policy, full_weights(policy, shards), tmp / name)
    if common.is_main_process():
        shutil.rmtree(tmp.with_name(tag), ignore_errors=True)
        os.replace(tmp, tmp.with_name(tag))
    run.save_checkpoint(step, policy, {**state, "active": roles.active, "roles_dir": tag})
    if common.is_main_process():  # a pruned checkpoint's role folder goes with it
        for d in tmp.parent.iterdir():
            if not (run.dir / "checkpoints" / d.name).is_dir():
                shutil.rmtree(d, ignore_errors=True)


def finish(run, policy, roles: Roles, cfg: Config, best: dict | None) -> None:
    """final/challenger, final/solver, and eval.json: the base, every iteration's, the best."""
    for role in (CHALLENGER, SOLVER):
        _save_model(policy, policy.iter_full_weights() if role == roles.active
                    else full_weights(policy, roles.parked[role]), run.dir / "final" / role)
    evals = {k: run.dir / f"eval_iter{k}.json" for k in range(1, cfg.iterations + 1)}
    base = run.dir / "eval_base.json"
    run.write_eval({"base": json.loads(base.read_text()) if base.is_file() else None,
                    "best": best, "iterations": {str(k): json.loads(p.read_text())
                                                 for k, p in evals.items() if p.is_file()}})


def train(cfg: Config, policy=None) -> pathlib.Path:
    """The whole run; `policy` may be passed in (tests share one vLLM engine), else loaded."""
    validate_config(cfg)
    decon = common.eval_decontaminator(cfg.eval_benchmarks, cfg.decontaminate)
    common.seed_everything(cfg.seed)
    run = common.Run(cfg, "r_zero")
    policy = policy or common.Policy.load(cfg)
    # `state` names the next step to run (step `phase_step` of `phase` in `iteration`)
    state = {"iteration": 1, "phase": CHALLENGER, "phase_step": 0, "dataset": [], "best": None}
    ref = None  # the KL reference: the trained role's weights at the start of its phase
    _, saved = (run.load_checkpoint(policy) if cfg.resume else None) or (0, None)
    if saved is None:
        roles = Roles(policy, CHALLENGER, folder=run.dir)  # iteration 1: both = the base
        if cfg.eval_base:
            run.log(0, evaluate_solver(policy, roles, cfg, run, "eval_base.json"))
    else:
        state.update({k: v for k, v in saved.items() if k in state})
        rdir, active = run.dir / "roles" / saved["roles_dir"], saved["active"]
        roles = Roles(policy, active, rdir / OTHER[active], run.dir)
        ref = roles.park(rdir / "ref") if (rdir / "ref").is_dir() else None
    sizes = {CHALLENGER: cfg.challenger_steps, "dataset": 1, SOLVER: cfg.solver_steps, "eval": 1}
    schedule = [(k, ph, j) for k in range(1, cfg.iterations + 1) for ph, n in sizes.items()
                for j in range(n)] + [(cfg.iterations + 1, CHALLENGER, 0)]  # the end
    position = (state["iteration"], state["phase"], state["phase_step"])
    if position not in schedule:
        raise ValueError(f"--resume: the run stopped at {position}, beyond this --iterations, "
                         "--challenger-steps or --solver-steps; resume with the run's own values")
    done = schedule.index(position)
    pbar = run.progress(len(schedule) - 1, initial=done)
    for step, (k, phase, j) in enumerate(schedule[done:-1], start=done + 1):
        m = {"iteration": k}
        if phase in (CHALLENGER, SOLVER) and j == 0:  # a phase starts: its role, a fresh AdamW
            roles.activate(phase)
            ref = None  # the previous one's file-backed pages go first
            ref = roles.park()
        if phase == CHALLENGER:  # 1. GRPO on the Challenger, the Solver frozen
            m.update(challenger_step(policy, roles, cfg, ref, step, run))
        elif phase == "dataset":  # 2. the Solver's dataset, filtered by its agreement
            state["dataset"], dm = build_dataset(policy, roles, cfg, step, run, k, decon)
            m.update(dm)
        elif phase == SOLVER:  # 3. GRPO on the Solver, the Challenger frozen
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
        state.update(zip(("iteration", "phase", "phase_step"), schedule[step]))
        last = j + 1 == sizes[phase]
        ref = None if last else ref
        every = not last and cfg.save_every and step % cfg.save_every == 0  # --save-every
        if (last and phase != SOLVER) or every:  # a phase's end (the Solver's: the eval's)
            save_state(run, policy, roles, state, step, ref)
    finish(run, policy, roles, cfg, state["best"])
    run.close()
    return run.dir


def main(argv: list[str] | None = None) -> None:
    common.run_cli(Config, train, argv, check=validate_config, tiny=TINY)


if __name__ == "__main__":
    main()
