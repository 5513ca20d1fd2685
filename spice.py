"""SPICE: Self-Play In Corpus Environments (Liu, Jin, Kim, Yuan, Zhao, Kulikov, Li, Sukhbaatar, Lanchantin,
Weston; FAIR at Meta; arXiv:2510.24684).

One model plays two roles on the same weights: the Challenger reads a document and writes a question whose gold
answer comes from that document (multiple choice with 4 options, or free-form with an Integer / Expression /
String answer); the Reasoner sees ONLY the question (information asymmetry) and answers in \\boxed{}.

The loop (Alg. 1 + §3.1, numbered as in spec §1: shared/methods/spice.md), one function per step, in order:
  1.  sample_documents     B document segments (<= 5,992 tokens) uniformly from the corpus
  2a. select_task_types    type-selection prompt (Fig. 9, not trained) -> MCQ or free-form (+ answer type)
  2b. challenger_generate  attempts (q, a*) ~ pi(.|d, C) until >= 1 is valid or N were made; keep G = 8 with the
                           valid:invalid ratio (validity: rule-based, §4)
  3a. reasoner_solve       K = 8 answers ~ pi(.|q, R) per valid task, WITHOUT the document
  3b. challenger_rewards   Eq. 1: r_C = exp(-(Var - 0.25)^2 / (2 tau)), Var = p(1 - p); invalid -> rho = -0.1
  4.  reasoner_group       one random valid task per document; its K answers, r_R = 1[a == a*]
  5.  build_trajectories   Eq. 3: A = r - mean(group), no std, per role and per document
  6.  drgrpo_update        Eqs. 3-4: sum over tokens / L_max; an optimizer step per mini-batch of
                           128 trajectories of the permuted batch (~16 per iteration); re-sync
Evaluation at the end (and every --eval-every steps), zero-shot with the Reasoner prompt.

Run it:   python spice.py --model Qwen/Qwen3-4B-Base            (resume: python spice.py --resume RUN_DIR)
Ablations: --challenger-reward {variance,learnability,uncertainty,threshold}, --no-document,
           --task-types {both,mcq,free}, --corpus <jsonl or hub id>, --freeze-challenger.
Baseline "Strong Challenger" (Table 1): --challenger-model M, a frozen M selects the types and writes the tasks
           (with its own tokenizer); only the Reasoner trains.
Gold-answer spot-check (spec §6, analysis §7.1): --oracle-model M answers valid tasks greedily from the
           Reasoner's prompt; gold_check/agree = share whose document-extracted gold answer M reaches too.

Where the paper is inconsistent or silent, this file chooses:
  * One Reasoner task per document (§3.1), not per iteration (Alg. 1 picks it after the document loop): each
    document gives G Challenger plus K Reasoner trajectories, which balances the roles.
  * The Reasoner group REUSES the K answers sampled for r_C (§2.5, §3.1); Alg. 1, line 16 samples fresh ones
    (--fresh-reasoner-samples).
  * B = 128 counts documents (§3.1). App. B's "128 trajectories per gradient update with rollout
    batch size of 128" is Oat's pair of settings (oat/args.py): rollout_batch_size counts prompts,
    train_batch_size = 128 trajectories per optimizer step. So an iteration's ~16 B trajectories
    take ~16 steps of --mini-batch 128, permuted first and pi_old the rollout policy for all, as in
    Oat's oat/algorithms/ppo.py learning_step. (App. B's "each document reused 2-3 times in 640
    iterations" still does not fit: 640 x 128 / 20,000 is ~4.1 uses.)
  * Answer types are Integer / Expression / String (the text), not "integer, float, expression" (Fig. 2).
  * LaTeX in the Challenger's JSON is kept as written (rule: repair_json_escapes).
  * Expression answers reach Math-Verify unless equal as strings or numbers ("hmg" = "mgh"), with no
    unit stripping.
  * --verify-timeout (Oat: 1 s) holds in training and evaluation alike.
  * The type-selection call is not trained; --type-selection random flips a coin instead.
  * r_C uses the POPULATION variance p(1 - p): torch.var's unbiased default moves the peak off a 50% pass rate.
  * A truncated Reasoner answer scores 0 (Oat); a truncated Challenger output is invalid. Both roles generate
    up to 4,096 tokens (the paper gives no limit), which is also Dr. GRPO's constant normaliser L_max.
  * The paper's corpus is not openly downloadable; the default streams an open 50/50 stand-in (open-web-math +
    FineWeb-Edu). Segments sharing a 13-gram with an eval set are dropped (analysis §7.3); a generated question
    that does, like one too long for the Reasoner's prompt, is an invalid attempt and earns rho.
  * Otherwise Oat's defaults (sail-sg/oat oat/args.py, oat/algorithms/ppo.py): clip 0.2, one PPO
    epoch, grad clip 1.0, no weight decay, Adam betas (0.9, 0.95), truncated IS at C = 2 (tis_c).
Kept as in the paper, and logged: zero-advantage trajectories (e.g. an all-invalid Challenger group) stay in the
batch and in Dr. GRPO's 1/N (`*/zero_adv_group_frac`); long Challenger outputs carry more total gradient than
short Reasoner answers under the shared L_max (`*/tokens`).
Prompts (PROMPTS, or --prompts FILE) carry every instruction of Figs. 8-10 in our words, except:
  * Free-form: only our Integer / Expression / String answers (Fig. 10 also Float, List, Boolean).
  * Generators: "write each LaTeX backslash twice in the JSON" is ours (single ones are repaired).
  * Type selection: the document between the generators' markers (Fig. 9: "Document: {document}").
  * Reasoner: one instruction for Qwen3 and OctoThinker (Fig. 8: two); "box the letter" is ours.
  * --no-document: a line saying that no document is given (the paper shows no prompt for it).
"""
from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import re
import sys
import types
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

import common


# --------------------------------------------------------------------------------------------------------------
# Config: the paper's defaults (sources in the comments). Every field is a --flag (common.parse_config).
# --------------------------------------------------------------------------------------------------------------
@dataclass
class Config(common.RunConfig):
    model: str = "Qwen/Qwen3-4B-Base"  # §3.1 (also Qwen3-8B-Base, OctoThinker-3B/8B-Hybrid-Base)
    corpus: str = "default"  # comma-separated JSONL paths or hub ids [id:config@split], equal shares; default = open stand-in for the 50/50 mix (App. B)
    corpus_field: str = "text"  # name of the document field in the corpus rows
    corpus_docs: int = 20000  # documents read from the corpus in total, 0 = all of a local file (§3.1: 20,000)
    chunk_tokens: int = 5992  # maximum tokens per document segment (App. B)
    steps: int = 640  # training iterations T (§3.1, App. B)
    docs_per_step: int = 128  # B, documents per iteration (§3.1; see docstring)
    group_size: int = 8  # G, Challenger trajectories kept per document (§3.1, Table 5)
    reasoner_k: int = 8  # K, Reasoner answers per valid task (= G in the paper, §3.1)
    max_attempts: int = 1024  # N, Challenger attempts per document before giving up (§3.1)
    invalid_penalty: float = -0.1  # rho, Challenger reward of an invalid task (§3.1)
    tau: float = 0.01  # width of the Gaussian around the target variance 0.25 (Eq. 1, App. D)
    challenger_reward: str = "variance"  # variance (Eq. 1) | learnability (AZR-style) | uncertainty (R-Zero-style) | threshold (ablations, Table 4)
    task_types: str = "both"  # both | mcq | free (§4 ablation: MCQ only 42.0, free-form only 43.7, mixed 44.9)
    type_selection: str = "prompt"  # prompt = Fig. 9 type-selection call (untrained) | random = 50/50 coin
    no_document: bool = False  # ablation: the Challenger writes questions without a document (Fig. 4b)
    freeze_challenger: bool = False  # train only the Reasoner (Challenger trajectories are not updated)
    challenger_model: str = ""  # "Strong Challenger" baseline (Table 1: a fixed Qwen3-32B-Instruct): this frozen model selects types and writes the tasks, only the Reasoner trains; "" = the policy
    challenger_gpu_memory_utilization: float = 0.2  # GPU share of the fixed Challenger's own engine (only if it cannot be swapped in)
    fresh_reasoner_samples: bool = False  # Alg. 1 line 16: sample new Reasoner answers for the update instead of reusing the K used for r_C (§3.1)
    reject_document_reference: bool = False  # not in the paper: mark questions that mention "the text/passage" invalid (always counted)
    eval_benchmarks: str = "amc23,minerva,math500,gsm8k,olympiadbench,aime24@32,aime25@32,supergpqa,gpqa_diamond,mmlu_pro,bbeh"  # Table 1's 11 (App. A): greedy, AIME mean@32 at T 0.6 (top-p 0.95 is ours, common.evaluate's default; the paper gives none); a set that cannot load is skipped with a warning
    eval_max_tokens: int = 4096  # the Reasoner's training limit (App. A; the paper gives none)
    decontaminate: bool = True  # drop corpus segments sharing a 13-gram with the eval sets; such a generated question is invalid (reward rho) (analysis §7.3)
    temperature: float = 1.0  # both roles (§3.1)
    max_tokens: int = 4096  # generation limit of both roles = Dr. GRPO's constant L_max (not stated; Oat recipes 3,000-4,096)
    verify_timeout: float = 1.0  # s per Math-Verify check, train and eval (oat/oracles/math.py)
    type_select_max_tokens: int = 512  # generation limit of the (untrained) type-selection call
    prompt_format: str = "auto"  # auto | chat (ChatML, Qwen3) | plain (User/Assistant preamble, OctoThinker) (Fig. 8)
    lr: float = 1e-6  # constant (App. B)
    clip: float = 0.2  # PPO clip, active from the 2nd mini-batch on (Oat default, not in the paper)
    mini_batch: int = 128  # trajectories per optimizer step (App. B; Oat args.py train_batch_size)
    tis_cap: float = 2.0  # truncated IS cap on exp(l_old - l_vllm), 0 = off (Oat ppo.py tis_c)
    adam_beta2: float = 0.95  # AdamW beta_2 (Oat oat/args.py adam_beta_2; beta_1 is 0.9 there too)
    kl_coef: float = 0.0  # no KL (App. B)
    max_model_len: int = 12288  # 5,992-token document + prompt + 4,096 generated tokens
    oracle_model: str = ""  # stronger model that answers valid tasks greedily to spot-check their document-extracted gold answers (spec §6, analysis §7.1); "" = off
    oracle_limit: int = 32  # valid tasks checked against the oracle per checked step
    oracle_every: int = 1  # spot-check every K steps
    oracle_gpu_memory_utilization: float = 0.2  # GPU share of the oracle's own engine (only if it cannot be swapped in)


