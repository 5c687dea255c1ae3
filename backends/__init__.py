"""Backend adapters. Each module imports its own optional dependency and nothing from its siblings;
only `parallel.registry` chooses between them."""
