"""Config files of the experiment scripts: each `configs/<name>.py` has a
`get_config(arg)` (pass it as `--config=configs/<name>.py[:arg]`) and its run
command in the module docstring. Not installed: used from the repository
root.
"""