CHOICES = {"challenger_reward": ("variance", "learnability", "uncertainty", "threshold"),
           "task_types": ("both", "mcq", "free"), "type_selection": ("prompt", "random"),
           "prompt_format": ("auto", "chat", "plain")}
ANSWER_TYPES = ("Integer", "Expression", "String")
CHALLENGER, REASONER = "challenger", "reasoner"

# --model tiny: a one-minute smoke run on the documents and questions in tests/data (flags override)
TINY = {"corpus": f"{common.TINY_DATA}/spice_corpus.jsonl",
        "eval_benchmarks": f"{common.TINY_DATA}/spice_eval.jsonl", "steps": 2, "docs_per_step": 1,
        "group_size": 2, "reasoner_k": 2, "max_attempts": 2, "max_tokens": 24,
        "max_model_len": 2048, "type_select_max_tokens": 16, "eval_max_tokens": 8,
        "prompts": f"{common.TINY_DATA}/spice_short_prompts.toml"}  # ours fill 3.6k tiny tokens

# Open stand-ins for the paper's Nemotron-CC-Math + NaturalReasoning (DCLM) mix: 50% math web text, 50% educational.
DEFAULT_CORPUS = "open-web-math/open-web-math,HuggingFaceFW/fineweb-edu:sample-10BT"


# --------------------------------------------------------------------------------------------------------------
# Corpus: local JSONL or hub datasets (streamed), cut into segments of <= chunk_tokens tokens.
# --------------------------------------------------------------------------------------------------------------
class CorpusError(ValueError):
    pass


def read_jsonl_documents(path: str, field_name: str = "text", limit: int = 0) -> list[str]:
    """Documents of a JSONL file. Bad input stops with the file, the line and the fix."""
    shape = f'pass --corpus PATH.jsonl with one JSON object like {{"{field_name}": "..."}} per line'
    docs: list[str] = []
    # errors="replace": web text may hold stray bytes; a document with a few of them is still a document
    for lineno, row in common.iter_jsonl(path, shape=shape, error=CorpusError, errors="replace"):
        if field_name not in row:
            keys = ", ".join(list(row)[:8]) or "none"
            raise CorpusError(f"{path}:{lineno}: missing field {field_name!r} (keys: {keys}); "
                              f"pass --corpus-field NAME to use another field")
        text = row[field_name]
        if not isinstance(text, str):
            raise CorpusError(f"{path}:{lineno}: field {field_name!r} must be a string, got {type(text).__name__}")
        if text.strip():
            docs.append(text)
            if limit and len(docs) >= limit:
                break
    if not docs:
        raise CorpusError(f"corpus file {path!r} holds no documents (empty file or only empty {field_name!r} fields)")
    return docs


def stream_hub_documents(spec: str, field_name: str, limit: int) -> list[str]:
    """First `limit` documents of a hub dataset, streamed; spec = "owner/name[:config][@split]"."""
    spec, _, split = spec.partition("@")
    name, _, config = spec.partition(":")
    try:
        import datasets
    except ImportError:
        raise CorpusError(f"--corpus {name!r} is a hub dataset, which needs the `datasets` package: "
                          f"pip install datasets (or pass a local JSONL file)") from None
    docs = []
    try:
        for row in datasets.load_dataset(name, config or None, split=split or "train", streaming=True):
            text = row.get(field_name)
            if text is None:
                raise CorpusError(f"hub dataset {name!r} has no field {field_name!r} (fields: {', '.join(row)}); "
                                  f"pass --corpus-field NAME")
            if isinstance(text, str) and text.strip():
                docs.append(text)
            if limit and len(docs) >= limit:
                break
    except CorpusError:
        raise
    except Exception as e:  # network, auth (gated), unknown id
        raise CorpusError(f"could not stream hub dataset {name!r} ({type(e).__name__}: {str(e)[:200]}). "
                          f"If the hub is unreachable or the set is gated, pass a local corpus: "
                          f"--corpus docs.jsonl (one {{\"{field_name}\": ...}} object per line)") from None
    if not docs:
        raise CorpusError(f"hub dataset {name!r} returned no documents")
    return docs


def chunk_document(text: str, tokenizer, max_tokens: int) -> list[str]:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) <= max_tokens:
        return [text]
    return [tokenizer.decode(ids[i:i + max_tokens]) for i in range(0, len(ids), max_tokens)]


def load_corpus(cfg: Config, tokenizer, chunk_tokens: int, decon=None) -> list[str]:
    """All segments of the configured sources (each source gets an equal share of cfg.corpus_docs), without the
    tokenizer's special-token strings, less those that share a 13-gram with an eval set."""
    spec = DEFAULT_CORPUS if cfg.corpus == "default" else cfg.corpus
    sources = [s.strip() for s in spec.split(",") if s.strip()]
    if not sources:
        raise CorpusError("--corpus is empty; pass a JSONL file or a hub dataset id")
    share = cfg.corpus_docs // len(sources)
    segments: list[str] = []
    for src in sources:
        if os.path.exists(src) or src.endswith((".jsonl", ".json")) or src.startswith((".", "/", "~")):
            docs = read_jsonl_documents(src, cfg.corpus_field, share)
        else:
            docs = stream_hub_documents(src, cfg.corpus_field, share or 20000)
        for d in docs:     # web text may hold "<|im_end|>" etc.: as real control tokens they would end the prompt
            segments.extend(c for c in (common.strip_special_tokens(c, tokenizer)
                                        for c in chunk_document(d, tokenizer, chunk_tokens)) if c.strip())
    if decon is not None:
        kept = [c for c, bad in zip(segments, decon.flags(segments)) if not bad]
        print(f"[spice] corpus: {len(kept)} segments ({len(segments) - len(kept)} dropped as contaminated)",
              file=sys.stderr)
        if not kept:
            raise CorpusError("every corpus segment overlaps an eval set; use another corpus")
        segments = kept
    return segments


