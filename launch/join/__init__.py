"""``loco join`` and ``loco status``: a run of internet peers over hivemind."""
