"""The command lines: `python -m kvbench` (cli, hydra_task), kvbench-torchrun, kvbench-info and kvbench-lm-eval (with the hook lm-eval's own command line loads)."""