# --------------------------------------------------------------------------------------------------------------
# Prompts: every instruction of the paper's Figs. 8-10 in our words (differences: module docstring).
# str.format templates (literal braces doubled); --prompts FILE replaces any (common.load_prompts).
# A line ending in a backslash continues on the next one.
# --------------------------------------------------------------------------------------------------------------
PROMPTS = {
    # Fig. 8 wrappers: ChatML with a generic system message (Qwen3), or plain dialogue (OctoThinker)
    "system": "You are a helpful assistant.",
    "plain": ("This is a conversation between a User and an Assistant. The User asks a question "
              "and the Assistant solves it: it first thinks the reasoning through in its mind, "
              "then gives the User the answer.\n\nUser: {content}\n\nAssistant:"),
    "document_block": "=== DOCUMENT START ===\n{document}\n=== DOCUMENT END ===",
    "no_document_block": ("(No document is given. Draw on your own knowledge of mathematics and "
                          "science and invent the material yourself.)"),

    # Fig. 9: task type selection (not trained)
"type_selection": """Read the document below and decide which kind of CHALLENGING exam question it \
supports best: multiple choice (MCQ) or free-form.

{document_block}

Keep in mind what each kind needs:
- Multiple choice: intricate relationships and reasoning that runs over several steps; several \
concepts that must be combined; room for three wrong options that are plausible but false, so that \
the wrong options themselves test understanding.
- Free-form: one clearly defined correct answer: a specific calculation (an Integer answer), a \
formula or expression to derive (an Expression answer), or a concept named with exact terminology \
(a String answer).

Choose exactly ONE kind: the one that would give the best challenging question from this document.

Reply with one valid JSON object and nothing else: no text before or after it, no markdown, no \
backticks.
{{"suitable_for_mcq": true or false, "suitable_for_free_form": true or false, "best_answer_type": \
"Integer" or "Expression" or "String" or null, "reason": "a few plain words"}}
Rules: exactly one of the two "suitable" values is true; give best_answer_type only for free-form, \
otherwise null; keep "reason" under 100 characters, with no LaTeX and no special characters.""",

    # Fig. 10, left: the multiple-choice generator
"mcq": """Your task: turn the document below into one CHALLENGING multiple-choice exam question, \
one that can only be answered by connecting several of its parts and reasoning over several steps.

{document_block}

Step 1. Find material that needs synthesis. Look for:
- relationships between several variables or concepts that appear in different parts of the \
document;
- calculations or procedures with several steps, each depending on the one before;
- formulas or principles whose parts interact;
- conclusions the document does not state but that follow from combining what it states;
- comparisons or trade-offs between approaches;
- conditional relationships (if X then Y, but if Z then W);
- systems in which changing one parameter changes several others.
Do not build on a fact stated outright (that makes an easy question), a definition that stands \
alone, a number mentioned in isolation, or anything that needs no synthesis.

Step 2. Plan how to make it hard, and say so explicitly (this goes into "hardening_process"): \
which easy version you avoid, which layers of complexity you add, which concepts the solver must \
connect, which shortcuts you block, and how you make sure that several reasoning steps are needed.

Step 3. Write the question. It applies several concepts from different parts of the document, \
tests relationships rather than recall, needs several steps of reasoning, and may compare \
scenarios, ask "what if", or apply the principles to a slightly changed situation.
It must stand completely on its own: the solver never sees the document and has no reference \
material, as in a formal exam. Never write "according to the text", "in the document", "as \
mentioned", "the passage states", "based on the analysis" or the like. Put all the context it \
needs into the question, and define specialised terms where that helps.

Step 4. Aim for HARD or EXTRA HARD by design. Hard: combines four or more concepts and needs \
multi-step problem solving or spotting a pattern. Extra hard: analysis of a complex system, a \
counter-intuitive application, or an edge case. It must be impossible to answer by looking up one \
fact, finding the one sentence that holds the answer, or matching keywords.

Step 5. Write down the reasoning path that makes it hard (this goes into \
"knowledge_and_reasoning_steps"): at least three distinct pieces of information from different \
parts of the document, the logical links between them, why a simple lookup fails, and the \
intermediate steps.

Step 6. Write exactly four options, A) to D), under these strict rules:
- Balanced length: the four options are about equally long (within about 20% of each other).
- Consistent units: numerical options use the same units and the same formatting.
- Neutral tone: no absolute words such as "definitely", "always" or "never" unless the content \
requires them.
- Plausible distractors: every wrong option looks right to someone who understood only part of the \
material. Build them from typical calculation slips in the multi-step process, results of stopping \
the reasoning halfway, confusion between related concepts of the document, and approximations that \
leave out a key factor.
Lay it out as the complete, self-contained question, then A) ..., B) ..., C) ..., D) ..., and note \
the correct letter.

Step 7. Now solve your own multiple-choice question as a student would, options in view (this goes \
into "self_test_solution"):
1. What is the quickest route a student might try?
2. Can two or more options be ruled out without real understanding? Then redesign the distractors.
3. Do the options give the answer away? Then improve them.
4. Count the reasoning steps still needed with the options in view: if fewer than 3, reject the \
question and write a harder one.
5. Would it take less than 30 seconds? Then make it harder.
6. Could the answer be guessed from patterns among the options? Then rebalance them.

Step 8. Final check that it is not easy: if one sentence answers it, redesign it; if it does not \
need several parts of the document, add complexity; if it tests facts rather than relationships, \
refocus it; if the options are not balanced and consistently formatted, revise them; if your own \
solve took less than a minute, make it harder.

Output. First think your design through step by step; this thinking is private. Then write one \
valid JSON object with the fields below, and nothing after it: no markdown, no code fences; start \
with {{ and end with }}. Inside its strings, write every LaTeX backslash twice \
(\\\\frac{{1}}{{2}}), as JSON requires.
- "identified_answer": the relationship or multi-step conclusion you derived by combining parts of \
the document
- "answer_quote": several quotes from the document that show the different pieces needed (not just \
one)
- "hardening_process": your strategy from Step 2
- "exam_question": the challenging, self-contained question; an empty string if the document is \
not rich enough
- "correct_answer": the full answer with its chain of reasoning from the document; an empty string \
if the document does not support one
- "multiple_choice_question": one string: the self-contained question followed by its balanced \
options A) to D); an empty string if you wrote no question
- "multiple_choice_correct": the letter of the correct option: A, B, C or D; an empty string if \
there is no question
- "self_test_solution": your solve from Step 7
- "knowledge_and_reasoning_steps": the reasoning path from Step 5, showing why the question is \
hard or extra hard
- "question_difficulty": "Hard" or "Extra Hard"; "Easy" only if the document really offers nothing \
more complex""",

    # Fig. 10, right: the free-form generator
"free_form": """Your task: turn the document below into one CHALLENGING free-form exam question \
whose answer is of type {answer_type}, a question that needs real understanding and reasoning over \
several steps.

{document_block}

Step 1. Find material for a {answer_type} answer that needs synthesis and several steps of \
reasoning:
- Integer: calculations with several variables from different parts of the document; chains of \
computation in which each step uses the previous result; counting that needs careful sorting into \
cases; rates, ratios or percentages with several components; optimisation under constraints; \
statistics that aggregate data.
- Expression: relationships between several variables that form equations; patterns that \
generalise into a formula; systems of equations from different constraints; derivatives or \
functional dependencies; algebraic expressions that combine several principles; recursive or \
iterative formulas.
- String, kept short (one to three words at most): a technical term, name or identifier; a \
category (a single term); a named person, place, concept or method; a unit, symbol or \
abbreviation. Never a description, sentence or explanation; good answers look like "Newton", \
"TCP/IP", "gradient descent", "Paris", "O(n log n)".
Avoid direct look-ups, answers that are a single stated fact, simple arithmetic, definitions \
quoted word for word, and trivial yes/no questions.

Step 2. Plan how to make it hard, and say so explicitly (this goes into "hardening_process"): \
which version would be too easy, which layers of complexity you add, which parts of the document \
must be combined, which intermediate steps are needed, how you block shortcut solutions, and what \
makes deep understanding necessary.

Step 3. Write the question. It connects at least three concepts from different parts of the \
document, cannot be answered by a look-up or by matching keywords, needs several steps of \
reasoning, tests relationships rather than memory, may apply principles to a changed scenario, and \
must be read precisely to give an answer of type {answer_type}.
It must stand completely on its own: the solver never sees the document and has no reference \
material, as in a formal exam. Never write "according to the text", "in the document", "as \
mentioned" or the like. Give all the context and definitions it needs, and state the units, format \
and constraints of the answer.

Step 4. Make the answer precise for its type:
- Integer: a whole number only, with no decimals, fractions or ranges; the question says what it \
counts and in which unit (for example "in meters", "number of items"). In the JSON: "answer": 42 \
or "answer": "42", never [42] or {{"value": 42}}.
- Expression: standard mathematical notation, every variable defined in the question, simplified \
to canonical form. In the JSON: "answer": "2x^2 + 3x - 5", never a list or an object.
- String: the question says exactly what form the answer takes, including whether case matters; no \
extra punctuation or quotation marks. In the JSON: "answer": "Newton's third law", never a list or \
an object.

Step 5. Solve your question yourself, step by step (this goes into "step_by_step_solution"): list \
every piece of information needed, show each calculation or reasoning step, handle edge cases and \
special conditions, reach the final answer in the required format, check that it is exactly of \
type {answer_type}, and estimate the solving time (a hard question takes more than a minute).

Step 6. Rate the difficulty and justify it (this goes into "difficulty_justification"):
- Medium: 2-3 steps, 1-2 minutes; combines 2-3 parts of the document; the path is clear once the \
relationships are seen.
- Hard: 4-5 steps, 2-3 minutes; combines four or more concepts; admits several valid approaches; \
careless work goes wrong.
- Extra hard: 6 or more steps, more than 3 minutes; a complex system with many interactions; the \
result may be counter-intuitive; it needs deep understanding of the principles.
Aim for hard or extra hard.

Step 7. Make sure exactly one answer is correct. Could the question be read another way? Are all \
constraints stated? Is the answer format unambiguous? Do different valid approaches reach the same \
answer? Are edge cases covered? If anything is ambiguous, rewrite the question.

Step 8. Final check: it cannot be answered by searching the text; it needs understanding, not \
extraction; the answer is exactly of type {answer_type}; the solution takes several reasoning \
steps; the question is self-contained and clear; the difficulty matches your target.

Format rules: "question" is one single string, never a list and never several questions; "answer" \
is one plain value, never a list, an object or anything nested.

Output. First think your design through step by step; this thinking is private. Then write one \
valid JSON object with the fields below, and nothing after it: no markdown, no code fences; start \
with {{ and end with }}. Inside its strings, write every LaTeX backslash twice \
(\\\\frac{{1}}{{2}}), as JSON requires.
- "identified_information": the three or more key pieces of information, from different parts of \
the document, that the solution needs
- "relevant_quotes": several word-for-word quotes from the document showing those pieces
- "hardening_process": your strategy from Step 2
- "question": exactly one complete, challenging, self-contained question; an empty string if the \
document is not rich enough for a question with a {answer_type} answer
- "answer": the precise answer in {answer_type} form; an empty string if the document does not \
give one
- "answer_type": "{answer_type}", exactly
- "step_by_step_solution": each step of your solution from Step 5
- "intermediate_results": an object with the intermediate result or conclusion of each step
- "difficulty_level": "Hard" or "Extra Hard" (not Medium)
- "difficulty_justification": why, from the steps and concepts required
- "solving_time_estimate": a realistic number of minutes for a student
- "required_concepts": the concepts from the document that must be understood
- "potential_errors": typical mistakes and edge cases a student may run into

Final rules:
1. If the document is not rich enough for a question with a {answer_type} answer, give "question": \
"", "answer": "" and "answer_type": "{answer_type}".
2. The answer meets the {answer_type} format rules exactly.
3. The question never mentions "the document" or "the text".
4. The answer follows from the document's content, and the information in the document is all the \
question needs.
5. A String answer has at most three words: prefer a single term, name or short identifier.""",

    # Fig. 8: the Reasoner sees the question only
    "reasoner": ("{question}\n\nReason step by step, then put your final answer inside "
                 "\\boxed{{}}. If the question lists lettered options, put only the letter of the "
                 "correct one in the box."),
}


