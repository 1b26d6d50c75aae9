"""Loss and algorithm pieces in pure Python: the preference losses in closed form
(preference_losses.py) and kind rl's algorithm pieces (rl_algorithms.py). No torch, no HTTP."""
