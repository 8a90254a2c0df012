"""Loading a model and running it: the loader, the placement planner, devices, CPU module swaps, generation and
sampling, and the options they take."""