def prompt_templates(cfg: Config):
    """PROMPTS, with the templates of --prompts FILE in their place (read once per file)."""
    return _load_templates(cfg.prompts)


@functools.lru_cache(maxsize=None)
def _load_templates(path: str):
    return types.MappingProxyType(common.load_prompts(path, PROMPTS))


def wrap(content: str, fmt: str, prompts=PROMPTS):
    """Fig. 8 wrapper: ChatML with a generic system message (Qwen3), or a plain User/Assistant preamble."""
    if fmt == "plain":
        return prompts["plain"].format(content=content)
    return [{"role": "system", "content": prompts["system"]}, {"role": "user", "content": content}]


def resolve_prompt_format(cfg: Config, tokenizer) -> str:
    if cfg.prompt_format != "auto":
        return cfg.prompt_format
    return "chat" if getattr(tokenizer, "chat_template", None) else "plain"


def _document_block(document: str | None, prompts) -> str:
    # str.format never reads braces in the values it inserts: a document's "{x}" stays as is
    if document is None:
        return prompts["no_document_block"]
    return prompts["document_block"].format(document=document)


def type_selection_prompt(document: str | None, fmt: str, prompts=PROMPTS):
    block = _document_block(document, prompts)
    return wrap(prompts["type_selection"].format(document_block=block), fmt, prompts)


def challenger_prompt(document: str | None, kind: str, answer_type: str | None, fmt: str,
                      prompts=PROMPTS):
    """The Challenger prompt C: MCQ or free-form generator (Fig. 10); document=None for --no-document."""
    block = _document_block(document, prompts)
    if kind == "mcq":
        return wrap(prompts["mcq"].format(document_block=block), fmt, prompts)
    content = prompts["free_form"].format(document_block=block, answer_type=answer_type)
    return wrap(content, fmt, prompts)


def reasoner_prompt(question: str, fmt: str = "chat", prompts=PROMPTS):
    """The Reasoner prompt R (Fig. 8), built from the question string ONLY (information asymmetry, §2.2)."""
    if not isinstance(question, str):
        raise TypeError("the Reasoner prompt is built from the question string only")
    return wrap(prompts["reasoner"].format(question=question.strip()), fmt, prompts)


# --------------------------------------------------------------------------------------------------------------
# Parsing, validity and grading (§4), and the Challenger reward (Eq. 1). Model output is untrusted: nothing here
# may raise on it.
# --------------------------------------------------------------------------------------------------------------
MAX_PARSE_CHARS = 60_000      # only the tail of a huge output is searched
MAX_JSON_STARTS = 2_000       # bound the work a hostile output with many "{" can cause (tried from the end)
_JSON_START = re.compile(r'\{(?=\s*["}])')   # an object opens with a key or closes at once; LaTeX "{1}" does not
MAX_QUESTION_CHARS = 6_000
DOC_REFERENCE = re.compile(r"\b(?:the|this|above|given|following|provided)\s+"
                           r"(?:document|text|passage|article|excerpt)\b", re.IGNORECASE)
_OPTION = re.compile(r"(?:^|(?<=\s)|(?<=\())([A-D])\s*[\)\.:]\s")

# LaTeX inside the Challenger's JSON strings. JSON's escapes \b \f \n \r \t also begin LaTeX
# commands (\beta, \frac, \nu, \rho, \times), and other backslashes (\sqrt, \cdot) are no JSON
# escape at all, so LaTeX written as in a paper becomes control characters or unparsable JSON.
# repair_json_escapes reads each backslash, left to right ("\\" pairs first), as:
#   \\  \"  \/  \uXXXX      the JSON escape
#   \b...  \f...            LaTeX, always: a backspace or form feed never belongs in a question
#   \r, \t + a letter       LaTeX (\rho, \times, \text, a user's \tr); else the control character
#   \n + letters            LaTeX if the letters spell a command in _N_COMMANDS (\nu, \neq, \nabla),
#                           else a newline ("\nA) 12 feet", "\nThe"). So a newline written right
#                           before "u", "e", "eq", "i", "ot" ... (the rest of a command) reads as it
#   \ + anything else       a literal backslash (\sqrt, \cdot, \, \{ ...)
_N_COMMANDS = frozenset("""
    nabla napprox natural ncong ne nearrow neg negmedspace negthickspace negthinspace neq nequiv
    newcommand newenvironment newline newpage newtheorem nexists ngeq ngeqq ngeqslant ngtr ngtrless
    ngtrsim ni niobar nis nisd nLeftarrow nleftarrow nleftrightarrow nLeftrightarrow nleq nleqq
    nleqslant nless nlessgtr nlesssim nmid nobreak noindent nolimits nolinebreak nonumber norm
    normalfont normalsize not notag notin notni notsmallowns nparallel nprec npreccurlyeq npreceq
    nrightarrow nRightarrow nshortmid nshortparallel nsim nsimeq nsqsubseteq nsqsupseteq nsubset
    nsubseteq nsubseteqq nsucc nsucccurlyeq nsucceq nsupset nsupseteq nsupseteqq ntriangleleft
    ntrianglelefteq ntriangleright ntrianglerighteq nu nvDash nVdash nVDash nvdash nwarrow
""".split())
_ESCAPE = re.compile(r'\\(?:(?P<json>[\\"/]|u[0-9a-fA-F]{4})|(?P<word>[A-Za-z]+)|.|$)', re.DOTALL)
_BAD_CHARS = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f\ud800-\udfff]")  # control, lone surrogate


