"""Run reports: PNG plots and a self-contained HTML page from a run directory."""
