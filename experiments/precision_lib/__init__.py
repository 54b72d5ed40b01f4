"""Parts of the decode-precision study (experiments/precision_accuracy.py).

  runs         the decode configurations of a study (replay policy x L,
               every-step baselines) and which a model supports
  generation   long generations against the f32 baseline's: token
               agreement and first divergence, greedy and sampled
  state_error  each recurrent layer's state along a long decode against a
               float64 recurrence over the same inputs
  shared       results every slice of a split study needs alike (the
               scores' reference decode, the f32 reference's
               generations, the state-error recording and floor),
               computed once through a folder
  report       summary.md tables (accuracy, perplexity and the 1%
               criterion, generations, state error, targets) and plots
"""
