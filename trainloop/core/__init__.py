"""The engine: the loop and its parts (the step, run state and length, data and its position, RNG, training state).

Users reach it through ``BaseTrainer``; it is not imported from directly (the top level and the
wings export what users name).
"""
