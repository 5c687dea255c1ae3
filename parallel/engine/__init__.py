"""The Engine every backend implements, grouped by concern (each package's docstring lists its modules):

- core/: the engine itself: set-up and the step (engine.py), the backend contract (hooks.py), the
  public calls that hand to a part (calls.py), what a step returns (step.py); what it minimises is
  parallel/kits/objective.py, below the engine (data/ and model/ use it too).
- data/: the batch side: resumable loaders (loaders.py, resumable.py), the batch check (guard.py),
  splitting and moving batches (batches.py), documents packed into rows (packing.py, documents.py).
- model/: what is done to the model before and while it trains: parameters by name (params.py), shard
  units and activation checkpointing (wrap.py), the tensor-parallel plan (tp_plan.py), compile
  (compile.py), mixture-of-experts bookkeeping (experts.py) and their router's loss (router.py), a
  tiled loss (tiled_loss.py), context parallelism (context_parallel.py), the optimizers (optim/:
  several in one job, torch.optim.Muon on sharded matrices).
- watch/: parts that watch the run and say what went wrong: hangs (hang.py, stall.py), preemption
  (preempt.py), non-finite losses (nonfinite.py), did compile run (compile.py).
- observe/: what people look at: trackers (tracking.py, trackers.py), the progress bar
  (progress_bar.py), FLOPs and MFU (flops.py).
- infer/: evaluation (evaluate.py) and generation (generate.py) on the sharded model. Its
  evaluate.py is importable as parallel.engine.evaluate too, the metrics' path before the grouping
  (#40), which scripts wrote (tests/unit/test_public_names.py).
- state/: checkpoints (checkpointing.py) and the user's registered state (user_state.py).

The process group the engine runs in is parallel/dist.py, outside the engine."""

import sys as _sys

from parallel.engine.infer import evaluate as _evaluate

# `from parallel.engine.evaluate import token_accuracy`, as scripts wrote it before the grouping:
# the same module object under its old name (a regroup broke such a script: #65)
_sys.modules.setdefault(f"{__name__}.evaluate", _evaluate)
