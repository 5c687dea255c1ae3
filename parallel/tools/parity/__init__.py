"""`polyshard parity`: report.py (every backend against one process), cell.py (one backend)."""
