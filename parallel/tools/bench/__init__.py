"""`polyshard bench`: report.py (cells, table, CSV), cell.py (one cell, per rank), measure.py
(collective bytes, held bytes), plot.py."""
