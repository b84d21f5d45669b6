"""The vendored DeepSpeed tests are run by `tests/peer/run_deepspeed.py` (their own pytest
session, conftest and ini), never collected by the project's test run."""

collect_ignore = ["deepspeed", "run_deepspeed.py"]
