"""CPU choices made by measurement on the machine that serves: a pure rule over measured times
(decide.py) and the timing shell with its per-CPU-model cache (measure.py). The linear path
per weight shape (model/linear_plan.py, `--linear-path`) is the first user."""
