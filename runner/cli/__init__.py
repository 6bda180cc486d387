"""The `runner` command line (main.py) and the batch-file command (run_batch.py): the top layer of the runner."""
