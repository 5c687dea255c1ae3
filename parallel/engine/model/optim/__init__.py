"""Optimizers the engine steps beyond one torch optimizer over whole tensors: several in one job
(several.py: one optimizer over its members, one schedule each), torch.optim.Muon on sharded
matrices (muon.py: each matrix gathered at an owner rank, orthogonalized, scattered back), the
layouts it reads off DTensors (layouts.py), and the Muon-with-AdamW recipe (recipes.py)."""
