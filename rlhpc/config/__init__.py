"""Configuration: the typed config (schema.py), the prefill/decode layout it describes (disaggregation.py), a command
line that does not compose, said in one line (errors.py), the help pages of commands (commandline.py), and where the
shipped folders conf/, envs/ and sbatch/ are found, in a clone or an installed wheel (shipped.py)."""
