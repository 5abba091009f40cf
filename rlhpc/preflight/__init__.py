"""Before a launch: the checks of the model, context, environment, loss and serving (checks.py), and the run
directory's setup, guard and resume check (rundir.py)."""