def _escape(m: re.Match) -> str:
    word = m["word"]
    if m["json"] or word in ("r", "t") or word and word[0] == "n" and word not in _N_COMMANDS:
        return m[0]
    return "\\" + m[0]


def repair_json_escapes(text: str) -> str:
    """`text` with each backslash that starts LaTeX doubled: JSON decodes it as written (above)."""
    return _ESCAPE.sub(_escape, text)


@dataclass
class Task:
    kind: str                 # "mcq" | "free"
    question: str             # what the Reasoner sees
    gold: str                 # option letter (MCQ) or the answer (free-form)
    answer_type: str          # "MCQ" | Integer | Expression | String
    mentions_document: bool = False


def last_json_object(text: str) -> dict | None:
    """The JSON object that ends last in `text` (the Challenger reasons first, then writes the JSON): a top-level
    object, since any object nested in it ends before it does. Candidate starts are tried from the END backwards,
    so LaTeX braces in the reasoning ("\\frac{1}{2}", which are not candidates anyway) never use
    up the budget. LaTeX in its strings is kept as written (repair_json_escapes)."""
    if not isinstance(text, str):
        return None
    text = repair_json_escapes(text[-MAX_PARSE_CHARS:])
    last_close = text.rfind("}") + 1           # no object can end after the last "}"
    starts = [m.start() for m in _JSON_START.finditer(text)][-MAX_JSON_STARTS:]
    decoder = json.JSONDecoder(strict=False)
    found, found_end = None, -1
    for start in reversed(starts):
        try:
            obj, end = decoder.raw_decode(text, start)
        except (ValueError, RecursionError):
            continue
        if isinstance(obj, dict) and end > found_end:
            found, found_end = obj, end         # an earlier start that ends later encloses the previous find
            if end == last_close:               # nothing can end later: this is the outermost, last object
                break
    return found


def split_options(mcq_text: str) -> tuple[str, list[str]] | None:
    """Stem and the four options of "stem A) .. B) .. C) .. D) ..", or None if the layout is off."""
    marks = []
    for m in _OPTION.finditer(mcq_text):
        if len(marks) < 4 and m.group(1) == "ABCD"[len(marks)]:
            start = m.start(1) - (1 if m.start(1) > 0 and mcq_text[m.start(1) - 1] == "(" else 0)
            marks.append((start, m.end()))
    if len(marks) != 4:
        return None
    ends = [start for start, _ in marks[1:]] + [len(mcq_text)]
    return mcq_text[:marks[0][0]].strip(), [mcq_text[a:b].strip() for (_, a), b in zip(marks, ends)]


def _scalar(x) -> str | None:
    if isinstance(x, str):
        return x.strip()
    if isinstance(x, int) and not isinstance(x, bool):
        return str(x)
    if isinstance(x, float) and math.isfinite(x):
        return str(int(x)) if x.is_integer() else repr(x)
    return None


def answer_has_type(answer: str, answer_type: str) -> bool:
    a = answer.strip().strip("$").strip()
    if answer_type == "Integer":
        return re.fullmatch(r"[+-]?\d+(?:,\d{3})*", a) is not None
    if answer_type == "Expression":
        return 0 < len(a) <= 300
    # a String is graded by its normalized form: one made only of symbols ("?!", "--") could never be matched
    return (answer_type == "String" and 0 < len(a) <= 100 and len(a.split()) <= 3
            and common.normalize_string(a) != "")


def parse_task(text: str, kind: str, answer_type: str | None = None) -> tuple[Task | None, str]:
    """Validity check (§4). Returns (task, "ok") or (None, reason)."""
    try:
        return _parse_task(text, kind, answer_type)
    except Exception as e:  # defensive: hostile output must never crash a run
        return None, f"parse_error:{type(e).__name__}"


def _parse_task(text, kind, answer_type):
    obj = last_json_object(text)
    if obj is None:
        return None, "no_json"
    mcq = kind == "mcq"
    exam_q = obj.get("exam_question")     # an empty one is how the MCQ generator says the document is too thin
    if mcq and "exam_question" in obj and not (isinstance(exam_q, str) and exam_q.strip()):
        return None, "too_thin"
    q = obj.get("multiple_choice_question" if mcq else "question")
    if not isinstance(q, str) or not q.strip():
        return None, "too_thin" if isinstance(q, str) and not mcq else "missing_question"
    if len(q) > MAX_QUESTION_CHARS:
        return None, "question_too_long"
    if _BAD_CHARS.search(q):          # "\u0008", a lone "\ud800": no repair recovers what was meant
        return None, "bad_characters"
    q = q.strip()
    if mcq:
        parts = split_options(q)
        if parts is None:
            return None, "options_not_A_to_D"
        stem, options = parts
        if not stem:
            return None, "empty_stem"
        if not all(options) or len({re.sub(r"[\s\.,;:]+", " ", o.lower()).strip() for o in options}) != 4:
            return None, "options_not_distinct"
        letter = obj.get("multiple_choice_correct")
        letter = letter.strip().strip("()").rstrip(").:").strip().upper() if isinstance(letter, str) else ""
        if letter not in ("A", "B", "C", "D"):
            return None, "bad_correct_letter"
        task = Task("mcq", q, letter, "MCQ")
    else:
        a = _scalar(obj.get("answer"))
        if not a:
            return None, "missing_answer"
        if _BAD_CHARS.search(a):
            return None, "bad_characters"
        declared = obj.get("answer_type")
        if isinstance(declared, str) and declared.strip().lower() != answer_type.lower():
            return None, "wrong_answer_type"
        if not answer_has_type(a, answer_type):
            return None, "answer_not_" + answer_type.lower()
        task = Task("free", q, a if answer_type == "String" else a.strip("$ ").strip(), answer_type)
    task.mentions_document = bool(DOC_REFERENCE.search(task.question))
    return task, "ok"


def parse_type_selection(text: str) -> tuple[str, str | None] | None:
    """Fig. 9 output -> ("mcq", None) | ("free", answer_type | None); None if unusable."""
    obj = last_json_object(text)
    if obj is None:
        return None
    mcq, free = obj.get("suitable_for_mcq"), obj.get("suitable_for_free_form")
    if mcq is True and free is not True:
        return "mcq", None
    if free is True and mcq is not True:
        t = obj.get("best_answer_type")
        t = t.strip().capitalize() if isinstance(t, str) else None
        return "free", t if t in ANSWER_TYPES else None
    return None


def grade_answers(task: Task, completions: list, timeout: float = 1.0) -> list[float]:
    """r_R = 1[a == a*] per Reasoner completion: no box, a truncated output or a verification that takes longer
    than `timeout` seconds (Oat: 1 s) is wrong. An Expression answer reaches math-verify unless an
    exact match or two plain numbers decide: a letters-only gold ("mgh") is a product, = "hmg"."""
    preds = [None if c.finish_reason == "length" else common.extract_boxed(c.text) for c in completions]
    if task.kind == "mcq":
        return [float(p is not None and common.choice_letter(p) == task.gold) for p in preds]
    if task.answer_type == "String":
        gold = common.normalize_string(task.gold)
        return [float(p is not None and bool(gold) and common.normalize_string(p) == gold) for p in preds]
    ok = common.math_equal_many([(p, task.gold) for p in preds], timeout=timeout,    # None: 0
                                expression=task.answer_type == "Expression")
    return [float(x) for x in ok]


def challenger_reward(correct: list[float], cfg: Config) -> float:
    """Eq. 1 (App. D, Eq. 5) on the K correctness bits: exp(-(p(1-p) - 0.25)^2 / (2 tau)), the POPULATION
    variance p(1-p); or the ablation shape named by --challenger-reward (learnability = AZR's Eq. 4,
    uncertainty = R-Zero's 1 - 2|p - 1/2|, threshold = 1[0 < p < 1])."""
    return float(common.proposer_reward(float(np.mean(correct)), cfg.challenger_reward, tau=cfg.tau))


# --------------------------------------------------------------------------------------------------------------
# The loop: one function per step of Alg. 1 / §3.1, in paper order.
# --------------------------------------------------------------------------------------------------------------
@dataclass
class Attempt:
    completion: object            # common.Completion of the Challenger
    task: Task | None             # None if invalid
    reason: str                   # "ok" or why it is invalid
    answers: list = field(default_factory=list)          # the K Reasoner completions of a valid task
    correct: list[float] = field(default_factory=list)   # their correctness bits
    reward: float | None = None                          # r_C


