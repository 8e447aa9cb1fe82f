"""``loco simulate``: N workers, each the ordinary training loop, on one device."""
