"""Configuration: the typed config (schema.py), the prefill/decode layout it describes (disaggregation.py), a command
line that does not compose, said in one line (errors.py), and the help pages of commands (commandline.py)."""
