"""Parts of experiments/train.py.

  resume       continuing a run from its last saved step (optimizer state
               beside the parameter checkpoints)
"""
