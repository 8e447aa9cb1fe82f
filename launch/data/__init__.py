"""Token data: sources -> documents -> tokens -> windows -> batches (see README.md beside this file)."""