@dataclass
class DocRollout:
    """Everything one document produces in one iteration."""
    document: str | None
    kind: str
    answer_type: str | None
    attempts: list[Attempt] = field(default_factory=list)     # the Challenger group T_C (<= G, subsampled)
    # The whole pool of attempts (<= N), before subsampling: the validity metrics come from these counts, since
    # the subsample keeps at least one valid attempt and so overstates the valid rate of a hard document.
    n_generated: int = 0
    n_valid: int = 0
    n_mentions_document: int = 0                              # valid attempts whose question cites "the text"
    invalid_reasons: Counter = field(default_factory=Counter)
    reasoner_task: Attempt | None = None                      # the valid attempt whose task gives T_R
    reasoner_answers: list = field(default_factory=list)      # T_R completions
    reasoner_rewards: list[float] = field(default_factory=list)


def sample_documents(corpus: list[str], n: int, rng: np.random.Generator, no_document: bool = False) -> list:
    """Step 1: B segments drawn uniformly (without replacement inside one iteration when possible)."""
    if no_document:
        return [None] * n
    return [corpus[i] for i in rng.choice(len(corpus), size=n, replace=len(corpus) < n)]


def select_task_types(policy, docs: list, cfg: Config, fmt: str, rng: np.random.Generator) -> tuple[list, int]:
    """Step 2a: MCQ or free-form (+ answer type) per document (Fig. 9), untrained and greedy; an unusable answer
    falls back to a coin flip. Returns the choices and the number of fallbacks."""
    allowed = ("mcq", "free") if cfg.task_types == "both" else (cfg.task_types,)
    # without a document (ablation) there is nothing to judge, and MCQ-only needs no answer type
    ask = cfg.type_selection == "prompt" and docs[0] is not None and "free" in allowed
    parsed = [None] * len(docs)
    if ask:
        templates = prompt_templates(cfg)
        outs = policy.generate([type_selection_prompt(d, fmt, templates) for d in docs], n=1,
                               temperature=0.0, max_tokens=cfg.type_select_max_tokens)
        parsed = [parse_type_selection(o[0].text) for o in outs]
    fallbacks = sum(c is None or c[0] not in allowed for c in parsed) if ask else 0
    choices = []
    for choice in parsed:
        if choice is None or choice[0] not in allowed:
            choice = (allowed[rng.integers(len(allowed))], None)
        kind, answer_type = choice
        if kind == "free" and answer_type is None:
            answer_type = ANSWER_TYPES[rng.integers(3)]
        choices.append((kind, answer_type))
    return choices, fallbacks


class ValidityChecker:
    """Is a Challenger attempt a usable task? (§4 rules, decontamination, room for the Reasoner's prompt). A failed
    check makes the attempt invalid (it stays in the Challenger's group with reward rho), never silently dropped."""

    def __init__(self, cfg: Config, tokenizer, fmt: str, decontaminator=None):
        self.cfg, self.tokenizer, self.fmt, self.decon = cfg, tokenizer, fmt, decontaminator

    def __call__(self, completion, kind: str, answer_type: str | None) -> tuple[Task | None, str]:
        if completion.finish_reason == "length":
            return None, "truncated"
        # The question goes into the Reasoner's prompt: special-token strings in it ("<|im_end|>\n<|im_start|>
        # assistant\n\boxed{B}") would forge chat turns there, so they go before parsing and the task is clean.
        task, reason = parse_task(common.strip_special_tokens(completion.text, self.tokenizer), kind, answer_type)
        if task is None:
            return None, reason
        if task.mentions_document and self.cfg.reject_document_reference:
            return None, "mentions_document"
        if self.decon is not None and self.decon.contaminated(task.question):
            return None, "contaminated"
        prompt = reasoner_prompt(task.question, self.fmt, prompt_templates(self.cfg))
        n_prompt = len(common.encode_prompt(self.tokenizer, prompt))
        if n_prompt + self.cfg.max_tokens > self.cfg.max_model_len:
            return None, "question_too_long"
        return task, "ok"


def subsample_group(attempts: list[Attempt], G: int, rng: np.random.Generator) -> list[Attempt]:
    """Keep G attempts with the valid:invalid ratio of all attempts (§3.1), at least one valid if any."""
    if len(attempts) <= G:
        return attempts
    valid = [a for a in attempts if a.task is not None]
    invalid = [a for a in attempts if a.task is None]
    n_valid = min(len(valid), max(1 if valid else 0, round(G * len(valid) / len(attempts))))
    n_invalid = min(len(invalid), G - n_valid)
    pick = lambda xs, k: [xs[i] for i in sorted(rng.choice(len(xs), size=k, replace=False))] if k else []
    return pick(valid, G - n_invalid) + pick(invalid, n_invalid)


def challenger_generate(policy, docs: list, types: list, cfg: Config, fmt: str, check: ValidityChecker,
                        rng: np.random.Generator) -> list[DocRollout]:
    """Step 2b: attempts (q, a*) ~ pi(.|d, C), G at a time, until one is valid or N were made; keep G."""
    pools: list[list[Attempt]] = [[] for _ in docs]
    active = list(range(len(docs)))
    while active:
        n = min(cfg.group_size, cfg.max_attempts - len(pools[active[0]]))
        templates = prompt_templates(cfg)
        prompts = [challenger_prompt(docs[i], *types[i], fmt, templates) for i in active]
        outs = policy.generate(prompts, n=n, temperature=cfg.temperature, max_tokens=cfg.max_tokens)
        for i, comps in zip(active, outs):
            pools[i].extend(Attempt(c, *check(c, *types[i])) for c in comps)
        active = [i for i in active if not any(a.task for a in pools[i]) and len(pools[i]) < cfg.max_attempts]
    return [DocRollout(d, kind, t, attempts=subsample_group(pool, cfg.group_size, rng), n_generated=len(pool),
                       n_valid=sum(a.task is not None for a in pool),
                       n_mentions_document=sum(a.task.mentions_document for a in pool if a.task),
                       invalid_reasons=Counter(a.reason for a in pool if a.task is None))
            for d, (kind, t), pool in zip(docs, types, pools)]


def sample_answers(policy, tasks: list[Task], cfg: Config, fmt: str) -> tuple[list, list]:
    """K Reasoner answers per task, from the question alone (no document), and their correctness bits."""
    if not tasks:
        return [], []
    templates = prompt_templates(cfg)
    outs = policy.generate([reasoner_prompt(t.question, fmt, templates) for t in tasks],
                           n=cfg.reasoner_k, temperature=cfg.temperature, max_tokens=cfg.max_tokens)
    return outs, [grade_answers(t, comps, cfg.verify_timeout) for t, comps in zip(tasks, outs)]


def reasoner_solve(policy, rollouts: list[DocRollout], cfg: Config, fmt: str) -> None:
    """Step 3a: the Reasoner answers every valid task of every Challenger group K times (one batched call)."""
    valid = [a for r in rollouts for a in r.attempts if a.task is not None]
    outs, correct = sample_answers(policy, [a.task for a in valid], cfg, fmt)
    for a, o, c in zip(valid, outs, correct):
        a.answers, a.correct = o, c


def challenger_rewards(rollouts: list[DocRollout], cfg: Config) -> None:
    """Step 3b, Eq. 1: r_C from the K correctness bits of each valid task; rho for invalid ones."""
    for r in rollouts:
        for a in r.attempts:
            a.reward = challenger_reward(a.correct, cfg) if a.task is not None else cfg.invalid_penalty


def reasoner_group(policy, rollouts: list[DocRollout], cfg: Config, fmt: str, rng: np.random.Generator) -> None:
    """Step 4: one random valid task per document (§3.1); its K answers are T_R with r_R = 1[a == a*]."""
    picked = []
    for r in rollouts:
        valid = [a for a in r.attempts if a.task is not None]
        if valid:
            r.reasoner_task = valid[rng.integers(len(valid))]
            picked.append(r)
    if cfg.fresh_reasoner_samples:   # Alg. 1, line 16
        outs, correct = sample_answers(policy, [r.reasoner_task.task for r in picked], cfg, fmt)
    else:                            # §2.5 / §3.1: reuse the answers behind r_C
        outs, correct = [r.reasoner_task.answers for r in picked], [r.reasoner_task.correct for r in picked]
    for r, o, c in zip(picked, outs, correct):
        r.reasoner_answers, r.reasoner_rewards = o, c


