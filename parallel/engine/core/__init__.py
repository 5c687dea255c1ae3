"""The engine itself: engine.py (Engine: train_step, eval_step, close), setup.py (the process group,
the parts the engine owns, prepare and the data loaders), hooks.py (what a backend implements, and
nothing else), calls.py (public calls that hand straight to one of the engine's parts), step.py
(what a step returns, building the optimizer, clipping). How micro-batches and ranks weigh into the
step's loss: parallel/kits/objective.py, below the engine, as data/ and model/ use it too."""
