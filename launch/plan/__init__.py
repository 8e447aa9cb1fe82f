"""``loco plan``: the settings to run for a model, a number of workers and a link, predicted as the simulator
charges them."""
