"""The machinery no paper describes, out of the reader's way. common.py imports from here; nothing
here imports common.

  sandbox.py, zygote.py    the Python sandbox: trusted side, and the fork server it starts
  verifier.py              the math-verify worker pool; math_verify_worker.py is its worker
  runfolder.py             atomic writes, JSON lines, checkpoints and resume, RNG states
  memory.py                fitting the trainer in the free memory; resident-memory figures
  parallel.py              torchrun helpers, FSDP2 shards, the trainer's compute precision
  benchmarks.py            benchmark loaders (hub datasets, hf: specs, local JSONL)
  code_eval.py             code benchmarks and their grading in the sandbox
  bleu.py                  the vectorised BLEU kernel (equal to common.sentence_bleu)
  cli.py                   a Config's command line: flags, one-line errors, the limits check
  plot.py                  a run's metrics.jsonl as one PNG (Run.write_plot, tools/plot.py)
  logs.py, timing.py       quiet third-party logs; phase timers
  tiny_model.py            the --model tiny builder
  errors.py                errors the command line prints as one line
"""