def build_trajectories(rollouts: list[DocRollout], cfg: Config) -> tuple[list, dict]:
    """Step 5, Dr. GRPO advantages (Eq. 3): A = r - mean(group), no std; one group per role and document.
    The Challenger groups are left out when it is frozen (--freeze-challenger, --challenger-model)."""
    groups = []                                   # (role, completions, rewards)
    for r in rollouts:
        if not (cfg.freeze_challenger or cfg.challenger_model):
            groups.append((CHALLENGER, [a.completion for a in r.attempts], [a.reward for a in r.attempts]))
        groups.append((REASONER, r.reasoner_answers, r.reasoner_rewards))
    groups = [g for g in groups if g[1]]
    trajs = [common.Trajectory.from_completion(c, reward=x, role=role) for role, cs, xs in groups
             for c, x in zip(cs, xs)]
    ids = [g for g, (_, cs, _) in enumerate(groups) for _ in cs]
    for t, a in zip(trajs, common.group_advantages([t.reward for t in trajs], ids, scale="none").tolist()):
        t.advantage = float(a)
    stats = {}
    for role in (CHALLENGER, REASONER):
        mine = [(cs, xs) for ro, cs, xs in groups if ro == role]
        if mine:      # a group whose rewards are all equal has zero advantages: no signal
            stats[f"{role}/zero_adv_group_frac"] = float(np.mean([len(set(xs)) == 1 for _, xs in mine]))
            toks = [len(c.token_ids) for cs, _ in mine for c in cs]
            stats[f"{role}/tokens"] = int(sum(toks))
            stats[f"{role}/response_len"] = float(np.mean(toks))
    return trajs, stats


def drgrpo_update(policy, trajs: list, cfg: Config) -> dict:
    """Step 6 (Eqs. 3-4): per-token clipped surrogate with truncated IS, summed per sequence /
    L_max, mean over the sequences of a mini-batch; no KL. T_C and T_R together, permuted as Oat
    does, one optimizer step per cfg.mini_batch trajectories; then the sampler is synced."""
    if not trajs:
        return {}
    pg = common.PGConfig(clip_low=cfg.clip, clip_high=cfg.clip, kl_coef=cfg.kl_coef, aggregation="drgrpo",
                         max_len=cfg.max_tokens, temperature=cfg.temperature, tis_cap=cfg.tis_cap,
                         mini_batch=cfg.mini_batch, shuffle=True)
    return common.pg_step(policy, trajs, pg)


# --------------------------------------------------------------------------------------------------------------
# Metrics and samples: validity, rewards and frontier share per role, question diversity (analysis §7.2),
# entropy per role (analysis §3), and every valid task with its pass rate in tasks.jsonl (analysis §2).
# --------------------------------------------------------------------------------------------------------------
def _mean(xs) -> float:
    return float(np.mean(xs)) if len(xs) else 0.0


def type_name(kind: str, answer_type: str | None) -> str:
    return kind if kind == "mcq" else f"free/{answer_type}"


def step_metrics(rollouts: list[DocRollout], type_fallbacks: int) -> dict:
    attempts = [a for r in rollouts for a in r.attempts]
    valid = [a for a in attempts if a.task is not None]
    pass_rates = [float(np.mean(a.correct)) for a in valid]
    generated = sum(r.n_generated for r in rollouts)
    m = {   # validity over every attempt generated (the pool); group_valid_rate over the G kept for training
        "challenger/valid_rate": sum(r.n_valid for r in rollouts) / max(1, generated),
        "challenger/group_valid_rate": len(valid) / max(1, len(attempts)),
        "challenger/attempts_per_doc": _mean([r.n_generated for r in rollouts]),
        "challenger/docs_without_valid": sum(not any(a.task for a in r.attempts) for r in rollouts),
        "challenger/reward": _mean([a.reward for a in attempts]),
        "challenger/reward_valid": _mean([a.reward for a in valid]),
        "challenger/mentions_document": sum(r.n_mentions_document for r in rollouts),
        "challenger/type_selection_fallbacks": type_fallbacks,
        "reasoner/accuracy": _mean(pass_rates),
        "reasoner/frontier_share": _mean([0.0 < p < 1.0 for p in pass_rates]),
        "reasoner/group_accuracy": _mean([x for r in rollouts for x in r.reasoner_rewards]),
        "reasoner/truncated_frac": _mean([c.finish_reason == "length" for a in valid for c in a.answers]),
    }
    kinds = [type_name(r.kind, r.answer_type) for r in rollouts]
    for k in ("mcq", *(f"free/{t}" for t in ANSWER_TYPES)):
        m[f"types/{k}"] = kinds.count(k) / max(1, len(kinds))
        ks = [r for r, kk in zip(rollouts, kinds) if kk == k]
        if sum(r.n_generated for r in ks):
            m[f"challenger/valid_rate/{k}"] = sum(r.n_valid for r in ks) / sum(r.n_generated for r in ks)
    why = Counter()
    for r in rollouts:
        why.update(r.invalid_reasons)
    m.update({f"invalid/{w}": n for w, n in sorted(why.items())})
    if valid:   # analysis §7.2: SPICE relies on document sampling for diversity, so watch it (<= B * G questions)
        m.update({f"challenger/{k}": v for k, v in common.diversity_metrics([a.task.question for a in valid]).items()})
    return m


def gold_check(oracle, policy, rollouts: list[DocRollout], cfg: Config) -> dict:
    """Spec §6 "wrong gold answers" (analysis §7.1): the share of valid tasks whose document-extracted gold
    answer the oracle reaches too, answering greedily from the Reasoner's prompt (never the document) and graded
    as the Reasoner is. The oracle's own errors bias the figure, so name it when reporting. The Reasoner's tasks
    come first, so that a small --oracle-limit still spreads over many documents."""
    picked = [r.reasoner_task.task for r in rollouts if r.reasoner_task]
    rest = [a.task for r in rollouts for a in r.attempts if a.task and a is not r.reasoner_task]
    tasks = (picked + rest)[:cfg.oracle_limit]
    if not tasks:
        return {}
    with oracle.sampling(policy) as s:     # the Reasoner's sampling, with one greedy answer per task
        greedy = replace(cfg, reasoner_k=1, temperature=0.0)
        outs, correct = sample_answers(s, tasks, greedy, resolve_prompt_format(cfg, s.tokenizer))
    agree = [c[0] for c in correct]
    answered = [o[0].finish_reason != "length" and common.extract_boxed(o[0].text) is not None for o in outs]
    m = {"gold_check/agree": _mean(agree), "gold_check/oracle_answered": _mean(answered), "gold_check/n": len(tasks)}
    kinds = [type_name(t.kind, t.answer_type) for t in tasks]
    for k in sorted(set(kinds)):
        m[f"gold_check/agree/{k}"] = _mean([a for a, kk in zip(agree, kinds) if kk == k])
    return m


def task_records(rollouts: list[DocRollout], step: int) -> list[dict]:
    """tasks.jsonl (analysis §2, difficulty over training): every valid task of the step with its gold answer,
    the pass rate of the K answers behind r_C, r_C, and whether it was the document's Reasoner task."""
    return [{"step": step, "type": type_name(r.kind, r.answer_type), "question": a.task.question,
             "gold": a.task.gold, "pass_rate": _mean(a.correct), "challenger_reward": a.reward,
             "reasoner_task": a is r.reasoner_task}
            for r in rollouts for a in r.attempts if a.task is not None]


def append_tasks(run, records: list[dict]) -> None:
    if run.is_main and records:
        with open(run.dir / "tasks.jsonl", "a", encoding="utf-8") as f:
            f.writelines(json.dumps(rec, ensure_ascii=False) + "\n" for rec in records)


def sample_records(rollouts: list[DocRollout], excerpt_chars: int = 2000) -> list[dict]:
    """samples.jsonl: each document excerpt with its task (the Reasoner's, else the first attempt; there is
    always one) and the Reasoner answers trained on: the K behind r_C, or with --fresh-reasoner-samples the
    fresh ones (then pass_rate, the r_C pass rate, comes from other answers)."""
    recs = []
    for r in rollouts:
        a = r.reasoner_task or r.attempts[0]
        answers, correct = (r.reasoner_answers, r.reasoner_rewards) if r.reasoner_task else (a.answers, a.correct)
        recs.append({
            "document_excerpt": None if r.document is None else r.document[:excerpt_chars],
            "type": type_name(r.kind, r.answer_type),
            "challenger_output": a.completion.text,
            "valid": a.task is not None,
            "invalid_reason": None if a.task else a.reason,
            "question": a.task.question if a.task else None,
            "gold": a.task.gold if a.task else None,
            "challenger_reward": a.reward,
            "pass_rate": _mean(a.correct) if a.task else None,
            "reasoner_answers": [c.text for c in answers],
            "reasoner_correct": correct,
        })
    return recs


# --------------------------------------------------------------------------------------------------------------
# Training loop and main()
# --------------------------------------------------------------------------------------------------------------
def load_eval_sets(cfg: Config) -> tuple[list[str], common.Decontaminator | None]:
    """The evaluation sets that load (checked up front, so that a 640-step run does not die at its final
    evaluation), and a 13-gram decontaminator built from their questions (analysis §7.3). A set that cannot be
    loaded is reported and skipped."""
    names, questions = [], []
    for name in [b.strip() for b in cfg.eval_benchmarks.split(",") if b.strip()]:
        try:
            questions.extend(row["question"] for row in common.load_benchmark(name))
            names.append(name)
        except Exception as e:  # e.g. an offline machine or a typo: say so and go on without that set
            print(f"[spice] warning: cannot load eval set {name!r}, so it is neither evaluated nor used for "
                  f"decontamination: {e}", file=sys.stderr)
    return names, common.Decontaminator(questions, n=13) if cfg.decontaminate and questions else None


def run_eval(policy, run, cfg: Config, fmt: str, benches: list[str], step: int, name: str = "eval.json") -> dict:
    """Zero-shot with the training Reasoner prompt (App. A) and Math-Verify timeout."""
    if not benches:
        return {}

    def spice_reasoner_prompt(problem: dict, tokenizer=None):
        options = "".join(f"\n{chr(65 + j)}) {c}" for j, c in enumerate(problem.get("choices") or []))
        return reasoner_prompt(problem["question"] + options, fmt, prompt_templates(cfg))
    res = common.evaluate(policy, benches, n=cfg.eval_n, k=cfg.eval_k, max_tokens=cfg.eval_max_tokens,
                          prompt_fn=spice_reasoner_prompt, limit=cfg.eval_limit, seed=cfg.seed,
                          timeout=cfg.verify_timeout)
    run.write_eval({"step": step, **res}, name=name)
    return res


def effective_chunk_tokens(cfg: Config, tokenizer) -> int:
    """Largest segment that still leaves room for the Challenger prompt and max_tokens inside max_model_len."""
    fmt, templates = resolve_prompt_format(cfg, tokenizer), prompt_templates(cfg)
    overhead = max(len(common.encode_prompt(tokenizer, p)) for p in (
        type_selection_prompt("", fmt, templates),
        challenger_prompt("", "mcq", None, fmt, templates),
        *(challenger_prompt("", "free", t, fmt, templates) for t in ANSWER_TYPES)))
    room = cfg.max_model_len - cfg.max_tokens - overhead - 16
    if room < 32:
        raise CorpusError(f"--max-model-len {cfg.max_model_len} leaves no room for a document next to "
                          f"--max-tokens {cfg.max_tokens} and a {overhead}-token prompt; raise --max-model-len")
    if room < cfg.chunk_tokens:
        print(f"[spice] segments shortened to {room} tokens so that prompt + document + {cfg.max_tokens} "
              f"generated tokens fit --max-model-len {cfg.max_model_len}", file=sys.stderr)
    return min(cfg.chunk_tokens, room)


def load_frozen(role: str, name: str, policy, cfg: Config, gpu_memory_utilization: float):
    if not name:
        return None
    frozen = common.FrozenModel(name, policy, cfg, gpu_memory_utilization)
    print(f"[spice] {role} {name}: {frozen.route}", file=sys.stderr)
    return frozen


def validate_config(cfg: Config) -> None:
    for name, allowed in CHOICES.items():
        if getattr(cfg, name) not in allowed:
            raise ValueError(f"--{name.replace('_', '-')} must be {', '.join(allowed[:-1])} or {allowed[-1]}, "
                             f"not {getattr(cfg, name)!r}")
    for name in ("steps", "docs_per_step", "group_size", "reasoner_k", "max_attempts", "max_tokens", "oracle_limit",
                 "oracle_every"):
        if getattr(cfg, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if not cfg.verify_timeout > 0:
        raise ValueError("--verify-timeout must be > 0 seconds")
    if cfg.mini_batch < 0 or cfg.tis_cap < 0:
        raise ValueError("--mini-batch (trajectories per step, 0 = all) and --tis-cap must be >= 0")
    if cfg.max_attempts < cfg.group_size:
        raise ValueError("--max-attempts must be at least --group-size")
    common.check_benchmark_names(cfg.eval_benchmarks)
    prompt_templates(cfg)       # a bad --prompts file: a one-line usage error before anything loads


def train(cfg: Config, policy=None) -> Path:
    """The whole run; `policy` may be passed in (tests share one vLLM engine), else it is loaded from cfg."""
    validate_config(cfg)
    common.seed_everything(cfg.seed)
    # Inputs first (corpus, eval sets), so that bad input fails in seconds, before the model is loaded.
    tokenizer = policy.tokenizer if policy else common.load_tokenizer(cfg.model)
    fmt = resolve_prompt_format(cfg, tokenizer)
    eval_sets, decon = load_eval_sets(cfg)      # decon also screens every generated question
    corpus = []
    if not cfg.no_document:
        # the Challenger reads the documents, so its tokenizer sizes the segments
        doc_tokenizer = common.load_tokenizer(cfg.challenger_model) if cfg.challenger_model else tokenizer
        corpus = load_corpus(cfg, doc_tokenizer, effective_chunk_tokens(cfg, doc_tokenizer), decon)
    run = common.Run(cfg, "spice")
    policy = policy or common.Policy.load(cfg)
    check = ValidityChecker(cfg, tokenizer, fmt, decon)
    oracle = load_frozen("oracle", cfg.oracle_model, policy, cfg, cfg.oracle_gpu_memory_utilization)
    writer = load_frozen("Challenger", cfg.challenger_model, policy, cfg, cfg.challenger_gpu_memory_utilization)

    loaded = run.load_checkpoint(policy) if cfg.resume else None
    start = int(loaded[0]) if loaded else 0
    if cfg.resume and run.is_main:      # like metrics.jsonl: the steps after the checkpoint are logged again
        common.truncate_jsonl(run.dir / "tasks.jsonl", start)
    pbar = run.progress(cfg.steps, initial=start)
    for step in range(start + 1, cfg.steps + 1):
        rng = np.random.default_rng([cfg.seed, step])    # per-step stream: a resumed run replays the same draws
        with run.timer("rollout"):
            docs = sample_documents(corpus, cfg.docs_per_step, rng, cfg.no_document)
            # the Challenger is the policy, or the fixed --challenger-model with its own tokenizer
            with writer.sampling(policy) if writer else contextlib.nullcontext(policy) as challenger:
                cfmt = resolve_prompt_format(cfg, challenger.tokenizer)
                types, fallbacks = select_task_types(challenger, docs, cfg, cfmt, rng)
                rollouts = challenger_generate(challenger, docs, types, cfg, cfmt, check, rng)
            reasoner_solve(policy, rollouts, cfg, fmt)
            challenger_rewards(rollouts, cfg)
            reasoner_group(policy, rollouts, cfg, fmt, rng)
        metrics = step_metrics(rollouts, fallbacks)
        if oracle is not None and step % cfg.oracle_every == 0:
            with run.timer("gold_check"):
                metrics.update(gold_check(oracle, policy, rollouts, cfg))
        trajs, traj_stats = build_trajectories(rollouts, cfg)
        with run.timer("update"):
            train_stats = drgrpo_update(policy, trajs, cfg)
        metrics.update(traj_stats)
        metrics.update({f"train/{k}": v for k, v in train_stats.items()
                        if isinstance(v, (int, float)) and "/" not in k})
        for role in (CHALLENGER, REASONER):     # entropy per role (analysis §3): Eq. 1 estimate and exact
            if f"entropy/{role}" in train_stats:
                metrics[f"{role}/entropy"] = train_stats[f"entropy/{role}"]
                metrics[f"{role}/entropy_exact"] = train_stats.get(f"entropy_exact/{role}")
        run.log_samples(step, "document", sample_records(rollouts))
        append_tasks(run, task_records(rollouts, step))
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.steps:
            res = run_eval(policy, run, cfg, fmt, eval_sets, step, f"eval_step{step}.json")
            metrics.update(common.eval_metrics(res))
        run.log(step, metrics)
        pbar.update(1)
        if (cfg.save_every and step % cfg.save_every == 0) or step == cfg.steps:
            run.save_checkpoint(step, policy, {"step": step})
    pbar.close()
    res = run_eval(policy, run, cfg, fmt, eval_sets, cfg.steps)
    if res:
        run.log(cfg.steps, common.eval_metrics(res))
    run.close()
    return run.dir


def main(argv: list[str] | None = None) -> None:
    common.run_cli(Config, train, argv, check=validate_config, tiny=TINY, errors=(CorpusError,))


if __name__ == "__main__":
    main()
